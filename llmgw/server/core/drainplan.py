"""Where a node drain would move each replica, as a pure function (a drain's dry run).

A node drain cordons the node and replaces each live replica on it elsewhere, one surge at
a time (``llmgw.server.core.reconciler``). :func:`plan_node_drain` asks placement
(``llmgw.server.core.placement``, the reconciler's own rules: GPU class and MIG profile,
free memory, topology, pool and labels, spread) where each replacement would go now, on
every schedulable node but the drained one, each replacement seeing the devices the ones
before it took. A replica that fits nowhere gets placement's reason: it would keep running
on the node until there is room. The replacements are named as the reconciler would name
them (``DEPLOYMENT-N``, the next serials); their engine ports are chosen when they are
placed for real, so none is claimed here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llmgw.api.llmgw.v1 import Deployment, EngineProfile
from llmgw.server.core.capacity import NodeCapacity
from llmgw.server.core.plan import ReplicaPlan, Unplaceable
from llmgw.server.core.reconcile_state import Lifecycle, PlaceFn, ReplicaRecord
from llmgw.server.core.reconciler import replica_id_for

__all__ = ["DrainMove", "drain_text", "moving_replicas", "plan_node_drain"]

_LIVE = (Lifecycle.ACTIVE, Lifecycle.SURGE)


@dataclass(frozen=True, slots=True)
class DrainMove:
    """One replica on the drained node and where its replacement would go (or why not)."""

    replica_id: str
    deployment: str
    profile: str
    placed: ReplicaPlan | Unplaceable


def moving_replicas(records: Mapping[str, ReplicaRecord], node_id: str) -> list[ReplicaRecord]:
    """The live replicas with a shard on ``node_id``, by id: what a drain of it moves."""
    return [
        r for _, r in sorted(records.items()) if r.lifecycle in _LIVE and node_id in r.plan.nodes
    ]


def plan_node_drain(
    node_id: str,
    records: Mapping[str, ReplicaRecord],
    deployments: Mapping[str, Deployment],
    profiles: Mapping[str, EngineProfile],
    place: PlaceFn,
    *,
    unusable: frozenset[str],
    taken: Sequence[ReplicaPlan],
) -> list[DrainMove]:
    """Where each replica a drain of ``node_id`` moves would go; ``unusable``: the nodes
    placement may not use (not READY, cordoned), ``taken``: every plan holding devices."""
    held = list(taken)
    serials: dict[str, int] = {}
    for record in records.values():
        name = record.plan.deployment
        serials[name] = max(serials.get(name, 0), record.serial)
    moves = []
    for record in moving_replicas(records, node_id):
        name = record.plan.deployment
        deployment = deployments.get(name)
        profile = profiles.get(deployment.profile) if deployment is not None else None
        if deployment is None or profile is None:
            why = f"deployment {name} is deleted" if deployment is None else (
                f"profile {deployment.profile!r} is not defined"
            )  # fmt: skip
            moves.append(DrainMove(record.replica_id, name, record.plan.profile, Unplaceable(why)))
            continue
        serial = serials[name] = _next_serial(records, name, serials[name])
        (placed,) = place(
            deployment,
            profile,
            [replica_id_for(name, serial)],
            excluding=unusable | {node_id},
            taken=held,
        )
        if isinstance(placed, ReplicaPlan):
            held.append(placed)
        moves.append(DrainMove(record.replica_id, name, profile.name, placed))
    return moves


def _next_serial(records: Mapping[str, ReplicaRecord], name: str, after: int) -> int:
    serial = after + 1
    while replica_id_for(name, serial) in records:
        serial += 1
    return serial


def drain_text(node_id: str, moves: Sequence[DrainMove], nodes: Sequence[NodeCapacity]) -> str:
    """The dry run's answer: a head line, then one line per replica on the node."""
    if not moves:
        return f"dry run: drain node {node_id}: no replica runs there; nothing was changed"
    stuck = sum(1 for m in moves if isinstance(m.placed, Unplaceable))
    head = (
        f"dry run: drain node {node_id}: {len(moves)} replica{'' if len(moves) == 1 else 's'} "
        f"to move, {len(moves) - stuck} can move now; nothing was changed"
    )
    by_id = {n.node_id: n for n in nodes}
    return "\n".join([head, *(_move_line(node_id, m, by_id) for m in moves)])


def _move_line(node_id: str, move: DrainMove, nodes: Mapping[str, NodeCapacity]) -> str:
    placed = move.placed
    if isinstance(placed, Unplaceable):
        return (
            f"{move.replica_id}: cannot move ({placed.reason}); "
            f"it keeps running on {node_id} until there is room"
        )
    where = "; ".join(_shard_words(s.node_id, s.gpu_uuids, nodes) for s in placed.shards)
    return f"{move.replica_id}: → {placed.replica_id} on {where}"


def _shard_words(node_id: str, uuids: Sequence[str], nodes: Mapping[str, NodeCapacity]) -> str:
    """``l4-1 GPU 0 (L4)``, ``a1 GPUs 2,3 (H100)``, ``m1 GPU 1 slice 3g.40gb (A100)``."""
    if not uuids:
        return f"{node_id} (CPU)"
    node = nodes.get(node_id)
    devices = {d.uuid: d for d in node.devices} if node is not None else {}
    known = [devices[u] for u in uuids if u in devices]
    if len(known) < len(uuids):
        return f"{node_id} {len(uuids)} GPU{'' if len(uuids) == 1 else 's'}"
    indexes = ",".join(str(d.index) for d in known)
    slices = sorted({d.mig_profile for d in known if d.mig_profile})
    classes = ",".join(sorted({d.gpu_class for d in known}))
    noun = "GPUs" if len(known) > 1 else "GPU"
    mig = f" slice {','.join(slices)}" if slices else ""
    return f"{node_id} {noun} {indexes}{mig} ({classes})"
