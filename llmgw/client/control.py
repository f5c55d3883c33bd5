"""Typed calls of ``llmgw.v1.ControlService`` over a gRPC-web channel."""

from __future__ import annotations

from collections.abc import AsyncIterator

import betterproto2

from llmgw.api.llmgw.v1 import (
    ActionResult,
    ApplyDeploymentRequest,
    Cluster,
    CreateKeyRequest,
    CreateKeyResponse,
    DeleteDeploymentRequest,
    DeleteNodeRequest,
    DescribeRequest,
    Description,
    EngineProfile,
    GetClusterRequest,
    GetRouterStatsRequest,
    ListKeysRequest,
    ListKeysResponse,
    ListProfilesRequest,
    ListProfilesResponse,
    LogLines,
    LogsRequest,
    NodeRequest,
    ReplicaRequest,
    ReprofileReplicaRequest,
    RevokeKeyRequest,
    RolloutHistoryRequest,
    RolloutHistoryResponse,
    RolloutUndoRequest,
    RouterStats,
    ScaleRequest,
    TenantKey,
    UsageRequest,
    UsageResponse,
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

    def stream_logs(
        self,
        name: str,
        *,
        follow: bool = False,
        tail: int | None = None,
        previous: bool = False,
        all_shards: bool = False,
    ) -> AsyncIterator[LogLines]:
        """A replica's (its rank-0 shard's, or with ``all_shards`` every shard's) or a
        shard's engine output from its node: the last ``tail`` lines (all the agent keeps
        when None), then with ``follow`` what the engine writes, until the stream is closed
        (``aclose``). Needs the operator role."""
        request = LogsRequest(
            name=name, follow=follow, tail_lines=tail, previous=previous, all_shards=all_shards
        )
        return self._channel.server_stream(_SERVICE + "StreamLogs", request, LogLines)

    async def list_profiles(self) -> list[EngineProfile]:
        path = _SERVICE + "ListProfiles"
        reply = await self._channel.unary(path, ListProfilesRequest(), ListProfilesResponse)
        return list(reply.profiles)

    async def get_router_stats(self) -> RouterStats:
        path = _SERVICE + "GetRouterStats"
        return await self._channel.unary(path, GetRouterStatsRequest(), RouterStats)

    async def describe(self, kind: str, name: str) -> Description:
        """Everything the server knows about a deployment, replica or node, with its events."""
        request = DescribeRequest(kind=kind, name=name)
        return await self._channel.unary(_SERVICE + "Describe", request, Description)

    async def rollout_history(self, deployment: str) -> RolloutHistoryResponse:
        request = RolloutHistoryRequest(deployment=deployment)
        path = _SERVICE + "RolloutHistory"
        return await self._channel.unary(path, request, RolloutHistoryResponse)

    async def list_keys(self, tenant: str = "") -> list[TenantKey]:
        """The live tenant keys (of ``tenant``, or every tenant's), by creation; admin only."""
        path = _SERVICE + "ListKeys"
        reply = await self._channel.unary(path, ListKeysRequest(tenant=tenant), ListKeysResponse)
        return list(reply.keys)

    async def get_usage(
        self, tenant: str = "", since_unix_ms: int = 0, until_unix_ms: int = 0
    ) -> UsageResponse:
        """Hourly usage per tenant, key and model (stored and pending); admin only."""
        request = UsageRequest(
            tenant=tenant, since_unix_ms=since_unix_ms, until_unix_ms=until_unix_ms
        )
        return await self._channel.unary(_SERVICE + "GetUsage", request, UsageResponse)

    # --- writes ----------------------------------------------------------------------------

    async def cordon_node(self, node_id: str) -> ActionResult:
        return await self._act("CordonNode", NodeRequest(node_id=node_id))

    async def uncordon_node(self, node_id: str) -> ActionResult:
        return await self._act("UncordonNode", NodeRequest(node_id=node_id))

    async def drain_node(self, node_id: str, *, dry_run: bool = False) -> ActionResult:
        """With ``dry_run`` the server changes nothing and says where each replica would go
        (still refused when read-only, like every action)."""
        return await self._act("DrainNode", NodeRequest(node_id=node_id, dry_run=dry_run))

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

    async def scale_deployment(self, deployment: str, replicas: int) -> ActionResult:
        request = ScaleRequest(deployment=deployment, replicas=replicas)
        return await self._act("ScaleDeployment", request)

    async def rollout_undo(self, deployment: str, *, to_revision: int = 0) -> ActionResult:
        request = RolloutUndoRequest(deployment=deployment, to_revision=to_revision)
        return await self._act("RolloutUndo", request)

    async def create_key(self, request: CreateKeyRequest) -> CreateKeyResponse:
        """Make a tenant key: the answer holds the key itself, once; admin only."""
        if self._read_only:
            raise ClientError("refused: this client is read-only")
        path = _SERVICE + "CreateKey"
        return await self._channel.unary(path, request, CreateKeyResponse)

    async def revoke_key(self, key_id: str) -> ActionResult:
        return await self._act("RevokeKey", RevokeKeyRequest(key_id=key_id))

    async def _act(self, method: str, request: betterproto2.Message) -> ActionResult:
        if self._read_only:
            raise ClientError("refused: this client is read-only")
        return await self._channel.unary(_SERVICE + method, request, ActionResult)
