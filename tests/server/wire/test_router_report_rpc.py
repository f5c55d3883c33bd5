"""RouterService.Report on a native grpclib server with tokens: the gateway role reports,
others are refused; GetRouterStats adds the reports to the in-server gateway's figures; and
the gateway's reporter (llmgw.gateway.reporter) sends its figures and rides out
failures."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpclib.client
import grpclib.server
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from llmgw.api.llmgw.v1 import (
    ControlServiceStub,
    GetRouterStatsRequest,
    ReplicaRouterStats,
    RouterReport,
    RouterServiceStub,
    RouterStats,
)
from llmgw.gateway.app import Gateway
from llmgw.gateway.modelsignals import LATENCY_BOUNDS_MS
from llmgw.gateway.reporter import ReportConfig, instance_id, report_forever
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.state.tokens import Role
from llmgw.server.wire.auth import Authenticator, hash_token, install, new_token
from llmgw.server.wire.controlsvc import NO_GATEWAY, ControlService
from llmgw.server.wire.routerreports import RouterReports
from llmgw.server.wire.routersvc import RouterService


@dataclass
class Server:
    port: int
    reports: RouterReports
    tokens: dict[Role, str]
    in_server: list[Gateway]  # the in-server gateway, when a test puts one there

    def channel(self, role: Role | None) -> grpclib.client.Channel:
        channel = grpclib.client.Channel("127.0.0.1", self.port)
        if role is not None:
            value = f"Bearer {self.tokens[role]}"

            async def _authorize(event: grpclib.events.SendRequest) -> None:
                event.metadata["authorization"] = value

            grpclib.events.listen(channel, grpclib.events.SendRequest, _authorize)
        return channel

    async def stats(self) -> RouterStats:
        channel = self.channel(Role.VIEWER)
        try:
            return await ControlServiceStub(channel).get_router_stats(GetRouterStatsRequest())
        finally:
            channel.close()

    async def report(self, role: Role | None, report: RouterReport) -> None:
        channel = self.channel(role)
        try:
            await RouterServiceStub(channel).report(report)
        finally:
            channel.close()


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    """Control and router services sharing one report store, with gateway and viewer tokens."""
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        tokens = {}
        for role in (Role.GATEWAY, Role.VIEWER):
            tokens[role] = new_token()
            await store.add_token(role, hash_token(tokens[role]), role.value)
        reports, in_server = RouterReports(), list[Gateway]()
        control = ControlService(
            plane, gateway=lambda: in_server[0] if in_server else None, reports=reports
        )
        grpc = grpclib.server.Server([control, RouterService(plane, reports)])
        install(grpc, Authenticator(store, refresh_s=0))
        await grpc.start("127.0.0.1", 0)
        try:
            port = grpc._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            yield Server(port, reports, tokens, in_server)
        finally:
            grpc.close()
            await grpc.wait_closed()


def figures(n: int, replica: str = "r1", in_flight: int = 0) -> RouterStats:
    row = ReplicaRouterStats(replica_id=replica, in_flight=in_flight, requests=n)
    return RouterStats(
        decisions=n,
        decisions_by_tier={"load": n},
        requests_by_status={200: n},
        replicas=[row],
    )


def report(gateway_id: str, n: int, **row: Any) -> RouterReport:
    return RouterReport(
        gateway_id=gateway_id, started_at_unix_ms=1, stats=figures(n, **row), interval_ms=2000
    )


async def test_only_the_gateway_role_may_report(server: Server) -> None:
    for role, status in ((None, Status.UNAUTHENTICATED), (Role.VIEWER, Status.PERMISSION_DENIED)):
        with pytest.raises(GRPCError) as caught:
            await server.report(role, report("gw", 5))
        assert caught.value.status is status
    assert "Report needs the gateway role" in (caught.value.message or "")
    assert not server.reports.ever_reported
    with pytest.raises(GRPCError) as caught:
        await server.stats()
    assert (caught.value.status, caught.value.message) == (Status.FAILED_PRECONDITION, NO_GATEWAY)

    await server.report(Role.GATEWAY, report("gw", 5, in_flight=2))
    stats = await server.stats()
    assert (stats.decisions, stats.requests_by_status) == (5, {200: 5})
    [row] = stats.replicas
    assert (row.replica_id, row.requests, row.in_flight) == ("r1", 5, 2)


async def test_a_bad_report_is_refused_naming_the_field(server: Server) -> None:
    bad = RouterReport(gateway_id="gw", started_at_unix_ms=1)
    with pytest.raises(GRPCError) as caught:
        await server.report(Role.GATEWAY, bad)
    assert (caught.value.status, caught.value.message) == (
        Status.INVALID_ARGUMENT,
        "stats is required",
    )
    assert not server.reports.ever_reported


async def test_reports_add_to_the_in_server_gateway(server: Server) -> None:
    gateway = Gateway(RoutingTable([Target("r1", "m", "http://127.0.0.1:9")]))
    gateway.metrics.decided("load", "miss", 1e-4, replica_id="r1")
    gateway.metrics.request_done(200)
    gateway.load.acquire("r1")
    server.in_server.append(gateway)
    await server.report(Role.GATEWAY, report("gw-a", 4, in_flight=2))
    await server.report(Role.GATEWAY, report("gw-b", 10, replica="r2"))
    stats = await server.stats()
    assert stats.decisions == 1 + 4 + 10
    assert stats.decisions_by_tier == {"load": 15}
    assert stats.requests_by_status == {200: 15}
    rows = {row.replica_id: (row.requests, row.in_flight) for row in stats.replicas}
    assert rows == {"r1": (5, 3), "r2": (10, 0)}


async def until(check: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what}: not within 5 s")


async def test_the_reporter_sends_the_gateways_figures_then_stops_when_cancelled(
    server: Server,
) -> None:
    gateway = Gateway(RoutingTable([Target("r7", "m", "http://127.0.0.1:9")]))
    for _ in range(3):
        gateway.metrics.decided("approximate", "hit", 1e-4, replica_id="r7")
        gateway.metrics.request_done(200)
        gateway.signals.arrived("m")
    gateway.signals.first_byte("m", 0.25, ok=True)
    config = ReportConfig(instance_id("gw-host:8000"), 1_700_000_000_000, interval_s=0.1)
    assert config.gateway_id.startswith("gw-host:8000#") and config.gateway_id != instance_id(
        "gw-host:8000"
    )  # a random suffix per process start
    channel = server.channel(Role.GATEWAY)
    task = asyncio.create_task(report_forever(channel, gateway, config))
    try:
        await until(lambda: server.reports.ever_reported, "the first report")
        gateway.metrics.decided("approximate", "miss", 1e-4, replica_id="r7")
        await until(lambda: server.reports.parts()[-1].stats.decisions == 4, "a later report")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        channel.close()
    assert task.cancelled()
    stats = await server.stats()
    assert stats.decisions == 4
    assert stats.decisions_by_tier_outcome == {"approximate/hit": 3, "approximate/miss": 1}
    assert [(r.replica_id, r.requests) for r in stats.replicas] == [("r7", 4)]
    (sent,) = server.reports.signals()  # and its signals per model, for the autoscaler
    assert sent.gateway_id == config.gateway_id and sent.bounds_ms == LATENCY_BOUNDS_MS
    assert [(m.model, m.arrivals, m.answered, m.ttft_counts[-1]) for m in sent.models] == [
        ("m", 3, 1, 1)
    ]


async def test_the_reporter_rides_out_failures_and_says_a_refusal_once(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="llmgw.gateway.reporter")
    gateway = Gateway(RoutingTable())
    config = ReportConfig("gw#1", 1, interval_s=0.1, timeout_s=1.0)
    for channel, refused in ((server.channel(Role.VIEWER), True), (_nowhere(), False)):
        caplog.clear()
        task = asyncio.create_task(report_forever(channel, gateway, config))
        try:
            await until(lambda: len(_failures(caplog)) >= 3, "three failed reports")
            assert not task.done()  # it keeps trying
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            channel.close()
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        if refused:
            [warning] = warnings  # the first refusal of the streak, then DEBUG
            assert "PERMISSION_DENIED" in warning.getMessage()
        else:
            assert warnings == []  # a server away is the feed's to say
    assert not server.reports.ever_reported


def _nowhere() -> grpclib.client.Channel:
    """A channel to a port nothing listens on."""
    import socket

    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return grpclib.client.Channel("127.0.0.1", port)


def _failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "router report" in r.getMessage()]
