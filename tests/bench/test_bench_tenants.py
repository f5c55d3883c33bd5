"""bench/tenants*.py: the tenants benchmark's fleet, its figures and the fleet-wide limit."""

from __future__ import annotations

from bench import tenants as bench_tenants
from bench.tenants_limits import LimitsConfig, _max_in_window, run_limits
from bench.tenants_sim import BATCH, INTERACTIVE, Fleet, SimConfig, TenantLoad, jain

SMALL = SimConfig(
    engines=2,
    max_num_seqs=4,
    duration_s=40.0,
    warmup_s=5.0,
    interactive=TenantLoad("interactive", INTERACTIVE, 200, 16, rate=1.0),
    batch=(
        TenantLoad("batch-a", BATCH, 100, 48, backlog=12),
        TenantLoad("batch-b", BATCH, 400, 12, backlog=12),
    ),
)


def test_jain_index() -> None:
    assert jain([5.0, 5.0]) == 1.0
    assert jain([10.0, 0.0]) == 0.5


def test_max_in_window_counts_a_sliding_minute() -> None:
    assert _max_in_window([0.0, 30.0, 59.9, 60.0, 61.0], 60.0) == 4
    assert _max_in_window([], 60.0) == 0


def test_the_flow_queue_keeps_the_interactive_tenant_ahead_and_the_batch_tenants_fair() -> None:
    figures = bench_tenants.measure(SMALL)
    # Without the queue the engines queue everything: the interactive tenant waits behind
    # the flood; with it, it does not.
    assert figures.unqueued_p90_s > 3 * figures.loaded_p90_s
    assert figures.jain >= 0.95
    assert figures.batch_ratio >= 0.9
    assert 0 < figures.interactive_slot_share < 0.5


def test_batch_tenants_alone_share_the_fleet_by_tokens_not_by_requests() -> None:
    out = Fleet(SMALL, SMALL.batch, flow=True).run()
    a, b = out.tokens["batch-a"], out.tokens["batch-b"]
    assert jain([float(a), float(b)]) >= 0.95
    # batch-b's requests are 3x heavier: it gets fewer requests for the same tokens
    assert out.completion["batch-a"] > 2 * out.completion["batch-b"]


def test_a_fleet_wide_limit_over_four_gateways_overshoots_little() -> None:
    outcome = run_limits(LimitsConfig(duration_s=240.0))
    assert outcome.overshoot <= 0.05
    assert outcome.asked > outcome.admitted > 0.8 * outcome.config.rpm * 3  # the limit is used


def test_one_gateway_alone_holds_the_whole_budget_and_no_more() -> None:
    outcome = run_limits(LimitsConfig(gateways=1, duration_s=180.0))
    assert outcome.max_in_minute == outcome.config.rpm
