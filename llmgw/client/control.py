"""Typed calls of ``llmgw.v1.ControlService`` over a gRPC-web channel."""

from __future__ import annotations

from collections.abc import AsyncIterator

import betterproto2

from llmgw.api.llmgw.v1 import (
    ActionResult,
    ApplyDeploymentRequest,
    Cluster,
    DeleteDeploymentRequest,
    DeleteNodeRequest,
    EngineProfile,
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
from llmgw.client.channel import GrpcWebChannel
from llmgw.client.errors import ClientError

__all__ = ["ControlClient"]

_SERVICE = "/llmgw.v1.ControlService/"


class ControlClient:
    """The operator API. A ``read_only`` client refuses every mutating call locally."""

    def __init__(self, channel: GrpcWebChannel, *, read_only: bool = False) -> None:
        self._channel = channel
        self._read_only = read_only

    @property
    def read_only(self) -> bool:
        return self._read_only

    # --- reads -----------------------------------------------------------------------------

    async def get_cluster(self) -> Cluster:
        return await self._channel.unary(_SERVICE + "GetCluster", GetClusterRequest(), Cluster)

    def watch(self) -> AsyncIterator[WatchEvent]:
        """One snapshot, then deltas, until the stream breaks (close it with ``aclose``)."""
        return self._channel.server_stream(_SERVICE + "Watch", WatchRequest(), WatchEvent)

    async def list_profiles(self) -> list[EngineProfile]:
        path = _SERVICE + "ListProfiles"
        reply = await self._channel.unary(path, ListProfilesRequest(), ListProfilesResponse)
        return list(reply.profiles)

    async def get_router_stats(self) -> RouterStats:
        path = _SERVICE + "GetRouterStats"
        return await self._channel.unary(path, GetRouterStatsRequest(), RouterStats)

    # --- writes ----------------------------------------------------------------------------

    async def cordon_node(self, node_id: str) -> ActionResult:
        return await self._act("CordonNode", NodeRequest(node_id=node_id))

    async def uncordon_node(self, node_id: str) -> ActionResult:
        return await self._act("UncordonNode", NodeRequest(node_id=node_id))

    async def drain_node(self, node_id: str) -> ActionResult:
        return await self._act("DrainNode", NodeRequest(node_id=node_id))

    async def apply_deployment(self, request: ApplyDeploymentRequest) -> ActionResult:
        """Refused when read-only even with ``dry_run``: a read-only client sends no action."""
        return await self._act("ApplyDeployment", request)

    async def delete_deployment(self, name: str) -> ActionResult:
        return await self._act("DeleteDeployment", DeleteDeploymentRequest(name=name))

    async def delete_node(self, node_id: str, *, force: bool = False) -> ActionResult:
        return await self._act("DeleteNode", DeleteNodeRequest(node_id=node_id, force=force))

    async def start_replica(self, deployment: str, *, replica_id: str = "") -> ActionResult:
        request = ReplicaRequest(replica_id=replica_id, deployment=deployment)
        return await self._act("StartReplica", request)

    async def drain_replica(self, replica_id: str, *, deployment: str = "") -> ActionResult:
        request = ReplicaRequest(replica_id=replica_id, deployment=deployment)
        return await self._act("DrainReplica", request)

    async def reprofile_replica(
        self,
        replica_id: str,
        *,
        profile: str = "",
        deployment: str = "",
        allow_model_change: bool = False,
    ) -> ActionResult:
        request = ReprofileReplicaRequest(
            replica_id=replica_id,
            deployment=deployment,
            profile=profile,
            allow_model_change=allow_model_change,
        )
        return await self._act("ReprofileReplica", request)

    async def _act(self, method: str, request: betterproto2.Message) -> ActionResult:
        if self._read_only:
            raise ClientError("refused: this client is read-only")
        return await self._channel.unary(_SERVICE + method, request, ActionResult)
