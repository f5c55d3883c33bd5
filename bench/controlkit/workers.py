"""The control benchmark's worker modes: ``_agents`` (many AgentLinks in one event loop,
driven over stdin/stdout) and ``_echo`` (the bare baseline server)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.controlkit.shared import FIXTURE, LAG_TICK_S, READ_LIMIT, REGISTER_STALL_S

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
