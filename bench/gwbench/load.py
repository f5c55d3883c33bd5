"""bench.gateway's load generator: closed loops of keep-alive connections through one proxy
(or direct to the upstream), every reply checked and timed, CPU read from ``/proc`` around a
measured window."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import re
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from bench.gwbench.settings import Settings, Timing
from bench.gwbench.workload import Prompt, chat_request
from bench.kit import Connection, Reply, cpu_seconds, percentile, proc_cpu_seconds

CELL_GRACE_S: Final = 30.0  # beyond warmup + window, how long a cell may take at most
_REPLICA: Final = re.compile(rb'"system_fingerprint":\s*"r(\d+)"')


class TimedConnection(Connection):
    """A ``Connection`` that also notes when each reply's first SSE ``data:`` arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.first_data = math.nan

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if math.isnan(self.first_data) and b"data:" in self.buf:
            self.first_data = time.perf_counter()
        self._deliver()

    def _reply(self, status: int, body: bytes, close: bool) -> Reply:
        first, self.first_data = self.first_data, math.nan
        return Reply(status, body, close, first)


def replica_of(reply: Reply, stream: bool, chunks: int) -> int:
    """The replica that answered ``reply``; ValueError when the reply is not the upstream's."""
    found = _REPLICA.search(reply.body)
    if reply.status != 200 or found is None:
        raise ValueError(f"bad reply: {reply.status} {reply.body[:300]!r}")
    if stream:
        events = reply.body.count(b"data: ")
        if not reply.body.endswith(b"data: [DONE]\n\n") or events != chunks + 1:
            raise ValueError(f"bad stream ({events} events): {reply.body[-300:]!r}")
    return int(found.group(1))


@dataclass(frozen=True, slots=True)
class Work:
    """What one cell sends: pre-encoded requests per target port, and how many at once."""

    kind: str
    conns: int
    stream: bool
    chunks: int
    requests: Mapping[int, Sequence[bytes]]  # port → one request per prompt
    groups: Sequence[int]  # the prompts' groups, by index


def make_work(kind: str, s: Settings, ports: Iterable[int], prompts: Sequence[Prompt]) -> Work:
    stream = kind == "stream"
    requests = {p: [chat_request(p, x, stream) for x in prompts] for p in ports}
    conns = s.conns if kind == "rps" else 1
    return Work(kind, conns, stream, s.chunks, requests, [x.group for x in prompts])


@dataclass(slots=True)
class Cell:
    proxy: str
    kind: str
    rep: int
    window_s: float
    requests: int
    latencies_s: list[float]  # sorted
    first_data_s: list[float]  # sorted; streams only
    proxy_cpu_s: float  # NaN for direct
    client_cpu_s: float
    upstream_cpu_s: float
    others_cpu_s: float  # what other processes used of the proxy's CPU meanwhile
    irq_cpu_s: float  # interrupt time on the proxy's CPU (mostly its sockets' softirq)
    client_others_cpu_s: float  # what other processes used of the client's CPU meanwhile
    routes: Counter[tuple[int, int]]  # (group, replica) → requests
    attempts: int = 1

    @property
    def rps(self) -> float:
        return self.requests / self.window_s if self.window_s > 0 else math.nan

    @property
    def others_share(self) -> float:
        """Other processes' share of the CPU that matters here: the proxy's, or for direct
        (the scheduler moves them to the proxy's idle core then) the client's."""
        others = self.client_others_cpu_s if self.proxy == "direct" else self.others_cpu_s
        return others / self.window_s if self.window_s > 0 else math.nan

    @property
    def cpu_us_per_request(self) -> float:
        return 1e6 * self.proxy_cpu_s / self.requests if self.requests else math.nan

    def latency_us(self, q: float) -> float:
        return 1e6 * percentile(self.latencies_s, q)

    def first_data_us(self, q: float) -> float:
        return 1e6 * percentile(self.first_data_s, q)


def stickiness(routes: Mapping[tuple[int, int], int]) -> float:
    """The share of requests that went to their group's most used replica (1.0: all did)."""
    by_group: dict[int, Counter[int]] = {}
    for (group, replica), n in routes.items():
        by_group.setdefault(group, Counter())[replica] += n
    total = sum(sum(c.values()) for c in by_group.values())
    top = sum(max(c.values()) for c in by_group.values())
    return top / total if total else math.nan


def busiest_share(routes: Mapping[tuple[int, int], int]) -> float:
    """The busiest replica's share of all requests."""
    per: Counter[int] = Counter()
    for (_, replica), n in routes.items():
        per[replica] += n
    total = sum(per.values())
    return max(per.values()) / total if total else math.nan


def tree_cpu_seconds(pid: int | None) -> float:
    """CPU seconds of a process and its descendants (NaN for no process)."""
    if pid is None:
        return math.nan
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        with contextlib.suppress(OSError):
            total += proc_cpu_seconds(p)
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
    return total


@dataclass(slots=True)
class _Window:
    start: float = math.inf
    end: float = math.inf
    done: int = 0
    latencies: list[float] = field(default_factory=list)
    first_data: list[float] = field(default_factory=list)
    routes: Counter[tuple[int, int]] = field(default_factory=Counter)


async def _drive(port: int, offset: int, work: Work, window: _Window, until: float) -> None:
    """One connection's closed loop over the prompts from ``offset``, until ``until``."""
    conn = await TimedConnection.open(port)
    requests, clock, n = work.requests[port], time.perf_counter, len(work.groups)
    i = offset
    try:
        while (t0 := clock()) < until:
            reply = await conn.request(requests[i % n])
            t1 = clock()
            replica = replica_of(reply, work.stream, work.chunks)
            if window.start <= t1 < window.end:
                window.latencies.append(t1 - t0)
                if work.stream:
                    window.first_data.append(reply.first_data - t0)
                window.routes[work.groups[i % n], replica] += 1
                window.done += 1
            i += 1
            if reply.close or conn.lost:
                conn.close()
                conn = await TimedConnection.open(port)
    finally:
        conn.close()


@dataclass(frozen=True, slots=True)
class Meter:
    """Where a cell reads CPU: the proxy's process, the upstream's, both cores."""

    proxy_pid: int | None
    upstream_pid: int | None
    proxy_cpu: int
    client_cpu: int

    def read(self) -> tuple[float, ...]:
        return (
            tree_cpu_seconds(self.proxy_pid),
            tree_cpu_seconds(self.upstream_pid),
            *cpu_seconds(self.proxy_cpu),
            cpu_seconds(self.client_cpu)[0],
            time.process_time(),
        )


async def run_cell(
    proxy: str, ports: Sequence[int], work: Work, meter: Meter, rep: int, timing: Timing
) -> Cell:
    """``work.conns`` connections spread over ``ports``, measured for ``timing.seconds``."""
    window, clock = _Window(), time.perf_counter
    until = clock() + timing.warmup_s + timing.seconds + 0.5
    n = len(work.groups)
    async with asyncio.timeout(timing.warmup_s + timing.seconds + CELL_GRACE_S):
        drivers = [
            asyncio.create_task(_drive(port, c * n // work.conns, work, window, until))
            for c, port in zip(range(work.conns), itertools.cycle(ports), strict=False)
        ]
        try:
            await asyncio.sleep(timing.warmup_s)
            before, window.start = meter.read(), clock()
            window.end = window.start + timing.seconds
            # the window ends early if a connection fails: its error is raised below
            await asyncio.wait(drivers, timeout=timing.seconds, return_when="FIRST_COMPLETED")
            after, window.end = meter.read(), min(clock(), window.end)
        finally:
            for d in drivers:
                d.cancel()
            results = await asyncio.gather(*drivers, return_exceptions=True)
    errors = [r for r in results if isinstance(r, Exception)]
    if errors:
        raise RuntimeError(f"{proxy} {work.kind}: {errors[0]!r}") from errors[0]
    deltas = (a - b for a, b in zip(after, before, strict=True))
    proxy_cpu, upstream_cpu, tasks, irq, client_tasks, own = deltas
    return Cell(
        proxy=proxy,
        kind=work.kind,
        rep=rep,
        window_s=window.end - window.start,
        requests=window.done,
        latencies_s=sorted(window.latencies),
        first_data_s=sorted(window.first_data),
        proxy_cpu_s=proxy_cpu,
        client_cpu_s=own,
        upstream_cpu_s=upstream_cpu,
        others_cpu_s=max(0.0, tasks - (0.0 if math.isnan(proxy_cpu) else proxy_cpu)),
        irq_cpu_s=irq,
        client_others_cpu_s=max(0.0, client_tasks - own - upstream_cpu),
        routes=window.routes,
    )
