"""The gateways' signals per model as the server keeps them (RouterReports.signals, and
llmgw.server.wire.reportsignals): every live gateway's latest, the in-server gateway's
read now, stale ones left out, and malformed signals refused naming the field."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from grpclib.const import Status

from llmgw.api.llmgw.v1 import ModelSignals, RouterReport, RouterStats
from llmgw.gateway import LATENCY_BOUNDS_MS, Gateway, RoutingTable
from llmgw.server.wire.reportsignals import IN_SERVER_GATEWAY
from llmgw.server.wire.routerreports import ReportRefused, RouterReports

BOUNDS = [10.0, 100.0, 1000.0]


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def signals(model: str, arrivals: int, **fields: object) -> ModelSignals:
    return ModelSignals(
        model=model,
        arrivals=arrivals,
        ttft_counts=[0, arrivals, arrivals, arrivals],
        itl_counts=[0, 0, 0, 0],
        **fields,  # type: ignore[arg-type]
    )


def report(
    gateway_id: str, *models: ModelSignals, started: int = 1, **fields: object
) -> RouterReport:
    return RouterReport(
        gateway_id=gateway_id,
        started_at_unix_ms=started,
        stats=RouterStats(),
        interval_ms=1000,
        models=list(models),
        latency_bounds_ms=list(fields.pop("bounds", BOUNDS)),  # type: ignore[call-overload]
    )


def test_every_live_gateways_latest_signals() -> None:
    clock = Clock()
    reports = RouterReports(clock=clock)
    reports.take(report("a", signals("m", 3)))
    reports.take(report("b", signals("z", 1), signals("m", 2, waiting=4)))
    clock.now += 1
    reports.take(report("a", signals("m", 5)))  # replaces a's earlier report
    got = {s.gateway_id: s for s in reports.signals()}
    assert set(got) == {"a", "b"}
    assert [m.arrivals for m in got["a"].models] == [5]
    assert [m.model for m in got["b"].models] == ["m", "z"]  # sorted by model
    assert got["b"].models[0].waiting == 4
    assert got["a"].bounds_ms == tuple(BOUNDS)
    assert got["a"].received_s == clock.now and got["b"].received_s == clock.now - 1
    clock.now += 2.5  # b's report is older than three of its intervals (3 s): stale
    assert [s.gateway_id for s in reports.signals()] == ["a"]


def test_the_in_server_gateways_signals_are_read_now() -> None:
    gateway = Gateway(RoutingTable())
    gateway.signals.arrived("m")
    slot: list[Gateway | None] = [gateway]
    clock = Clock()
    reports = RouterReports(clock=clock, local=lambda: slot[0])
    reports.take(report("a", signals("m", 3)))
    (local, other) = reports.signals()
    assert local.gateway_id == IN_SERVER_GATEWAY and other.gateway_id == "a"
    assert local.bounds_ms == LATENCY_BOUNDS_MS
    assert local.started_at_unix_ms == gateway.started_at_unix_ms
    assert [(m.model, m.arrivals) for m in local.models] == [("m", 1)]
    gateway.signals.arrived("m")
    assert reports.signals()[0].models[0].arrivals == 2
    slot[0] = None  # the in-server gateway stopped
    assert [s.gateway_id for s in reports.signals()] == ["a"]


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (report("g", bounds=[10.0, 10.0]), "latency_bounds_ms[1] 10.0"),
        (report("g", bounds=[float("nan")]), "latency_bounds_ms[0] nan"),
        (report("g", bounds=[-1.0]), "latency_bounds_ms[0] -1.0"),
        (report("g", signals("m", 1), bounds=[]), "latency_bounds_ms is required"),
        (report("g", signals("m", 1), signals("m", 2)), "models[1].model 'm' is repeated"),
        (report("g", signals("", 1)), "models[0].model must be printable"),
        (
            report("g", ModelSignals(model="m", ttft_counts=[1, 2], itl_counts=[0, 0, 0, 0])),
            "models[0].ttft_counts has 2 counts; latency_bounds_ms asks for 4",
        ),
        (
            report("g", ModelSignals(model="m", ttft_counts=[0] * 4, itl_counts=[3, 2, 2, 2])),
            "models[0].itl_counts[1] 2 is below 3: not cumulative",
        ),
    ],
)
def test_malformed_signals_are_refused_naming_the_field(bad: RouterReport, words: str) -> None:
    reports = RouterReports()
    reports.take(report("g", signals("m", 7)))
    with pytest.raises(ReportRefused) as refused:
        reports.take(bad)
    assert refused.value.status is Status.INVALID_ARGUMENT
    assert words in refused.value.why
    (kept,) = reports.signals()  # nothing kept changed
    assert kept.models[0].arrivals == 7


def test_too_many_models_are_refused() -> None:
    reports = RouterReports()
    many = [signals(f"m{i}", 1) for i in range(257)]
    with pytest.raises(ReportRefused, match="models has more than 256 entries"):
        reports.take(report("g", *many))
    assert reports.signals() == []
