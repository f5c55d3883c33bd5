#!/usr/bin/env python3
"""Benchmark: how many heartbeating agents one control server holds.

Many simulated agents (``dgx-h100``, 8 GPUs each) register with a real ``llmgw server``
and heartbeat once a second, each over its own gRPC connection, exactly as
``llmgw.agent.link.AgentLink`` does in a real agent. The fleet grows in steps; each step is
held for ``--hold`` seconds once every agent registered, and measured:

* heartbeat round trip p50/p99, from the agents' own measurements (``link.stats.rtt_ms``);
* messages the server handled (heartbeats in + acks out, counted at the agents);
* server CPU (``utime + stime`` from ``/proc/PID/stat``) per 1,000 heartbeats and per message;
* server RSS, registration time, client CPU and client event-loop lag (to tell a slow server
  from a saturated load generator).

The largest step whose p99 stays under 1 s with every agent connected is the result. A bare
grpclib bidi-stream server that only acknowledges heartbeats (``_echo`` below) is measured
in the same run under the same client, as the baseline for CPU-per-heartbeat ratios.

New agents are launched at most ``--rate`` a second with at most ``--inflight``
registrations outstanding: a registration costs the server milliseconds (an 8 KB
``NodeInfo`` to check, parse and store), and an uncapped storm of them on top of a large
fleet can outrun the agents' 10 s register timeout (try ``--inflight 10000``). Each window
also reports the CPU every other process used, since a shared machine is noisy.

The server (and the baseline) run pinned to ``--server-cpu``; the agents run in
``--workers`` child processes of this module (``_agents`` mode) pinned to ``--client-cpu``.
Everything listens on 127.0.0.1 only; every loop is bounded and every child process is
stopped on exit, Ctrl-C included.

    .venv/bin/python -m bench.control            # full ramp, a few minutes
    .venv/bin/python -m bench.control --quick    # 50 and 100 agents, 5 s holds
    .venv/bin/python -m bench.control --markdown # also a BENCHMARKS.md section
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO

from bench.kit import (
    CLK_TCK,
    REPO_ROOT,
    base_machine,
    command_line,
    git_query,
    load_average,
    module_command,
    proc_cpu_seconds,
)
from llmgw.addresses import free_port

HOST = "127.0.0.1"
FIXTURE = "dgx-h100"
RTT_LIMIT_MS = 1000
DEFAULT_STEPS: tuple[int, ...] = (250, 500, 1000, 1500, 2000)
QUICK_STEPS: tuple[int, ...] = (50, 100)
QUICK_BASELINE: tuple[int, ...] = (50,)
READ_LIMIT = 16 << 20  # largest reply line from a worker
LAG_TICK_S = 0.1
CLIENT_LAG_NOTE_MS = 20  # agents' loop lag above this: the load generator shows in RTT
NOISY_OTHER_UTIL = 0.10  # other processes above 10% of a core during a window: say so
REGISTER_STALL_S = 60.0  # a step fails when no agent registers for this long

log = logging.getLogger("bench_control")


# ======================================================================================
# Shared: counts of integer milliseconds, and pinning
# ======================================================================================


def merge_counts(parts: Sequence[Mapping[str, int] | Mapping[int, int]]) -> Counter[int]:
    """Merge ``{ms: count}`` histograms (JSON turns their keys into strings)."""
    merged: Counter[int] = Counter()
    for part in parts:
        for key, count in part.items():
            merged[int(key)] += count
    return merged


def percentile(counts: Mapping[int, int], q: float) -> int | None:
    """Nearest-rank percentile of a ``{value: count}`` histogram; None when empty."""
    total = sum(counts.values())
    if not total:
        return None
    rank, seen = max(1, math.ceil(q * total)), 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return value
    return max(counts)


def pin_to(cpu: int) -> Callable[[], None]:
    """A ``preexec_fn`` that pins the child process to one CPU."""

    def pin() -> None:
        os.sched_setaffinity(0, {cpu})

    return pin


# ======================================================================================
# Worker mode `_agents`: many AgentLinks in one event loop, driven over stdin/stdout
# ======================================================================================


@dataclass(slots=True)
class _Agent:
    link: Any  # llmgw.agent.link.AgentLink (imported lazily: the orchestrator never needs it)
    task: asyncio.Task[None]
    launched: float
    registered: float | None = None


@dataclass(slots=True)
class Fleet:
    """This worker's share of the simulated fleet: agents ``index``, ``index + of``, ..."""

    host: str
    port: int
    index: int
    of: int
    seed: int
    agents: list[_Agent] = field(default_factory=list)
    lag_ms: Counter[int] = field(default_factory=Counter)
    _mark_heartbeats: int = 0
    _mark_sessions: int = 0

    def my_ids(self, before: int, total: int) -> list[int]:
        """The global agent numbers in ``[before, total)`` that belong to this worker."""
        return [i for i in range(before, total) if i % self.of == self.index]

    def launch(self, number: int) -> None:
        from llmgw.agent.discovery import SimulatedTelemetry, simulated_node
        from llmgw.agent.link import AgentLink, LinkConfig

        node_id = f"bench-{number:05d}"
        node = simulated_node(FIXTURE, node_id=node_id, hostname=f"{node_id}.bench")
        link = AgentLink(
            LinkConfig(self.host, self.port),
            node=lambda: node,
            telemetry=SimulatedTelemetry(node, self.seed).sample,
        )
        task = asyncio.create_task(link.run(), name=node_id)
        self.agents.append(_Agent(link, task, time.monotonic()))

    async def grow(self, before: int, total: int, rate: float, inflight: int) -> dict[str, Any]:
        """Launch this worker's new agents (at most ``rate`` per second and ``inflight``
        registrations at a time) and wait until they registered or registration stalls."""
        ids = self.my_ids(before, total)
        first = len(self.agents)
        started = time.monotonic()
        launcher = asyncio.create_task(self._launch_paced(ids, first, rate, inflight))
        try:
            await self._wait_registered(first, len(ids), launcher)
        finally:
            launcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await launcher
        new = self.agents[first:]
        times = [(a.launched, a.registered) for a in new if a.registered is not None]
        return {
            "started": len(new),
            "registered": len(times),
            "wall_s": max((r for _, r in times), default=started) - started,
            "reg_ms": Counter(round(1000 * (r - launched)) for launched, r in times),
        }

    async def _launch_paced(
        self, ids: Sequence[int], first: int, rate: float, inflight: int
    ) -> None:
        next_at = time.monotonic() + random.random() * self.of / rate  # workers interleave
        for number in ids:
            await self._room_to_register(first, inflight)
            next_at = max(next_at, time.monotonic())  # held back: no burst to catch up
            await asyncio.sleep(next_at - time.monotonic())
            self.launch(number)
            next_at += self.of / rate

    async def _room_to_register(self, first: int, inflight: int) -> None:
        """Wait (polling: a link has no registration event) until fewer than ``inflight``
        of the agents from ``first`` on are still registering; at most REGISTER_STALL_S."""
        for _ in range(int(REGISTER_STALL_S / 0.01)):
            if self._pending(first) < inflight:
                return
            await asyncio.sleep(0.01)

    def _pending(self, first: int) -> int:
        """Mark newly registered agents; the number still registering."""
        pending, now = 0, time.monotonic()
        for agent in self.agents[first:]:
            if agent.registered is None:
                if agent.link.stats.sessions:
                    agent.registered = now
                else:
                    pending += 1
        return pending

    async def _wait_registered(self, first: int, count: int, launcher: asyncio.Task[None]) -> None:
        """Until all ``count`` registered, or none did for ``REGISTER_STALL_S``, or (a bound
        whatever happens) ``count`` seconds plus the stall time have passed."""
        now = time.monotonic()
        deadline, progress_at, done = now + count + REGISTER_STALL_S, now, 0
        while now < deadline and now - progress_at < REGISTER_STALL_S:
            pending = self._pending(first)
            registered = len(self.agents) - first - pending
            if registered > done:
                done, progress_at = registered, now
            if launcher.done() and not pending:
                return
            await asyncio.sleep(0.02)
            now = time.monotonic()

    def mark(self) -> None:
        """Start a measurement window."""
        for agent in self.agents:
            agent.link.stats.rtt_ms.clear()
        self._mark_heartbeats = sum(a.link.stats.heartbeats for a in self.agents)
        self._mark_sessions = sum(a.link.stats.sessions for a in self.agents)
        self.lag_ms.clear()

    def collect(self) -> dict[str, Any]:
        """What the agents saw since ``mark``."""
        rtt: Counter[int] = Counter()
        for agent in self.agents:
            rtt.update(int(ms) for ms in agent.link.stats.rtt_ms)
        return {
            "rtt_ms": rtt,
            "heartbeats": sum(a.link.stats.heartbeats for a in self.agents) - self._mark_heartbeats,
            "acks": sum(rtt.values()),
            "sessions": sum(a.link.stats.sessions for a in self.agents) - self._mark_sessions,
            "connected": sum(1 for a in self.agents if a.link.stats.connected),
            "agents": len(self.agents),
            "lag_ms": dict(self.lag_ms),
        }

    async def stop(self) -> None:
        for agent in self.agents:
            agent.task.cancel()
        if self.agents:
            await asyncio.wait([a.task for a in self.agents], timeout=10)


async def _watch_lag(fleet: Fleet, until: float) -> None:
    """Record how late the event loop wakes up (a saturated client shows here)."""
    while time.monotonic() < until:
        expected = time.monotonic() + LAG_TICK_S
        await asyncio.sleep(LAG_TICK_S)
        fleet.lag_ms[max(0, round(1000 * (time.monotonic() - expected)))] += 1


async def _stdin_reader() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=READ_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


def _reply(payload: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


async def _handle(fleet: Fleet, request: Mapping[str, Any]) -> dict[str, Any]:
    op = request.get("op")
    if op == "grow":
        return await fleet.grow(
            int(request["before"]), int(request["total"]), request["rate"], request["inflight"]
        )
    if op == "mark":
        fleet.mark()
        return {"ok": True}
    if op == "collect":
        return fleet.collect()
    raise ValueError(f"unknown op {op!r}")


async def run_agents_worker(args: argparse.Namespace) -> None:
    """Serve the orchestrator's requests until it says stop, closes stdin, or time is up."""
    fleet = Fleet(args.host, args.port, args.index, args.of, args.seed)
    until = time.monotonic() + args.max_seconds
    lag = asyncio.create_task(_watch_lag(fleet, until))
    reader = await _stdin_reader()
    try:
        while time.monotonic() < until:
            try:
                async with asyncio.timeout(until - time.monotonic()):
                    line = await reader.readline()
            except TimeoutError:
                break
            request = json.loads(line) if line.strip() else {"op": "stop"}
            if request.get("op") == "stop":
                break
            _reply(await _handle(fleet, request))
    finally:
        lag.cancel()
        await fleet.stop()
    _reply({"ok": True})


# ======================================================================================
# Worker mode `_echo`: the bare baseline server
# ======================================================================================


class EchoAgentService:
    """``AgentService.Connect`` reduced to grpclib + protobuf: acknowledge, nothing else."""

    def __mapping__(self) -> dict[str, Any]:
        import grpclib.const

        from llmgw.agent.link import CONNECT_PATH
        from llmgw.api.llmgw.v1 import AgentMessage, ControlMessage

        return {
            CONNECT_PATH: grpclib.const.Handler(
                self._connect,
                grpclib.const.Cardinality.STREAM_STREAM,
                AgentMessage,
                ControlMessage,
            )
        }

    async def _connect(self, stream: Any) -> None:
        from llmgw.api.llmgw.v1 import ControlMessage, HeartbeatAck, Registered
        from llmgw.protocol import PROTOCOL_VERSION

        first = await stream.recv_message()
        if first is None or first.register is None:
            return
        welcome = Registered(protocol_version=PROTOCOL_VERSION, heartbeat_interval_ms=1000)
        await stream.send_message(ControlMessage(registered=welcome))
        async for message in stream:
            if message.heartbeat is not None:
                beat = message.heartbeat
                ack = HeartbeatAck(seq=beat.seq, sent_at_ms=beat.sent_at_ms)
                await stream.send_message(ControlMessage(heartbeat_ack=ack))


async def run_echo_server(args: argparse.Namespace) -> None:
    """Serve the echo baseline until SIGTERM/SIGINT or ``--max-seconds``."""
    import grpclib.server

    server = grpclib.server.Server([EchoAgentService()])
    await server.start(args.host, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(args.max_seconds):
            await stop.wait()
    server.close()
    await server.wait_closed()


# ======================================================================================
# Orchestrator: child processes, /proc readings
# ======================================================================================


def machine_busy_seconds() -> float:
    """CPU seconds all CPUs spent busy since boot (``/proc/stat``; idle and iowait excluded)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass(slots=True)
class Child:
    """A child process in its own session, pinned to a CPU, logging to a file."""

    name: str
    proc: asyncio.subprocess.Process
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float:
        return proc_cpu_seconds(self.pid)

    def alive(self) -> bool:
        return self.proc.returncode is None

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()


class Children:
    """Every child process of the run; ``close`` stops them all (on any exit path)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.all: list[Child] = []

    async def spawn(self, name: str, argv: Sequence[str], cpu: int, pipes: bool = False) -> Child:
        log_path = self.workdir / f"{name}.log"
        pipe = asyncio.subprocess.PIPE if pipes else asyncio.subprocess.DEVNULL
        with log_path.open("wb") as log_file:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=pipe,
                stdout=pipe,
                stderr=log_file,
                preexec_fn=pin_to(cpu),
                cwd=REPO_ROOT,
                start_new_session=True,  # Ctrl-C reaches us only; we stop them in order
                limit=READ_LIMIT,
            )
        child = Child(name, proc, log_path)
        self.all.append(child)
        return child

    async def close(self) -> None:
        await asyncio.gather(*(child.stop() for child in reversed(self.all)))


class Worker:
    """The orchestrator's handle on one ``_agents`` worker: JSON lines over its pipes."""

    def __init__(self, child: Child) -> None:
        self.child = child

    async def call(self, timeout_s: float, **request: Any) -> dict[str, Any]:
        proc = self.child.proc
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write((json.dumps(request) + "\n").encode())
        await proc.stdin.drain()
        line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
        if not line:
            tail = self.child.log_tail()
            raise RuntimeError(f"worker {self.child.name} exited; its log ends:\n{tail}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.call(20.0, op="stop")
        await self.child.stop()


async def wait_listening(child: Child, port: int, timeout_s: float = 30.0) -> None:
    """Wait until ``port`` accepts connections; fail if the child exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited; its log ends:\n{child.log_tail()}")
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection(HOST, port)
            writer.close()
            await writer.wait_closed()
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{child.name} did not listen on {HOST}:{port} within {timeout_s:g}s")


# ======================================================================================
# Orchestrator: one measured step
# ======================================================================================


@dataclass(frozen=True, slots=True)
class Settings:
    """What the run was asked to do."""

    steps: tuple[int, ...]
    hold_s: float
    settle_s: float
    baseline_agents: tuple[int, ...]
    workers: int
    rate: float
    inflight: int
    server_cpu: int
    client_cpu: int
    seed: int
    max_seconds: float


@dataclass(frozen=True, slots=True)
class Usage:
    """A clock reading and CPU seconds; subtract two to get a window's usage."""

    at: float
    server_s: float
    client_s: float
    other_s: float

    def __sub__(self, earlier: Usage) -> Usage:
        return Usage(
            self.at - earlier.at,
            self.server_s - earlier.server_s,
            self.client_s - earlier.client_s,
            self.other_s - earlier.other_s,
        )


@dataclass(frozen=True, slots=True)
class Step:
    """The figures of one held fleet size."""

    label: str
    agents: int
    registered: int
    reg_wall_s: float
    reg_p99_ms: int | None
    window_s: float
    heartbeats: int
    acks: int
    rtt_p50_ms: int | None
    rtt_p99_ms: int | None
    server_cpu_s: float
    server_rss_mib: float
    client_cpu_s: float
    other_cpu_s: float  # every other process on the machine (a shared machine is noisy)
    client_lag_p99_ms: int | None
    reconnects: int
    connected: int

    @property
    def messages(self) -> int:
        return self.heartbeats + self.acks

    @property
    def us_per_message(self) -> float:
        return 1e6 * self.server_cpu_s / self.messages if self.messages else math.nan

    @property
    def us_per_heartbeat(self) -> float:
        return 1e6 * self.server_cpu_s / self.heartbeats if self.heartbeats else math.nan

    @property
    def server_util(self) -> float:
        return self.server_cpu_s / self.window_s

    @property
    def client_util(self) -> float:
        return self.client_cpu_s / self.window_s

    @property
    def other_util(self) -> float:
        # /proc counts in 10 ms ticks sampled at slightly different moments: a quiet
        # machine can come out a tick or two below zero.
        return max(0.0, self.other_cpu_s / self.window_s)

    @property
    def held(self) -> bool:
        """Every agent registered and stayed connected, and p99 stayed under the limit."""
        return (
            self.registered == self.agents
            and self.connected == self.agents
            and self.reconnects == 0
            and self.rtt_p99_ms is not None
            and self.rtt_p99_ms < RTT_LIMIT_MS
        )


@dataclass(slots=True)
class Rig:
    """A server under test and the agent workers pointed at it."""

    label: str
    server: Child
    workers: list[Worker]
    settings: Settings
    size: int = 0

    async def grow(self, total: int) -> list[dict[str, Any]]:
        new = total - self.size
        timeout = new + REGISTER_STALL_S + 60  # the worker gives up first (see grow)
        per_worker = max(1, math.ceil(self.settings.inflight / len(self.workers)))
        calls = [
            w.call(
                timeout,
                op="grow",
                before=self.size,
                total=total,
                rate=self.settings.rate,
                inflight=per_worker,
            )
            for w in self.workers
        ]
        replies = await asyncio.gather(*calls)
        self.size = total
        return list(replies)

    def usage(self) -> Usage:
        """CPU seconds used so far by the server, the workers, and everything else."""
        server = self.server.cpu_seconds()
        client = sum(w.child.cpu_seconds() for w in self.workers)
        other = machine_busy_seconds() - server - client - proc_cpu_seconds(os.getpid())
        return Usage(time.monotonic(), server, client, other)

    async def window(self) -> tuple[Usage, list[dict[str, Any]]]:
        """Hold for ``hold_s``: what was used meanwhile, and what each worker saw."""
        start = self.usage()
        await asyncio.gather(*(w.call(30.0, op="mark") for w in self.workers))
        await asyncio.sleep(self.settings.hold_s)
        collected = await asyncio.gather(*(w.call(60.0, op="collect") for w in self.workers))
        return self.usage() - start, list(collected)

    async def step(self, total: int) -> Step:
        before = self.size
        grown = await self.grow(total)
        registered = before + sum(g["registered"] for g in grown)
        if registered < total:
            return _unregistered_step(self.label, total, registered, grown)
        await asyncio.sleep(self.settings.settle_s)
        usage, parts = await self.window()
        return _measured_step(self, total, grown, usage, parts)


def _unregistered_step(
    label: str, total: int, registered: int, grown: Sequence[Mapping[str, Any]]
) -> Step:
    reg = merge_counts([g["reg_ms"] for g in grown])
    wall = max(g["wall_s"] for g in grown)
    return Step(
        label=label,
        agents=total,
        registered=registered,
        reg_wall_s=wall,
        reg_p99_ms=percentile(reg, 0.99),
        window_s=math.nan,
        heartbeats=0,
        acks=0,
        rtt_p50_ms=None,
        rtt_p99_ms=None,
        server_cpu_s=0.0,
        server_rss_mib=0.0,
        client_cpu_s=0.0,
        other_cpu_s=0.0,
        client_lag_p99_ms=None,
        reconnects=0,
        connected=registered,
    )


def _measured_step(
    rig: Rig,
    total: int,
    grown: Sequence[Mapping[str, Any]],
    usage: Usage,
    parts: Sequence[Mapping[str, Any]],
) -> Step:
    rtt = merge_counts([p["rtt_ms"] for p in parts])
    reg = merge_counts([g["reg_ms"] for g in grown])
    return Step(
        label=rig.label,
        agents=total,
        registered=total,
        reg_wall_s=max(g["wall_s"] for g in grown),
        reg_p99_ms=percentile(reg, 0.99),
        window_s=usage.at,
        heartbeats=sum(p["heartbeats"] for p in parts),
        acks=sum(p["acks"] for p in parts),
        rtt_p50_ms=percentile(rtt, 0.50),
        rtt_p99_ms=percentile(rtt, 0.99),
        server_cpu_s=usage.server_s,
        server_rss_mib=proc_rss_mib(rig.server.pid),
        client_cpu_s=usage.client_s,
        other_cpu_s=usage.other_s,
        client_lag_p99_ms=percentile(merge_counts([p["lag_ms"] for p in parts]), 0.99),
        reconnects=sum(p["sessions"] for p in parts),
        connected=sum(p["connected"] for p in parts),
    )


# ======================================================================================
# Orchestrator: the two phases
# ======================================================================================


SELF: Final = module_command("bench.control")


async def start_workers(children: Children, settings: Settings, port: int) -> list[Worker]:
    workers = []
    for index in range(settings.workers):
        argv = [
            *SELF,
            "_agents",
            "--host",
            HOST,
            "--port",
            str(port),
            "--index",
            str(index),
            "--of",
            str(settings.workers),
            "--seed",
            str(settings.seed),
            "--max-seconds",
            str(settings.max_seconds),
        ]
        child = await children.spawn(f"agents-{index}", argv, settings.client_cpu, pipes=True)
        workers.append(Worker(child))
    return workers


async def start_llmgw_server(children: Children, settings: Settings) -> tuple[Child, int]:
    grpc_port, http_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "llmgw",
        "server",
        "--grpc-listen",
        f"{HOST}:{grpc_port}",
        "--http-listen",
        f"{HOST}:{http_port}",
        "--gateway-listen",
        "off",
        "--db",
        str(children.workdir / "server.db"),
        "--node-grace",
        "10",
        "--heartbeat-interval",
        "1",
        "--grpc-max-connections",  # every simulated agent connects from 127.0.0.1
        "1000000",
        "--grpc-max-connections-per-peer",
        "1000000",
    ]
    child = await children.spawn("llmgw-server", argv, settings.server_cpu)
    await wait_listening(child, grpc_port)
    return child, grpc_port


async def start_echo_server(children: Children, settings: Settings) -> tuple[Child, int]:
    port = free_port()
    argv = [
        *SELF,
        "_echo",
        "--host",
        HOST,
        "--port",
        str(port),
        "--max-seconds",
        str(settings.max_seconds),
    ]
    child = await children.spawn("echo-server", argv, settings.server_cpu)
    await wait_listening(child, port)
    return child, port


ServerStarter = Callable[[Children, Settings], Awaitable[tuple[Child, int]]]


async def run_phase(
    children: Children,
    settings: Settings,
    label: str,
    start: ServerStarter,
    sizes: Sequence[int],
    report: Callable[[Step], None],
) -> list[Step]:
    """Start a server and fresh workers, hold each size in turn, stop at the first failure."""
    server, port = await start(children, settings)
    workers = await start_workers(children, settings, port)
    rig = Rig(label, server, workers, settings)
    steps: list[Step] = []
    try:
        for size in sizes:
            step = await rig.step(size)
            steps.append(step)
            report(step)
            if not step.held:
                break
    finally:
        await asyncio.gather(*(w.stop() for w in workers))
        await server.stop()
    return steps


async def run_bench(
    settings: Settings, workdir: Path, report: Callable[[Step], None]
) -> tuple[list[Step], list[Step]]:
    """The baseline, then the ramp; SIGTERM cancels the run like Ctrl-C does."""
    children = Children(workdir)
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    try:
        baseline = await run_phase(
            children,
            settings,
            "bare grpclib echo",
            start_echo_server,
            settings.baseline_agents,
            report,
        )
        ramp = await run_phase(
            children, settings, "llmgw server", start_llmgw_server, settings.steps, report
        )
    finally:
        await children.close()
    return baseline, ramp


# ======================================================================================
# Reporting
# ======================================================================================


COLUMNS = (
    "server",
    "agents",
    "reg s",
    "reg p99 ms",
    "hb/s",
    "RTT p50 ms",
    "RTT p99 ms",
    "srv CPU %",
    "srv CPU s/1k hb",
    "µs/msg",
    "× bare",
    "srv RSS MiB",
    "client CPU %",
    "client lag p99 ms",
    "other CPU %",
    "held",
)


def _fmt(value: float | int | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:,.{digits}f}"


def nearest_bare(baseline: Sequence[Step], agents: int) -> Step | None:
    """The measured baseline step closest in fleet size to ``agents``."""
    measured = [b for b in baseline if b.heartbeats]
    return min(measured, key=lambda b: (abs(b.agents - agents), b.agents), default=None)


def bare_ratio(step: Step, baseline: Sequence[Step]) -> float | None:
    bare = nearest_bare(baseline, step.agents)
    return step.us_per_heartbeat / bare.us_per_heartbeat if bare and step.heartbeats else None


def step_row(step: Step, baseline: Sequence[Step]) -> list[str]:
    ratio = bare_ratio(step, baseline)
    held = "yes" if step.held else _why_not(step)
    return [
        step.label,
        f"{step.agents:,}",
        _fmt(step.reg_wall_s, 1),
        _fmt(step.reg_p99_ms),
        _fmt(step.heartbeats / step.window_s if step.heartbeats else None, 0),
        _fmt(step.rtt_p50_ms),
        _fmt(step.rtt_p99_ms),
        _fmt(100 * step.server_util, 0),
        _fmt(step.us_per_heartbeat / 1000, 3),
        _fmt(step.us_per_message, 0),
        _fmt(ratio, 2),
        _fmt(step.server_rss_mib, 0),
        _fmt(100 * step.client_util, 0),
        _fmt(step.client_lag_p99_ms),
        _fmt(100 * step.other_util if step.heartbeats else None, 0),
        held,
    ]


def _why_not(step: Step) -> str:
    if step.registered < step.agents:
        return f"no: {step.registered}/{step.agents} registered"
    if step.connected < step.agents or step.reconnects:
        return f"no: {step.connected} connected, {step.reconnects} reconnects"
    return f"no: p99 ≥ {RTT_LIMIT_MS} ms"


def table(rows: Sequence[Sequence[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def machine() -> dict[str, str]:
    return {
        **base_machine(),
        "client loop": _client_loop_name(),
        "llmgw source": source_fingerprint(),
        "load average at start": load_average(),
    }


def source_fingerprint() -> str:
    """The commit, and a hash of every ``llmgw/**/*.py`` as it is on disk (it may be
    uncommitted work): which server and agent code the figures describe."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted((root / "llmgw").rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    head = git_query("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git_query("status", "--porcelain", "--", "llmgw")
    state = f"{head} + uncommitted changes" if dirty else head
    return f"{state}; sha256 of llmgw/**/*.py {digest.hexdigest()[:12]}"


def _client_loop_name() -> str:
    try:
        import uvloop
    except ImportError:
        return "asyncio (default)"
    return f"uvloop {getattr(uvloop, '__version__', '?')}"


def conclusion(baseline: Sequence[Step], ramp: Sequence[Step]) -> list[str]:
    held = [s for s in ramp if s.held]
    lines = []
    if held:
        best = held[-1]
        lines.append(
            f"Largest fleet held with heartbeat RTT p99 < {RTT_LIMIT_MS} ms: {best.agents:,} "
            f"agents (p99 {best.rtt_p99_ms} ms, server CPU {100 * best.server_util:.0f}% of "
            f"one core; the agents' own event-loop lag p99 {best.client_lag_p99_ms} ms with "
            f"client CPU {100 * best.client_util:.0f}% of one core{_client_note(best)})."
        )
        lines.append(
            f"At that size the server spent {best.us_per_heartbeat:,.0f} µs of CPU per heartbeat "
            f"({best.us_per_heartbeat / 1000:.3f} CPU s per 1,000 heartbeats; "
            f"{best.us_per_message:,.0f} µs per message, heartbeat or ack)."
        )
    else:
        lines.append(f"No step held with heartbeat RTT p99 < {RTT_LIMIT_MS} ms.")
    lines += [_bare_line(bare, ramp) for bare in baseline if bare.heartbeats]
    noisy = [s for s in [*baseline, *ramp] if s.heartbeats and s.other_util > NOISY_OTHER_UTIL]
    if noisy:
        worst = max(noisy, key=lambda s: s.other_util)
        lines.append(
            f"Other processes used up to {100 * worst.other_util:.0f}% of a core during a "
            f"window ({worst.label}, {worst.agents:,} agents): those figures are less reliable."
        )
    stopped = [s for s in ramp if not s.held]
    if stopped:
        lines.append(f"The ramp stopped at {stopped[0].agents:,} agents: {_why_not(stopped[0])}.")
    return lines


def _client_note(step: Step) -> str:
    lag = step.client_lag_p99_ms or 0
    if lag < CLIENT_LAG_NOTE_MS:
        return ""
    return ", so part of that round trip is queueing in the load generator, not the server"


def _bare_line(bare: Step, ramp: Sequence[Step]) -> str:
    text = (
        f"Bare grpclib echo at {bare.agents:,} agents: {bare.us_per_heartbeat:,.0f} µs of server "
        f"CPU per heartbeat (p99 {bare.rtt_p99_ms} ms)"
    )
    same = [s for s in ramp if s.agents == bare.agents and s.heartbeats]
    if not same:
        return text + "."
    return (
        f"{text}; llmgw at the same size: {same[0].us_per_heartbeat:,.0f} µs, "
        f"{same[0].us_per_heartbeat / bare.us_per_heartbeat:.2f}× the bare cost."
    )


def render(
    settings: Settings,
    facts: Mapping[str, str],
    baseline: Sequence[Step],
    ramp: Sequence[Step],
    markdown: bool,
) -> str:
    rows = [step_row(s, baseline) for s in [*baseline, *ramp]]
    out = []
    if markdown:
        out += [
            "## Control server: agents heartbeating (bench/control.py)",
            "",
            "```",
            command_line(),
            "```",
            "",
        ]
        out += [f"- {k}: {v}" for k, v in facts.items()]
        out += [f"- settings: {_settings_line(settings)}", "", table(rows, True), ""]
        out += [f"{line}" for line in conclusion(baseline, ramp)]
    else:
        out += [f"command: {command_line()}"]
        out += [f"{k}: {v}" for k, v in facts.items()]
        out += [f"settings: {_settings_line(settings)}", "", table(rows, False), ""]
        out += conclusion(baseline, ramp)
    return "\n".join(out)


def _settings_line(s: Settings) -> str:
    return (
        f"{FIXTURE} agents (8 GPUs each), heartbeat every 1 s, one gRPC connection per agent; "
        f"server pinned to CPU {s.server_cpu}, {s.workers} agent worker process(es) pinned to "
        f"CPU {s.client_cpu}; agents launched at up to {s.rate:g}/s with up to {s.inflight} "
        f"registrations in flight; each step held {s.hold_s:g} s "
        f"after a {s.settle_s:g} s settle; baseline at {_sizes_text(s.baseline_agents)} agents"
    )


def _sizes_text(sizes: Sequence[int]) -> str:
    return ", ".join(f"{n:,}" for n in sizes) or "no"


def progress(step: Step) -> None:
    print(
        f"  {step.label}: {step.agents:,} agents, p99 {_fmt(step.rtt_p99_ms)} ms, "
        f"server CPU {_fmt(100 * step.server_util if step.heartbeats else None)}%, "
        f"client CPU {_fmt(100 * step.client_util if step.heartbeats else None)}%, "
        f"other CPU {_fmt(100 * step.other_util if step.heartbeats else None)}%, "
        f"{'held' if step.held else _why_not(step)}",
        file=sys.stderr,
        flush=True,
    )


# ======================================================================================
# Command line
# ======================================================================================


def parse_main(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.control", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("--max-agents", type=int, default=2000, help="largest step (default 2000)")
    p.add_argument(
        "--steps",
        default=None,
        metavar="N,N,...",
        help="explicit fleet sizes (default 250,500,1000,1500,2000, then +500)",
    )
    p.add_argument("--hold", type=float, default=20.0, help="seconds measured per step")
    p.add_argument("--settle", type=float, default=3.0, help="seconds before measuring a step")
    p.add_argument(
        "--baseline-agents",
        default="500",
        metavar="N,N,...",
        help="fleet sizes for the bare baseline (default 500; 0 skips it)",
    )
    p.add_argument(
        "--logs",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the server's and workers' logs (and the database) in DIR",
    )
    p.add_argument("--workers", type=int, default=2, help="agent worker processes")
    p.add_argument("--rate", type=float, default=40.0, help="most agents launched per second")
    p.add_argument("--inflight", type=int, default=8, help="most registrations at a time")
    p.add_argument("--server-cpu", type=int, default=0)
    p.add_argument("--client-cpu", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="steps 50,100, hold 5 s, baseline 50")
    p.add_argument("--markdown", action="store_true", help="also print a BENCHMARKS.md section")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    if args.quick:
        steps, hold, settle, baseline = QUICK_STEPS, 5.0, 1.0, QUICK_BASELINE
    else:
        steps, hold, settle = _steps(args), args.hold, args.settle
        baseline = _sizes(args.baseline_agents)
    if not 0 < hold <= 3600 or not steps or min(steps) <= 0 or args.rate <= 0:
        raise SystemExit("need 0 < --hold <= 3600, positive --steps and a positive --rate")
    cpus = os.sched_getaffinity(0)
    if {args.server_cpu, args.client_cpu} - cpus:
        raise SystemExit(f"--server-cpu/--client-cpu must be among the CPUs {sorted(cpus)}")
    worst = sum(hold + settle + 2 * REGISTER_STALL_S + s for s in steps) + 600
    return Settings(
        steps=steps,
        hold_s=hold,
        settle_s=settle,
        baseline_agents=baseline,
        workers=max(1, args.workers),
        rate=args.rate,
        inflight=max(1, args.inflight),
        server_cpu=args.server_cpu,
        client_cpu=args.client_cpu,
        seed=args.seed,
        max_seconds=worst + 600,
    )


def _steps(args: argparse.Namespace) -> tuple[int, ...]:
    if args.steps:
        return _sizes(args.steps)
    extra = range(DEFAULT_STEPS[-1] + 500, args.max_agents + 1, 500)
    return tuple(n for n in (*DEFAULT_STEPS, *extra) if n <= args.max_agents)


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(",") if n.strip() and int(n) > 0)


def parse_worker(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.control _agents")
    p.add_argument("--host", default=HOST)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--of", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-seconds", type=float, default=3600)
    return p.parse_args(argv)


def _agent_loop() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


@contextlib.contextmanager
def _workdir(keep: Path | None) -> Iterator[Path]:
    """``keep`` (created, left in place) or a temporary directory removed afterwards."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        print(f"bench_control: logs in {keep}", file=sys.stderr)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="bench_control.") as tmp:
        yield Path(tmp)


def main_orchestrator(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    args = parse_main(argv)
    settings = settings_from(args)
    facts = machine()  # before pinning: nproc counts the CPUs this process may use
    os.sched_setaffinity(0, {settings.client_cpu})  # keep our own bookkeeping off the server
    print(
        f"bench_control: steps {list(settings.steps)}, hold {settings.hold_s:g}s",
        file=sys.stderr,
        flush=True,
    )
    with _workdir(args.logs) as workdir:
        try:
            baseline, ramp = asyncio.run(run_bench(settings, workdir, progress))
        except (KeyboardInterrupt, asyncio.CancelledError):
            print("interrupted; every child process was stopped", file=sys.stderr)
            return 130
    print(render(settings, facts, baseline, ramp, markdown=False), file=out)
    if args.markdown:
        print("\n" + render(settings, facts, baseline, ramp, markdown=True), file=out)
    return 0


def main(argv: Sequence[str]) -> int:
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if argv[:1] == ["_agents"]:
        with asyncio.Runner(loop_factory=_agent_loop()) as runner:
            runner.run(run_agents_worker(parse_worker(argv[1:])))
        return 0
    if argv[:1] == ["_echo"]:
        asyncio.run(run_echo_server(parse_worker(argv[1:])))  # the default loop, as the server
        return 0
    return main_orchestrator(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
