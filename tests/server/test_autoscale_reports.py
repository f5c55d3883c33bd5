"""What the autoscaler takes of the gateways' reports
(``llmgw.server.wire.routerreports.gateway_reports``): each gateway process its own window, a
restart another one, differences over the window."""

from __future__ import annotations

from llmgw.api.llmgw.v1 import ModelSignals, RouterReport, RouterStats
from llmgw.server.core.autoscale_window import GatewayReport, keep, measure
from llmgw.server.wire.routerreports import RouterReports, gateway_reports

BOUNDS = [100.0, 1000.0]


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def _report(arrivals: int, slow: int, *, started: int = 1) -> RouterReport:
    """Gateway "gw" has seen ``arrivals`` requests for "chat", ``slow`` of them over 1 s."""
    fast = arrivals - slow
    signals = ModelSignals(
        model="chat",
        arrivals=arrivals,
        answered=arrivals,
        ttft_counts=[fast, fast, arrivals],
        itl_counts=[0, 0, 0],
        in_flight=2,
    )
    return RouterReport(
        gateway_id="gw",
        started_at_unix_ms=started,
        stats=RouterStats(),
        interval_ms=1000,
        models=[signals],
        latency_bounds_ms=BOUNDS,
    )


def _window(taken: list[list[GatewayReport]]) -> dict[str, tuple[GatewayReport, ...]]:
    histories: dict[str, tuple[GatewayReport, ...]] = {}
    for round_ in taken:
        histories = {r.gateway: keep(histories.get(r.gateway, ()), r, 30.0) for r in round_}
    return histories


def test_a_gateways_reports_make_its_window() -> None:
    clock = Clock()
    reports = RouterReports(clock=clock)
    taken = []
    reports.take(_report(10, 0))
    taken.append(gateway_reports(reports))
    clock.now += 10.0
    reports.take(_report(60, 40))
    taken.append(gateway_reports(reports))
    assert [r.gateway for r in taken[-1]] == ["gw@1"]  # no in-server gateway here
    figures = measure(_window(taken), {"chat"})
    assert figures.arrivals == 50 and figures.arrival_rps == 5.0
    assert figures.ttft_p90_ms == 1000.0  # 40 of the 50 over a second: the p90 is in +Inf
    assert figures.in_flight == 2


def test_a_restarted_gateway_starts_a_window_of_its_own() -> None:
    clock = Clock()
    reports = RouterReports(clock=clock)
    reports.take(_report(100, 0))
    first = gateway_reports(reports)
    clock.now += 5.0
    reports.take(_report(3, 3, started=2))  # counters from zero again
    second = gateway_reports(reports)
    histories = _window([first, second])
    assert set(histories) == {"gw@2"}  # the earlier process's window is gone with it
    assert measure(histories, {"chat"}).arrivals == 0  # one report: no difference yet
