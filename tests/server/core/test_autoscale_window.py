"""The autoscaler's window: differences between cumulative gateway reports, p90s, rates."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from llmgw.api.llmgw.v1 import EngineProfile, LoraAdapter, ModelSignals, ReplicaRouterStats
from llmgw.server.core.autoscale_window import (
    GatewayReport,
    deployment_models,
    engine_figures,
    gpus_per_replica,
    keep,
    measure,
    quantile,
)

BOUNDS = (100.0, 200.0, 400.0, 800.0)


def _cumulative(values: list[float], bounds: tuple[float, ...] = BOUNDS) -> list[int]:
    return [sum(1 for v in values if v <= b) for b in bounds] + [len(values)]


def _report(
    at: float,
    *,
    gateway: str = "gw-1",
    model: str = "chat",
    bounds: tuple[float, ...] = BOUNDS,
    **figures: Any,
) -> GatewayReport:
    """A report of one model: ``arrivals``, ``ttft`` (answers' times), ``in_flight``,
    ``waiting`` as given in ``figures``."""
    ttft: list[float] = figures.get("ttft", [])
    signals = ModelSignals(
        model=model,
        arrivals=figures.get("arrivals", 0),
        answered=len(ttft),
        ttft_counts=_cumulative(ttft, bounds),
        itl_counts=_cumulative([], bounds),
        in_flight=figures.get("in_flight", 0),
        waiting=figures.get("waiting", 0),
    )
    return GatewayReport(gateway, at, bounds, {model: signals})


def test_quantile_interpolates_within_its_bucket_as_prometheus_does() -> None:
    # 10 observations: 5 in (0,100], 5 in (100,200]: rank 9 is 4/5 into the second bucket
    assert quantile(BOUNDS, [5, 10, 10, 10, 10], 0.9) == 180.0
    assert quantile(BOUNDS, [10, 10, 10, 10, 10], 0.5) == 50.0


def test_quantile_in_the_inf_bucket_is_the_largest_bound_and_empty_is_none() -> None:
    assert quantile(BOUNDS, [0, 0, 0, 0, 4], 0.9) == 800.0
    assert quantile(BOUNDS, [0, 0, 0, 0, 0], 0.9) is None
    assert quantile(BOUNDS, [1, 2, 3], 0.9) is None  # does not match its bounds


@given(st.lists(st.floats(min_value=0.0, max_value=800.0), min_size=1, max_size=200))
def test_quantile_lies_in_the_bucket_of_the_true_p90(values: list[float]) -> None:
    counts = _cumulative(values)
    got = quantile(BOUNDS, counts, 0.9)
    assert got is not None
    true = sorted(values)[math.ceil(0.9 * len(values)) - 1]
    upper = next(b for b in BOUNDS if true <= b)
    lower = max((b for b in BOUNDS if b < upper), default=0.0)
    assert lower <= got <= upper


def test_keep_holds_the_window_and_one_baseline_before_it() -> None:
    history: tuple[GatewayReport, ...] = ()
    for at in (0.0, 10.0, 20.0, 30.0, 40.0, 50.0):
        history = keep(history, _report(at), window_s=30.0)
    assert [r.at for r in history] == [20.0, 30.0, 40.0, 50.0]
    assert keep(history, _report(50.0), window_s=30.0) == history  # the same report again


def test_measure_takes_differences_over_the_window() -> None:
    base = _report(0.0, arrivals=100, ttft=[50.0] * 100)
    newest = _report(10.0, arrivals=150, ttft=[50.0] * 100 + [700.0] * 50, in_flight=3)
    figures = measure({"gw-1": (base, newest)}, {"chat"})
    assert figures.arrivals == 50
    assert figures.arrival_rps == 5.0
    assert figures.samples == 50
    assert figures.ttft_p90_ms is not None and 400.0 < figures.ttft_p90_ms <= 800.0
    assert figures.in_flight == 3


def test_measure_adds_gateways_and_rebuckets_other_bounds() -> None:
    a = (_report(0.0), _report(10.0, arrivals=20, ttft=[150.0] * 20))
    other = (150.0, 1000.0)
    b = (
        _report(0.0, gateway="gw-2", bounds=other),
        _report(5.0, gateway="gw-2", arrivals=10, ttft=[900.0] * 10, bounds=other, waiting=2),
    )
    figures = measure({"gw-1": a, "gw-2": b}, {"chat"})
    assert figures.arrival_rps == 2.0 + 2.0
    assert figures.samples == 30
    assert figures.waiting == 2
    # gw-2's 900 ms answers fall above every bound of gw-1 (≤ 800 is not known of them)
    assert figures.ttft_p90_ms == 800.0


def test_a_single_report_counts_in_the_gauges_only() -> None:
    figures = measure({"gw-1": (_report(5.0, arrivals=9, ttft=[10.0], in_flight=4),)}, {"chat"})
    assert (figures.arrivals, figures.samples, figures.in_flight) == (0, 0, 4)
    assert figures.ttft_p90_ms is None


def test_counters_that_went_back_give_no_difference() -> None:
    history = (_report(0.0, arrivals=50, ttft=[10.0] * 50), _report(5.0, arrivals=3, ttft=[10.0]))
    figures = measure({"gw-1": history}, {"chat"})
    assert (figures.arrivals, figures.samples) == (0, 0)


def test_a_model_new_since_the_baseline_counts_from_zero() -> None:
    base = GatewayReport("gw-1", 0.0, BOUNDS, {})
    figures = measure({"gw-1": (base, _report(10.0, arrivals=10, ttft=[10.0] * 10))}, {"chat"})
    assert (figures.arrivals, figures.samples) == (10, 10)


def test_only_the_deployments_models_count() -> None:
    history = (_report(0.0, model="other"), _report(10.0, arrivals=40, model="other"))
    assert measure({"gw-1": history}, {"chat"}).arrivals == 0


def test_engine_figures_are_the_ready_replicas_summed_and_their_mean_usage() -> None:
    rows = [
        ReplicaRouterStats(replica_id="a", engine_waiting=2, engine_running=5, kv_usage=0.5),
        ReplicaRouterStats(replica_id="b", engine_waiting=1, kv_usage=0.25),
        ReplicaRouterStats(replica_id="c", engine_waiting=9, engine_running=9, kv_usage=1.0),
    ]
    figures = engine_figures(rows, {"a", "b"})
    assert (figures.waiting, figures.running, figures.kv_usage) == (3, 5, 0.375)
    unknown = engine_figures([ReplicaRouterStats(replica_id="a")], {"a"})
    assert (unknown.waiting, unknown.running, unknown.kv_usage) == (None, None, None)


def test_a_deployments_models_and_gpus() -> None:
    profile = EngineProfile(
        name="p", gpu_class="H100", gpus_per_node=4, nodes=2, served_model_name="chat",
        adapters=[LoraAdapter(name="chat-sql", path="/a")],
    )  # fmt: skip
    assert deployment_models(profile) == {"chat", "chat-sql"}
    assert gpus_per_replica(profile) == 8
    assert gpus_per_replica(EngineProfile(name="c", gpu_class="cpu")) == 0
