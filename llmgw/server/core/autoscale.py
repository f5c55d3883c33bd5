"""The autoscaler's planner: a deployment's window of signals and its state → a count.

Pure: no clock, no I/O. The server's autoscale loop (``llmgw.server.autoscale_loop``) builds
a :class:`Signals` window per deployment from the gateways' reports and the engines' polled
figures, calls :func:`plan` once per round with the :class:`Memory` it returned last time,
then ``share_budget`` (``llmgw.server.core.autoscale_budget``) over every deployment of a
pool with a GPU budget, and (mode "act") stores the count.

The rules, in the order they apply, are :func:`plan`'s docstring; ``bench autoscale``
(``bench/autoscale.py``) replays a day through them against static counts and an HPA-like
rule (BENCHMARKS.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from llmgw.api.llmgw.v1 import AutoscalePolicy

__all__ = [
    "ACT", "ADVISE", "Claim", "Current", "Decision", "Memory", "Policy", "Signals", "Tuning",
    "plan",
]  # fmt: skip

ACT = "act"
ADVISE = "advise"


@dataclass(frozen=True, slots=True)
class Policy:
    """``[deployments.NAME.autoscale]`` as checked (targets 0.0: none)."""

    min: int
    max: int
    ttft_p90_ms: float = 0.0
    itl_p90_ms: float = 0.0
    scale_down_after_s: float = 300.0
    mode: str = ACT

    @classmethod
    def from_proto(cls, policy: AutoscalePolicy) -> Policy:
        return cls(
            min=policy.min,
            max=policy.max,
            ttft_p90_ms=float(policy.ttft_p90_ms),
            itl_p90_ms=float(policy.itl_p90_ms),
            scale_down_after_s=float(policy.scale_down_after_s),
            mode=policy.mode or ACT,
        )


@dataclass(frozen=True, slots=True)
class Signals:
    """One deployment's window (the last ``Tuning.window_s`` seconds), every gateway's
    figures added up; None where nothing was measured in the window."""

    ttft_p90_ms: float | None = None
    itl_p90_ms: float | None = None
    samples: int = 0  # requests answered in the window: what the percentiles stand on
    arrival_rps: float = 0.0  # requests that arrived per second over the window
    in_flight: int = 0  # upstream now, every gateway together
    waiting: int = 0  # held now by gateways for a READY replica (scale from zero)
    engine_waiting: int | None = None  # the engines' queues, summed over READY replicas
    engine_running: int | None = None
    kv_usage: float | None = None  # mean over READY replicas, 0..1


@dataclass(frozen=True, slots=True)
class Current:
    """The deployment as it is now."""

    count: int  # Deployment.replicas: the count the reconciler works toward
    ready: int  # live replicas all READY
    coming: int  # live replicas placed but not READY yet (PENDING, STARTING, LOADING)
    gpus_per_replica: int  # 0 for a CPU profile
    pool: str = ""
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Memory:
    """What the planner carries from one round to the next for one deployment (kept by the
    loop in memory; a restarted server starts from ``Memory()``)."""

    low_since: float | None = None  # the window has been below target since (loop clock, s)
    idle_since: float | None = None  # no arrivals and nothing in flight since
    last_change: float | None = None  # when the planner last changed the count
    capacity_rps: float | None = None  # learned requests/s one replica serves at target
    extra: Mapping[str, float] = field(default_factory=dict)  # the planner's own


@dataclass(frozen=True, slots=True)
class Tuning:
    """The planner's constants (tests and the benchmark may change them)."""

    window_s: float = 30.0
    max_step_up: int = 4  # replicas added in one decision at most
    max_step_down: int = 4  # replicas removed in one decision at most
    min_samples: int = 5  # fewer answered requests in the window: the percentiles say nothing
    down_ratio: float = 0.6  # "below target": the window's TTFT p90 at most this share of target
    up_util: float = 1.0  # plan replicas to carry at most this share of the learned capacity
    queue_per_replica: float = 1.0  # engines' waiting requests per READY replica: over target
    settle_s: float = 15.0  # after the last change came READY, the window's p90s are stale
    busy_util: float = 0.75  # plan replicas to have at most this share of their slots busy
    max_ratio: float = 2.0  # a p90 over target at most doubles the count
    down_util: float = 0.65  # a replica goes only if the rest would have this share busy
    lead_s: float = 60.0  # a change's time to READY until one was seen
    max_growth: float = 1.0  # growing, the arrivals' trend adds up to this factor (1: off)
    trend_smoothing: float = 0.1  # how far one round moves the arrivals' smoothed slope
    smoothing: float = 1.0  # how far one round moves the smoothed requests on hand (1: none)


@dataclass(frozen=True, slots=True)
class Decision:
    """The planner's count for one deployment, why (one word and in words), and on what."""

    desired: int
    reason: str  # scale_up, scale_down, hold, from_zero, to_zero, budget, pending, no_signal
    message: str
    signal: str  # e.g. "ttft_p90_ms=1240"
    memory: Memory


@dataclass(frozen=True, slots=True)
class Claim:
    """One deployment's decision as the pool's GPU budget weighs it."""

    decision: Decision
    current: Current
    policy: Policy


def plan(
    policy: Policy,
    signals: Signals,
    current: Current,
    memory: Memory,
    now: float,
    tuning: Tuning = Tuning(),
) -> Decision:
    """The count ``policy`` wants now, always within ``[policy.min, policy.max]``.

    The rules, in order: a count outside ``[min, max]`` is brought inside at once; from
    zero, a replica starts as soon as anything waits or arrives; while replicas are coming
    (placed but not READY) they count as capacity on its way, not asked for again: the
    count goes up only where the load (the arrivals past the learned capacity, the requests
    on hand past ``tuning.busy_util`` of the slots) needs more than the count with them, and
    nothing else changes; above target the count goes up at once, by up to
    ``tuning.max_step_up``, to the most that any of these asks: a p90 over its target (× its
    excess, at most ``tuning.max_ratio``; not while the window still holds the time before
    the last change came READY), the engines queueing more than ``tuning.queue_per_replica``
    per READY replica (one more), the requests on hand (smoothed by ``tuning.smoothing``)
    over ``tuning.busy_util`` of the replicas' slots (an engine's slots are learned from
    the running count whenever the engines queue, ``tuning.settle_s`` after a change came
    READY), arrivals past the learned capacity (``Memory.capacity_rps``). Below target
    (TTFT p90 at most ``tuning.down_ratio`` of its target, ITL p90 meeting its target on
    one replica fewer, the requests on hand within ``tuning.down_util`` of one replica
    fewer's slots, none held) for ``policy.scale_down_after_s``, it goes down, by up to
    ``tuning.max_step_down``, to the fewest replicas whose slots hold the most on hand of
    about the last ``scale_down_after_s`` within ``tuning.down_util`` (one step where the
    slots are unknown), then again each window while it stays below; to zero only when
    ``min`` is 0 and nothing arrived or ran for ``scale_down_after_s``.
    """
    memory = _observe(policy, signals, current, memory, now, tuning)
    count = current.count
    if count < policy.min or count > policy.max:
        desired = min(max(count, policy.min), policy.max)
        reason = "scale_up" if desired > count else "scale_down"
        message = f"count {count} outside [min {policy.min}, max {policy.max}]"
        return _change(desired, reason, message, f"replicas={count}", memory, now)
    if count == 0:
        return _from_zero(policy, signals, memory, now, tuning)
    if current.ready < count:  # a change on its way is not asked for again
        load = _load_pressure(signals, current, memory, tuning)
        if load is not None:
            return _scale_up(policy, current, memory, now, tuning, load)
        if current.coming > 0:
            message = f"{current.coming} replica(s) of {count} still coming; their load is met"
            return _hold(count, "pending", message, _signal(policy, signals), memory)
    pressure = _pressure(policy, signals, current, memory, now, tuning)
    if pressure is not None and current.ready < count:
        message = f"{pressure.message}; {count - current.ready} of {count} not placed yet"
        return _hold(count, "pending", message, pressure.signal, memory)
    if pressure is not None:
        return _scale_up(policy, current, memory, now, tuning, pressure)
    return _scale_down_or_hold(policy, signals, current, memory, now, tuning)


@dataclass(frozen=True, slots=True)
class _Pressure:
    """Why the deployment is over target, and how many replicas that asks for."""

    wants: int
    message: str
    signal: str


def _observe(
    policy: Policy,
    signals: Signals,
    current: Current,
    memory: Memory,
    now: float,
    tuning: Tuning,
) -> Memory:
    """``memory`` with this round's window taken in: idle since, settled since, capacity."""
    idle = signals.arrival_rps <= 0.0 and signals.in_flight == 0 and signals.waiting == 0
    idle_since = (memory.idle_since if memory.idle_since is not None else now) if idle else None
    extra = dict(memory.extra)
    if current.coming > 0:
        extra.pop("settled_at", None)
        extra["coming"] = 1.0
    elif extra.pop("coming", None) is not None:
        extra["settled_at"] = now
        if memory.last_change is not None:  # how long a change takes to come READY
            extra["lead"] = now - memory.last_change
    _trend(extra, signals, now, tuning)
    memory = replace(memory, idle_since=idle_since, extra=extra)
    slots = _slots(signals, current)
    if slots is not None and _settled_for(memory, now) >= tuning.settle_s:
        extra["slots"] = slots  # not while the queues are still on the replicas of before
    smooth = extra.get("busy")
    busy = float(_busy(signals))
    extra["busy"] = busy if smooth is None else smooth + (busy - smooth) * tuning.smoothing
    _peak(extra, extra["busy"], now, policy.scale_down_after_s / 2.0)
    if _settled_for(memory, now) >= tuning.window_s:  # the window is all of the count now
        memory = replace(memory, capacity_rps=_learn(policy, signals, current, memory, tuning))
    return memory


def _settled_for(memory: Memory, now: float) -> float:
    """Seconds since the last change came READY (infinite when none was seen coming)."""
    settled_at = memory.extra.get("settled_at")
    return math.inf if settled_at is None else now - settled_at


def _trend(extra: dict[str, float], signals: Signals, now: float, tuning: Tuning) -> None:
    """The arrivals' slope (req/s per s, smoothed over rounds) into ``extra``."""
    then, rps = extra.get("rps_at"), extra.get("rps")
    if then is not None and rps is not None and now > then:
        slope = (signals.arrival_rps - rps) / (now - then)
        trend = extra.get("trend", 0.0)
        extra["trend"] = trend + (slope - trend) * tuning.trend_smoothing
    extra["rps_at"], extra["rps"] = now, signals.arrival_rps


def _slots(signals: Signals, current: Current) -> float | None:
    """Requests one READY replica runs at once when full, seen when the engines queue
    (an engine queues only when its batch or its KV cache is full; the gateway sends a
    request to a full one only when every one is full)."""
    running, queued = signals.engine_running, signals.engine_waiting
    if running is None or not queued or current.ready == 0 or current.ready != current.count:
        return None
    return running / current.ready


def _busy(signals: Signals) -> int:
    """Requests the deployment has on hand now: upstream (running or queued in the engines)
    and held by the gateways."""
    engines = (signals.engine_running or 0) + (signals.engine_waiting or 0)
    return max(signals.in_flight, engines) + signals.waiting


def _needed_busy(memory: Memory, tuning: Tuning, ahead: bool = False) -> int | None:
    """Replicas for what is on hand (smoothed over rounds) at ``tuning.busy_util`` of the
    learned slots."""
    slots = memory.extra.get("slots")
    busy = memory.extra.get("busy")
    if slots is None or slots <= 0.0 or busy is None:
        return None
    growth = _growth(memory, tuning) if ahead else 1.0
    return math.ceil(busy * growth / (slots * tuning.busy_util) - 1e-9)


def _growth(memory: Memory, tuning: Tuning) -> float:
    """How much the arrivals will have grown by the time a replica started now is READY
    (their trend over the learned start-up time; 1 when falling or unknown)."""
    rps, trend = memory.extra.get("rps", 0.0), memory.extra.get("trend", 0.0)
    if rps <= 0.0 or trend <= 0.0:
        return 1.0
    lead = memory.extra.get("lead", tuning.lead_s)
    return min(1.0 + trend * lead / rps, tuning.max_growth)


def _learn(
    policy: Policy,
    signals: Signals,
    current: Current,
    memory: Memory,
    tuning: Tuning,
) -> float | None:
    """The requests/s at which one READY replica breaks its target, learned from windows
    where every replica was READY all along: one over target at ``x`` rps per replica says it
    is at most ``x`` only while the replicas are full now (the engines or the gateways queue,
    where the engines report: a window that still holds a burst's slow answers after the
    arrivals fell says nothing of what a replica carries); one within target at ``x`` above
    what was learned says it is at least ``x``. Unknown until a window went over target
    (then the planner plans ahead of it, at ``tuning.up_util`` of it)."""
    capacity = memory.capacity_rps
    ratio = _ratio(policy, signals, tuning)
    steady = current.ready == current.count > 0 and current.coming == 0
    if ratio is None or not steady or signals.arrival_rps <= 0.0:
        return capacity
    per_replica = signals.arrival_rps / current.ready
    if ratio[0] > 1.0:
        if signals.engine_waiting is not None and not (signals.waiting or signals.engine_waiting):
            return capacity
        return per_replica if capacity is None else min(capacity, per_replica)
    if capacity is not None and per_replica > capacity:
        return per_replica
    return capacity


def _ratio(policy: Policy, signals: Signals, tuning: Tuning) -> tuple[float, str] | None:
    """The worst p90 as a share of its target, and the signal it is (None: too few samples,
    or no target measured)."""
    if signals.samples < tuning.min_samples:
        return None
    found = [
        (value / target, f"{name}={value:.0f}")
        for name, value, target in (
            ("ttft_p90_ms", signals.ttft_p90_ms, policy.ttft_p90_ms),
            ("itl_p90_ms", signals.itl_p90_ms, policy.itl_p90_ms),
        )
        if value is not None and target > 0.0
    ]
    return max(found) if found else None


def _needed(signals: Signals, capacity: float | None, tuning: Tuning) -> int | None:
    """Replicas the window's arrivals need at ``tuning.up_util`` of the learned capacity."""
    if capacity is None or capacity <= 0.0:
        return None
    return math.ceil(signals.arrival_rps / (capacity * tuning.up_util) - 1e-9)


def _pressure(
    policy: Policy,
    signals: Signals,
    current: Current,
    memory: Memory,
    now: float,
    tuning: Tuning,
) -> _Pressure | None:
    """Why the deployment should grow now, or None when nothing says so."""
    count = current.count
    found: list[_Pressure] = []
    fresh = _settled_for(memory, now) >= tuning.settle_s
    ratio = _ratio(policy, signals, tuning)
    if ratio is not None and ratio[0] > 1.0 and fresh:  # a p90's excess says little of how
        wants = math.ceil(count * min(ratio[0], tuning.max_ratio) - 1e-9)  # many more
        message = f"{_words(ratio[1])} over target {_target(policy, ratio[1])} on {count}"
        found.append(_Pressure(wants, message, ratio[1]))
    queued = signals.engine_waiting or 0
    if queued > tuning.queue_per_replica * max(current.ready, 1):
        message = f"engines queue {queued} requests on {current.ready} READY"
        found.append(_Pressure(count + 1, message, f"engine_waiting={queued}"))
    found += _load_needs(signals, count, memory, tuning)
    if not found:
        return None
    top = max(found, key=lambda p: p.wants)  # growing anyway: for what comes meanwhile too
    ahead = _needed_busy(memory, tuning, ahead=True) or 0
    return replace(top, wants=max(top.wants, count + 1, ahead))


def _load_needs(signals: Signals, count: int, memory: Memory, tuning: Tuning) -> list[_Pressure]:
    """What the load asks of ``count`` replicas (coming ones included): the arrivals past
    the learned capacity, the requests on hand past ``tuning.busy_util`` of the slots."""
    found: list[_Pressure] = []
    needed = _needed(signals, memory.capacity_rps, tuning)
    if needed is not None and needed > count:
        message = f"{signals.arrival_rps:.2f} req/s > {count} × {memory.capacity_rps:.2f} learned"
        found.append(_Pressure(needed, message, f"arrival_rps={signals.arrival_rps:.2f}"))
    busy = _needed_busy(memory, tuning)
    if busy is not None and busy > count:
        slots, on_hand = memory.extra["slots"], memory.extra["busy"]
        message = f"{on_hand:.0f} on hand > {tuning.busy_util:.0%} of {count} × {slots:.0f} slots"
        found.append(_Pressure(busy, message, f"in_flight={on_hand:.0f}"))
    return found


def _load_pressure(
    signals: Signals, current: Current, memory: Memory, tuning: Tuning
) -> _Pressure | None:
    """While replicas are on their way: a scale-up only where the load needs more than the
    count that already includes them (a p90 over target, or the engines queueing, is what
    the coming ones are for, and is not asked for again)."""
    found = _load_needs(signals, current.count, memory, tuning)
    if not found:
        return None
    top = max(found, key=lambda p: p.wants)
    message = f"{top.message}, {current.count - current.ready} of them not READY yet"
    return replace(top, message=message)


def _scale_up(
    policy: Policy,
    current: Current,
    memory: Memory,
    now: float,
    tuning: Tuning,
    pressure: _Pressure,
) -> Decision:
    count = current.count
    desired = min(pressure.wants, count + tuning.max_step_up, policy.max)
    memory = replace(memory, low_since=None)
    if desired <= count:
        message = f"{pressure.message}; at max {policy.max}"
        return _hold(count, "hold", message, pressure.signal, memory)
    message = f"{pressure.message}"
    return _change(desired, "scale_up", message, pressure.signal, memory, now)


def _is_low(
    policy: Policy,
    signals: Signals,
    current: Current,
    memory: Memory,
    tuning: Tuning,
) -> bool:
    """Below target with room to spare: a replica fewer would still meet the targets."""
    if memory.idle_since is not None:
        return True
    if signals.waiting > 0:
        return False
    fewer = current.count - 1
    slots = memory.extra.get("slots")
    if slots is not None:  # what is on hand fits on fewer replicas' slots
        fits = memory.extra.get("busy", 0.0) <= slots * fewer * tuning.down_util
    else:
        fits = not signals.engine_waiting
    if signals.samples < tuning.min_samples:  # too few answered to say: light, unless much
        return fits and signals.in_flight <= current.ready  # is upstream
    return fits and _below(policy, signals, current.count, tuning.down_ratio)


def _below(policy: Policy, signals: Signals, count: int, down_ratio: float = 0.6) -> bool:
    """The window's p90s would meet their targets on one replica fewer. TTFT stays near
    the prefill's time until the engines fill up, then climbs steeply: it must be at most
    ``down_ratio`` of its target (the engines' fill is checked apart). ITL grows with the
    batch, at most in proportion: its p90 × count / (count − 1) must meet its target."""
    if policy.ttft_p90_ms > 0.0 and signals.ttft_p90_ms is not None:
        if signals.ttft_p90_ms > policy.ttft_p90_ms * down_ratio:
            return False
    if policy.itl_p90_ms > 0.0 and signals.itl_p90_ms is not None and count > 1:
        if signals.itl_p90_ms * count / (count - 1) > policy.itl_p90_ms:
            return False
    return True


def _scale_down_or_hold(
    policy: Policy,
    signals: Signals,
    current: Current,
    memory: Memory,
    now: float,
    tuning: Tuning,
) -> Decision:
    count = current.count
    signal = _signal(policy, signals)
    if not _is_low(policy, signals, current, memory, tuning):
        return _hold(
            count, "hold", f"within target on {count}", signal, replace(memory, low_since=None)
        )
    low_since = memory.low_since if memory.low_since is not None else now
    memory = replace(memory, low_since=low_since)
    idle_for = now - memory.idle_since if memory.idle_since is not None else 0.0
    floor = policy.min if idle_for >= policy.scale_down_after_s else max(policy.min, 1)
    needed = _needed(signals, memory.capacity_rps, tuning) or 0
    fewest = _fewest(policy, signals, count, memory, tuning)
    desired = max(count - tuning.max_step_down, floor, needed, fewest)
    low_for = now - low_since
    since_change = now - memory.last_change if memory.last_change is not None else math.inf
    if desired >= count:
        return _hold(count, "hold", f"below target on {count}; at its floor", signal, memory)
    if low_for < policy.scale_down_after_s or since_change < tuning.window_s:
        message = f"below target for {low_for:.0f} s of {policy.scale_down_after_s:.0f} s"
        return _hold(count, "hold", message, signal, memory)
    if desired == 0:
        message = f"idle for {idle_for:.0f} s"
        return _change(0, "to_zero", message, f"idle_s={idle_for:.0f}", memory, now)
    message = f"below target for {low_for:.0f} s"
    return _change(desired, "scale_down", message, signal, memory, now)


def _peak(extra: dict[str, float], busy: float, now: float, span: float) -> None:
    """The most on hand (smoothed) over the last ``span`` to ``2 × span`` seconds into
    ``extra["peak"]``: the maxima of this ``span``-long bucket and the one before."""
    bucket = math.floor(now / span) if span > 0.0 else now
    last = extra.get("peak_bucket")
    if last != bucket:
        extra["peak_before"] = extra.get("peak_now", 0.0) if last == bucket - 1 else 0.0
        extra["peak_now"], extra["peak_bucket"] = 0.0, bucket
    extra["peak_now"] = max(extra["peak_now"], busy)
    extra["peak"] = max(extra["peak_now"], extra["peak_before"])


def _fewest(policy: Policy, signals: Signals, count: int, memory: Memory, tuning: Tuning) -> int:
    """The fewest replicas a step down may leave: the most on hand over the last
    ``policy.scale_down_after_s`` (about: :func:`_peak`) within ``tuning.down_util`` of
    their slots, the ITL p90 scaled up with the batch within its target (one replica fewer
    where the slots are not known yet)."""
    slots = memory.extra.get("slots")
    if slots is None or slots <= 0.0:
        return count - 1
    fewest = math.ceil(memory.extra.get("peak", 0.0) / (slots * tuning.down_util) - 1e-9)
    if policy.itl_p90_ms > 0.0 and signals.itl_p90_ms is not None:
        fewest = max(fewest, math.ceil(count * signals.itl_p90_ms / policy.itl_p90_ms - 1e-9))
    return fewest


def _from_zero(
    policy: Policy,
    signals: Signals,
    memory: Memory,
    now: float,
    tuning: Tuning,
) -> Decision:
    if signals.waiting <= 0 and signals.arrival_rps <= 0.0 and signals.in_flight == 0:
        return _hold(0, "hold", "idle at zero", "waiting=0", memory)
    wants = max(1, policy.min, _needed(signals, memory.capacity_rps, tuning) or 0)
    desired = min(wants, tuning.max_step_up, policy.max)
    message = f"{signals.waiting} waiting, {signals.arrival_rps:.2f} req/s at zero"
    return _change(desired, "from_zero", message, f"waiting={signals.waiting}", memory, now)


def _signal(policy: Policy, signals: Signals) -> str:
    """The signal a hold stood on: the first target's p90, or the arrivals."""
    if policy.ttft_p90_ms > 0.0 and signals.ttft_p90_ms is not None:
        return f"ttft_p90_ms={signals.ttft_p90_ms:.0f}"
    if policy.itl_p90_ms > 0.0 and signals.itl_p90_ms is not None:
        return f"itl_p90_ms={signals.itl_p90_ms:.0f}"
    return f"arrival_rps={signals.arrival_rps:.2f}"


def _words(signal: str) -> str:
    """``ttft_p90_ms=1240`` → ``ttft p90 1240 ms``."""
    name, _, value = signal.partition("=")
    return f"{name.split('_')[0]} p90 {value} ms"


def _target(policy: Policy, signal: str) -> str:
    target = policy.ttft_p90_ms if signal.startswith("ttft") else policy.itl_p90_ms
    return f"{target:.0f} ms"


def _hold(count: int, reason: str, message: str, signal: str, memory: Memory) -> Decision:
    return Decision(desired=count, reason=reason, message=message, signal=signal, memory=memory)


def _change(
    desired: int, reason: str, message: str, signal: str, memory: Memory, now: float
) -> Decision:
    memory = replace(memory, last_change=now)
    if reason != "scale_down":
        memory = replace(memory, low_since=None)
    return Decision(desired=desired, reason=reason, message=message, signal=signal, memory=memory)
