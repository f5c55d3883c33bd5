"""ControlService.in_flight: each replica's requests in flight now, over the in-server
gateway and every live gateway's report (what the reconciler's scale-in costs read)."""

from __future__ import annotations

import time
from pathlib import Path

from llmgw.api.llmgw.v1 import ReplicaRouterStats, RouterReport, RouterStats
from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.controlsvc import ControlService
from llmgw.server.wire.routerreports import RouterReports


def report(gateway_id: str, **in_flight: int) -> RouterReport:
    rows = [ReplicaRouterStats(replica_id=r, in_flight=n) for r, n in in_flight.items()]
    return RouterReport(
        gateway_id=gateway_id,
        started_at_unix_ms=int(time.time() * 1000) - 5000,
        interval_ms=2000,
        stats=RouterStats(replicas=rows),
    )


async def test_in_flight_sums_the_in_server_gateway_and_every_live_report(
    tmp_path: Path,
) -> None:
    table = RoutingTable([Target("r1", "chat", "http://127.0.0.1:9"),
                          Target("r2", "chat", "http://127.0.0.1:9")])  # fmt: skip
    gateway = Gateway(table, GatewayConfig(port=0, engine_poll_s=0, precise=False))
    gateway.load.acquire("r2")
    reports = RouterReports()
    reports.take(report("gw-a", r1=2, r3=4))
    reports.take(report("gw-b", r1=1))
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        with_gateway = ControlService(plane, gateway=lambda: gateway, reports=reports)
        assert with_gateway.in_flight() == {"r1": 3, "r2": 1, "r3": 4}
        alone = ControlService(plane, gateway=lambda: None, reports=RouterReports())
        assert alone.in_flight() == {}
