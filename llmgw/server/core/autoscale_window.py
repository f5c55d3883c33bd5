"""The autoscaler's window: the gateways' cumulative reports → one deployment's figures.

Pure: the loop (``llmgw.server.autoscale_loop``) keeps, per gateway process, the reports it
took during the last ``window_s`` seconds (:func:`keep`) and asks :func:`measure` for a
deployment's figures over them. Each gateway reports counters cumulative since it started
(``ModelSignals``); the window's figures are differences between a gateway's newest report
and its oldest one kept, which is the newest one taken before the window began (its
baseline), so a window is covered whole once a gateway has reported for that long:

- **arrival rate**: each gateway's arrivals over the time between the two reports, summed
  over the gateways;
- **p90 of TTFT and ITL**: the bucket counts' differences, added over the gateways (a
  gateway whose bounds differ from the first one's is re-bucketed onto them: each bound
  counts what that gateway saw at or below its largest bound not above it, so a p90 is
  never read lower than measured), then the 90th percentile as Prometheus'
  ``histogram_quantile`` reads it: linear within the bucket it falls in, the largest finite
  bound when it falls in the +Inf bucket; None when nothing was observed;
- **in flight and waiting**: gauges, from each gateway's newest report, summed.

A gateway with a single report has no difference yet (it counts in the gauges only); a
counter lower than in the baseline (a reset the report's id did not show) gives no
difference for that model; a histogram whose length does not match its bounds is skipped.

A deployment's models are its served model name and its LoRA adapters' names: requests for
any of them are requests for its replicas. Two deployments serving the same model name
both see that model's figures whole.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from llmgw.api.llmgw.v1 import EngineProfile, ModelSignals, ReplicaRouterStats
from llmgw.server.core.profiles import CPU_CLASS

__all__ = [
    "P90",
    "EngineFigures",
    "GatewayReport",
    "WindowFigures",
    "deployment_models",
    "engine_figures",
    "gpus_per_replica",
    "keep",
    "measure",
    "quantile",
]

P90 = 0.9


@dataclass(frozen=True, slots=True)
class GatewayReport:
    """One gateway process's figures as the server took them at ``at`` (the loop's clock)."""

    gateway: str  # names the process: a restarted gateway is another one
    at: float
    bounds: tuple[float, ...]  # RouterReport.latency_bounds_ms
    models: Mapping[str, ModelSignals] = field(default_factory=dict)  # by model name


@dataclass(frozen=True, slots=True)
class WindowFigures:
    """One deployment's figures over the window, every gateway together."""

    ttft_p90_ms: float | None = None
    itl_p90_ms: float | None = None
    samples: int = 0  # requests answered (first byte) in the window
    arrivals: int = 0
    arrival_rps: float = 0.0
    in_flight: int = 0
    waiting: int = 0


@dataclass(frozen=True, slots=True)
class EngineFigures:
    """The engines' own figures over a deployment's READY replicas (None: none said)."""

    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None


def keep(
    history: Sequence[GatewayReport], report: GatewayReport, window_s: float
) -> tuple[GatewayReport, ...]:
    """``history`` (one gateway's, oldest first) with ``report`` added (unless it is the
    one taken last), less what the window no longer needs: reports older than
    ``report.at - window_s`` but the newest of them, the window's baseline."""
    kept = list(history)
    if not kept or report.at > kept[-1].at:
        kept.append(report)
    start = kept[-1].at - window_s
    while len(kept) > 1 and kept[1].at <= start:
        kept.pop(0)
    return tuple(kept)


def measure(
    histories: Mapping[str, Sequence[GatewayReport]], models: Collection[str]
) -> WindowFigures:
    """The figures of ``models`` over every gateway's kept reports (see the docstring)."""
    bounds: tuple[float, ...] | None = None
    ttft: list[int] = []
    itl: list[int] = []
    arrivals = in_flight = waiting = 0
    rate = 0.0
    for gateway in sorted(histories):
        history = histories[gateway]
        if not history:
            continue
        newest, base = history[-1], history[0]
        for model in models:
            now = newest.models.get(model)
            if now is None:
                continue
            in_flight += now.in_flight
            waiting += now.waiting
            before = (
                base.models.get(model, ModelSignals(model=model)) if base is not newest else None
            )
            if before is None or now.arrivals < before.arrivals:
                continue
            span = newest.at - base.at
            arrivals += now.arrivals - before.arrivals
            rate += (now.arrivals - before.arrivals) / span if span > 0 else 0.0
            if bounds is None:
                bounds = newest.bounds
            _add(
                ttft,
                _rebucket(
                    _delta(now.ttft_counts, before.ttft_counts, newest.bounds),
                    newest.bounds,
                    bounds,
                ),
            )
            _add(
                itl,
                _rebucket(
                    _delta(now.itl_counts, before.itl_counts, newest.bounds), newest.bounds, bounds
                ),
            )
    return WindowFigures(
        ttft_p90_ms=quantile(bounds or (), ttft, P90),
        itl_p90_ms=quantile(bounds or (), itl, P90),
        samples=ttft[-1] if ttft else 0,
        arrivals=arrivals,
        arrival_rps=rate,
        in_flight=in_flight,
        waiting=waiting,
    )


def _delta(now: Sequence[int], before: Sequence[int], bounds: Sequence[float]) -> list[int] | None:
    """The counts observed between two cumulative histograms; None when either is
    malformed or went back."""
    if len(now) != len(bounds) + 1:
        return None
    if not before:
        return list(now)
    if len(before) != len(now):
        return None
    delta = [a - b for a, b in zip(now, before, strict=True)]
    return delta if min(delta) >= 0 else None


def _rebucket(
    counts: list[int] | None, source: Sequence[float], target: Sequence[float]
) -> list[int] | None:
    """``counts`` over ``source`` bounds as counts over ``target`` bounds (see the docstring)."""
    if counts is None or tuple(source) == tuple(target):
        return counts
    out = []
    for bound in target:
        below = [i for i, b in enumerate(source) if b <= bound]
        out.append(counts[below[-1]] if below else 0)
    out.append(counts[-1])
    return out


def _add(total: list[int], counts: list[int] | None) -> None:
    if counts is None:
        return
    if not total:
        total.extend(counts)
        return
    for i, count in enumerate(counts):
        total[i] += count


def quantile(bounds: Sequence[float], counts: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile of a cumulative histogram (``counts[i]``: observations at or
    below ``bounds[i]``, the last one +Inf), as Prometheus' ``histogram_quantile``
    reads it; None when it holds nothing or does not match its bounds."""
    if len(counts) != len(bounds) + 1 or not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    i = next(i for i, count in enumerate(counts) if count >= rank)  # counts[-1] is
    count = counts[i]
    if i >= len(bounds):  # in +Inf: the largest finite bound
        return float(bounds[-1]) if bounds else None
    low, below = (bounds[i - 1], counts[i - 1]) if i > 0 else (0.0, 0)
    inside = count - below
    if inside <= 0:
        return float(bounds[i])
    return float(low + (bounds[i] - low) * (rank - below) / inside)


def engine_figures(rows: Iterable[ReplicaRouterStats], ready: Collection[str]) -> EngineFigures:
    """The engines' queues (summed) and KV cache usage (the mean) over the rows of the
    ``ready`` replicas that say them."""
    mine = [row for row in rows if row.replica_id in ready]
    waiting = [r.engine_waiting for r in mine if r.engine_waiting is not None]
    running = [r.engine_running for r in mine if r.engine_running is not None]
    usage = [r.kv_usage for r in mine if r.kv_usage is not None]
    return EngineFigures(
        waiting=sum(waiting) if waiting else None,
        running=sum(running) if running else None,
        kv_usage=sum(usage) / len(usage) if usage else None,
    )


def deployment_models(profile: EngineProfile) -> frozenset[str]:
    """The model names a deployment on ``profile`` answers: its served name, its adapters'."""
    names = {profile.served_model_name} | {a.name for a in profile.adapters}
    return frozenset(n for n in names if n)


def gpus_per_replica(profile: EngineProfile) -> int:
    """The GPUs one replica on ``profile`` holds (0 for a CPU profile)."""
    if profile.gpu_class == CPU_CLASS:
        return 0
    return max(1, profile.gpus_per_node) * max(1, profile.nodes)
