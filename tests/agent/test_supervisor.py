"""The supervisor with real processes: tests/agent/fake_engine.py as the engine.

Every test runs with short timings (backoff 0.3 s doubling to 1.2 s, probes every 0.1 s) and
kills whatever engine it leaves behind: closing a supervisor leaves its engines running on
purpose, so that the next agent adopts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import stat
import sys
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.agent.engines.base import EngineError, LaunchSpec, ShardSpec
from llmgw.agent.probe import ProbeTimeouts
from llmgw.agent.process import ProcessIdentity, boot_id, read_stat
from llmgw.agent.records import EngineRecord, RecordStore
from llmgw.agent.shards import RestartPolicy
from llmgw.agent.supervisor import Launcher, Supervisor, SupervisorConfig
from llmgw.api.llmgw.v1 import (
    ControlMessage,
    DrainShard,
    EngineProfile,
    ShardState,
    ShardStatus,
    StartShard,
    StopShard,
)

S = ShardState
FAKE = Path(__file__).with_name("fake_engine.py")
pytestmark = pytest.mark.timeout(60)


def fake_launcher(spec: ShardSpec) -> LaunchSpec:
    """The fake engine with the profile's args as its flags; engine 'bad' is refused."""
    if spec.profile.engine == "bad":
        raise EngineError("tp: 3 does not divide 8 (profile 'p', shard 's')", field="tp")
    argv = (sys.executable, str(FAKE), "--port", str(spec.port), "--api-key", spec.api_key)
    return LaunchSpec(
        engine=spec.profile.engine,
        argv=(*argv, *spec.profile.args),
        env=dict(spec.profile.env),
        port=spec.port,
        api_key=spec.api_key,
    )


def start(
    shard_id: str = "s1",
    *args: str,
    env: dict[str, str] | None = None,
    engine: str = "fake",
    gpus: Iterable[str] = ("GPU-aaa", "GPU-bbb"),
) -> StartShard:
    profile = EngineProfile(name="p", engine=engine, args=list(args), env=env or {})
    return StartShard(
        shard_id=shard_id,
        replica_id="r1",
        profile=profile,
        profile_fingerprint="fp-1",
        gpu_uuids=list(gpus),
        api_key="sekret",
    )


class Recorder:
    """Every status the supervisor emits, in order."""

    def __init__(self) -> None:
        self.statuses: list[ShardStatus] = []

    def __call__(self, status: ShardStatus) -> None:
        self.statuses.append(status)

    def of(self, shard_id: str) -> list[ShardStatus]:
        return [s for s in self.statuses if s.shard_id == shard_id]

    def states(self, shard_id: str) -> list[ShardState]:
        return [s.state for s in self.of(shard_id)]

    async def wait(
        self, shard_id: str, state: ShardState, *, nth: int = 1, within: float = 15.0
    ) -> ShardStatus:
        """The ``nth`` status of ``shard_id`` in ``state``, once it is emitted."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            found = [s for s in self.of(shard_id) if s.state is state]
            if len(found) >= nth:
                return found[nth - 1]
            await asyncio.sleep(0.02)
        seen = [(s.state.name, s.reason) for s in self.of(shard_id)]
        raise AssertionError(f"{shard_id}: no {state.name} #{nth} within {within}s; saw {seen}")


class Harness:
    """Supervisors on one state directory, and the cleanup of every engine they started."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.recorder = Recorder()
        self.supervisors: list[Supervisor] = []
        self.extra_pids: set[int] = set()

    def config(self, **overrides: Any) -> SupervisorConfig:
        base = SupervisorConfig(
            state_dir=self.root / "state",
            restart=RestartPolicy(base_s=0.3, cap_s=1.2, stable_s=60.0),
            startup_timeout_s=10.0,
            stop_grace_s=2.0,
            kill_grace_s=0.5,
            poll_s=0.05,
            startup_probe_s=0.1,
            ready_probe_s=0.2,
            probe_failures=2,
            drain_poll_s=0.1,
            drain_settle_s=0.0,
            probe=ProbeTimeouts(connect_s=0.5, read_s=0.5),
        )
        return dataclasses.replace(base, **overrides)

    async def open(self, launcher: Launcher = fake_launcher, **overrides: Any) -> Supervisor:
        supervisor = Supervisor(
            self.config(**overrides), launcher=launcher, on_status=self.recorder
        )
        self.supervisors.append(supervisor)
        await supervisor.open()
        return supervisor

    async def cleanup(self) -> None:
        for supervisor in self.supervisors:
            await supervisor.close()
        pids = {s.pid for s in self.recorder.statuses if s.pid} | self.extra_pids
        for pid in pids:
            found = read_stat(pid)
            if found is not None and found.session == pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        for pid in pids:
            await _reap(pid)


async def _reap(pid: int) -> None:
    for _ in range(100):
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 (never blocks)
        except ChildProcessError:
            return
        if done:
            return
        await asyncio.sleep(0.02)


def gone(pid: int) -> bool:
    found = read_stat(pid)
    return found is None or found.state in "ZX"


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        await h.cleanup()


# --- starting ----------------------------------------------------------------------------


async def test_start_goes_through_every_state_to_ready(harness: Harness) -> None:
    sup = await harness.open()
    await sup.handle(
        ControlMessage(start_shard=start("s1", "--load-seconds", "0.8", env={"VLLM_TEST_ENV": "x"}))
    )
    ready = await harness.recorder.wait("s1", S.READY)

    assert harness.recorder.states("s1") == [S.PENDING, S.STARTING, S.LOADING, S.READY]
    loading = harness.recorder.of("s1")[2]
    assert "/health answered 503" in loading.reason
    assert ready.pid > 0 and ready.restarts == 0 and not ready.exited
    port = sup._shards["s1"].command.launch.port  # type: ignore[union-attr]
    assert ready.endpoint == f"http://127.0.0.1:{port}"
    assert (ready.replica_id, ready.engine, ready.profile_fingerprint) == ("r1", "fake", "fp-1")
    assert ready.gpu_uuids == ["GPU-aaa", "GPU-bbb"]
    assert ready.since_unix_ms >= loading.since_unix_ms
    # its own session and process group, so that stopping reaches everything it forks
    found = read_stat(ready.pid)
    assert found is not None and found.session == ready.pid and found.pgrp == ready.pid
    # the environment: the agent's, plus the profile's and CUDA_VISIBLE_DEVICES with UUIDs
    lines = sup.logs("s1")
    assert "env CUDA_VISIBLE_DEVICES=GPU-aaa,GPU-bbb" in lines
    assert "env VLLM_TEST_ENV=x" in lines
    log_file = harness.root / "state" / "logs" / "s1.log"
    assert "env VLLM_TEST_ENV=x" in log_file.read_text()
    # the record, with the key kept apart
    record = RecordStore(harness.root / "state" / "engines").load(
        harness.root / "state" / "engines" / "s1.json"
    )
    assert record.identity.pid == ready.pid and record.port == port
    assert "sekret" not in (harness.root / "state" / "engines" / "s1.json").read_text()
    key_mode = (harness.root / "state" / "engines" / "s1.key").stat().st_mode
    assert stat.S_IMODE(key_mode) == 0o600
    assert [s.state for s in sup.statuses()] == [S.READY]


async def test_starting_until_the_port_accepts(harness: Harness) -> None:
    """vLLM binds its port only when ready: STARTING lasts until then."""
    sup = await harness.open()
    await sup.start(start("s1", "--bind-after", "0.8"))
    await harness.recorder.wait("s1", S.READY)
    pending, starting, loading, ready = harness.recorder.of("s1")
    assert [starting.state, loading.state] == [S.STARTING, S.LOADING]
    assert loading.since_unix_ms - starting.since_unix_ms >= 600
    assert starting.endpoint == "" and loading.endpoint.startswith("http://127.0.0.1:")


async def test_models_needs_the_key_and_the_startup_timeout_fails_it(harness: Harness) -> None:
    sup = await harness.open(startup_timeout_s=1.5)
    await sup.start(start("s1", "--api-key", "another-key"))  # the engine wants another key
    failed = await harness.recorder.wait("s1", S.FAILED)
    assert "not ready after 1.5 s" in failed.reason
    assert "/v1/models answered 401" in failed.reason
    assert harness.recorder.states("s1")[:4] == [S.PENDING, S.STARTING, S.LOADING, S.FAILED]


async def test_a_headless_rank_is_ready_while_it_runs_and_drains_at_once(harness: Harness) -> None:
    def headless(spec: ShardSpec) -> LaunchSpec:
        return dataclasses.replace(fake_launcher(spec), listens_http=False)

    sup = await harness.open(launcher=headless)
    await sup.start(start("s1", "--bind-after", "60"))  # never answers HTTP
    ready = await harness.recorder.wait("s1", S.READY)
    assert harness.recorder.states("s1") == [S.PENDING, S.STARTING, S.LOADING, S.READY]
    assert ready.endpoint == "" and ready.reason == "headless rank: running (the leader serves)"
    await sup.drain("s1", grace_s=30)
    stopped = await harness.recorder.wait("s1", S.STOPPED, within=5)
    assert stopped.reason == "drained (headless rank: nothing to wait for)" and gone(ready.pid)


# --- failures and restarts ---------------------------------------------------------------


async def test_killed_engine_fails_and_restarts_after_the_backoff(harness: Harness) -> None:
    sup = await harness.open()
    await sup.start(start("s1"))
    first = await harness.recorder.wait("s1", S.READY)
    os.kill(first.pid, signal.SIGKILL)

    failed = await harness.recorder.wait("s1", S.FAILED)
    assert failed.exited and failed.exit_code == -9
    assert f"pid {first.pid} killed by SIGKILL" in failed.reason
    assert "restart 1 in 0.3 s" in failed.reason
    restarted = await harness.recorder.wait("s1", S.STARTING, nth=2)
    assert restarted.since_unix_ms - failed.since_unix_ms >= 300
    again = await harness.recorder.wait("s1", S.READY, nth=2)
    assert again.restarts == 1 and again.pid not in (0, first.pid) and not again.exited
    assert gone(first.pid)


async def test_a_crash_loop_backs_off_doubling_up_to_the_cap(harness: Harness) -> None:
    sup = await harness.open()
    await sup.start(start("s1", "--exit-after", "0.3", "--exit-code", "3"))
    failures = [await harness.recorder.wait("s1", S.FAILED, nth=n) for n in (1, 2, 3, 4)]
    assert all(f.exit_code == 3 and f.exited for f in failures)
    assert "exited with code 3; last output: fake engine exiting with 3" in failures[0].reason
    delays = [f.reason.rpartition(" in ")[2] for f in failures]
    assert delays == ["0.3 s", "0.6 s", "1.2 s", "1.2 s"]
    starts = [s for s in harness.recorder.of("s1") if s.state is S.STARTING]
    for failure, restart, delay in zip(failures, starts[1:], (0.3, 0.6, 1.2), strict=False):
        assert restart.since_unix_ms - failure.since_unix_ms >= delay * 1000
        assert restart.restarts == failure.restarts + 1


async def test_an_engine_that_stops_answering_fails_and_restarts(harness: Harness) -> None:
    sup = await harness.open()
    await sup.start(start("s1"))
    first = await harness.recorder.wait("s1", S.READY)
    os.kill(first.pid, signal.SIGSTOP)  # alive, but it answers nothing
    failed = await harness.recorder.wait("s1", S.FAILED)
    assert "health probe failed 2 times in a row" in failed.reason and not failed.exited
    again = await harness.recorder.wait("s1", S.READY, nth=2)
    assert again.pid != first.pid and again.restarts == 1
    assert gone(first.pid)  # SIGTERM stays pending on a stopped process: it got SIGKILL


async def test_an_engine_that_cannot_be_executed_fails_with_the_reason(harness: Harness) -> None:
    def missing(spec: ShardSpec) -> LaunchSpec:
        return dataclasses.replace(fake_launcher(spec), argv=("/nonexistent/engine", "serve"))

    sup = await harness.open(launcher=missing)
    await sup.start(start("s1"))
    failed = await harness.recorder.wait("s1", S.FAILED)
    assert "cannot execute '/nonexistent/engine'" in failed.reason
    assert harness.recorder.states("s1") == [S.PENDING, S.FAILED]
    noted = await harness.recorder.wait("s1", S.FAILED, nth=2)  # tried again after 0.3 s
    assert "restart 2 in 0.6 s" in noted.reason


# --- stop and drain ----------------------------------------------------------------------


async def test_stop_sends_sigkill_to_a_group_that_ignores_sigterm(harness: Harness) -> None:
    sup = await harness.open()
    await sup.start(start("s1", "--ignore-sigterm", "--child"))
    ready = await harness.recorder.wait("s1", S.READY)
    child = await _child_pid(sup, "s1")
    harness.extra_pids.add(child)

    began = time.monotonic()
    await sup.handle(ControlMessage(stop_shard=StopShard(shard_id="s1", grace_seconds=1)))
    stopped = await harness.recorder.wait("s1", S.STOPPED)
    assert time.monotonic() - began >= 1.0
    assert harness.recorder.states("s1")[-2:] == [S.DRAINING, S.STOPPED]
    assert stopped.exited and stopped.exit_code == -9
    assert gone(ready.pid) and gone(child)
    assert not (harness.root / "state" / "engines" / "s1.json").exists()
    await sup.settle("s1")
    assert sup.statuses() == []
    count = len(harness.recorder.statuses)
    await asyncio.sleep(0.8)  # longer than the backoff: a stopped shard never restarts
    assert len(harness.recorder.statuses) == count


async def test_drain_waits_for_the_request_in_flight(harness: Harness) -> None:
    sup = await harness.open()
    await sup.start(start("s1"))
    ready = await harness.recorder.wait("s1", S.READY)
    async with httpx.AsyncClient(timeout=10) as client:
        request = asyncio.create_task(client.get(f"{ready.endpoint}/slow?seconds=1.5"))
        await _until_in_flight(client, ready.endpoint, 1)
        await sup.handle(ControlMessage(drain_shard=DrainShard(shard_id="s1", grace_seconds=10)))
        await harness.recorder.wait("s1", S.DRAINING)
        await asyncio.sleep(0.5)
        assert harness.recorder.states("s1")[-1] is S.DRAINING
        reply = await request
        finished_ms = time.time_ns() // 1_000_000
    assert reply.status_code == 200
    stopped = await harness.recorder.wait("s1", S.STOPPED)
    assert stopped.reason == "drained: no request in flight"
    assert stopped.since_unix_ms >= finished_ms - 50
    assert stopped.exit_code == -15 and gone(ready.pid)


async def test_an_idle_drain_keeps_serving_for_the_settle_time(harness: Harness) -> None:
    sup = await harness.open(drain_settle_s=1.0)
    await sup.start(start("s1"))
    ready = await harness.recorder.wait("s1", S.READY)
    await sup.drain("s1", grace_s=10)
    draining = await harness.recorder.wait("s1", S.DRAINING)
    async with httpx.AsyncClient(timeout=10) as client:
        await asyncio.sleep(0.6)  # a router that still sends, a moment after the drain began
        assert (await client.get(f"{ready.endpoint}/health")).status_code == 200
    stopped = await harness.recorder.wait("s1", S.STOPPED)
    assert stopped.since_unix_ms - draining.since_unix_ms >= 1000
    assert stopped.reason == "drained: no request in flight"


async def test_drain_stops_when_its_grace_runs_out(harness: Harness) -> None:
    sup = await harness.open()
    await sup.start(start("s1"))
    ready = await harness.recorder.wait("s1", S.READY)
    async with httpx.AsyncClient(timeout=10) as client:
        request = asyncio.create_task(client.get(f"{ready.endpoint}/slow?seconds=8"))
        await _until_in_flight(client, ready.endpoint, 1)
        await sup.drain("s1", grace_s=0.5)
        stopped = await harness.recorder.wait("s1", S.STOPPED)
        with pytest.raises(httpx.HTTPError):
            await request
    assert stopped.reason == "drain grace of 0.5 s ran out (1 requests in flight)"


# --- idempotence and replacement ---------------------------------------------------------


async def test_start_twice_is_idempotent_and_a_new_command_replaces(harness: Harness) -> None:
    sup = await harness.open()
    await sup.start(start("s1", env={"VLLM_TEST_ENV": "a"}))
    first = await harness.recorder.wait("s1", S.READY)
    count = len(harness.recorder.statuses)
    await sup.start(start("s1", env={"VLLM_TEST_ENV": "a"}))
    await asyncio.sleep(0.5)
    assert len(harness.recorder.statuses) == count
    assert sup.status("s1").pid == first.pid  # type: ignore[union-attr]

    await sup.start(start("s1", env={"VLLM_TEST_ENV": "b"}))
    second = await harness.recorder.wait("s1", S.READY, nth=2)
    assert harness.recorder.states("s1")[count:] == [
        *(S.DRAINING, S.STOPPED, S.PENDING, S.STARTING, S.LOADING, S.READY)
    ]
    assert second.pid != first.pid and gone(first.pid)
    assert second.endpoint == first.endpoint  # a port of 0 keeps the shard's port
    assert "env VLLM_TEST_ENV=b" in sup.logs("s1")


async def test_a_drain_or_a_second_stop_of_a_stopping_shard_changes_nothing(
    harness: Harness,
) -> None:
    sup = await harness.open()
    await sup.start(start("s1"))
    await harness.recorder.wait("s1", S.READY)
    count = len(harness.recorder.statuses)
    await sup.stop("s1", reason="first")
    await sup.drain("s1", grace_s=10)
    await sup.stop("s1", reason="second")
    stopped = await harness.recorder.wait("s1", S.STOPPED)
    assert stopped.reason == "stopped: first"
    assert harness.recorder.states("s1")[count:] == [S.DRAINING, S.STOPPED]
    await asyncio.sleep(0.2)
    assert sup.status("s1") is None  # a stopped shard is forgotten


async def test_bad_commands_are_reported_never_raised(harness: Harness) -> None:
    sup = await harness.open()
    await sup.handle(ControlMessage(start_shard=start("bad1", engine="bad")))
    await sup.handle(ControlMessage(start_shard=start("../etc")))
    await sup.handle(ControlMessage(stop_shard=StopShard(shard_id="nobody")))
    await sup.handle(ControlMessage())
    await sup.handle(ControlMessage(start_shard=StartShard(shard_id="noprofile")))
    await sup.handle(ControlMessage(start_shard=start("good")))
    await harness.recorder.wait("good", S.READY)

    assert harness.recorder.states("bad1") == [S.PENDING, S.FAILED]
    assert (
        harness.recorder.of("bad1")[-1].reason == "tp: 3 does not divide 8 (profile 'p', shard 's')"
    )
    assert harness.recorder.of("../etc")[-1].state is S.FAILED
    assert "invalid shard id" in harness.recorder.of("../etc")[-1].reason
    # the agent will not restart what it refused: it says so, so the server replaces it
    assert harness.recorder.of("bad1")[-1].gave_up and harness.recorder.of("../etc")[-1].gave_up
    assert harness.recorder.of("nobody")[-1].reason == "not running on this node"
    assert "carries no profile" in harness.recorder.of("noprofile")[-1].reason
    by_id = {s.shard_id: s.state for s in sup.statuses()}
    assert by_id == {"bad1": S.FAILED, "good": S.READY, "noprofile": S.FAILED}
    header = (harness.root / "state" / "logs" / "good.log").read_text().splitlines()[0]
    assert "--api-key '***'" in header and "sekret" not in header  # the key is masked
    # a bad profile for a running shard leaves it running, and says so
    await sup.start(start("good", engine="bad"))
    assert sup.status("good").state is S.READY  # type: ignore[union-attr]
    assert not sup.status("good").gave_up  # type: ignore[union-attr]
    assert "StartShard refused: tp: 3" in sup.status("good").reason  # type: ignore[union-attr]


async def test_a_port_another_process_holds_is_refused_before_any_engine_starts(
    harness: Harness,
) -> None:
    sup = await harness.open()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        message = start("s1")
        message.port = port
        await sup.start(message)
        failed = harness.recorder.of("s1")[-1]
    assert failed.state is S.FAILED and failed.gave_up and failed.pid == 0
    assert failed.port_in_use == port  # so the server places it on another port
    why = f"port {port} on 127.0.0.1 is in use by another process (Address already in use)"
    assert failed.reason == why


async def test_a_port_taken_while_the_engine_loads_gives_up_instead_of_restarting(
    harness: Harness,
) -> None:
    """The port was free at StartShard, but another process took it before the engine
    bound it (real vLLM binds a minute later): restarting on it would fail forever."""
    sup = await harness.open()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    message = start("s1", "--load-seconds", "30", "--exit-after", "0.3")
    message.port = port
    await sup.start(message)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        # FAILED as any failure ("restart 1 in …"), then given up once the port is seen taken
        failed = await harness.recorder.wait("s1", S.FAILED, nth=2)
    assert failed.state is S.FAILED and failed.gave_up and failed.restarts == 0
    assert failed.port_in_use == port  # so the server places it on another port
    assert f"port {port} on 127.0.0.1 is in use by another process" in failed.reason
    assert not (harness.root / "state" / "engines" / "s1.json").exists()


async def test_an_adapter_bug_is_reported_as_failed(harness: Harness) -> None:
    def broken(spec: ShardSpec) -> LaunchSpec:
        raise RuntimeError("adapter bug")

    sup = await harness.open(launcher=broken)
    await sup.handle(ControlMessage(start_shard=start("s1")))
    failed = await harness.recorder.wait("s1", S.FAILED)
    assert failed.reason == "internal error building the command: RuntimeError('adapter bug')"


# --- adoption ----------------------------------------------------------------------------


async def test_a_new_supervisor_adopts_the_running_engine(harness: Harness) -> None:
    starts = harness.root / "starts.txt"
    first_sup = await harness.open()
    await first_sup.start(start("s1", "--starts", str(starts)))
    ready = await harness.recorder.wait("s1", S.READY)
    await first_sup.close()
    async with httpx.AsyncClient(timeout=2) as client:
        assert (await client.get(f"{ready.endpoint}/health")).status_code == 200

    second_sup = await harness.open()
    assert second_sup.statuses()[0].state is S.LOADING  # Register carries it at once
    adopted = await harness.recorder.wait("s1", S.READY, nth=2)
    assert adopted.pid == ready.pid and adopted.endpoint == ready.endpoint
    assert (
        harness.recorder.of("s1")[-2].reason
        == f"adopted engine pid {ready.pid} from a previous agent"
    )
    assert starts.read_text().split() == [str(ready.pid)]  # no second engine
    # and it is supervised: stopping it works, killing it restarts it
    os.kill(ready.pid, signal.SIGKILL)
    failed = await harness.recorder.wait("s1", S.FAILED)
    assert f"pid {ready.pid}" in failed.reason
    await harness.recorder.wait("s1", S.READY, nth=3)
    assert len(starts.read_text().split()) == 2


async def test_a_stale_record_is_cleaned_and_the_shard_started_again(harness: Harness) -> None:
    first_sup = await harness.open()
    await first_sup.start(start("s1"))
    ready = await harness.recorder.wait("s1", S.READY)
    await first_sup.close()
    os.kill(ready.pid, signal.SIGKILL)
    await _reap(ready.pid)

    await harness.open()
    pending = await harness.recorder.wait("s1", S.PENDING, nth=2)
    assert pending.reason == f"engine pid {ready.pid} of a previous agent is gone; starting again"
    again = await harness.recorder.wait("s1", S.READY, nth=2)
    assert again.pid != ready.pid


async def test_a_reused_pid_is_never_adopted_nor_signalled(harness: Harness) -> None:
    """A record whose pid now belongs to another process (here: this test) is stale."""
    store = RecordStore(harness.root / "state" / "engines")
    own = read_stat(os.getpid())
    assert own is not None
    message = start("s1")
    message.port = 0
    store.save(
        EngineRecord(
            shard_id="s1",
            identity=ProcessIdentity(os.getpid(), own.start_ticks + 1, boot_id()),
            fingerprint="whatever",
            port=0,
            engine="fake",
            start=message,
            restarts=2,
            started_unix_ms=0,
            log_path="",
        )
    )
    await harness.open()
    ready = await harness.recorder.wait("s1", S.READY)
    assert ready.pid != os.getpid() and ready.restarts == 2


async def test_an_engine_with_a_changed_command_is_replaced(harness: Harness) -> None:
    first_sup = await harness.open()
    await first_sup.start(start("s1"))
    old = await harness.recorder.wait("s1", S.READY)
    await first_sup.close()

    def changed(spec: ShardSpec) -> LaunchSpec:
        launch = fake_launcher(spec)
        return dataclasses.replace(launch, env={**launch.env, "VLLM_TEST_ENV": "new"})

    sup = await harness.open(launcher=changed)
    pending = await harness.recorder.wait("s1", S.PENDING, nth=2)
    assert "its command changed" in pending.reason
    new = await harness.recorder.wait("s1", S.READY, nth=2)
    assert new.pid != old.pid and gone(old.pid)
    assert "env VLLM_TEST_ENV=new" in sup.logs("s1")


async def test_a_stop_cut_short_by_the_agent_is_finished_not_restarted(harness: Harness) -> None:
    first_sup = await harness.open()
    await first_sup.start(start("s1", "--ignore-sigterm"))
    ready = await harness.recorder.wait("s1", S.READY)
    await first_sup.stop("s1", grace_s=30)
    await harness.recorder.wait("s1", S.DRAINING)
    await first_sup.close()  # the agent goes away during the grace
    record = harness.root / "state" / "engines" / "s1.json"
    assert json.loads(record.read_text())["stopping"] is True
    assert not gone(ready.pid)

    sup = await harness.open(stop_grace_s=0.5)
    resumed = await harness.recorder.wait("s1", S.DRAINING, nth=2)
    assert resumed.reason == f"finishing the stop of engine pid {ready.pid} a previous agent began"
    stopped = await harness.recorder.wait("s1", S.STOPPED)
    await sup.settle("s1")
    assert stopped.exit_code == -9 and gone(ready.pid)
    assert not record.exists() and sup.statuses() == []
    await asyncio.sleep(0.6)
    assert harness.recorder.states("s1")[-1] is S.STOPPED  # never started again


async def test_a_drain_whose_engine_ended_meanwhile_is_reported_stopped(harness: Harness) -> None:
    first_sup = await harness.open()
    await first_sup.start(start("s1"))
    ready = await harness.recorder.wait("s1", S.READY)
    async with httpx.AsyncClient(timeout=10) as client:
        request = asyncio.create_task(client.get(f"{ready.endpoint}/slow?seconds=8"))
        await _until_in_flight(client, ready.endpoint, 1)
        await first_sup.drain("s1", grace_s=60)
        await harness.recorder.wait("s1", S.DRAINING)
        await first_sup.close()
        os.kill(ready.pid, signal.SIGKILL)
        await _reap(ready.pid)
        with pytest.raises(httpx.HTTPError):
            await request

    sup = await harness.open()
    stopped = await harness.recorder.wait("s1", S.STOPPED)
    assert (
        stopped.reason == f"stopped: engine pid {ready.pid} ended while a previous agent stopped it"
    )
    assert sup.statuses() == [] and not (harness.root / "state" / "engines" / "s1.json").exists()
    await asyncio.sleep(0.6)
    assert harness.recorder.states("s1")[-1] is S.STOPPED


async def test_an_unreadable_record_is_removed(harness: Harness) -> None:
    engines = harness.root / "state" / "engines"
    engines.mkdir(parents=True)
    (engines / "s9.json").write_text("{not json")
    sup = await harness.open()
    assert sup.statuses() == [] and not (engines / "s9.json").exists()


# --- helpers -----------------------------------------------------------------------------


async def _child_pid(sup: Supervisor, shard_id: str) -> int:
    for _ in range(100):
        for line in sup.logs(shard_id):
            if line.startswith("child pid "):
                return int(line.split()[-1])
        await asyncio.sleep(0.05)
    raise AssertionError(f"no child pid in {sup.logs(shard_id)}")


async def _until_in_flight(client: httpx.AsyncClient, endpoint: str, count: int) -> None:
    for _ in range(100):
        text = (await client.get(f"{endpoint}/metrics")).text
        if f"}} {count}.0" in text:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never {count} in flight")
