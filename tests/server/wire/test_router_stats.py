"""GetRouterStats: the in-server gateway's counters, per-replica rows, and no gateway."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.testing import ChannelFor
from simserve import NO_TIME, sim_engine

from llmgw.api.llmgw.v1 import ControlServiceStub, GetRouterStatsRequest, RouterStats
from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.gateway.stats import router_stats
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.controlsvc import NO_GATEWAY, ControlService
from llmgw.sim.engine.metrics import EngineGauges, EngineStats, render_metrics


@contextlib.asynccontextmanager
async def control(tmp_path: Path, gateway: Gateway | None) -> AsyncIterator[ControlServiceStub]:
    """A ControlService over an in-process plane, reached through an in-memory channel."""
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        service = ControlService(plane, gateway=lambda: gateway)
        async with ChannelFor([service]) as channel:
            yield ControlServiceStub(channel)


def small_engine(model: str, blocks: int) -> contextlib.AbstractAsyncContextManager[str]:
    """A simulated vLLM with block size 16 and ``blocks`` KV blocks, no prefill or decode
    time; its URL."""
    flags = ("--block-size", "16", "--sim-kv-blocks", str(blocks))
    return sim_engine(model, *flags, *NO_TIME)


async def test_no_gateway_answers_failed_precondition(tmp_path: Path) -> None:
    async with control(tmp_path, None) as stub:
        with pytest.raises(GRPCError) as caught:
            await stub.get_router_stats(GetRouterStatsRequest())
    assert caught.value.status is Status.FAILED_PRECONDITION
    assert caught.value.message == NO_GATEWAY


async def test_requests_through_a_gateway_reach_get_router_stats(tmp_path: Path) -> None:
    async with small_engine("sim-model", 500) as url:
        table = RoutingTable(
            [
                Target("r1", "sim-model", url),
                Target("r2", "other", "http://127.0.0.1:9", ready=False),
            ]
        )
        gateway = Gateway(table, GatewayConfig(port=0, engine_poll_s=0, precise=False))
        host, port = await gateway.start()
        try:
            await gateway.engines.poll_once()  # the engine's baseline
            prompt = " ".join(f"word{i}" for i in range(300))
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
                for model in ("sim-model", "sim-model", "nope"):
                    body = {"model": model, "prompt": prompt, "max_tokens": 1}
                    await client.post("/v1/completions", json=body)
            await gateway.engines.poll_once()
            gateway.load.acquire("r2")  # one request in flight, as if still streaming
            before_ms = int(time.time() * 1000)
            async with control(tmp_path, gateway) as stub:
                stats = await stub.get_router_stats(GetRouterStatsRequest())
        finally:
            await gateway.stop()
    assert stats.decisions == 2
    assert stats.decisions_by_tier == {"load": 1, "approximate": 1}
    assert stats.decisions_by_tier_outcome == {"load/miss": 1, "approximate/hit": 1}
    assert stats.requests_by_status == {200: 2, 404: 1}
    assert stats.reuse_delivered_tokens > 0  # the second prompt hit the first's blocks
    assert stats.engine_prompt_tokens >= 2 * 300 > stats.reuse_delivered_tokens
    assert stats.at_unix_ms >= before_ms
    rows = {row.replica_id: row for row in stats.replicas}
    assert sorted(rows) == ["r1", "r2"]
    assert (rows["r1"].in_flight, rows["r2"].in_flight) == (0, 1)
    assert rows["r1"].kv_capacity_tokens == 500 * 16
    ratio = stats.reuse_delivered_tokens / stats.engine_prompt_tokens
    assert rows["r1"].delivered_hit_ratio == pytest.approx(ratio)
    assert rows["r2"].delivered_hit_ratio is None  # never polled (not READY)
    assert rows["r2"].kv_capacity_tokens == 0
    assert rows["r1"].kv_usage is not None and 0.0 <= rows["r1"].kv_usage <= 1.0
    assert rows["r2"].kv_usage is None  # never polled: unknown, not 0


@contextlib.asynccontextmanager
async def metrics_page(body: bytes) -> AsyncIterator[str]:
    """A replica whose ``/metrics`` always answers ``body`` (one request a connection)."""
    handlers: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await reader.readuntil(b"\r\n\r\n")
            head = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
            writer.write(head % len(body) + body)
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


async def test_the_polled_kv_usage_maps_onto_the_replica_row() -> None:
    gauges = EngineGauges(running=2, waiting=0, waiting_deferred=0, kv_usage=0.625)
    info = {"block_size": "16", "num_gpu_blocks": "500", "num_cpu_blocks": "None"}
    page = render_metrics(EngineStats(4096), gauges, model_name="m", cache_info=info)
    async with metrics_page(page.encode()) as url:
        gateway = Gateway(RoutingTable([Target("r1", "m", url)]), GatewayConfig(engine_poll_s=0))
        try:
            [unpolled] = router_stats(gateway, now_ms=0).replicas
            await gateway.engines.poll_once()
            [row] = router_stats(gateway, now_ms=0).replicas
        finally:
            await gateway.stop()
    assert unpolled.kv_usage is None
    assert row.kv_usage == pytest.approx(0.625)
    assert row.kv_capacity_tokens == 500 * 16


def test_recorded_figures_map_onto_every_field() -> None:
    gateway = Gateway(RoutingTable([Target("r1", "m", "http://127.0.0.1:9")]))
    metrics = gateway.metrics
    metrics.decided("precise", "hit", 1e-4, replica_id="r1")
    metrics.decided("precise", "guarded", 1e-4, replica_id="r1")
    metrics.decided("load", "miss", 1e-4, replica_id="gone")
    metrics.precise_decided(prompt_tokens=1000, available=640, captured=512, seconds=1e-4)
    metrics.delivered(queried_tokens=900, hit_tokens=300)
    metrics.request_done(200)
    metrics.request_done(499)
    stats = router_stats(gateway, now_ms=1_700_000_000_000)
    assert stats == RouterStats(
        decisions=3,
        decisions_by_tier={"precise": 2, "load": 1},
        decisions_by_tier_outcome={"precise/hit": 1, "precise/guarded": 1, "load/miss": 1},
        requests_by_status={200: 1, 499: 1},
        reuse_available_tokens=640,
        reuse_captured_tokens=512,
        reuse_delivered_tokens=300,
        router_prompt_tokens=1000,
        engine_prompt_tokens=900,
        replicas=stats.replicas,
        at_unix_ms=1_700_000_000_000,
    )
    [row] = stats.replicas  # "gone" is neither in the table nor in flight
    assert (row.replica_id, row.requests, row.in_flight) == ("r1", 2, 0)
    metrics.forget_replica("r1")
    assert router_stats(gateway, now_ms=0).replicas[0].requests == 0
