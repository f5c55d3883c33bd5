"""The control benchmark's orchestrator: its settings and one measured step."""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.controlkit.children import Child, Worker, machine_busy_seconds, proc_rss_mib
from bench.controlkit.shared import REGISTER_STALL_S, RTT_LIMIT_MS, merge_counts, percentile
from bench.kit import proc_cpu_seconds

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
    extra_cpu: Callable[[], float] | None = None  # the server's database's CPU seconds

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
        """CPU seconds used so far by the server (and its database's processes, if any),
        the workers, and everything else."""
        server = self.server.cpu_seconds() + (self.extra_cpu() if self.extra_cpu else 0.0)
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
