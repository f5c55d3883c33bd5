"""The chaos run's faults: SIGKILL and SIGSTOP/SIGCONT on servers, agents, engines, gateways.

One fault at a time, a random pause (``gap_s``) before each, for ``duration_s``:

* ``kill-server``: SIGKILL, then start it again after ``restart_delay_s`` with the same
  database and ports; ``kill-agent``: the same for one agent (its engines keep running and
  the new agent adopts them); ``kill-engine``: SIGKILL one engine's process group (its agent
  restarts it).
* ``stop-server``, ``stop-agent``, ``stop-engine``, ``stop-gateway``: SIGSTOP, ``stop_s``
  later SIGCONT: a hung process. A gateway fault hits one of the load's gateways
  (`ChaosCluster.load_gateways`), drawn from the run's rng when there are several; its
  record's target names it (the request check holds it only against requests through it).
* ``fill-disk``: the server's state disk (a tmpfs, chaoskit.disk) filled for ``stop_s``,
  freed for a moment, filled again for a shorter while, and freed; the server must stay up
  and take writes again by itself. Its record says how often ``/healthz`` answered 503
  (the server saw the disk full) and how long after the end it was 200 again.
* With several servers on one PostgreSQL (chaoskit.ha): ``kill-server`` and ``stop-server``
  aim at the current leader (``LEADER_SHARE`` of the time) or else at a follower; on the
  leader the record has the failover (the signal → another server says ``llmgw_leader 1`` at
  a higher epoch; None: not within ``FAILOVER_TIMEOUT_S``). ``kill-postgres``: ``pg_ctl stop
  -m immediate``, started again after ``restart_delay_s`` + 2 s; ``stop-postgres``: the
  postmaster's process group SIGSTOPped for ``stop_s``, then SIGCONT.
* ``duplicate-agent``: once an agent is registered, a second agent process with a copy of
  its state dir and its node id starts, runs ``duplicate_s`` from the server's first answer
  to it, then is SIGKILLed. The server
  must refuse it (the node, its replicas and its engines stay the first agent's); the
  check ``duplicate_agents_refused`` (chaoskit.checks) reads its log.

Each fault is recorded with its target's pid and, on this process's monotonic clock, when
it began (the signal) and ended (the restart, the SIGCONT; a kill of an engine ends when it
begins: its agent does the rest).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import time
from dataclasses import dataclass
from typing import Final

import httpx

from bench.chaoskit.cluster import ChaosCluster, signal_group
from bench.chaoskit.ha import Postgres, choose_server, leader_of, read_leaders, wait_failover

log = logging.getLogger("chaos.faults")

KINDS: Final = (
    "kill-server", "kill-agent", "kill-engine",
    "stop-server", "stop-agent", "stop-engine", "stop-gateway", "fill-disk",
    "duplicate-agent",
)  # fmt: skip
PG_KINDS: Final = ("kill-postgres", "stop-postgres")  # with several servers only
ALL_KINDS: Final = (*KINDS, *PG_KINDS)
HEALTHY_AGAIN_S: Final = 30.0  # after a fill-disk, the most it waits for /healthz 200


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """How often and how hard; seconds."""

    duration_s: float = 600.0
    gap_s: tuple[float, float] = (2.0, 6.0)
    restart_delay_s: tuple[float, float] = (0.5, 3.0)
    stop_s: tuple[float, float] = (2.0, 6.0)
    duplicate_s: tuple[float, float] = (3.0, 8.0)
    kinds: tuple[str, ...] = KINDS
    in_turn: bool = False  # each kind in turn (a seeded shuffle, repeated), not at random


@dataclass(frozen=True, slots=True)
class FaultRecord:
    """One fault: what, on which process, from when to when (monotonic seconds)."""

    kind: str
    target: str  # a server, a gateway's name, a node id, an engine's shard id, or "postgres"
    pid: int
    started: float
    ended: float
    model: str = ""  # an engine's served model
    node: str = ""  # an engine's or an agent's node
    replica: str = ""  # an engine's replica
    healthz_looks: int = 0  # fill-disk: how often it asked the server's /healthz meanwhile
    healthz_503: int = 0  # fill-disk: how often that answered 503 (the disk full)
    healthy_again_s: float | None = None  # fill-disk: its end → /healthz 200 (None: never)
    leader: bool = False  # several servers: the target led when the fault began
    failover_s: float | None = None  # on the leader: the signal → another leads (None: not)

    @property
    def note(self) -> str:
        """What a fill-disk saw of the server, or a leader fault's failover, in words ("" for
        the other kinds)."""
        if self.leader:
            took = self.failover_s
            return "on the leader; " + (
                f"another led after {took:.2f}s" if took is not None else "no other led"
            )
        if self.kind != "fill-disk":
            return ""
        back = self.healthy_again_s
        return f"/healthz 503 in {self.healthz_503} of {self.healthz_looks} looks; " + (
            f"200 again {back:.1f}s after" if back is not None else "never 200 again"
        )


class FaultLoop:
    """Inject faults until the duration is over or ``stop`` is set; `records` says which."""

    def __init__(
        self,
        cluster: ChaosCluster,
        config: FaultConfig,
        rng: random.Random,
        postgres: Postgres | None = None,
    ) -> None:
        self._cluster = cluster
        self._postgres = postgres
        self._config = config
        self._rng = rng
        self._turns: list[str] = []  # with in_turn: the kinds still to come in this round
        self.records: list[FaultRecord] = []

    async def run(self, stop: asyncio.Event) -> None:
        deadline = time.monotonic() + self._config.duration_s
        while time.monotonic() < deadline and not stop.is_set():
            await self._pause(self._config.gap_s, deadline, stop)
            if stop.is_set() or time.monotonic() >= deadline:
                return
            record = await self._one(self._next_kind())
            if record is not None:
                self.records.append(record)
                log.info(
                    "fault %s on %s (pid %d) for %.1fs%s",
                    record.kind, record.target, record.pid, record.ended - record.started,
                    f": {record.note}" if record.note else "",
                )  # fmt: skip

    def _next_kind(self) -> str:
        """A kind drawn at random, or with ``in_turn`` the next of a seeded shuffle of them
        (reshuffled once each has had its turn), so that a short run meets every kind."""
        if not self._config.in_turn:
            return self._rng.choice(self._config.kinds)
        if not self._turns:
            self._turns = self._rng.sample(self._config.kinds, len(self._config.kinds))
        return self._turns.pop(0)

    async def _one(self, kind: str) -> FaultRecord | None:
        if kind == "duplicate-agent":
            return await self._duplicate_agent()
        action, _, role = kind.partition("-")
        if kind == "fill-disk":
            return await self._fill_disk()
        if role == "engine":
            return await self._engine(action)
        if role == "postgres":
            return await self._database(action)
        if role == "server" and len(self._cluster.servers) > 1:
            return await self._server(action)
        name = self._target(role)
        node = name if role == "agent" else ""
        pid = self._cluster.pid(name)
        if pid is None:
            return None
        started = time.monotonic()
        if action == "kill":
            self._cluster.kill(name)
            await asyncio.sleep(self._rng.uniform(*self._config.restart_delay_s))
            self._cluster.start(name)
        else:
            await self._hang(pid)
        return FaultRecord(kind, name, pid, started, time.monotonic(), node=node)

    def _target(self, role: str) -> str:
        """The process a fault on ``role`` hits: one agent, or one of the load's gateways
        (drawn only when there are several: a run with one draws what it always drew)."""
        if role == "agent":
            return self._rng.choice(self._cluster.nodes)
        if role == "gateway":
            names = self._cluster.load_gateways
            return names[0] if len(names) == 1 else self._rng.choice(names)
        return role

    async def _server(self, action: str) -> FaultRecord | None:
        """A fault on one of several servers: the leader most of the time (its failover
        measured meanwhile), else a follower."""
        webs = self._cluster.server_web
        async with httpx.AsyncClient() as http:
            leading = leader_of(await read_leaders(http, webs))
            name = choose_server(self._cluster.servers, leading and leading[0], self._rng)
            pid = self._cluster.pid(name)
            if pid is None:
                return None
            on_leader = leading is not None and leading[0] == name
            others = {n: u for n, u in webs.items() if n != name}
            started = time.monotonic()
            if action == "kill":
                self._cluster.kill(name)
            else:
                signal_group(pid, signal.SIGSTOP)
            failover = (
                asyncio.create_task(wait_failover(http, others, leading[1]))
                if on_leader and leading is not None
                else None
            )
            try:
                if action == "kill":
                    await asyncio.sleep(self._rng.uniform(*self._config.restart_delay_s))
                    self._cluster.start(name)
                else:
                    await asyncio.sleep(self._rng.uniform(*self._config.stop_s))
            finally:
                if action != "kill":
                    signal_group(pid, signal.SIGCONT)
            ended = time.monotonic()
            took = await failover if failover is not None else None
        return FaultRecord(
            f"{action}-server", name, pid, started, ended, leader=on_leader, failover_s=took
        )

    async def _database(self, action: str) -> FaultRecord | None:
        if self._postgres is None:
            return None
        started = time.monotonic()
        if action == "kill":
            pid = await self._postgres.kill(2.0 + self._rng.uniform(*self._config.restart_delay_s))
        else:
            pid = await self._postgres.hang(self._rng.uniform(*self._config.stop_s))
        return FaultRecord(f"{action}-postgres", "postgres", pid, started, time.monotonic())

    async def _engine(self, action: str) -> FaultRecord | None:
        engines = [e for e in self._cluster.engines() if e.shard_id and not e.stopped]
        if not engines:
            return None
        engine = self._rng.choice(engines)
        started = time.monotonic()
        if action == "kill":
            signal_group(engine.pid, signal.SIGKILL)
        else:
            await self._hang(engine.pid)
        return FaultRecord(
            f"{action}-engine", engine.shard_id, engine.pid, started, time.monotonic(),
            model=engine.model, node=engine.node, replica=engine.replica_id,
        )  # fmt: skip

    async def _fill_disk(self) -> FaultRecord | None:
        """Fill the state disk, free it a moment, fill it again, free it; then wait (at most
        HEALTHY_AGAIN_S) for the server's /healthz to be 200, noting what it answered."""
        pid, disk = self._cluster.pid("server"), self._cluster.state_disk
        if disk is None or pid is None:
            return None
        answers: list[int] = []
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=1.0) as http:
            try:
                for hold in (self._rng.uniform(*self._config.stop_s), self._rng.uniform(1, 3)):
                    disk.fill()
                    await self._health_for(http, hold, answers)
                    disk.free()
                    await self._health_for(http, self._rng.uniform(0.3, 1.0), answers)
            finally:
                disk.free()
            ended = time.monotonic()
            back = await self._healthy_again(http)
        return FaultRecord(
            "fill-disk", "state disk", pid, started, ended,
            healthz_looks=len(answers), healthz_503=answers.count(503), healthy_again_s=back,
        )  # fmt: skip

    async def _health_for(self, http: httpx.AsyncClient, seconds: float, out: list[int]) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            out.append(await self._health(http))
            await asyncio.sleep(min(0.25, max(0.0, left)))

    async def _health(self, http: httpx.AsyncClient) -> int:
        with contextlib.suppress(httpx.HTTPError):
            return (await http.get(f"{self._cluster.web}/healthz")).status_code
        return 0

    async def _healthy_again(self, http: httpx.AsyncClient) -> float | None:
        start = time.monotonic()
        while time.monotonic() - start < HEALTHY_AGAIN_S:
            if await self._health(http) == 200:
                return time.monotonic() - start
            await asyncio.sleep(0.25)
        return None

    async def _duplicate_agent(self) -> FaultRecord | None:
        """A second agent of a registered node (a copied state dir) for a few seconds."""
        node = self._rng.choice(self._cluster.nodes)
        if not await self._cluster.registered(node, timeout_s=15.0):
            return None  # its agent is not back from an earlier fault: nothing to duplicate
        started = time.monotonic()
        name, pid = self._cluster.start_duplicate(node)
        try:  # from its first answer from the server (an agent takes seconds to start)
            await self._cluster.logged(name, ("ALREADY_EXISTS", "registered with"), 60.0)
            await asyncio.sleep(self._rng.uniform(*self._config.duplicate_s))
        finally:
            self._cluster.kill(name)
        return FaultRecord("duplicate-agent", name, pid, started, time.monotonic(), node=node)

    async def _hang(self, pid: int) -> None:
        """SIGSTOP, a while, SIGCONT (always: a cancelled run leaves nothing stopped)."""
        signal_group(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(self._rng.uniform(*self._config.stop_s))
        finally:
            signal_group(pid, signal.SIGCONT)

    async def _pause(
        self, bounds: tuple[float, float], deadline: float, stop: asyncio.Event
    ) -> None:
        """A random pause, cut short by ``deadline`` (monotonic) or ``stop``."""
        seconds = min(self._rng.uniform(*bounds), deadline - time.monotonic())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, seconds)):
                await stop.wait()
