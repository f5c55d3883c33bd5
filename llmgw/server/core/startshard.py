"""What the reconciler writes when it places a replica and starts a shard: the
``StartShard`` of one shard (multi-node ranks meet at the leader), and the words of a
placement event."""

from __future__ import annotations

from llmgw.api.llmgw.v1 import MultiNode, StartShard
from llmgw.server.core.plan import ShardPlan
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord

__all__ = ["placement_why", "start_message", "where"]


def where(shard: ShardPlan) -> str:
    """``a1 (GPU-48352ab2, GPU-a9edc71a; port 20001)``: a shard's node, devices (their UUIDs'
    first 12 characters) and port, as a placement event names them."""
    devices = ", ".join(u[:12] for u in shard.gpu_uuids) or f"{shard.cpu_threads} CPU threads"
    return f"{shard.node_id} ({devices}; port {shard.port})"


def placement_why(lifecycle: Lifecycle, old: str) -> str:
    if lifecycle is Lifecycle.SURGE:
        return f"rolling replacement of out-of-date replica {old} (surge of one)"
    return f"replaces {old}" if old else "fewer replicas than desired"


def start_message(record: ReplicaRecord, plan: ShardPlan, leader_address: str) -> StartShard:
    """The StartShard of one shard of ``record``; multi-node ranks meet at the leader."""
    replica = record.plan
    multinode = None
    if len(replica.shards) > 1:
        multinode = MultiNode(
            nnodes=len(replica.shards),
            node_rank=plan.rank,
            master_addr=leader_address,
            master_port=replica.master_port,
            hcas=list(plan.hcas),
        )
    return StartShard(
        shard_id=plan.shard_id,
        replica_id=replica.replica_id,
        rank=plan.rank,
        profile=record.profile,
        profile_fingerprint=replica.fingerprint,
        gpu_uuids=list(plan.gpu_uuids),
        port=plan.port,
        api_key=record.api_key,
        multinode=multinode,
    )
