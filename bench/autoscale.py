#!/usr/bin/env python3
"""Benchmark: the autoscaler's planner against static counts and an HPA-like rule.

A replay in simulated time (no processes; figures depend on the seed only) of a day-shaped
trace with bursts over one deployment's replicas (one GPU each), the same trace and the
same engines for four policies measured in the same run (the trace, the engine and the
gateway are described in ``bench.autoscale_sim``):

* **static at peak**: the count that carries the trace's busiest minute at 80 % of a
  replica's full-batch throughput (``replica_capacity_rps``), all day;
* **static at mean**: the same for the day's mean rate;
* **HPA-like**: Kubernetes' HorizontalPodAutoscaler algorithm on a per-replica
  utilisation of (running + waiting) / batch, averaged over READY replicas, target 70 %,
  its defaults: a 15 s sync, 10 % tolerance, no stabilisation up and 300 s down (the
  highest recommendation of the last 300 s), at most max(100 %, 4 replicas) more per
  sync, replicas not READY yet counted as 0 % for a scale up;
* **planner**: ``llmgw.server.core.autoscale.plan`` then ``share_budget``, called as the
  server's autoscale loop calls them (every 5 s, a 30 s window of the gateway's
  cumulative histograms differenced, the engines' queues of READY replicas, its own
  ``Memory`` carried), with the deployment's policy (min 1, max 24, ttft_p90_ms and
  itl_p90_ms the SLO's targets, scale_down_after_s 300) and ``PLANNER_TUNING``;
* **oracle** (a bound, not a policy anyone can run): it reads the trace generator's true
  rate over the next ``ORACLE_LEAD_S`` seconds and keeps the replicas that rate needs by
  square-root staffing (slots for the offered load R = rate × a full batch's time per
  request, plus ``beta`` × √R), every 5 s; twice, at ``ORACLE_BETAS``. It shows what this
  engine model leaves to be won over HPA by anyone who could see the future.

Reported per policy: GPU-hours (from placement, cold starts included, until a retired
replica's batch has finished), SLO attainment (the share of requests whose TTFT and ITL
both meet the targets; a request answered 503 after its hold is a violation), goodput
per GPU-hour (requests meeting the SLO / GPU-hours), cold starts, scale events (changes
of the count), the most replicas, and the ratios of goodput per GPU-hour against static
at peak and HPA, and of SLO violations against HPA.

    .venv/bin/python -m bench.autoscale             # the day (24 h simulated)
    .venv/bin/python -m bench.autoscale --markdown  # also a BENCHMARKS.md section
    .venv/bin/python -m bench.autoscale --quick     # a short day, for a look
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from bench.autoscale_sim import (
    Decide,
    Fleet,
    Outcome,
    Request,
    SimConfig,
    View,
    make_bursts,
    make_trace,
    rate_at,
    replica_capacity_rps,
)
from llmgw.server.core.autoscale import (
    Claim,
    Current,
    Memory,
    Policy,
    Signals,
    Tuning,
    plan,
)
from llmgw.server.core.autoscale_budget import share_budget

PLANNER_TUNING = Tuning()
MIN_REPLICAS = 1
MAX_REPLICAS = 24
DEFAULT_SEED = 16
ORACLE_LEAD_S = 60.0  # the cold start (40 s) and a round's margin
ORACLE_BETAS = (1.5, 1.0)


def quick(config: SimConfig) -> SimConfig:
    """A 2 h day with 2 bursts (a look, and the test)."""
    return replace(config, day_s=7_200.0, peak_rps=6.0, bursts=2)


class Hpa:
    """Kubernetes' HPA algorithm (module docstring) as a policy."""

    def __init__(self, target: float = 0.7, tolerance: float = 0.1, down_s: float = 300.0):
        self.target = target
        self.tolerance = tolerance
        self.down_s = down_s
        self.recommendations: deque[tuple[float, int]] = deque()

    def __call__(self, view: View) -> int:
        rec = self._recommend(view)
        self.recommendations.append((view.now, rec))
        while self.recommendations[0][0] < view.now - self.down_s:
            self.recommendations.popleft()
        if rec < view.count:  # scale-down stabilisation: the highest of the window
            rec = min(view.count, max(r for _, r in self.recommendations))
        rec = min(rec, max(2 * view.count, view.count + 4))
        return min(max(rec, MIN_REPLICAS), MAX_REPLICAS)

    def _recommend(self, view: View) -> int:
        if view.ready == 0:
            return view.count
        usage = (view.engine_running + view.engine_waiting) / view.batch
        ratio = usage / view.ready / self.target
        if abs(ratio - 1.0) <= self.tolerance:
            return view.count
        if ratio > 1.0 and view.coming:  # not READY yet: 0 % for a scale up
            ratio = usage / (view.ready + view.coming) / self.target
            if ratio <= 1.0:
                return view.count
        return math.ceil(ratio * (view.ready + (view.coming if ratio > 1.0 else 0)))


class Oracle:
    """The future-reading bound (module docstring) as a policy."""

    def __init__(self, config: SimConfig, beta: float) -> None:
        self.config = config
        self.beta = beta
        self.bursts = make_bursts(config)
        self.seconds_per_slot = config.batch / replica_capacity_rps(config)

    def __call__(self, view: View) -> int:
        steps = range(0, int(ORACLE_LEAD_S) + 1, 5)
        rate = max(rate_at(self.config, view.now + s, self.bursts) for s in steps)
        load = rate * self.seconds_per_slot
        slots = load + self.beta * math.sqrt(load)
        return min(max(math.ceil(slots / self.config.batch), MIN_REPLICAS), MAX_REPLICAS)


class Planner:
    """The planner as the server's autoscale loop calls it (module docstring)."""

    def __init__(self, config: SimConfig, tuning: Tuning = PLANNER_TUNING) -> None:
        self.policy = Policy(
            min=MIN_REPLICAS, max=MAX_REPLICAS, ttft_p90_ms=config.ttft_target_ms,
            itl_p90_ms=config.itl_target_ms, scale_down_after_s=300.0,
        )  # fmt: skip
        self.tuning = replace(tuning, window_s=config.window_s)
        self.memory = Memory()
        self.reasons: Counter[str] = Counter()

    def __call__(self, view: View) -> int:
        signals = Signals(
            ttft_p90_ms=view.ttft_p90_ms, itl_p90_ms=view.itl_p90_ms, samples=view.samples,
            arrival_rps=view.arrival_rps, in_flight=view.in_flight, waiting=view.waiting,
            engine_waiting=view.engine_waiting, engine_running=view.engine_running,
        )  # fmt: skip
        current = Current(count=view.count, ready=view.ready, coming=view.coming,
                          gpus_per_replica=1, pool="bench")  # fmt: skip
        decision = plan(self.policy, signals, current, self.memory, view.now, self.tuning)
        decision = share_budget({"chat": Claim(decision, current, self.policy)}, {})["chat"]
        self.memory = decision.memory
        if decision.desired != view.count:
            self.reasons[f"{decision.reason} on {decision.signal.partition('=')[0]}"] += 1
        return decision.desired


@dataclass(frozen=True, slots=True)
class Row:
    """One policy's figures."""

    policy: str
    replicas: str
    gpu_hours: float
    requests: int
    slo: float
    ttft_ok: float
    itl_ok: float
    refused: int
    goodput_per_gpu_hour: float
    cold_starts: int
    scale_events: int
    peak_count: int


@dataclass(frozen=True, slots=True)
class Facts:
    requests: int
    mean_rps: float
    peak_minute_rps: float
    capacity_rps: float
    static_peak: int
    static_mean: int


def trace_facts(config: SimConfig, trace: Sequence[Request]) -> Facts:
    minutes = Counter(int(r.arrival // 60.0) for r in trace)
    peak = max(minutes.values()) / 60.0
    mean = len(trace) / config.day_s
    capacity = replica_capacity_rps(config)
    return Facts(
        requests=len(trace), mean_rps=mean, peak_minute_rps=peak, capacity_rps=capacity,
        static_peak=math.ceil(peak / (0.8 * capacity)),
        static_mean=math.ceil(mean / (0.8 * capacity)),
    )  # fmt: skip


def _row(name: str, replicas: str, out: Outcome) -> Row:
    gpu_hours = out.gpu_s / 3600.0
    return Row(
        policy=name, replicas=replicas, gpu_hours=gpu_hours, requests=out.requests,
        slo=out.good / out.requests, ttft_ok=out.ttft_ok / out.requests,
        itl_ok=out.itl_ok / out.requests, refused=out.refused,
        goodput_per_gpu_hour=out.good / gpu_hours, cold_starts=out.cold_starts,
        scale_events=out.scale_events, peak_count=out.peak_count,
    )  # fmt: skip


def run_bench(config: SimConfig) -> tuple[Facts, list[Row], Counter[str]]:
    """Every policy over the same trace; the planner's decisions by reason."""
    trace = make_trace(config)
    facts = trace_facts(config, trace)
    planner = Planner(config)
    start = max(MIN_REPLICAS, math.ceil(config.base_rps / (0.8 * facts.capacity_rps)))
    peak, mean = facts.static_peak, facts.static_mean
    runs: list[tuple[str, str, Decide, float, int]] = [
        ("static at peak", str(peak), lambda v: peak, 15.0, peak),
        ("static at mean", str(mean), lambda v: mean, 15.0, mean),
        ("HPA-like", f"{MIN_REPLICAS}-{MAX_REPLICAS}", Hpa(), 15.0, start),
        ("planner", f"{MIN_REPLICAS}-{MAX_REPLICAS}", planner, 5.0, start),
    ]  # fmt: skip
    runs += [
        (f"oracle, beta {beta}", f"{MIN_REPLICAS}-{MAX_REPLICAS}", Oracle(config, beta), 5.0, start)
        for beta in ORACLE_BETAS
    ]
    rows = [
        _row(name, replicas, Fleet(config, trace, decide, interval, initial).run())
        for name, replicas, decide, interval, initial in runs
    ]
    return facts, rows, planner.reasons


def _ratios(rows: Sequence[Row], policy: str = "planner") -> dict[str, float]:
    by = {r.policy: r for r in rows}
    ours, peak, hpa = by[policy], by["static at peak"], by["HPA-like"]
    violations = (1.0 - ours.slo) * ours.requests
    hpa_violations = (1.0 - hpa.slo) * hpa.requests
    return {
        "goodput_vs_static_peak": ours.goodput_per_gpu_hour / peak.goodput_per_gpu_hour,
        "goodput_vs_hpa": ours.goodput_per_gpu_hour / hpa.goodput_per_gpu_hour,
        "violations_vs_hpa": violations / hpa_violations if hpa_violations else math.inf,
    }


def _compared(row: Row) -> bool:
    """A row whose ratios against static at peak and HPA are reported."""
    return row.policy.startswith(("planner", "oracle"))


def _ratio_line(rows: Sequence[Row], policy: str) -> str:
    ratios = _ratios(rows, policy)
    return (
        f"{policy}: goodput/GPU-h {ratios['goodput_vs_static_peak']:.2f}x static at peak, "
        f"{ratios['goodput_vs_hpa']:.2f}x HPA-like; SLO violations "
        f"{ratios['violations_vs_hpa']:.2f}x HPA-like's"
    )


def render(config: SimConfig, facts: Facts, rows: Sequence[Row], reasons: Counter[str]) -> str:
    lines = [
        f"trace: {facts.requests} requests over {config.day_s / 3600:.1f} h (seed {config.seed}), "
        f"mean {facts.mean_rps:.2f} req/s, busiest minute {facts.peak_minute_rps:.2f} req/s; "
        f"a replica carries {facts.capacity_rps:.2f} req/s with its batch of {config.batch} full; "
        f"cold start {config.cold_start_s:.0f} s; SLO TTFT <= {config.ttft_target_ms:.0f} ms "
        f"and ITL <= {config.itl_target_ms:.0f} ms",
        "",
        "| policy | replicas | GPU-h | SLO attainment | TTFT ok | ITL ok | 503 | goodput/GPU-h "
        "| cold starts | scale events | most replicas |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines.extend(
        f"| {r.policy} | {r.replicas} | {r.gpu_hours:.1f} | {100 * r.slo:.2f} % "
        f"| {100 * r.ttft_ok:.2f} % | {100 * r.itl_ok:.2f} % | {r.refused} "
        f"| {r.goodput_per_gpu_hour:.0f} | {r.cold_starts} | {r.scale_events} "
        f"| {r.peak_count} |"
        for r in rows
    )
    lines += ["", *(_ratio_line(rows, r.policy) for r in rows if _compared(r))]
    lines += [
        "planner's changes by reason: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.autoscale", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="the trace's seed")
    p.add_argument("--quick", action="store_true", help="a 2 h day with 2 bursts")
    p.add_argument("--markdown", action="store_true", help="also print a BENCHMARKS.md section")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    config = SimConfig(seed=args.seed)
    if args.quick:
        config = quick(config)
    began = time.perf_counter()
    facts, rows, reasons = run_bench(config)
    wall = time.perf_counter() - began
    if args.json:
        doc = {"config": asdict(config), "facts": asdict(facts), "rows": [asdict(r) for r in rows]}
        ratios = {r.policy: _ratios(rows, r.policy) for r in rows if _compared(r)}
        print(json.dumps(doc | {"ratios": ratios, "reasons": dict(reasons)}, indent=2))
        return 0
    print(render(config, facts, rows, reasons))
    print(
        f"\n(wall {wall:.1f} s on {platform.python_implementation()} {platform.python_version()})"
    )
    if args.markdown:
        title = "## Autoscaling: the planner against static counts and HPA (bench/autoscale.py)"
        command = f"    python -m bench.autoscale --seed {config.seed}"
        print(f"\n{title}\n\n{command}\n\n{render(config, facts, rows, reasons)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
