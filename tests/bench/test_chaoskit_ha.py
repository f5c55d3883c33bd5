"""bench/chaoskit/ha.py and the --servers parts of the chaos run: leader reading, fault
choice, the one-leader check, the failover figures, the kinds allowed per server count."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from bench import chaos
from bench.chaoskit import checks, faults, ha, observe

METRICS = """\
# HELP llmgw_leader 1 while this server leads
# TYPE llmgw_leader gauge
llmgw_leader {lead}
# TYPE llmgw_leader_epoch gauge
llmgw_leader_epoch {epoch}
"""


def test_parse_leader_reads_both_gauges() -> None:
    assert ha.parse_leader(METRICS.format(lead=1, epoch=7)) == (1, 7)
    assert ha.parse_leader(METRICS.format(lead=0, epoch=3)) == (0, 3)
    assert ha.parse_leader("llmgw_leader 1\n") is None


def test_leader_of_takes_the_highest_epoch_that_leads() -> None:
    assert ha.leader_of({"a": (0, 9), "b": (1, 4), "c": (0, 2)}) == ("b", 4)
    assert ha.leader_of({"a": (1, 3), "b": (1, 5)}) == ("b", 5)
    assert ha.leader_of({"a": (0, 3)}) is None
    assert ha.leader_of({}) is None


def test_choose_server_aims_at_the_leader_most_of_the_time() -> None:
    names = ("server-0", "server-1", "server-2")
    rng = random.Random(5)
    picks = Counter(ha.choose_server(names, "server-1", rng, 0.75) for _ in range(4000))
    assert 0.70 < picks["server-1"] / 4000 < 0.80
    assert picks["server-0"] > 300 and picks["server-2"] > 300


def test_choose_server_without_a_leader_picks_any() -> None:
    names = ("a", "b", "c")
    rng = random.Random(1)
    picks = Counter(ha.choose_server(names, None, rng) for _ in range(600))
    assert set(picks) == set(names)
    assert ha.choose_server(("a",), "a", rng, 0.0) == "a"  # no follower to aim at
    with pytest.raises(ValueError, match="no servers"):
        ha.choose_server((), None, rng)


def test_postmaster_pid_reads_the_first_line(tmp_path: Path) -> None:
    (tmp_path / "postmaster.pid").write_text("4242\n/var/lib/pg\n1700000000\n5432\n")
    assert ha.postmaster_pid(tmp_path) == 4242
    with pytest.raises(ValueError, match="no postmaster pid"):
        ha.postmaster_pid(tmp_path / "absent")


def _sample(at: float, leaders: tuple[str, ...]) -> observe.Sample:
    return observe.Sample(at, True, (), (), (), (), 5, leaders)


def test_one_leader_check_fails_on_two_at_once() -> None:
    ok = [_sample(0.0, ("a",)), _sample(0.5, ()), _sample(1.0, ("b",))]
    passed = checks.check_one_leader(ok)
    assert passed.passed
    assert "2 with one leader, 0 with two or more, 1 with none" in passed.summary
    failed = checks.check_one_leader([*ok, _sample(1.5, ("a", "b"))])
    assert not failed.passed
    assert failed.details == ("t=1.5s: a, b lead",)


def _leader_fault(kind: str, took: float | None) -> faults.FaultRecord:
    return faults.FaultRecord(kind, "server-0", 1, 0.0, 1.0, leader=True, failover_s=took)


def test_failover_line_gives_p50_and_max_and_the_misses() -> None:
    records = [
        _leader_fault("kill-server", 2.0),
        _leader_fault("stop-server", 4.0),
        _leader_fault("kill-server", 3.0),
        _leader_fault("stop-server", None),
        faults.FaultRecord("kill-server", "server-1", 2, 0.0, 1.0),  # a follower: not counted
    ]
    line = chaos.failover_line(records)
    assert "4 faults on the leader (kill-server 2, stop-server 2)" in line
    assert "p50 3.00 s, max 4.00 s" in line
    assert "1 with no other leader" in line
    assert chaos.failover_line(records[-1:]) == "no fault hit the leader"
    assert "another led after 2.00s" in records[0].note
    assert records[3].note == "on the leader; no other led"


def _options(*argv: str) -> chaos.Options:
    return chaos._options(chaos._parser().parse_args(list(argv)))


def test_kinds_follow_the_server_count() -> None:
    assert _options().kinds == faults.KINDS  # one server: today's kinds
    several = _options("--servers", "3").kinds
    assert "fill-disk" not in several
    assert set(faults.PG_KINDS) <= set(several)
    assert _options("--servers", "3").servers == 3
    with pytest.raises(SystemExit, match="not with --servers 1"):
        _options("--kinds", "kill-postgres")
    with pytest.raises(SystemExit, match="fill-disk not with --servers 2"):
        _options("--servers", "2", "--kinds", "fill-disk,kill-server")
    with pytest.raises(SystemExit, match="--servers 0"):
        _options("--servers", "0")
