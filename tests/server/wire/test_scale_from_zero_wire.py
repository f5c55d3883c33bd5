"""Scale from zero over the wire: a control plane whose deployment is autoscaled (mode
"act") serves the router feed and takes reports on a real grpclib port; a gateway follows
the feed and reports to it, in front of a simulated engine. A request that finds no READY
replica is held, the server learns it waits from the gateway's report, and the request is
answered by the replica once the plane says it is READY."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpclib.server
import httpx
import pytest
from simserve import NO_TIME, sim_engine

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    AutoscalePolicy,
    Deployment,
    EngineProfile,
    ModelSignals,
    Register,
    ShardState,
    ShardStatus,
)
from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.feed import FollowConfig, feed_channel, follow
from llmgw.gateway.holding import HoldConfig
from llmgw.gateway.reporter import ReportConfig, report_forever
from llmgw.gateway.routing.table import RoutingTable
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server.core.plan import ReplicaPlan, ShardPlan
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord
from llmgw.server.state.desired import Change
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.routerreports import RouterReports
from llmgw.server.wire.routersvc import RouterService

PROFILE = EngineProfile(
    name="chat-p", engine="sim", gpu_class="H100", tp=1, model_path="/m/chat",
    served_model_name="chat",
)  # fmt: skip
FAST = FollowConfig(base_s=0.02, cap_s=0.1, keepalive_s=5, keepalive_timeout_s=5)
BODY = {"model": "chat", "prompt": "hello", "max_tokens": 2, "stream": True}


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        node = simulated_node("dgx-h100", node_id="a1", hostname="a1")
        message = Register(protocol_version=PROTOCOL_VERSION, node=node)
        await plane.register(node, message, peer="127.0.0.1:5000")
        policy = AutoscalePolicy(min=0, max=2, ttft_p90_ms=800, mode="act")
        deployment = Deployment(name="chat", profile="chat-p", replicas=0, autoscale=policy)
        await plane.desired.apply(Change((PROFILE,), deployment, PROFILE))
        yield plane


async def until(check: Callable[[], object], what: str) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what}: not within 5 s")


def reported(reports: RouterReports) -> ModelSignals | None:
    """The separate gateway's signals of model chat, as the server keeps them."""
    for gateway in reports.signals():
        for signals in gateway.models:
            if gateway.gateway_id == "gw#1" and signals.model == "chat":
                return signals
    return None


async def test_a_held_request_is_reported_and_answered_once_the_replica_is_ready(
    plane: ControlPlane,
) -> None:
    reports = RouterReports()
    server = grpclib.server.Server([RouterService(plane, reports)])
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    table, stop = RoutingTable(), asyncio.Event()
    config = GatewayConfig(port=0, engine_poll_s=0, hold=HoldConfig(timeout_s=20))
    gateway = Gateway(table, config)
    feed = asyncio.create_task(
        follow(lambda: feed_channel("127.0.0.1", port, FAST), table, stop=stop, config=FAST)
    )
    channel = feed_channel("127.0.0.1", port, FAST)
    reporting = ReportConfig("gw#1", 1_700_000_000_000, interval_s=0.1)
    reporter = asyncio.create_task(report_forever(channel, gateway, reporting))
    try:
        async with sim_engine("chat", *NO_TIME) as url:
            await until(lambda: table.scalable("chat"), "the feed's scalable models")
            engine_port = int(url.rsplit(":", 1)[1])
            shard = ShardPlan("chat-1.0", "a1", 0, ("gpu-0",), engine_port)
            plan = ReplicaPlan("chat-1", "chat", "chat-p", "fp", (shard,))
            record = ReplicaRecord(plan, PROFILE, Lifecycle.ACTIVE, serial=1, api_key="k" * 40)
            await plane.save_replicas({"chat-1": record})  # placed, not READY yet
            await until(lambda: table.get("chat-1") is not None, "the replica in the table")

            host, gw_port = await gateway.start()
            async with httpx.AsyncClient(base_url=f"http://{host}:{gw_port}", timeout=20) as client:
                held = asyncio.create_task(client.post("/v1/completions", json=BODY))
                await until(
                    lambda: (s := reported(reports)) is not None and s.waiting == 1,
                    "the server to learn a request waits",
                )
                assert not held.done()
                status = ShardStatus(shard_id="chat-1.0", replica_id="chat-1")
                status.state = ShardState.READY
                plane.shard_status("a1", status)
                reply = await held
            assert reply.status_code == 200 and reply.headers["x-llmgw-replica"] == "chat-1"
            assert "data: [DONE]" in reply.text
            await until(
                lambda: (s := reported(reports)) is not None and s.held_answered == 1,
                "the held request's outcome reported",
            )
            signals = reported(reports)
            assert signals is not None
            assert (signals.arrivals, signals.answered, signals.waiting) == (1, 1, 0)
            assert signals.ttft_counts[-1] == 1
    finally:
        stop.set()
        reporter.cancel()
        await asyncio.gather(reporter, return_exceptions=True)
        await asyncio.wait_for(feed, 5)
        channel.close()
        await gateway.stop()
        server.close()
        await server.wait_closed()
