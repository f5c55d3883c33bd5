"""The autoscaling benchmark's replay in simulated time (bench/autoscale.py runs and reports it).

**The trace** (``make_trace``, everything from the seed): a day of ``day_s`` seconds whose
arrival rate is ``base + (peak - base) × ((1 − cos 2π t/day) / 2) ** 2`` (night at the
start and the end, one broad peak at midday; the square makes the peak narrower than
the trough, as chat traffic is), plus ``bursts`` bursts at uniform random times, each
adding ``burst_frac × peak`` × U(0.3, 1) requests/s, ramping up over 60 s, holding
U(2, 8) minutes and ramping down over 60 s. Arrivals are a non-homogeneous Poisson
process (thinning); prompts and answers are lognormal in tokens (means ``prompt_tokens``
and ``output_tokens``, σ 0.6, clipped to [16, 4 × mean]).

**The engine** (one replica = one GPU running a vLLM-like continuous batcher): at most
``batch`` requests in its batch; beyond that they wait in its queue (the engine's
``num_requests_waiting``), first come first served. An admitted request prefills in
``prefill_ms + prefill_ms_per_token × prompt`` (× 1 + batch share / 2: prefill competes
with the decoding batch), then decodes with everyone in the batch: a decode step of
``n`` requests takes ``step_ms + step_ms_per_seq × n`` and gives each one token, so a
request's tokens come at the pace of the batch it is in (simulated exactly as processor
sharing in virtual time). TTFT = time held at the gateway + queue + prefill; ITL = the
request's decode time / its tokens (one figure per request: every gap of a request is
the step time of the batch it was in). A new replica serves after ``cold_start_s`` (the
model's load time; the GPU counts from the moment it is placed). A replica scaled in
stops taking requests, hands its queue back to the gateway and counts until its batch
has finished.

**The gateway**: a request goes to the READY replica with the fewest requests (batch +
queue); with none READY it is held (``hold_s`` at most, then answered 503: a violation)
and sent as soon as one is READY. Its windows are what the real gateway reports:
cumulative arrivals and bucket histograms of TTFT and ITL (``BOUNDS_MS``), read every
round and differenced over ``window_s``, p90 by linear interpolation in the bucket.

This module holds the trace, the engines and the replay; the policies and the report
are in ``bench.autoscale``.
"""

from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

BOUNDS_MS = (
    5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0, 400.0, 500.0,
    650.0, 800.0, 1000.0, 1250.0, 1500.0, 2000.0, 2500.0, 3000.0, 4000.0, 5000.0, 7500.0,
    10000.0, 20000.0, 60000.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The trace, the engine and the gateway (module docstring)."""

    seed: int = 16
    day_s: float = 86_400.0
    base_rps: float = 0.8
    peak_rps: float = 10.0
    bursts: int = 10
    burst_frac: float = 0.5
    prompt_tokens: int = 600
    output_tokens: int = 400
    batch: int = 16
    step_ms: float = 12.0
    step_ms_per_seq: float = 1.5
    prefill_ms: float = 20.0
    prefill_ms_per_token: float = 0.15
    cold_start_s: float = 40.0
    hold_s: float = 60.0
    window_s: float = 30.0
    ttft_target_ms: float = 1000.0
    itl_target_ms: float = 40.0


@dataclass(frozen=True, slots=True)
class Request:
    arrival: float
    prompt: int
    output: int


def rate_at(config: SimConfig, t: float, bursts: Sequence[tuple[float, float, float]]) -> float:
    """Requests/s at ``t``: the day's curve plus every burst (start, hold, height)."""
    day = ((1.0 - math.cos(2.0 * math.pi * t / config.day_s)) / 2.0) ** 2
    rate = config.base_rps + (config.peak_rps - config.base_rps) * day
    for start, hold, height in bursts:
        ramp = 60.0
        if start <= t < start + ramp:
            rate += height * (t - start) / ramp
        elif start + ramp <= t < start + ramp + hold:
            rate += height
        elif start + ramp + hold <= t < start + 2 * ramp + hold:
            rate += height * (1.0 - (t - start - ramp - hold) / ramp)
    return rate


def make_bursts(config: SimConfig) -> list[tuple[float, float, float]]:
    rng = random.Random(config.seed * 7919 + 1)
    out = []
    for _ in range(config.bursts):
        start = rng.uniform(0.0, config.day_s - 600.0)
        hold = rng.uniform(120.0, 480.0)
        out.append((start, hold, config.burst_frac * config.peak_rps * rng.uniform(0.3, 1.0)))
    return sorted(out)


def make_trace(config: SimConfig) -> list[Request]:
    """The day's requests, in arrival order (module docstring)."""
    rng = random.Random(config.seed)
    bursts = make_bursts(config)
    top = config.peak_rps * (1.0 + config.burst_frac) + config.base_rps
    out: list[Request] = []
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= config.day_s:
            return out
        if rng.random() * top < rate_at(config, t, bursts):
            out.append(
                Request(t, _tokens(rng, config.prompt_tokens), _tokens(rng, config.output_tokens))
            )


def _tokens(rng: random.Random, mean: int) -> int:
    sigma = 0.6
    value = rng.lognormvariate(math.log(mean) - sigma * sigma / 2.0, sigma)
    return int(min(max(value, 16.0), 4.0 * mean))


def replica_capacity_rps(config: SimConfig) -> float:
    """Requests/s one replica finishes with its batch full (Little: batch / time in it)."""
    step_s = (config.step_ms + config.step_ms_per_seq * config.batch) / 1000.0
    prefill_s = (config.prefill_ms + config.prefill_ms_per_token * config.prompt_tokens) / 1000.0
    return config.batch / (config.output_tokens * step_s + prefill_s * 1.5)


class _Live:
    """One request on its way (index into the trace, and its times)."""

    __slots__ = ("first", "index", "vfinish")

    def __init__(self, index: int) -> None:
        self.index = index
        self.first = 0.0
        self.vfinish = 0.0


@dataclass(slots=True)
class Replica:
    """One simulated engine (module docstring): slots, queue, and its decode in virtual time
    (``v``: tokens each decoding request has got since the replica started)."""

    created: float
    ready_at: float
    draining: bool = False
    gone_at: float | None = None
    queue: deque[_Live] = field(default_factory=deque)
    prefilling: int = 0
    decoding: list[tuple[float, int, _Live]] = field(default_factory=list)
    v: float = 0.0
    t: float = 0.0
    version: int = 0

    @property
    def used(self) -> int:
        return self.prefilling + len(self.decoding)

    def load(self) -> int:
        return self.used + len(self.queue)


class Histogram:
    """Cumulative bucket counts over ``BOUNDS_MS`` (the last bucket +Inf), like the gateway's."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BOUNDS_MS) + 1)

    def observe(self, ms: float) -> None:
        self.counts[bisect_left(BOUNDS_MS, ms)] += 1


def p90_of(before: Sequence[int], after: Sequence[int]) -> tuple[float | None, int]:
    """The p90 of the observations between two cumulative snapshots, and how many there were
    (linear in the bucket, as Prometheus' histogram_quantile; the +Inf bucket: its bound)."""
    delta = [a - b for a, b in zip(after, before, strict=True)]
    total = sum(delta)
    if total == 0:
        return None, 0
    rank = 0.9 * total
    seen = 0
    for i, n in enumerate(delta):
        if n and seen + n >= rank:
            low = BOUNDS_MS[i - 1] if i > 0 else 0.0
            high = BOUNDS_MS[i] if i < len(BOUNDS_MS) else BOUNDS_MS[-1]
            return low + (high - low) * (rank - seen) / n, total
        seen += n
    return BOUNDS_MS[-1], total


@dataclass(frozen=True, slots=True)
class View:
    """What a policy sees in a round: the gateway's window and the engines now."""

    now: float
    count: int
    ready: int
    coming: int
    ttft_p90_ms: float | None
    itl_p90_ms: float | None
    samples: int
    arrival_rps: float
    in_flight: int
    waiting: int
    engine_waiting: int
    engine_running: int
    batch: int


@dataclass(slots=True)
class Outcome:
    """One policy's replay."""

    requests: int = 0
    good: int = 0
    ttft_ok: int = 0
    itl_ok: int = 0
    refused: int = 0
    gpu_s: float = 0.0
    cold_starts: int = 0
    scale_events: int = 0
    peak_count: int = 0
    counts: list[tuple[float, int]] = field(default_factory=list)


Decide = Callable[[View], int]


_JOIN, _FINISH, _READY, _TICK = 0, 1, 2, 3


class Fleet:
    """One policy's replay of the trace over one deployment's replicas (module docstring):
    ``decide`` is called every ``interval_s`` with the round's :class:`View` and returns
    the count, which is acted on at once (new replicas serve after the cold start)."""

    def __init__(self, config: SimConfig, trace: Sequence[Request], decide: Decide,
                 interval_s: float, initial: int) -> None:  # fmt: skip
        self.config = config
        self.trace = trace
        self.decide = decide
        self.interval_s = interval_s
        self.replicas: list[Replica] = []
        self.count = 0
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.held: deque[_Live] = deque()
        self.arrivals = 0
        self.ttft = Histogram()
        self.itl = Histogram()
        self.snaps: deque[tuple[float, int, list[int], list[int]]] = deque()
        self.out = Outcome()
        for _ in range(initial):
            self.replicas.append(Replica(created=0.0, ready_at=0.0))
        self.count = initial

    def run(self) -> Outcome:
        self._push(self.interval_s, _TICK, None)
        trace, i, end = self.trace, 0, 0.0
        while i < len(trace) or self.events:
            arrival = trace[i].arrival if i < len(trace) else math.inf
            if self.events and self.events[0][0] <= arrival:
                t, _, kind, payload = heapq.heappop(self.events)
                self._handle(t, kind, payload)
            else:
                t = arrival
                self.arrivals += 1
                self._route(_Live(i), t)
                i += 1
            end = max(end, t)
        self._expire(math.inf)
        for r in self.replicas:
            self.out.gpu_s += (r.gone_at if r.gone_at is not None else end) - r.created
        return self.out

    def _push(self, t: float, kind: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def _handle(self, t: float, kind: int, payload: object) -> None:
        if kind == _JOIN:
            replica, live = cast(tuple[Replica, _Live], payload)
            self._join(replica, live, t)
        elif kind == _FINISH:
            replica, version = cast(tuple[Replica, int], payload)
            if version == replica.version:
                self._finish(replica, t)
        elif kind == _READY:
            self._release(t)
        elif kind == _TICK:
            self._tick(t)

    def _serving(self, t: float) -> list[Replica]:
        return [
            r for r in self.replicas if r.gone_at is None and not r.draining and r.ready_at <= t
        ]

    def _route(self, live: _Live, t: float) -> None:
        serving = self._serving(t)
        if not serving:
            self.held.append(live)
            return
        replica = min(serving, key=Replica.load)
        if replica.used < self.config.batch:
            self._admit(replica, live, t)
        else:
            replica.queue.append(live)

    def _admit(self, replica: Replica, live: _Live, t: float) -> None:
        c = self.config
        request = self.trace[live.index]
        share = replica.used / c.batch
        prefill_s = (
            (c.prefill_ms + c.prefill_ms_per_token * request.prompt) * (1 + share / 2) / 1000
        )
        replica.prefilling += 1
        self._push(t + prefill_s, _JOIN, (replica, live))

    def _step_ms(self, n: int) -> float:
        return self.config.step_ms + self.config.step_ms_per_seq * n

    def _advance(self, replica: Replica, t: float) -> None:
        n = len(replica.decoding)
        if n:
            replica.v += (t - replica.t) * 1000.0 / self._step_ms(n)
        replica.t = t

    def _reschedule(self, replica: Replica, t: float) -> None:
        replica.version += 1
        if replica.decoding:
            tokens = replica.decoding[0][0] - replica.v
            dt = max(tokens, 0.0) * self._step_ms(len(replica.decoding)) / 1000.0
            self._push(t + dt, _FINISH, (replica, replica.version))

    def _join(self, replica: Replica, live: _Live, t: float) -> None:
        replica.prefilling -= 1
        live.first = t
        self.ttft.observe((t - self.trace[live.index].arrival) * 1000.0)
        self._advance(replica, t)
        live.vfinish = replica.v + self.trace[live.index].output
        heapq.heappush(replica.decoding, (live.vfinish, live.index, live))
        self._reschedule(replica, t)

    def _finish(self, replica: Replica, t: float) -> None:
        self._advance(replica, t)
        c = self.config
        while replica.decoding and replica.decoding[0][0] <= replica.v + 1e-6:
            _, index, live = heapq.heappop(replica.decoding)
            request = self.trace[index]
            ttft_ms = (live.first - request.arrival) * 1000.0
            itl_ms = (t - live.first) * 1000.0 / request.output
            self.itl.observe(itl_ms)
            self._tally(ttft_ms <= c.ttft_target_ms, itl_ms <= c.itl_target_ms)
        self._reschedule(replica, t)
        while replica.queue and replica.used < c.batch:
            self._admit(replica, replica.queue.popleft(), t)
        if replica.draining and replica.used == 0:
            replica.gone_at = t

    def _tally(self, ttft_ok: bool, itl_ok: bool) -> None:
        out = self.out
        out.requests += 1
        out.ttft_ok += ttft_ok
        out.itl_ok += itl_ok
        out.good += ttft_ok and itl_ok

    def _release(self, t: float) -> None:
        self._expire(t)
        while self.held and self._serving(t):
            self._route(self.held.popleft(), t)

    def _expire(self, t: float) -> None:
        """Held requests past the hold limit are answered 503 (violations)."""
        while self.held and self.trace[self.held[0].index].arrival + self.config.hold_s <= t:
            self.held.popleft()
            self.out.refused += 1
            self._tally(False, False)

    def _tick(self, t: float) -> None:
        self._release(t)
        self.snaps.append((t, self.arrivals, list(self.ttft.counts), list(self.itl.counts)))
        while len(self.snaps) > 1 and self.snaps[1][0] <= t - self.config.window_s + 1e-9:
            self.snaps.popleft()
        self._scale(self.decide(self.view(t)), t)
        if t < self.config.day_s:
            self._push(t + self.interval_s, _TICK, None)

    def view(self, t: float) -> View:
        then, arrivals, ttft, itl = self.snaps[0]
        ttft_p90, samples = p90_of(ttft, self.ttft.counts)
        itl_p90, _ = p90_of(itl, self.itl.counts)
        live = [r for r in self.replicas if r.gone_at is None and not r.draining]
        serving = [r for r in live if r.ready_at <= t]
        return View(
            now=t, count=self.count, ready=len(serving), coming=len(live) - len(serving),
            ttft_p90_ms=ttft_p90, itl_p90_ms=itl_p90, samples=samples,
            arrival_rps=(self.arrivals - arrivals) / max(t - then, self.interval_s),
            in_flight=sum(r.load() for r in self.replicas if r.gone_at is None),
            waiting=len(self.held), engine_waiting=sum(len(r.queue) for r in serving),
            engine_running=sum(r.used for r in serving), batch=self.config.batch,
        )  # fmt: skip

    def _scale(self, desired: int, t: float) -> None:
        live = [r for r in self.replicas if r.gone_at is None and not r.draining]
        for _ in range(desired - len(live)):
            replica = Replica(created=t, ready_at=t + self.config.cold_start_s)
            self.replicas.append(replica)
            self.out.cold_starts += 1
            self._push(replica.ready_at, _READY, None)
        if desired < len(live):  # still loading first, then the least loaded
            order = sorted(live, key=lambda r: (r.ready_at <= t, r.load()))
            for replica in order[: len(live) - desired]:
                self._retire(replica, t)
        if desired != self.count:
            self.out.scale_events += 1
            self.count = desired
        self.out.peak_count = max(self.out.peak_count, desired)
        self.out.counts.append((t, desired))

    def _retire(self, replica: Replica, t: float) -> None:
        replica.draining = True
        queued, replica.queue = replica.queue, deque()
        if replica.used == 0:
            replica.gone_at = t
        for live in queued:
            self._route(live, t)
