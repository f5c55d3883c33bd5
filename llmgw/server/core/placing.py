"""The placement rules the reconciler and the dry run share, as plain functions.

A dry run (``llmgw.server.core.applyplan``) must place replicas exactly as the reconciler
(``llmgw.server.core.reconciler``) will: the same order of deployments, the same plans
counted as holding devices and ports, the same nodes left out, the same replica ids, the
same profile refusals, the same replicas retired first when a count is lowered
(:func:`retire_key`). Each of those rules is defined here once and both call it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from llmgw import engineinput
from llmgw.api.llmgw.v1 import Deployment, EngineProfile, Shard, ShardState
from llmgw.protocol import read_shard_state
from llmgw.server.core.plan import ReplicaPlan
from llmgw.server.core.reconcile_state import Lifecycle, NodeView, ReplicaRecord, ScaleInCost

__all__ = [
    "holding",
    "next_serials",
    "placement_order",
    "profile_refusal",
    "ready_everywhere",
    "replica_id_for",
    "retire_key",
    "shard_state",
    "unusable_nodes",
    "warm_nodes",
]


def replica_id_for(deployment: str, serial: int) -> str:
    """The id of a deployment's ``serial``-th replica: ``DEPLOYMENT-SERIAL``."""
    return f"{deployment}-{serial}"


def placement_order(
    deployments: Iterable[Deployment], profiles: Mapping[str, EngineProfile]
) -> list[Deployment]:
    """Deployments in the order their replicas are placed: the most devices per shard
    first, then by name. Small shards placed first spread over every node and leave no
    node whole for a TP=8 one; placed last they fill the gaps."""

    def size(deployment: Deployment) -> int:
        profile = profiles.get(deployment.profile)
        if profile is None:
            return 0
        return max(1, profile.tp) * max(1, profile.pp) // max(1, profile.nodes)

    named = sorted(deployments, key=lambda d: d.name)
    return sorted(named, key=lambda d: -size(d))


def holding(records: Iterable[ReplicaRecord], shards: Mapping[str, Shard]) -> list[ReplicaPlan]:
    """The plans that hold devices and ports now, by replica id: every replica that is not
    RETIRED, and a RETIRED one while a shard of it still runs."""
    return [
        record.plan
        for record in sorted(records, key=lambda r: r.replica_id)
        if record.lifecycle is not Lifecycle.RETIRED or _still_running(record, shards)
    ]


def _still_running(record: ReplicaRecord, shards: Mapping[str, Shard]) -> bool:
    reported = (shards.get(p.shard_id) for p in record.plan.shards)
    return any(s is not None and shard_state(s) is not ShardState.STOPPED for s in reported)


def shard_state(shard: Shard) -> ShardState:
    """A reported shard's state; one without a status reads as FAILED."""
    return read_shard_state(shard.status.state) if shard.status else ShardState.FAILED


def unusable_nodes(nodes: Mapping[str, NodeView]) -> frozenset[str]:
    """Nodes that take no new replica: not READY, or cordoned."""
    return frozenset(n.node_id for n in nodes.values() if not n.ready or n.cordoned)


def next_serials(records: Mapping[str, ReplicaRecord], name: str, count: int) -> list[int]:
    """The next ``count`` serials of deployment ``name`` whose ids are not taken: after the
    highest serial any of its replicas (RETIRED ones too) ever had, so the first is 1."""
    used = [r.serial for r in records.values() if r.plan.deployment == name]
    serial = max(used, default=0) + 1
    serials: list[int] = []
    while len(serials) < count:
        if replica_id_for(name, serial) not in records:
            serials.append(serial)
        serial += 1
    return serials


def profile_refusal(profile: EngineProfile) -> str:
    """Why no engine may run ``profile`` (``llmgw.engineinput``, the agent's own rule), or ""."""
    problems = engineinput.profile_problems(profile)
    if not problems:
        return ""
    return f"profile {profile.name!r} is refused: {engineinput.describe(problems)}"


def warm_nodes(records: Iterable[ReplicaRecord], model_path: str) -> frozenset[str]:
    """The nodes that are *warm* for ``model_path``: a replica of a profile with that
    ``model_path`` (of any deployment, RETIRED ones included) was READY on every shard
    there once (``ReplicaRecord.was_ready``), so the node has fetched the weights and
    likely holds them on disk and in its page cache: an engine there loads faster than on
    a node that never loaded them. Placement prefers such nodes. An empty path is warm
    nowhere."""
    if not model_path:
        return frozenset()
    return frozenset(
        shard.node_id
        for record in records
        if record.was_ready and record.profile.model_path == model_path
        for shard in record.plan.shards
    )


_FREE = ScaleInCost()  # a replica without a cost: nothing cached, nothing in flight


def ready_everywhere(
    record: ReplicaRecord, shards: Mapping[str, Shard], nodes: Mapping[str, NodeView]
) -> bool:
    """Every shard of ``record`` is reported READY on its planned node, and that node is
    READY (a NOT_READY node's last reports are stale)."""
    for plan in record.plan.shards:
        shard, node = shards.get(plan.shard_id), nodes.get(plan.node_id)
        if shard is None or shard.node_id != plan.node_id or node is None or not node.ready:
            return False
        if shard_state(shard) is not ShardState.READY:
            return False
    return True


def retire_key(
    record: ReplicaRecord, *, ready: bool, current: bool, costs: Mapping[str, ScaleInCost]
) -> tuple[bool, bool, int, int, int]:
    """Where a live replica stands when a lowered count retires some (lowest first): not
    READY ones, then out-of-date ones, then the one whose loss costs the fewest cached
    prefix blocks no other replica of its deployment holds, then the fewest requests in
    flight (``costs``, by replica id; one not named costs nothing), then the newest."""
    cost = costs.get(record.replica_id, _FREE)
    return ready, current, cost.unique_blocks, cost.in_flight, -record.serial
