"""The reconciler's inputs and outputs: plain frozen values, no I/O.

:class:`ReconcileInput` is everything one reconciliation round looks at (desired state,
the replicas the server has decided on, what agents report, the nodes, the commands
already sent); :class:`Decision` is what it decided. :func:`apply_decision` folds a
decision's state changes into the next round's input, as the server does after it has
stored the records and sent the commands.

Replica lifecycle (``Lifecycle``)::

    ACTIVE ──→ RETIRING ──→ RETIRED
      ↑  └──────────────────→ RETIRED   (replaced: node gone or restarts exhausted; fenced)
    SURGE ──→ RETIRING                  (no longer needed)

A SURGE replica becomes ACTIVE when every shard is READY (or when nothing is left to
replace). A RETIRED replica is kept as a record: its shards are *fenced*, stopped wherever
an agent reports them, so a replica never runs twice.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from llmgw.api.llmgw.v1 import ControlMessage, Deployment, EngineProfile, Shard
from llmgw.server.core.plan import ReplicaPlan, Unplaceable

__all__ = [
    "ALLOWED_LIFECYCLE",
    "CommandKind",
    "CrashLoop",
    "Decision",
    "Event",
    "Lifecycle",
    "NodeView",
    "PendingCommand",
    "PlaceFn",
    "ReconcileConfig",
    "ReconcileInput",
    "ReplicaRecord",
    "ScaleInCost",
    "apply_decision",
    "crash_delay",
    "held_reason",
]


class Lifecycle(enum.Enum):
    """Where a replica is in its life, as the server decided it (not as agents report)."""

    ACTIVE = "active"  # wanted: its shards are started and kept running
    SURGE = "surge"  # a replacement being brought up during a reprofile; started like ACTIVE
    RETIRING = "retiring"  # draining; RETIRED once none of its shards runs
    RETIRED = "retired"  # gone for good: any shard of it an agent reports is stopped


ALLOWED_LIFECYCLE: Mapping[Lifecycle, frozenset[Lifecycle]] = {
    Lifecycle.ACTIVE: frozenset({Lifecycle.RETIRING, Lifecycle.RETIRED}),
    Lifecycle.SURGE: frozenset({Lifecycle.ACTIVE, Lifecycle.RETIRING, Lifecycle.RETIRED}),
    Lifecycle.RETIRING: frozenset({Lifecycle.RETIRED}),
    Lifecycle.RETIRED: frozenset(),
}
"""Every lifecycle change the reconciler may make."""


class CommandKind(enum.Enum):
    """A command sent to an agent about one shard."""

    START = "start"  # StartShard
    STOP = "stop"  # StopShard
    DRAIN = "drain"  # DrainShard


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    """One replica the server decided on: where it goes, with what, and where it stands."""

    plan: ReplicaPlan
    profile: EngineProfile  # the profile it was placed with (its shards start with this)
    lifecycle: Lifecycle
    serial: int  # per deployment, increasing: higher is newer
    api_key: str = field(default="", repr=False)  # a secret: kept out of logs
    replaces: str = ""  # the replica id this one replaces, if any
    # Every shard was READY at once, some time: its nodes have loaded the weights of its
    # profile's model_path (what warm placement looks for, ``placing.warm_nodes``).
    was_ready: bool = False

    @property
    def replica_id(self) -> str:
        return self.plan.replica_id


@dataclass(frozen=True, slots=True)
class ScaleInCost:
    """What retiring one live replica would cost now: a scale-in retires, after the
    not-READY and out-of-date replicas, the one that costs least, in this order."""

    # its cached prefix blocks (the server's KV block store) that no other live replica of
    # its deployment holds: what the deployment's prefix caches lose with it
    unique_blocks: int = 0
    in_flight: int = 0  # requests the gateways have in flight on it now


@dataclass(frozen=True, slots=True)
class NodeView:
    """What the reconciler needs of a node."""

    node_id: str
    ready: bool  # its agent is connected and heartbeating
    cordoned: bool = False  # no new replicas go there
    not_ready_since: float | None = None  # monotonic seconds; None: ready, or unknown
    address: str = ""  # management address, the rendezvous address of a multi-node leader


@dataclass(frozen=True, slots=True)
class PendingCommand:
    """A command already sent for a shard and not yet reflected in what its agent reports."""

    kind: CommandKind
    node_id: str
    sent_at: float  # monotonic seconds


@dataclass(frozen=True, slots=True)
class CrashLoop:
    """A replica that failed again and again, restarted in place (same id, same node) after
    a delay that doubles per failure up to a cap (``crash_delay``), as kubelet does."""

    failures: int  # in a row, counting the deployment's failures before it
    reason: str  # the last failure's, in words
    until: float  # monotonic seconds: not restarted before
    restarted: bool = False  # its failed shards were stopped to start again since then


@dataclass(frozen=True, slots=True)
class ReconcileConfig:
    """Timing and limits of reconciliation."""

    node_grace_s: float = 60.0  # NOT_READY this long: its replicas are replaced elsewhere
    command_retry_s: float = 30.0  # a command not reflected after this is sent again
    max_restarts: int = 5  # a FAILED shard restarted this often: its replica is replaced
    # After failed replicas in a row, a deployment's next placement waits this long,
    # doubling per failure up to the cap; a deployment that has not failed for
    # ``crash_reset_s`` starts again from the first delay (as kubelet's CrashLoopBackOff).
    crash_backoff_s: float = 5.0
    crash_backoff_max_s: float = 300.0
    crash_reset_s: float = 600.0
    drain_grace_s: int = 30  # DrainShard grace
    stop_grace_s: int = 10  # StopShard grace


class PlaceFn(Protocol):
    """Places replicas of a deployment: one plan or reason per id, in order.

    ``excluding`` names nodes that must not be chosen; ``taken`` is every plan that holds
    devices and ports now, including those placed earlier in this round.
    """

    def __call__(
        self,
        deployment: Deployment,
        profile: EngineProfile,
        replica_ids: Sequence[str],
        *,
        excluding: frozenset[str],
        taken: Sequence[ReplicaPlan],
    ) -> Sequence[ReplicaPlan | Unplaceable]: ...


@dataclass(frozen=True, slots=True)
class ReconcileInput:
    """Everything one round looks at.

    ``retire`` names replicas to retire now, before the deployment's count is looked at
    (an operator's drain, stored with the lowered count); ``replace`` names replicas to
    treat as out of date, so the rolling surge replaces them first (a node drain).
    ``costs`` says what retiring each live replica would lose (:class:`ScaleInCost`), so a
    scale-in retires the cheapest.

    ``nodes`` must hold every node a replica's plan names: one missing reads as NOT_READY
    since an unknown time, which never reaches the grace (a server that restarted lists the
    nodes it has seen, NOT_READY since its start, until their agents come back).
    """

    deployments: Mapping[str, Deployment]
    profiles: Mapping[str, EngineProfile]
    fingerprint: Callable[[EngineProfile], str]
    place: PlaceFn
    replicas: Mapping[str, ReplicaRecord]
    shards: Mapping[str, Shard]
    nodes: Mapping[str, NodeView]
    pending: Mapping[str, PendingCommand]
    now: float
    api_key_for: Callable[[str], str]  # a fresh secret for a new replica id
    config: ReconcileConfig = field(default_factory=ReconcileConfig)
    retire: frozenset[str] = frozenset()  # replica ids an operator drained: retire them now
    replace: frozenset[str] = frozenset()  # replica ids to replace by surge (node drain)
    held: Mapping[str, str] = field(default_factory=dict)  # deployment → why nothing is placed
    streak: Mapping[str, int] = field(default_factory=dict)  # deployment → failures in a row
    crashloops: Mapping[str, CrashLoop] = field(default_factory=dict)  # replica id → its loop
    # replica id → what retiring it costs; one not named costs nothing (computed by the
    # caller only for deployments with more replicas than their count)
    costs: Mapping[str, ScaleInCost] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Event:
    """Something the reconciler decided, for the audit log and the Watch stream."""

    subject: str  # the replica or shard id it is about
    what: str
    why: str


@dataclass(frozen=True, slots=True)
class Decision:
    """What one round decided.

    ``replicas`` holds only new or changed records; ``pending`` is the whole table of
    commands in flight after this round (it replaces the old one).
    """

    replicas: Mapping[str, ReplicaRecord]
    commands: tuple[tuple[str, ControlMessage], ...]  # (node_id, message), in send order
    pending: Mapping[str, PendingCommand]
    events: tuple[Event, ...]
    unplaceable: Mapping[str, str]  # deployment → why some of its replicas have no place
    failed: Mapping[str, int] = field(default_factory=dict)  # deployment → replicas that failed
    crashloops: Mapping[str, CrashLoop] = field(default_factory=dict)  # the whole table after


def crash_delay(failures: int, config: ReconcileConfig) -> float:
    """How long a deployment's next placement waits after ``failures`` in a row."""
    if failures <= 0:
        return 0.0
    delay = config.crash_backoff_s * 2.0 ** min(failures - 1, 30)
    return float(min(delay, config.crash_backoff_max_s))


def held_reason(name: str, failures: int, config: ReconcileConfig) -> str:
    """Why a deployment's next replica waits, in an operator's words."""
    replicas = f"{failures} replica{'' if failures == 1 else 's'}"
    delay = crash_delay(failures, config)
    return f"{replicas} of {name} failed in a row; waiting {delay:g} s before placing another"


def apply_decision(state: ReconcileInput, decision: Decision) -> ReconcileInput:
    """The next round's input: ``state`` with the decision's records and pending table."""
    return replace(
        state,
        replicas={**state.replicas, **decision.replicas},
        pending=dict(decision.pending),
        crashloops=dict(decision.crashloops),
    )
