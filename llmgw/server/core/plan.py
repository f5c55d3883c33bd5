"""Where replicas go: the values placement produces and the reconciler consumes.

Pure data. A :class:`ReplicaPlan` is one replica of a deployment with one
:class:`ShardPlan` per node it spans; shard rank 0 is the leader, whose endpoint is the
replica's. :class:`Unplaceable` says, in words an operator understands, why a replica
cannot be placed now.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """One shard of a replica: the node, its devices and the engine's port."""

    shard_id: str
    node_id: str
    rank: int
    gpu_uuids: tuple[str, ...]  # GPUs or MIG slices; empty for CPU engines
    port: int  # the engine's HTTP port on that node
    hcas: tuple[str, ...] = ()  # the HCAs nearest its GPUs, for multi-node traffic
    cpu_threads: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    """One replica of a deployment, placed."""

    replica_id: str
    deployment: str
    profile: str
    fingerprint: str  # profile_fingerprint of the profile it was placed for
    shards: tuple[ShardPlan, ...]
    master_port: int = 0  # multi-node rendezvous port on the leader's node; 0 if single-node

    @property
    def leader(self) -> ShardPlan:
        return self.shards[0]

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(s.node_id for s in self.shards)


@dataclass(frozen=True, slots=True)
class Unplaceable:
    """Why a replica cannot be placed, in an operator's words."""

    reason: str
