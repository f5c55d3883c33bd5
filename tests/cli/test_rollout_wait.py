"""The verdicts ``--wait`` and ``llmgw rollout status`` draw from the server's statuses."""

from __future__ import annotations

import argparse

import pytest

from llmgw.api.llmgw.v1 import Deployment, DeploymentCondition, DeploymentStatus
from llmgw.cli.rollout_wait import STALLED_S, duration, judge

NOW = 1_000_000_000


def deployment(
    *, available: int, replicas: int, progressing: bool = True, since: int = NOW, desired: int = 2
) -> Deployment:
    conditions = [
        DeploymentCondition(type="Available", status=available >= desired),
        DeploymentCondition(
            type="Progressing",
            status=progressing,
            reason="ReplicasUpdating" if progressing else "Unplaceable",
            message="" if progressing else "needs 16 GPUs of one node; the largest has 8",
            since_unix_ms=since,
        ),
        DeploymentCondition(type="ReplicaFailure", status=not progressing),
    ]
    status = DeploymentStatus(
        desired=desired, replicas=replicas, ready=available, up_to_date=available,
        available=available, reason="" if available == desired else "replicas starting",
        conditions=conditions,
    )  # fmt: skip
    return Deployment(name="chat", profile="p", replicas=desired, status=status)


def test_done_only_when_every_wanted_replica_is_available_and_no_other_is_left() -> None:
    assert judge("chat", deployment(available=2, replicas=2), NOW).done
    assert not judge("chat", deployment(available=1, replicas=2), NOW).done
    rolling = judge("chat", deployment(available=2, replicas=3), NOW)  # an old one still there
    assert not rolling.done and not rolling.blocked
    assert "2 of 2 replicas available" in rolling.line and "3 placed" in rolling.line


def test_not_progressing_blocks_only_after_it_held_for_the_stall_time() -> None:
    fresh = judge("chat", deployment(available=0, replicas=0, progressing=False), NOW)
    assert not fresh.blocked and not fresh.done
    since = NOW - int(STALLED_S * 1000)
    stalled = judge(
        "chat", deployment(available=0, replicas=0, progressing=False, since=since), NOW
    )
    assert stalled.blocked
    assert "cannot progress (Unplaceable)" in stalled.line
    assert "needs 16 GPUs of one node" in stalled.line


def test_a_missing_deployment_blocks_and_one_without_status_waits() -> None:
    assert judge("gone", None, NOW).blocked
    bare = judge("new", Deployment(name="new", profile="p", replicas=1), NOW)
    assert not bare.blocked and not bare.done


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("90s", 90), ("10m", 600), ("1h30m", 5400), ("1.5m", 90)]
)
def test_durations_read_as_kubectl_writes_them(text: str, seconds: float) -> None:
    assert duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "ten", "10x", "-5s", "m"])
def test_bad_durations_are_refused_naming_the_text(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="duration"):
        duration(text)
