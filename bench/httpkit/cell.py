"""The HTTP benchmark's cells: a workload against one server, measured over a window."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from bench.httpkit.settings import CELL_GRACE_S, Settings
from bench.httpkit.workload import Workload
from bench.kit import Connection, cpu_seconds, percentile, proc_cpu_seconds

# ======================================================================================
# One cell: a workload against one server, measured over a window
# ======================================================================================


@dataclass(slots=True)
class Cell:
    server: str
    workload: str
    rep: int
    window_s: float
    requests: int
    latencies_s: list[float]
    server_cpu_s: float
    client_cpu_s: float
    others_cpu_s: float  # what other processes used of the server's CPU meanwhile
    reconnects: int
    attempts: int = 1

    @property
    def others_share(self) -> float:
        """The share of the server's CPU that other processes used during the window."""
        return self.others_cpu_s / self.window_s

    @property
    def rps(self) -> float:
        return self.requests / self.window_s

    def latency_us(self, q: float) -> float:
        return 1e6 * percentile(self.latencies_s, q)

    @property
    def server_us_per_request(self) -> float:
        return 1e6 * self.server_cpu_s / self.requests if self.requests else math.nan

    @property
    def server_util(self) -> float:
        return self.server_cpu_s / self.window_s

    @property
    def client_util(self) -> float:
        return self.client_cpu_s / self.window_s


def cpu_busy_seconds(cpu: int) -> float:
    """Busy (not idle, not iowait) seconds of one CPU since boot, from ``/proc/stat``."""
    return sum(cpu_seconds(cpu))


@dataclass(slots=True)
class _Window:
    start: float = math.inf
    end: float = math.inf
    max_requests: int = 0
    done: int = 0
    latencies: list[float] = field(default_factory=list)
    reconnects: int = 0


async def _drive(port: int, workload: Workload, window: _Window, until: float) -> None:
    """One connection's closed loop: request, check, record, repeat until ``until``."""
    conn = await Connection.open(port)
    raw, check, latencies = workload.raw, workload.check, window.latencies
    clock = time.perf_counter
    try:
        while True:
            t0 = clock()
            if t0 >= until or window.done >= window.max_requests:
                return
            reply = await conn.request(raw)
            t1 = clock()
            if not check(reply):
                raise RuntimeError(f"{workload.label}: bad reply {reply.status} {reply.body!r}")
            if window.start <= t1 < window.end:
                latencies.append(t1 - t0)
                window.done += 1
            if reply.close or conn.lost:
                conn.close()
                conn = await Connection.open(port)
                window.reconnects += 1
    finally:
        conn.close()


async def run_cell(
    server: str, pid: int, port: int, workload: Workload, rep: int, settings: Settings
) -> Cell:
    window = _Window(max_requests=settings.max_requests)
    clock = time.perf_counter
    until = clock() + settings.warmup_s + settings.seconds + 1.0  # the loops' own bound
    async with asyncio.timeout(settings.warmup_s + settings.seconds + CELL_GRACE_S):
        drivers = [
            asyncio.create_task(_drive(port, workload, window, until))
            for _ in range(workload.conns)
        ]
        try:
            await asyncio.sleep(settings.warmup_s)
            busy0, cpu0 = cpu_busy_seconds(settings.server_cpu), proc_cpu_seconds(pid)
            own0, window.start = time.process_time(), clock()
            window.end = window.start + settings.seconds
            while clock() < window.end and window.done < window.max_requests:
                await asyncio.sleep(min(0.05, max(0.0, window.end - clock())))
                if any(d.done() for d in drivers):
                    break
            stopped = min(clock(), window.end)
            cpu1, own1 = proc_cpu_seconds(pid), time.process_time()
            busy1 = cpu_busy_seconds(settings.server_cpu)
            window.end = stopped
        finally:
            for d in drivers:
                d.cancel()
            results = await asyncio.gather(*drivers, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException) and not _cancelled(r)]
    if errors:
        raise errors[0]
    return Cell(
        server=server,
        workload=workload.key,
        rep=rep,
        window_s=window.end - window.start,
        requests=window.done,
        latencies_s=sorted(window.latencies),
        server_cpu_s=cpu1 - cpu0,
        others_cpu_s=max(0.0, (busy1 - busy0) - (cpu1 - cpu0)),
        client_cpu_s=own1 - own0,
        reconnects=window.reconnects,
    )


def _cancelled(exc: BaseException) -> bool:
    return isinstance(exc, asyncio.CancelledError)
