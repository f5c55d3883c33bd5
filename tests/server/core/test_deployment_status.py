"""A deployment's status from its replicas and the reconciler's verdict: counts, the one
reason, the three conditions and when each last changed."""

from __future__ import annotations

from llmgw.api.llmgw.v1 import Deployment, DeploymentCondition, DeploymentStatus, ShardState
from llmgw.server.core.deployment_status import (
    AVAILABLE,
    PROGRESSING,
    REPLICA_FAILURE,
    ReplicaFacts,
    RoundVerdict,
    deployment_status,
)

CHAT = Deployment(name="chat", profile="chat-tp2", replicas=2)
NO_ROOM = "no H100 node has 2 free GPUs in one NVLink group (a1: 0 free)"


def _ready(replica_id: str, *, up_to_date: bool = True) -> ReplicaFacts:
    return ReplicaFacts(replica_id, ShardState.READY, True, up_to_date)


def _conditions(status: DeploymentStatus) -> dict[str, DeploymentCondition]:
    return {c.type: c for c in status.conditions}


def _status(
    replicas: list[ReplicaFacts],
    verdict: RoundVerdict | None = None,
    *,
    previous: DeploymentStatus | None = None,
    now_ms: int = 1000,
    deployment: Deployment = CHAT,
) -> DeploymentStatus:
    return deployment_status(
        deployment, replicas, verdict or RoundVerdict(), previous=previous, now_ms=now_ms
    )


def test_a_deployment_that_fits_is_available_and_done() -> None:
    status = _status([_ready("chat-1"), _ready("chat-2")])
    counts = (status.desired, status.replicas, status.ready, status.up_to_date, status.available)
    assert counts == (2, 2, 2, 2, 2)
    assert (status.starting, status.failed, status.unplaceable, status.reason) == (0, 0, 0, "")
    assert [c.type for c in status.conditions] == [AVAILABLE, PROGRESSING, REPLICA_FAILURE]
    conditions = _conditions(status)
    assert (conditions[AVAILABLE].status, conditions[AVAILABLE].reason) == (
        True,
        "MinimumReplicasAvailable",
    )
    assert conditions[PROGRESSING].reason == "NewReplicasAvailable"
    assert (conditions[REPLICA_FAILURE].status, conditions[REPLICA_FAILURE].reason) == (
        False,
        "NoFailures",
    )
    assert all(c.since_unix_ms == 1000 for c in status.conditions)


def test_a_shortfall_shows_the_placement_reason_everywhere() -> None:
    status = _status([_ready("chat-1")], RoundVerdict(NO_ROOM))
    assert (status.ready, status.unplaceable, status.unplaceable_reason) == (1, 1, NO_ROOM)
    assert status.reason == NO_ROOM
    conditions = _conditions(status)
    assert (conditions[AVAILABLE].status, conditions[AVAILABLE].message) == (
        False,
        "1 of 2 replicas ready",
    )
    assert (conditions[PROGRESSING].status, conditions[PROGRESSING].reason) == (
        False,
        "Unplaceable",
    )
    assert conditions[REPLICA_FAILURE].status and conditions[REPLICA_FAILURE].message == NO_ROOM


def test_a_crash_loop_back_off_is_named_as_such() -> None:
    held = "3 replicas of chat failed in a row; waiting 20 s before placing another"
    status = _status([], RoundVerdict(held, backoff=True))
    conditions = _conditions(status)
    assert status.unplaceable == 2 and status.reason == held
    assert (
        conditions[PROGRESSING].reason == conditions[REPLICA_FAILURE].reason == ("CrashLoopBackOff")
    )


def test_starting_failed_and_lost_replicas_are_counted_apart() -> None:
    replicas = [
        ReplicaFacts("chat-1", ShardState.LOADING, False, True),
        ReplicaFacts("chat-2", ShardState.FAILED, False, True, "FAILED: exit 1: CUDA OOM"),
        ReplicaFacts("chat-3", ShardState.READY, False, True, "node a2 is NOT_READY"),
    ]
    status = _status(replicas, deployment=Deployment(name="chat", profile="p", replicas=3))
    assert (status.starting, status.failed, status.ready, status.available) == (1, 1, 0, 0)
    assert status.reason == "replica chat-2: FAILED: exit 1: CUDA OOM"
    failure = _conditions(status)[REPLICA_FAILURE]
    assert (failure.status, failure.reason) == (True, "ReplicaFailed")
    assert failure.message == "replica chat-2 FAILED: FAILED: exit 1: CUDA OOM"
    assert _conditions(status)[PROGRESSING].reason == "ReplicasUpdating"


def test_starting_replicas_are_the_reason_while_nothing_is_wrong() -> None:
    status = _status([_ready("chat-1"), ReplicaFacts("chat-2", ShardState.PENDING, False, True)])
    assert status.reason == "1 replica starting"
    assert _conditions(status)[PROGRESSING].status


def test_a_rollout_counts_up_to_date_and_available_apart_from_ready() -> None:
    replicas = [
        _ready("chat-1", up_to_date=False),
        _ready("chat-2", up_to_date=False),
        ReplicaFacts("chat-3", ShardState.LOADING, False, True),
    ]
    status = _status(replicas)
    assert (status.replicas, status.ready, status.up_to_date, status.available) == (3, 2, 1, 0)
    assert _conditions(status)[AVAILABLE].status  # READY never dropped below the count
    assert _conditions(status)[PROGRESSING].message == (
        "0 of 2 replicas available on profile chat-tp2"
    )
    done = _status([_ready("chat-3"), _ready("chat-4"), _ready("chat-2", up_to_date=False)])
    assert done.reason == "rolling to profile chat-tp2: 2 of 3 up to date"


def test_since_moves_only_when_a_condition_flips() -> None:
    first = _status([_ready("chat-1")], RoundVerdict(NO_ROOM), now_ms=1000)
    # Later, the same shortfall with other words: no condition flips, every since stays.
    worded = _status([_ready("chat-1")], RoundVerdict("other words"), previous=first, now_ms=2000)
    assert [c.since_unix_ms for c in worded.conditions] == [1000, 1000, 1000]
    assert _conditions(worded)[REPLICA_FAILURE].message == "other words"
    fixed = _status([_ready("chat-1"), _ready("chat-2")], previous=worded, now_ms=3000)
    assert [c.since_unix_ms for c in fixed.conditions] == [3000, 3000, 3000]
    again = _status([_ready("chat-1"), _ready("chat-2")], previous=fixed, now_ms=4000)
    assert again == fixed


def test_no_replicas_desired_is_done() -> None:
    status = _status([], deployment=Deployment(name="idle", profile="p", replicas=0))
    assert status.reason == "" and all(
        c.status is (c.type != REPLICA_FAILURE) for c in status.conditions
    )
