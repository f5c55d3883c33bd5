"""bench/autoscale*.py: the trace, the engine model, the HPA rule and a small replay."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from bench import autoscale as bench
from bench import autoscale_sim as sim

SMALL = replace(sim.SimConfig(), day_s=1_800.0, peak_rps=4.0, bursts=1, seed=3)


BASE = sim.View(now=100.0, count=4, ready=4, coming=0, ttft_p90_ms=None, itl_p90_ms=None,
                samples=0, arrival_rps=0.0, in_flight=0, waiting=0, engine_waiting=0,
                engine_running=0, batch=10)  # fmt: skip


def _view(**kw: Any) -> sim.View:
    return replace(BASE, **kw)


def test_the_trace_comes_from_the_seed_and_follows_the_day() -> None:
    trace = sim.make_trace(SMALL)
    assert trace == sim.make_trace(SMALL)
    assert trace != sim.make_trace(replace(SMALL, seed=4))
    assert all(a.arrival <= b.arrival for a, b in zip(trace, trace[1:], strict=False))
    night = sum(1 for r in trace if r.arrival < 300.0)
    noon = sum(1 for r in trace if 750.0 <= r.arrival < 1050.0)
    assert noon > 3 * night
    assert all(16 <= r.output <= 4 * SMALL.output_tokens for r in trace)


def test_p90_interpolates_in_the_bucket_between_two_snapshots() -> None:
    before = sim.Histogram()
    before.observe(3000.0)
    after = sim.Histogram()
    after.counts = list(before.counts)
    for ms in [100.0] * 9 + [900.0]:
        after.observe(ms)
    p90, samples = sim.p90_of(before.counts, after.counts)
    assert samples == 10
    assert p90 == pytest.approx(100.0)  # the 9th of 10 is the top of the (75, 100] bucket
    assert sim.p90_of(after.counts, after.counts) == (None, 0)


def test_one_replica_under_a_full_batch_queues_and_its_ttft_grows() -> None:
    config = replace(SMALL, day_s=120.0)
    trace = [sim.Request(0.01 * i, 600, 400) for i in range(40)]  # 40 at once, batch 16
    out = sim.Fleet(config, trace, lambda v: 1, 15.0, 1).run()
    assert out.requests == 40
    assert out.ttft_ok == 16  # the first batch; the rest waited for a whole answer
    assert out.gpu_s == pytest.approx(max(120.0, out.gpu_s))


def test_held_requests_wait_for_a_cold_start_or_are_refused_after_the_hold() -> None:
    config = replace(SMALL, day_s=200.0, cold_start_s=30.0, hold_s=60.0)
    trace = [sim.Request(1.0, 100, 50), sim.Request(2.0, 100, 50)]
    started = sim.Fleet(config, trace, lambda v: 1, 5.0, 0).run()
    assert (started.requests, started.refused, started.cold_starts) == (2, 0, 1)
    assert started.ttft_ok == 0  # held 30 s: over the TTFT target
    never = sim.Fleet(config, trace, lambda v: 0, 5.0, 0).run()
    assert (never.requests, never.refused) == (2, 2)


def test_hpa_follows_kubernetes_tolerance_limits_and_down_stabilisation() -> None:
    hpa = bench.Hpa()
    assert hpa(_view(engine_running=28)) == 4  # 70 %: within the tolerance
    assert hpa(_view(now=115.0, engine_running=40, engine_waiting=40)) == 8  # ceil(4 × 2.86), ≤ +4
    assert hpa(_view(now=130.0, count=8, ready=8, engine_running=8)) == 8  # the window holds it
    assert hpa(_view(now=431.0, count=8, ready=8, engine_running=8)) == 2  # 300 s later


def test_hpa_counts_replicas_still_coming_as_idle_for_a_scale_up() -> None:
    assert bench.Hpa()(_view(count=6, ready=4, coming=2, engine_running=33)) == 6


def test_every_policy_replays_the_same_requests_and_the_planner_stays_in_bounds() -> None:
    facts, rows, reasons = bench.run_bench(SMALL)
    oracles = [f"oracle, beta {beta}" for beta in bench.ORACLE_BETAS]
    assert [r.policy for r in rows] == [
        "static at peak", "static at mean", "HPA-like", "planner", *oracles
    ]  # fmt: skip
    assert {r.requests for r in rows} == {facts.requests}
    by = {r.policy: r for r in rows}
    assert by["static at peak"].gpu_hours == pytest.approx(facts.static_peak * 0.5, rel=0.05)
    assert by["static at peak"].slo >= by["static at mean"].slo
    assert by["static at peak"].cold_starts == 0 == by["static at peak"].scale_events
    planner = by["planner"]
    assert bench.MIN_REPLICAS <= planner.peak_count <= bench.MAX_REPLICAS
    assert planner.scale_events == sum(reasons.values()) > 0
    assert planner.gpu_hours < by["static at peak"].gpu_hours
    text = bench.render(SMALL, facts, rows, reasons)
    assert "| planner | 1-24 |" in text and "x static at peak" in text
    assert f"{oracles[0]}: goodput/GPU-h" in text


def test_the_oracle_staffs_the_coming_rate_with_square_root_headroom() -> None:
    config = replace(SMALL, bursts=0)
    oracle = bench.Oracle(config, beta=1.5)
    noon = config.day_s / 2  # the peak: 4 req/s, flat within the next minute
    load = 4.0 * config.batch / sim.replica_capacity_rps(config)
    want = -(-(load + 1.5 * load**0.5) // config.batch)
    assert oracle(_view(now=noon)) == want
    assert bench.Oracle(config, beta=0.0)(_view(now=noon)) < want  # no headroom: fewer
    assert oracle(_view(now=0.0)) < want  # night
