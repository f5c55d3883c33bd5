"""``ControlService``: the operator API, on the native gRPC port and over gRPC-web.

The RPCs whose implementation belongs to later work (deployments, replicas, reprofiling,
node drain, router statistics) answer UNIMPLEMENTED with a message naming what is missing,
so a client can tell "not yet" from "failed".
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import NoReturn

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from llmgw.api.llmgw.v1 import (
    ActionResult,
    ApplyDeploymentRequest,
    Cluster,
    ControlServiceBase,
    DeleteDeploymentRequest,
    GetClusterRequest,
    GetRouterStatsRequest,
    ListProfilesRequest,
    ListProfilesResponse,
    NodeRequest,
    ReplicaRequest,
    ReprofileReplicaRequest,
    RouterStats,
    WatchEvent,
    WatchRequest,
)
from llmgw.server.errors import UnknownNode
from llmgw.server.plane import ControlPlane

log = logging.getLogger(__name__)

OPERATOR = "operator"
"""The actor recorded in the audit log until operator tokens exist (the trust issue)."""


def _not_yet(rpc: str, arrives_with: str) -> NoReturn:
    raise GRPCError(
        Status.UNIMPLEMENTED,
        f"{rpc} is not implemented by this server yet: it arrives with {arrives_with}",
    )


_DESIRED_STATE = "desired state (deployments, placement and the reconciler)"


class ControlService(ControlServiceBase):
    """Operator RPCs over the control plane."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    async def get_cluster(self, message: GetClusterRequest) -> Cluster:
        return self.plane.snapshot()

    async def watch(self, message: WatchRequest) -> AsyncIterator[WatchEvent]:
        async for event in self.plane.hub.subscribe():
            yield event

    async def cordon_node(self, message: NodeRequest) -> ActionResult:
        return await self._cordon(message.node_id, True)

    async def uncordon_node(self, message: NodeRequest) -> ActionResult:
        return await self._cordon(message.node_id, False)

    async def _cordon(self, node_id: str, cordoned: bool) -> ActionResult:
        verb = "cordoned" if cordoned else "uncordoned"
        try:
            await self.plane.set_cordoned(node_id, cordoned, actor=OPERATOR)
        except UnknownNode as exc:
            raise GRPCError(Status.NOT_FOUND, str(exc)) from exc
        return ActionResult(ok=True, message=f"node {node_id} {verb}")

    async def apply_deployment(self, message: ApplyDeploymentRequest) -> ActionResult:
        _not_yet("ApplyDeployment", _DESIRED_STATE)

    async def delete_deployment(self, message: DeleteDeploymentRequest) -> ActionResult:
        _not_yet("DeleteDeployment", _DESIRED_STATE)

    async def start_replica(self, message: ReplicaRequest) -> ActionResult:
        _not_yet("StartReplica", _DESIRED_STATE)

    async def drain_replica(self, message: ReplicaRequest) -> ActionResult:
        _not_yet("DrainReplica", _DESIRED_STATE)

    async def reprofile_replica(self, message: ReprofileReplicaRequest) -> ActionResult:
        _not_yet("ReprofileReplica", _DESIRED_STATE)

    async def drain_node(self, message: NodeRequest) -> ActionResult:
        _not_yet("DrainNode", _DESIRED_STATE)

    async def list_profiles(self, message: ListProfilesRequest) -> ListProfilesResponse:
        _not_yet("ListProfiles", _DESIRED_STATE)

    async def get_router_stats(self, message: GetRouterStatsRequest) -> RouterStats:
        _not_yet("GetRouterStats", "the gateway")
