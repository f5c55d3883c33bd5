"""The cluster's pulse in a few numbers, from a snapshot (pure; the overview and ``--once``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from llmgw.api.llmgw.v1 import Health, NodeState, ShardState
from llmgw.tui.model import ConsoleSnapshot

__all__ = ["REPLICA_ORDER", "Overview", "Shortfall", "summarize"]

REPLICA_ORDER: tuple[ShardState, ...] = (
    ShardState.READY,
    ShardState.PENDING,
    ShardState.STARTING,
    ShardState.LOADING,
    ShardState.DRAINING,
    ShardState.STOPPED,
    ShardState.FAILED,
)
"""States in the order the overview lists them."""


@dataclass(frozen=True, slots=True)
class Shortfall:
    """A deployment with fewer replicas available than desired, and the server's reason."""

    deployment: str
    ready: int
    available: int  # ready on its profile as it is now
    desired: int
    reason: str


@dataclass(frozen=True, slots=True)
class Overview:
    """Counts over the whole cluster.

    GPUs are the devices placement may use: whole GPUs and MIG slices, not MIG parents;
    "used" ones are held by a shard that is not STOPPED.
    """

    nodes_total: int
    nodes_ready: int
    nodes_cordoned: int
    nodes_not_ready: int
    gpus_total: int
    gpus_used: int
    gpus_unhealthy: int
    gpus_unknown_health: int
    gpu_memory_used_bytes: int
    gpu_memory_total_bytes: int
    mean_utilization_pct: float | None
    replicas_total: int
    replicas_by_state: tuple[tuple[ShardState, int], ...]  # every state, REPLICA_ORDER
    replicas_out_of_date: int
    shards_total: int
    deployments: int
    short: tuple[Shortfall, ...] = ()  # deployments short of desired, by name


def summarize(snapshot: ConsoleSnapshot) -> Overview:
    nodes = Counter(row.state for row in snapshot.nodes.values())
    devices = [g for g in snapshot.gpus.values() if not g.info.mig_enabled]
    health = Counter(g.health for g in devices)
    states = Counter(r.state for r in snapshot.replicas.values())
    return Overview(
        nodes_total=len(snapshot.nodes),
        nodes_ready=nodes[NodeState.READY],
        nodes_cordoned=nodes[NodeState.CORDONED],
        nodes_not_ready=nodes[NodeState.NOT_READY],
        gpus_total=len(devices),
        gpus_used=sum(1 for g in devices if g.shard_id),
        gpus_unhealthy=health[Health.UNHEALTHY],
        gpus_unknown_health=health[Health.UNKNOWN],
        gpu_memory_used_bytes=sum(g.memory_used_bytes for g in devices),
        gpu_memory_total_bytes=sum(g.info.memory_total_bytes for g in devices),
        mean_utilization_pct=(
            sum(g.utilization_pct for g in devices) / len(devices) if devices else None
        ),
        replicas_total=len(snapshot.replicas),
        replicas_by_state=tuple((s, states[s]) for s in REPLICA_ORDER),
        replicas_out_of_date=sum(1 for r in snapshot.replicas.values() if r.out_of_date),
        shards_total=len(snapshot.shards),
        deployments=len(snapshot.deployments),
        short=tuple(
            Shortfall(d.name, d.ready, d.available, d.replicas, d.reason)
            for _, d in sorted(snapshot.deployments.items())
            if d.short
        ),
    )
