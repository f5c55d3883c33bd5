"""What applying deployments would change, replica by replica, against what runs now.

:func:`plan_apply` is the dry run's diff (``llmgw apply --dry-run``) and the count of
replicas an apply, start or reprofile can place. It looks at the reconciler's own input
(:class:`~llmgw.server.core.reconcile_state.ReconcileInput`, whose ``deployments`` and
``profiles`` already hold the change) and places with its ``place`` function and the
rules of ``llmgw.server.core.placing``, so it names the replicas, nodes, GPUs and ports
the reconciler will choose. Per deployment, replicas that are live (ACTIVE or SURGE, not
being drained by an operator) and run its profile as it is now are kept up to the count,
those the reconciler would retire last kept (``placing.retire_key``: READY ones, then those
whose loss costs most cached blocks and requests in flight, ``ReconcileInput.costs``, then
the oldest); out-of-date ones are rolled (a replacement placed while it still runs, then
it is retired, one at a time: the reconciler's surge of one, each surge placed while the
replicas replaced before still drain, if there is room); replicas still missing are
added; the rest are removed. Removed replicas' devices count as free (the end state), the
other plans, of every deployment, as taken.

Each change is a :class:`PlannedReplica` (``keep``, ``add``, ``remove``, ``roll``,
``unplaceable``). A replacement or addition that finds no room is ``unplaceable`` with the
placement's reason, named by the id it would have had. ``live`` and ``applied`` (the
deployments as stored now and as last applied) tell when the change undoes an operator's
live scale or reprofile: each change of that deployment then says so in ``reason``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from llmgw.api.llmgw.v1 import Deployment, EngineProfile
from llmgw.server.core.placing import (
    holding,
    next_serials,
    placement_order,
    profile_refusal,
    ready_everywhere,
    replica_id_for,
    retire_key,
    unusable_nodes,
)
from llmgw.server.core.plan import ReplicaPlan, Unplaceable
from llmgw.server.core.reconcile_state import Lifecycle, ReconcileInput, ReplicaRecord

__all__ = ["Action", "ApplyPlan", "PlannedReplica", "plan_apply", "undone_live_change"]

_LIVE = (Lifecycle.ACTIVE, Lifecycle.SURGE)


class Action(enum.Enum):
    """What an apply does to one replica."""

    KEEP = "keep"  # runs as it is and stays
    ADD = "add"  # a new replica, placed
    REMOVE = "remove"  # retired: more replicas than the count
    ROLL = "roll"  # replaced by one of the new profile (``from_profile`` → ``profile``)
    UNPLACEABLE = "unplaceable"  # asked for, but there is no room (``reason``)


@dataclass(frozen=True, slots=True)
class PlannedReplica:
    """One replica's fate. ``plan`` is where it runs (keep, remove) or would go (add, roll)."""

    action: Action
    deployment: str
    replica: str
    profile: str
    from_profile: str = ""
    plan: ReplicaPlan | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ApplyPlan:
    """Every change, deployment by deployment in placement order."""

    changes: tuple[PlannedReplica, ...] = ()
    desired: Mapping[str, int] = field(default_factory=dict)  # deployment → count asked

    @property
    def placeable(self) -> bool:
        """Every replica asked for can be placed."""
        return all(c.action is not Action.UNPLACEABLE for c in self.changes)

    @property
    def placed(self) -> int:
        """How many replicas of the planned deployments will run after the change."""
        running = (Action.KEEP, Action.ADD, Action.ROLL)
        return sum(1 for c in self.changes if c.action in running)

    def reasons(self) -> list[str]:
        """Each distinct reason a replica cannot be placed, with its deployment."""
        found = [
            f"deployment {c.deployment}: {c.reason}"
            for c in self.changes
            if c.action is Action.UNPLACEABLE
        ]
        return list(dict.fromkeys(found))


def plan_apply(
    state: ReconcileInput,
    names: Sequence[str],
    *,
    live: Mapping[str, Deployment] | None = None,
    applied: Mapping[str, Deployment] | None = None,
) -> ApplyPlan:
    """The changes that deployments ``names`` of ``state.deployments`` make (see the module
    docstring); nothing is placed for the other deployments, whose plans stay taken."""
    planner = _Planner(state)
    wanted = [state.deployments[n] for n in names if n in state.deployments]
    changes: list[PlannedReplica] = []
    desired: dict[str, int] = {}
    ordered = placement_order(wanted, state.profiles)
    for deployment in ordered:  # free what shrinking deployments give back first
        planner.split(deployment)
    for deployment in ordered:
        desired[deployment.name] = deployment.replicas
        mine = planner.plan(deployment)
        note = undone_live_change(
            deployment, (live or {}).get(deployment.name), (applied or {}).get(deployment.name)
        )
        changes += [_noted(c, note) for c in mine] if note else mine
    return ApplyPlan(tuple(changes), desired)


def undone_live_change(
    deployment: Deployment, live: Deployment | None, applied: Deployment | None
) -> str:
    """What live change (a scale or a reprofile since the last apply) ``deployment`` undoes,
    in words, or ""."""
    if live is None or applied is None:
        return ""
    undone = []
    if live.replicas != applied.replicas and deployment.replicas != live.replicas:
        undone.append(
            f"scale to {live.replicas} (start/drain since the last apply); "
            f"the file says {deployment.replicas}"
        )
    if live.profile != applied.profile and deployment.profile != live.profile:
        undone.append(
            f"reprofile to {live.profile} (since the last apply); the file says "
            f"{deployment.profile}"
        )
    return "undoes a live " + " and a live ".join(undone) if undone else ""


def _noted(change: PlannedReplica, note: str) -> PlannedReplica:
    if change.action is Action.KEEP:
        return change
    reason = f"{change.reason}; {note}" if change.reason else note
    return PlannedReplica(
        change.action,
        change.deployment,
        change.replica,
        change.profile,
        change.from_profile,
        change.plan,
        reason,
    )


@dataclass(slots=True)
class _Split:
    """A deployment's live replicas sorted into what happens to them."""

    keep: list[ReplicaRecord]
    roll: list[ReplicaRecord]
    remove: list[ReplicaRecord]
    add: int


class _Planner:
    """The working state of one plan: the plans that hold devices, ids handed out so far."""

    def __init__(self, state: ReconcileInput) -> None:
        self.s = state
        self.records: dict[str, ReplicaRecord] = dict(state.replicas)
        self.taken: list[ReplicaPlan] = holding(self.records.values(), state.shards)
        self.unusable = unusable_nodes(state.nodes)
        self.splits: dict[str, _Split] = {}

    def split(self, deployment: Deployment) -> None:
        """Sort the deployment's replicas; free what it removes."""
        profile = self.s.profiles.get(deployment.profile)
        fingerprint = self.s.fingerprint(profile) if profile is not None else ""

        def current(r: ReplicaRecord) -> bool:
            now = (r.plan.profile, r.plan.fingerprint) == (deployment.profile, fingerprint)
            return now and r.replica_id not in self.s.replace

        live = sorted(
            (
                r
                for r in self.records.values()
                if r.plan.deployment == deployment.name
                and r.lifecycle in _LIVE
                and r.replica_id not in self.s.retire
            ),
            key=lambda r: (r.serial, r.replica_id),
        )
        up = [r for r in live if current(r)]
        out = [r for r in live if not current(r)]
        extra = {r.replica_id for r in self.retire_first(up)[: len(up) - deployment.replicas]}
        keep = [r for r in up if r.replica_id not in extra]
        need = deployment.replicas - len(keep)
        # the reconciler retires the newest first: extras, then each rolled replica in turn
        rolled = out[:need][::-1]
        removed = [r for r in up if r.replica_id in extra] + out[need:]
        split = _Split(keep, rolled, removed, need - len(rolled))
        self.splits[deployment.name] = split
        gone = {r.replica_id for r in split.remove}
        self.taken = [p for p in self.taken if p.replica_id not in gone]

    def retire_first(self, records: list[ReplicaRecord]) -> list[ReplicaRecord]:
        """Current replicas in the order the reconciler retires them when there are too many."""
        s = self.s

        def key(r: ReplicaRecord) -> tuple[bool, bool, int, int, int]:
            ready = ready_everywhere(r, s.shards, s.nodes)
            return retire_key(r, ready=ready, current=True, costs=s.costs)

        return sorted(records, key=key)

    def plan(self, deployment: Deployment) -> list[PlannedReplica]:
        split = self.splits[deployment.name]
        name = deployment.name
        changes = [
            PlannedReplica(Action.KEEP, name, r.replica_id, r.plan.profile, plan=r.plan)
            for r in split.keep
        ]
        profile = self.s.profiles.get(deployment.profile)
        why = f"profile {deployment.profile!r} is not defined"
        if profile is not None:
            why = profile_refusal(profile)
        serials = next_serials(self.records, name, split.add + len(split.roll))
        ids = [replica_id_for(name, s) for s in serials]
        if why or profile is None:
            changes += [
                PlannedReplica(Action.UNPLACEABLE, name, i, deployment.profile, reason=why)
                for i in ids
            ]
        else:
            changes += self.place_new(deployment, profile, ids, split)
        changes += [
            PlannedReplica(
                Action.REMOVE, name, r.replica_id, r.plan.profile, plan=r.plan,
                reason="more replicas than desired",
            )
            for r in split.remove
        ]  # fmt: skip
        return changes

    def place_new(
        self, deployment: Deployment, profile: EngineProfile, ids: list[str], split: _Split
    ) -> list[PlannedReplica]:
        """The additions (all at once, as the reconciler places a shortfall), then the
        rolls, one at a time: each placed while the replica it replaces still runs, and
        while those replaced before still drain (the reconciler places the next surge as
        soon as it retires one), unless only their room is left: then the oldest first."""
        name = deployment.name
        changes: list[PlannedReplica] = []
        adds, rolls = ids[: split.add], ids[split.add :]
        for replica_id, placed in zip(adds, self.place(deployment, profile, adds), strict=True):
            if isinstance(placed, Unplaceable):
                changes.append(
                    PlannedReplica(
                        Action.UNPLACEABLE, name, replica_id, profile.name, reason=placed.reason
                    )
                )
            else:
                changes.append(
                    PlannedReplica(Action.ADD, name, replica_id, profile.name, plan=placed)
                )
        failure: Unplaceable | None = None
        retiring: list[str] = []  # replicas rolled before: they still drain meanwhile
        for replica_id, old in zip(rolls, split.roll, strict=True):
            placed = failure or self.place(deployment, profile, [replica_id])[0]
            while isinstance(placed, Unplaceable) and retiring:  # gone soon: room then
                self.free(retiring.pop(0))
                placed = self.place(deployment, profile, [replica_id])[0]
            if isinstance(placed, Unplaceable):
                failure = placed
                reason = f"cannot roll {old.replica_id}: {placed.reason}"
                changes.append(
                    PlannedReplica(
                        Action.UNPLACEABLE, name, replica_id, profile.name, old.plan.profile,
                        reason=reason,
                    )
                )  # fmt: skip
                continue
            why = f"replaces {old.replica_id}"
            if old.plan.profile == profile.name:  # the same name, edited
                why += f" (profile edited: {old.plan.fingerprint} → {placed.fingerprint})"
            changes.append(
                PlannedReplica(
                    Action.ROLL, name, replica_id, profile.name, old.plan.profile, placed, why,
                )
            )  # fmt: skip
            retiring.append(old.replica_id)
        return changes

    def free(self, replica_id: str) -> None:
        self.taken = [p for p in self.taken if p.replica_id != replica_id]

    def place(
        self, deployment: Deployment, profile: EngineProfile, ids: list[str]
    ) -> list[ReplicaPlan | Unplaceable]:
        if not ids:
            return []
        placed = list(
            self.s.place(deployment, profile, ids, excluding=self.unusable, taken=tuple(self.taken))
        )
        for result in placed:
            if isinstance(result, ReplicaPlan):
                self.taken.append(result)
                self.records[result.replica_id] = ReplicaRecord(
                    result, profile, Lifecycle.ACTIVE, _serial(result.replica_id)
                )
        return placed


def _serial(replica_id: str) -> int:
    tail = replica_id.rpartition("-")[2]
    return int(tail) if tail.isdigit() else 0
