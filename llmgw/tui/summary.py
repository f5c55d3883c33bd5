"""The cluster's pulse in a few numbers, from a snapshot (pure; the overview and ``--once``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from llmgw.api.llmgw.v1 import Health, NodeState, ShardState
from llmgw.tui.model import ConsoleSnapshot
from llmgw.tui.rows import GpuRow

__all__ = ["REPLICA_ORDER", "GpuCounts", "Overview", "Shortfall", "gpu_counts", "summarize"]

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
class GpuCounts:
    """Physical GPUs and MIG slices, counted apart (a slice is no GPU of its own).

    A GPU is used when a shard that is not STOPPED holds it or any slice carved from it;
    a slice when a shard holds it."""

    gpus: int
    gpus_used: int
    slices: int
    slices_used: int

    @property
    def words(self) -> str:
        """``GPUs 2/4 used · MIG slices 3/9 used`` (no slices: ``GPUs 2/4 used``)."""
        text = f"GPUs {self.gpus_used}/{self.gpus} used"
        return text + (
            f" · MIG slices {self.slices_used}/{self.slices} used" if self.slices else ""
        )


def gpu_counts(gpus: Iterable[GpuRow]) -> GpuCounts:
    """Count ``gpus`` (rows of GPUs and MIG devices, any nodes) as :class:`GpuCounts` says."""
    physical: dict[tuple[str, int], bool] = {}  # (node, NVML index) → held itself
    slices = slices_used = 0
    held_parents: set[tuple[str, int]] = set()  # a slice's index is its parent's
    for gpu in gpus:
        if gpu.info.is_mig:
            slices += 1
            if gpu.shard_id:
                slices_used += 1
                held_parents.add((gpu.node_id, gpu.info.index))
        else:
            physical[(gpu.node_id, gpu.info.index)] = bool(gpu.shard_id)
    used = sum(1 for key, held in physical.items() if held or key in held_parents)
    return GpuCounts(len(physical), used, slices, slices_used)


@dataclass(frozen=True, slots=True)
class Overview:
    """Counts over the whole cluster.

    ``gpus`` counts physical GPUs and MIG slices apart (:class:`GpuCounts`). Health,
    memory and utilisation are over the devices placement may use: whole GPUs and MIG
    slices, not MIG parents.
    """

    nodes_total: int
    nodes_ready: int
    nodes_cordoned: int
    nodes_not_ready: int
    gpus: GpuCounts
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
        gpus=gpu_counts(snapshot.gpus.values()),
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
