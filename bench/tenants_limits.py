"""The tenants benchmark's fleet-wide rate limit (bench/tenants.py runs and reports it).

``gateways`` gateways, each with its own ``TenantRegistry`` on the simulated clock, share one
key of ``rpm`` requests per minute. The key's requests arrive as a Poisson process at
``demand`` × the limit, spread over the gateways by weights redrawn every ``shift_s`` (the
traffic moves: a client's connections land elsewhere). Every gateway reports its windows
every ``interval_s`` (their phases staggered) to the server's split
(``llmgw.server.core.tenantsplit.FleetSplit``), whose answer it enforces until its next
report, exactly as ``llmgw gateway`` applies its report's ack. The figure: the most
requests admitted, over all gateways together, in any sliding minute, against the limit.
"""

from __future__ import annotations

import hashlib
import heapq
import random
from bisect import bisect_left
from dataclasses import dataclass

from llmgw.api.llmgw.v1 import TenantKey
from llmgw.gateway.errors import RateLimited
from llmgw.gateway.tenants import TenantRegistry
from llmgw.server.core.tenantsplit import FleetSplit

_KEY = b"bench-tenant-key"
_AUTHORIZATION = b"Bearer " + _KEY


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    gateways: int = 4
    rpm: int = 600
    demand: float = 2.0  # offered load as a multiple of the limit
    interval_s: float = 2.0  # each gateway's report interval
    shift_s: float = 20.0  # the traffic's spread over the gateways is redrawn this often
    duration_s: float = 600.0
    seed: int = 1


@dataclass(frozen=True, slots=True)
class LimitsOutcome:
    config: LimitsConfig
    asked: int
    admitted: int
    max_in_minute: int

    @property
    def overshoot(self) -> float:
        return max(0.0, self.max_in_minute / self.config.rpm - 1)

    @property
    def use(self) -> float:
        """Admitted over what the limit allows over the run (after the first minute)."""
        return self.admitted / (self.config.rpm * self.config.duration_s / 60)


def run_limits(config: LimitsConfig) -> LimitsOutcome:
    rng = random.Random(config.seed)
    now = [0.0]

    def clock() -> float:
        return now[0]

    key = TenantKey(key_id="k", tenant="t", rpm=config.rpm, digest=hashlib.sha256(_KEY).digest())
    registries = [TenantRegistry(clock=clock) for _ in range(config.gateways)]
    for registry in registries:
        registry.replace([key])
    split = FleetSplit(clock=clock)
    rate = config.demand * config.rpm / 60
    heap: list[tuple[float, int, int]] = []  # (at, kind 0 report / 1 arrival, gateway)
    for g in range(config.gateways):
        heapq.heappush(heap, (config.interval_s * (g + 0.5) / config.gateways, 0, g))
    heapq.heappush(heap, (rng.expovariate(rate), 1, -1))
    weights = [rng.random() for _ in range(config.gateways)]
    next_shift = config.shift_s
    admitted_at: list[float] = []
    asked = 0
    while heap:
        at, kind, g = heapq.heappop(heap)
        if at >= config.duration_s:
            break
        now[0] = at
        if kind == 0:
            allowances = split.take(f"gw{g}", registries[g].windows(), config.interval_s, [key])
            registries[g].apply_allowances(allowances)
            heapq.heappush(heap, (at + config.interval_s, 0, g))
            continue
        while at >= next_shift:
            weights = [rng.random() ** 2 for _ in range(config.gateways)]
            next_shift += config.shift_s
        gateway = rng.choices(range(config.gateways), weights)[0]
        asked += 1
        registry = registries[gateway]
        state = registry.lookup(_AUTHORIZATION)
        assert state is not None
        try:
            ticket = registry.admit(state, "m", "m", 1)
        except RateLimited:
            pass
        else:
            ticket.close()
            admitted_at.append(at)
        heapq.heappush(heap, (at + rng.expovariate(rate), 1, -1))
    return LimitsOutcome(config, asked, len(admitted_at), _max_in_window(admitted_at, 60.0))


def _max_in_window(times: list[float], window_s: float) -> int:
    """The most of ``times`` (sorted) in any half-open window of ``window_s``."""
    best = 0
    for i, at in enumerate(times):
        best = max(best, i + 1 - bisect_left(times, at - window_s + 1e-9, 0, i + 1))
    return best


__all__ = ["LimitsConfig", "LimitsOutcome", "run_limits"]
