"""A deployment's status as the server shows it: counts, one reason, three conditions.

Pure: :func:`deployment_status` takes the deployment, one :class:`ReplicaFacts` per live
replica (ACTIVE or SURGE: what the reconciler keeps running), what the reconciler's last
round said it could not place, whether failed replicas in a row hold its placement back,
the status shown before and the wall clock; it returns a ``DeploymentStatus``
(``protos/llmgw/v1/workload.proto`` documents every field).

Conditions follow kubectl's Deployment conditions: ``Available`` (ready >= desired),
``Progressing`` (true while the deployment is on its way or there; false when the
reconciler cannot go on: no place, or a crash-loop back-off) and ``ReplicaFailure``. A
condition's ``since`` is kept from the previous status while its true/false stays the same,
so it says how long a deployment has been unavailable or stuck.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from llmgw.api.llmgw.v1 import (
    Deployment,
    DeploymentCondition,
    DeploymentStatus,
    Shard,
    ShardState,
)
from llmgw.protocol import read_shard_state
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord

__all__ = [
    "AVAILABLE",
    "PROGRESSING",
    "REPLICA_FAILURE",
    "ReplicaFacts",
    "RoundVerdict",
    "deployment_status",
    "replica_state",
]

AVAILABLE = "Available"
PROGRESSING = "Progressing"
REPLICA_FAILURE = "ReplicaFailure"

_STARTING = (ShardState.PENDING, ShardState.STARTING, ShardState.LOADING)


@dataclass(frozen=True, slots=True)
class ReplicaFacts:
    """What the status needs of one live replica."""

    replica_id: str
    state: ShardState  # as :func:`replica_state` derives it
    ready: bool  # every shard READY on its planned node, and every such node READY
    up_to_date: bool  # placed with the deployment's profile as it is now
    reason: str = ""  # why it is not ready, in words ("" when it is, or none is known)


@dataclass(frozen=True, slots=True)
class RoundVerdict:
    """What the reconciler's last round said about the deployment."""

    unplaceable: str = ""  # why some replica it needs has no place ("" when none)
    backoff: bool = False  # failed replicas in a row hold its next placement back


def deployment_status(
    deployment: Deployment,
    replicas: Sequence[ReplicaFacts],
    verdict: RoundVerdict,
    *,
    previous: DeploymentStatus | None,
    now_ms: int,
    retiring: int = 0,
) -> DeploymentStatus:
    """The deployment's status now (see the module docstring); ``retiring``: its replicas
    draining out."""
    desired = deployment.replicas
    ready = sum(1 for r in replicas if r.ready)
    up_to_date = sum(1 for r in replicas if r.up_to_date)
    status = DeploymentStatus(
        desired=desired,
        replicas=len(replicas),
        ready=ready,
        starting=sum(1 for r in replicas if r.state in _STARTING),
        failed=sum(1 for r in replicas if r.state is ShardState.FAILED),
        unplaceable=max(0, desired - len(replicas)) if verdict.unplaceable else 0,
        unplaceable_reason=verdict.unplaceable,
        up_to_date=up_to_date,
        available=sum(1 for r in replicas if r.ready and r.up_to_date),
        retiring=retiring,
    )
    status.reason = _reason(deployment, status, replicas, verdict)
    fresh = [
        _available(status),
        _progressing(deployment, status, verdict),
        _replica_failure(status, replicas, verdict),
    ]
    status.conditions = [_since(c, previous, now_ms) for c in fresh]
    return status


def _complete(status: DeploymentStatus) -> bool:
    return status.available == status.desired == status.replicas and not status.retiring


def _reason(
    deployment: Deployment,
    status: DeploymentStatus,
    replicas: Sequence[ReplicaFacts],
    verdict: RoundVerdict,
) -> str:
    """The first thing that keeps the deployment from done, in words."""
    if _complete(status):
        return ""
    if verdict.unplaceable:
        return verdict.unplaceable
    for replica in replicas:
        if not replica.ready and replica.reason:
            return f"replica {replica.replica_id}: {replica.reason}"
    if status.starting:
        return _replicas(status.starting, "starting")
    if status.replicas < status.desired:
        return _replicas(status.desired - status.replicas, "to place")
    if status.up_to_date < status.replicas:
        return (
            f"rolling to profile {deployment.profile}: "
            f"{status.up_to_date} of {status.replicas} up to date"
        )
    if status.replicas > status.desired:
        return _replicas(status.replicas - status.desired, "extra, retiring")
    if status.retiring:
        return _replicas(status.retiring, "draining out")
    return f"{status.available} of {status.desired} available"


def _available(status: DeploymentStatus) -> DeploymentCondition:
    words = f"{status.ready} of {status.desired} replica{_s(status.desired)} ready"
    if status.ready >= status.desired:
        return _condition(AVAILABLE, True, "MinimumReplicasAvailable", words)
    return _condition(AVAILABLE, False, "MinimumReplicasUnavailable", words)


def _progressing(
    deployment: Deployment, status: DeploymentStatus, verdict: RoundVerdict
) -> DeploymentCondition:
    if _complete(status):
        words = (
            f"{status.desired} replica{_s(status.desired)} ready on profile {deployment.profile}"
        )
        return _condition(PROGRESSING, True, "NewReplicasAvailable", words)
    if verdict.unplaceable:
        why = "CrashLoopBackOff" if verdict.backoff else "Unplaceable"
        return _condition(PROGRESSING, False, why, verdict.unplaceable)
    words = (
        f"{status.available} of {status.desired} replica{_s(status.desired)} "
        f"available on profile {deployment.profile}"
    )
    return _condition(PROGRESSING, True, "ReplicasUpdating", words)


def _replica_failure(
    status: DeploymentStatus, replicas: Sequence[ReplicaFacts], verdict: RoundVerdict
) -> DeploymentCondition:
    if verdict.unplaceable:
        why = "CrashLoopBackOff" if verdict.backoff else "Unplaceable"
        return _condition(REPLICA_FAILURE, True, why, verdict.unplaceable)
    failed = [r for r in replicas if r.state is ShardState.FAILED]
    if failed:
        first = failed[0]
        words = f"replica {first.replica_id} FAILED" + (f": {first.reason}" if first.reason else "")
        return _condition(REPLICA_FAILURE, True, "ReplicaFailed", words)
    return _condition(REPLICA_FAILURE, False, "NoFailures", "")


def _since(
    condition: DeploymentCondition, previous: DeploymentStatus | None, now_ms: int
) -> DeploymentCondition:
    """``condition`` with its transition time: the previous one's while its status holds."""
    earlier = previous.conditions if previous is not None else []
    before = next((c for c in earlier if c.type == condition.type), None)
    same = before is not None and before.status == condition.status
    condition.since_unix_ms = before.since_unix_ms if same and before is not None else now_ms
    return condition


def _condition(type_: str, status: bool, reason: str, message: str) -> DeploymentCondition:
    return DeploymentCondition(type=type_, status=status, reason=reason, message=message)


def _replicas(count: int, what: str) -> str:
    return f"{count} replica{_s(count)} {what}"


def _s(count: int) -> str:
    return "" if count == 1 else "s"


_ORDER = (ShardState.PENDING, ShardState.STARTING, ShardState.LOADING, ShardState.READY)


def replica_state(record: ReplicaRecord, shards: Iterable[Shard | None]) -> ShardState:
    """A replica's state from its shards on their planned nodes (None: not reported there).

    A retiring replica is DRAINING (STOPPED once none runs); else READY only when every
    shard is READY, FAILED if one is, DRAINING if one drains, else the least advanced shard's state
    (a missing or STOPPED shard of a live replica counts as PENDING: it will be started).
    """
    states = [
        read_shard_state(s.status.state)
        if s is not None and s.status is not None
        else ShardState.STOPPED
        for s in shards
    ]
    if record.lifecycle is Lifecycle.RETIRING:  # it takes no new requests, READY or not
        running = any(s is not ShardState.STOPPED for s in states)
        return ShardState.DRAINING if running else ShardState.STOPPED
    if all(s is ShardState.READY for s in states):
        return ShardState.READY
    if ShardState.FAILED in states:
        return ShardState.FAILED
    if ShardState.DRAINING in states:
        return ShardState.DRAINING
    return min((s if s in _ORDER else ShardState.PENDING for s in states), key=_ORDER.index)
