"""The pure core of supervision: the lifecycle table, backoff, fingerprints, /metrics,
/proc parsing, the log ring buffer and engine records."""

from __future__ import annotations

import itertools
import json
import os
import stat
from pathlib import Path

import pytest

from llmgw.agent.enginelog import EngineLog
from llmgw.agent.engines.base import LaunchSpec, ShardSpec
from llmgw.agent.errors import RecordError, ShardTransitionError
from llmgw.agent.probe import parse_in_flight
from llmgw.agent.process import ExitStatus, ProcessIdentity, read_stat
from llmgw.agent.records import EngineRecord, RecordStore
from llmgw.agent.shards import (
    ADOPTED_STATE,
    NEW_STATE,
    TRANSITIONS,
    RestartPolicy,
    can_transition,
    check_transition,
    engine_env,
    launch_fingerprint,
)
from llmgw.api.llmgw.v1 import EngineProfile, ShardState, StartShard

S = ShardState
SPEC = Path("/work/shared/spec")

ALLOWED = {
    (S.PENDING, S.STARTING),
    (S.PENDING, S.FAILED),
    (S.PENDING, S.STOPPED),
    (S.STARTING, S.LOADING),
    (S.STARTING, S.FAILED),
    (S.STARTING, S.STOPPED),
    (S.LOADING, S.READY),
    (S.LOADING, S.FAILED),
    (S.LOADING, S.STOPPED),
    (S.READY, S.DRAINING),
    (S.READY, S.FAILED),
    (S.DRAINING, S.STOPPED),
    (S.DRAINING, S.FAILED),
    (S.STOPPED, S.PENDING),
    (S.FAILED, S.STARTING),
    (S.FAILED, S.STOPPED),
    (S.FAILED, S.PENDING),
}


# --- the lifecycle table -----------------------------------------------------------------


def test_every_pair_of_states_is_allowed_or_refused_as_the_table_says() -> None:
    assert set(TRANSITIONS) == set(ShardState)  # every state has a row
    for current, new in itertools.product(ShardState, repeat=2):
        if (current, new) in ALLOWED:
            assert can_transition(current, new), (current, new)
            check_transition(current, new)
        else:
            assert not can_transition(current, new), (current, new)
            with pytest.raises(ShardTransitionError, match=f"from {current.name} to {new.name}"):
                check_transition(current, new)


def test_the_design_path_and_failure_from_every_live_state() -> None:
    path = [S.PENDING, S.STARTING, S.LOADING, S.READY, S.DRAINING, S.STOPPED]
    assert all(can_transition(a, b) for a, b in itertools.pairwise(path))
    for state in (S.PENDING, S.STARTING, S.LOADING, S.READY, S.DRAINING):
        assert can_transition(state, S.FAILED)
    assert NEW_STATE is S.PENDING and ADOPTED_STATE is S.LOADING
    assert not any(can_transition(S.UNSPECIFIED, s) or can_transition(s, S.UNSPECIFIED) for s in S)
    assert not can_transition(S.READY, S.STOPPED)  # a serving engine drains first


# --- restart backoff ---------------------------------------------------------------------


def test_default_backoff_is_ten_seconds_doubling_to_five_minutes() -> None:
    policy = RestartPolicy()
    assert [policy.delay(n) for n in range(8)] == [0, 10, 20, 40, 80, 160, 300, 300]


def test_backoff_is_configurable() -> None:
    policy = RestartPolicy(base_s=0.5, cap_s=3.0, factor=3.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.5, 3.0, 3.0]


# --- the command and its fingerprint -----------------------------------------------------


def _spec(gpus: tuple[str, ...]) -> ShardSpec:
    return ShardSpec("s", "r", 0, EngineProfile(name="p"), "fp", gpus, 8000, "k")


def test_engine_env_adds_gpu_uuids_unless_the_adapter_set_them() -> None:
    launch = LaunchSpec(engine="x", argv=("x",), env={"A": "1"}, port=8000)
    assert engine_env(_spec(("GPU-1", "MIG-2")), launch) == {
        "A": "1",
        "CUDA_VISIBLE_DEVICES": "GPU-1,MIG-2",
    }
    assert engine_env(_spec(()), launch) == {"A": "1"}
    own = LaunchSpec(engine="x", argv=("x",), env={"CUDA_VISIBLE_DEVICES": "GPU-9"}, port=1)
    assert engine_env(_spec(("GPU-1",)), own) == {"CUDA_VISIBLE_DEVICES": "GPU-9"}


def test_fingerprint_changes_with_argv_or_env_and_nothing_else() -> None:
    base = launch_fingerprint(("vllm", "serve", "m"), {"A": "1", "B": "2"})
    assert base == launch_fingerprint(("vllm", "serve", "m"), {"B": "2", "A": "1"})
    assert base != launch_fingerprint(("vllm", "serve", "m2"), {"A": "1", "B": "2"})
    assert base != launch_fingerprint(("vllm", "serve", "m"), {"A": "1", "B": "3"})
    assert base != launch_fingerprint(("vllm", "serve m"), {"A": "1", "B": "2"})
    assert len(base) == 32 and int(base, 16) >= 0


# --- requests in flight from /metrics ----------------------------------------------------


def test_in_flight_of_the_real_vllm_and_llamacpp_pages() -> None:
    vllm = (SPEC / "vllm-0.32-metrics-sample.txt").read_text()
    llamacpp = (SPEC / "llamacpp-metrics-sample.txt").read_text()
    assert parse_in_flight(vllm) == 0
    assert parse_in_flight(llamacpp) == 0
    busy = vllm.replace(
        'vllm:num_requests_running{engine="0",model_name="smollm2-135m"} 0.0',
        'vllm:num_requests_running{engine="0",model_name="smollm2-135m"} 4.0',
    ).replace(
        'vllm:num_requests_waiting{engine="0",model_name="smollm2-135m"} 0.0',
        'vllm:num_requests_waiting{engine="0",model_name="smollm2-135m"} 2.0',
    )
    assert parse_in_flight(busy) == 6  # the by-reason breakdown is not counted twice
    assert (
        parse_in_flight(
            llamacpp.replace("llamacpp:requests_processing 0", "llamacpp:requests_processing 3")
        )
        == 3
    )


def test_in_flight_parsing_edge_cases() -> None:
    assert parse_in_flight("") is None
    assert parse_in_flight("# HELP vllm:num_requests_running x\nother_metric 5\n") is None
    labels_with_space = 'vllm:num_requests_running{model_name="a b} c",engine="1"} 2 1700000000\n'
    assert parse_in_flight(labels_with_space) == 2
    two_engines = (
        'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 2\n'
    )
    assert parse_in_flight(two_engines) == 3
    assert parse_in_flight("vllm:num_requests_running NaN\n") is None
    assert parse_in_flight('vllm:num_requests_running{engine="0"} junk\n') is None


# --- /proc and exits ---------------------------------------------------------------------


def test_read_stat_handles_command_names_with_spaces_and_parentheses(tmp_path: Path) -> None:
    (tmp_path / "77").mkdir()
    fields = ["S", "1", "77", "77", "0", "-1"] + ["0"] * 13 + ["123456", "0"]
    (tmp_path / "77" / "stat").write_text("77 (VLLM::Engine) (x y) " + " ".join(fields) + "\n")
    found = read_stat(77, proc=tmp_path)
    assert found is not None
    assert (found.state, found.pgrp, found.session, found.start_ticks) == ("S", 77, 77, 123456)
    assert read_stat(78, proc=tmp_path) is None


def test_exit_descriptions() -> None:
    assert ExitStatus(3).describe() == "exited with code 3"
    assert ExitStatus(-9).describe() == "killed by SIGKILL (exit code -9)"
    assert ExitStatus(None).describe().startswith("exited (exit code unknown")


# --- the log ring buffer -----------------------------------------------------------------


def test_log_ring_keeps_the_last_lines_and_joins_partial_writes(tmp_path: Path) -> None:
    log = EngineLog(tmp_path / "logs" / "s.log", max_lines=3)
    fd = log.open_for_engine("start")
    try:
        for text in (b"one\ntwo\nthr", b"ee\nfour\n", b"five"):
            os.write(fd, text)
            log.refresh()
    finally:
        os.close(fd)
    assert log.tail() == ["two", "three", "four"]  # "five" has no newline yet
    assert log.tail(1) == ["four"] and log.tail(0) == []
    assert log.last_line() == "four"
    assert (tmp_path / "logs" / "s.log").read_text().startswith("=== llmgw ")


def test_log_rotates_a_big_file_and_keeps_the_run_before_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "s.log"
    log = EngineLog(path, max_file_bytes=50)
    fd = log.open_for_engine("first")
    os.write(fd, b"x" * 60 + b"\n")
    log.refresh()  # past 50 bytes: copied to s.log.1 and emptied in place
    assert (tmp_path / "s.log.1").read_bytes().endswith(b"x" * 60 + b"\n")
    assert path.stat().st_size == 0
    os.write(fd, b"after\n")  # the engine appends: at the start of the emptied file
    os.close(fd)
    log.refresh()
    assert path.read_bytes() == b"after\n" and log.tail()[-1] == "after"
    os.close(log.open_for_engine("second"))  # a restart: that run becomes the previous one
    assert (tmp_path / "s.previous.log").read_bytes() == b"after\n"
    assert not (tmp_path / "s.log.1").exists()
    assert path.read_text().startswith("=== llmgw ") and "second" in path.read_text()
    path.write_text("fresh\n")  # truncated under us
    log.refresh()
    assert log.tail()[-1] == "fresh"


# --- records -----------------------------------------------------------------------------


def _record(shard_id: str = "r1-0") -> EngineRecord:
    message = StartShard(
        shard_id=shard_id,
        replica_id="r1",
        profile=EngineProfile(name="p", engine="vllm", tp=2),
        gpu_uuids=["GPU-1", "GPU-2"],
        api_key="sekret-key",
    )
    return EngineRecord(
        shard_id=shard_id,
        identity=ProcessIdentity(4242, 99, "boot"),
        fingerprint="f" * 32,
        port=8100,
        engine="vllm",
        start=message,
        restarts=3,
        started_unix_ms=1,
        log_path="/x/logs/r1-0.log",
    )


def test_record_round_trip_keeps_the_key_apart(tmp_path: Path) -> None:
    store = RecordStore(tmp_path / "engines")
    store.save(_record())
    text = (tmp_path / "engines" / "r1-0.json").read_text()
    assert "sekret-key" not in text and json.loads(text)["api_key_file"] == "r1-0.key"
    assert stat.S_IMODE((tmp_path / "engines" / "r1-0.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "engines" / "r1-0.json").stat().st_mode) == 0o600
    records, errors = store.load_all()
    assert errors == [] and records == [_record()]
    store.delete("r1-0")
    assert list((tmp_path / "engines").iterdir()) == []


def test_broken_records_are_reported_with_their_path(tmp_path: Path) -> None:
    store = RecordStore(tmp_path)
    store.save(_record("good"))
    (tmp_path / "junk.json").write_text("[]")
    (tmp_path / "old.json").write_text(json.dumps({"version": 0}))
    moved = json.loads((tmp_path / "good.json").read_text())
    (tmp_path / "other.json").write_text(json.dumps(moved))  # holds shard "good"
    records, errors = store.load_all()
    assert [r.shard_id for r in records] == ["good"]
    assert sorted(p.name for p, _ in errors) == ["junk.json", "old.json", "other.json"]
    assert all(isinstance(e, RecordError) and str(p) in str(e) for p, e in errors)
    assert "this agent reads 1" in str(dict(errors)[tmp_path / "old.json"])
    with pytest.raises(ValueError, match="not valid"):
        store.path("../escape")
