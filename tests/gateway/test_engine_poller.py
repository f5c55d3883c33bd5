"""The engine poller: vLLM's /metrics → delivered reuse, block size, KV capacity."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from simserve import NO_TIME, sim_engine

from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.engines import (
    EnginePoller,
    EngineSample,
    PollerConfig,
    ReuseWindow,
    parse_engine_metrics,
)
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.routing.policy import PrefixPolicy
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.gateway.stats import replica_rows
from llmgw.gateway.upstream import UpstreamPool
from llmgw.sim.engine.metrics import EngineGauges, EngineStats, render_metrics

SAMPLE = Path("/work/shared/spec/vllm-0.32-metrics-sample.txt")
if not SAMPLE.exists():  # the copy the simulated engine's tests keep
    SAMPLE = Path(__file__).resolve().parents[1] / "sim" / "vllm-0.32-metrics-sample.txt"


def page(queries: float, hits: float, *, blocks: int = 364, size: int = 128) -> bytes:
    return (
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries.\n"
        "# TYPE vllm:prefix_cache_queries_total counter\n"
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}\n'
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}\n'
        f'vllm:cache_config_info{{block_size="{size}",engine="0",num_gpu_blocks="{blocks}",'
        'num_cpu_blocks="None"} 1.0\n'
    ).encode()


def test_the_real_vllm_sample_is_read() -> None:
    sample = parse_engine_metrics(SAMPLE.read_text())
    assert sample.queries == {"0": 79.0} and sample.hits == {"0": 0.0}
    assert (sample.block_size, sample.kv_tokens) == (128, 364 * 128)
    assert sample.kv_usage == 0.0  # said (idle), not unknown
    assert (sample.waiting, sample.running) == (0, 0)
    busy = SAMPLE.read_text().replace(
        'vllm:kv_cache_usage_perc{engine="0",model_name="smollm2-135m"} 0.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="smollm2-135m"} 0.022',
    )
    assert parse_engine_metrics(busy).kv_usage == pytest.approx(0.022)


def test_kv_usage_is_read_from_the_simulated_engines_page() -> None:
    gauges = EngineGauges(running=3, waiting=1, waiting_deferred=0, kv_usage=0.4375)
    info = {"block_size": "16", "num_gpu_blocks": "500", "num_cpu_blocks": "None"}
    text = render_metrics(EngineStats(4096), gauges, model_name="m", cache_info=info)
    sample = parse_engine_metrics(text)
    assert sample.kv_usage == pytest.approx(0.4375)
    assert (sample.block_size, sample.kv_tokens) == (16, 500 * 16)
    assert (sample.waiting, sample.running) == (1, 3)  # not the waiting_by_reason family


def test_engine_queues_add_up_over_dp_ranks_and_unsaid_is_unknown() -> None:
    def queue(name: str, engine: str, value: str) -> str:
        return f'vllm:num_requests_{name}{{engine="{engine}",model_name="m"}} {value}\n'

    text = queue("waiting", "0", "2.0") + queue("waiting", "1", "5.0") + queue("running", "0", "7")
    sample = parse_engine_metrics(text)
    assert (sample.waiting, sample.running) == (7, 7)
    assert parse_engine_metrics(queue("waiting", "0", "NaN")).waiting is None
    assert parse_engine_metrics(queue("running", "0", "-3")).running == 0
    said = parse_engine_metrics(page(10, 4).decode())
    assert (said.waiting, said.running) == (None, None)  # not said: unknown, not idle


def test_kv_usage_is_the_mean_over_dp_ranks_and_bad_values_are_left_out() -> None:
    def usage(engine: str, value: str) -> str:
        return f'vllm:kv_cache_usage_perc{{engine="{engine}",model_name="m"}} {value}\n'

    assert parse_engine_metrics(usage("0", "0.2") + usage("1", "0.6")).kv_usage == (
        pytest.approx(0.4)
    )
    assert parse_engine_metrics(usage("0", "NaN") + usage("1", "0.5")).kv_usage == 0.5
    assert parse_engine_metrics(usage("0", "1.5")).kv_usage == 1.0  # a share, at most all
    assert parse_engine_metrics(usage("0", "NaN")).kv_usage is None
    assert parse_engine_metrics(page(10, 4).decode()).kv_usage is None  # not said: unknown


def test_data_parallel_engines_add_up_and_bad_samples_are_refused() -> None:
    two = page(10, 4).decode() + page(30, 6).decode().replace('engine="0"', 'engine="1"')
    sample = parse_engine_metrics(two)
    assert sample.queries == {"0": 10.0, "1": 30.0}
    assert sample.kv_tokens == 2 * 364 * 128
    with pytest.raises(ValueError, match="unreadable"):
        parse_engine_metrics('vllm:prefix_cache_hits_total{engine="0"} lots\n')
    assert parse_engine_metrics("other_metric 1\n") == EngineSample({}, {}, 0, 0)


def test_delivered_reuse_survives_a_counter_reset() -> None:
    window = ReuseWindow(window_s=60.0)
    assert window.update(parse_engine_metrics(page(1000, 400).decode()), 0.0) == (0, 0)  # base
    assert window.update(parse_engine_metrics(page(1500, 700).decode()), 5.0) == (500, 300)
    # the engine restarted: its counters start again from 0
    assert window.update(parse_engine_metrics(page(200, 20).decode()), 10.0) == (200, 20)
    assert window.update(parse_engine_metrics(page(400, 120).decode()), 15.0) == (200, 100)
    assert (window.queried, window.hit, window.resets) == (900, 420, 1)
    assert window.ratio() == pytest.approx(420 / 900)
    window.update(parse_engine_metrics(page(400, 120).decode()), 100.0)  # the rest aged out
    assert window.ratio() is None


@contextlib.asynccontextmanager
async def metrics_replica(pages: list[bytes | None]) -> AsyncIterator[tuple[str, list[str]]]:
    """Serves ``pages`` in turn on GET /metrics (None: a hang); then the last one again."""
    seen: list[str] = []
    writers: set[asyncio.StreamWriter] = set()
    handlers: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                seen.append(head.split(b" ")[1].decode())
                body = pages.pop(0) if len(pages) > 1 else pages[0]
                if body is None:
                    await reader.read()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


@contextlib.asynccontextmanager
async def poller(
    targets: list[Target], metrics: GatewayMetrics | None = None, **config: float
) -> AsyncIterator[tuple[EnginePoller, dict[str, int | None]]]:
    told: dict[str, int | None] = {}
    pool = UpstreamPool()
    try:
        yield (
            EnginePoller(
                RoutingTable(targets),
                pool,
                PollerConfig(**config),  # type: ignore[arg-type]
                metrics=metrics,
                on_capacity=told.__setitem__,
            ),
            told,
        )
    finally:
        await pool.close()


async def test_polls_count_delivered_reuse_across_an_engine_restart() -> None:
    pages: list[bytes | None] = [page(1000, 400), page(1600, 1000), page(300, 250, blocks=100)]
    metrics = GatewayMetrics()
    async with metrics_replica(pages) as (url, seen):
        async with poller([Target("r1", "m", url)], metrics) as (engines, told):
            for _ in range(3):
                await engines.poll_once()
    facts = engines.facts("r1")
    assert facts is not None
    assert (facts.queried_tokens, facts.hit_tokens, facts.resets) == (900, 850, 1)
    assert facts.hit_ratio == pytest.approx(850 / 900)
    assert metrics.reuse["delivered"] == 850 and metrics.reuse_prompt["engine"] == 900
    assert told == {"r1": 100 * 128}  # the restarted engine has a smaller cache
    assert engines.block_size("r1") == 128
    assert seen == ["/metrics"] * 3
    text = "\n".join(engines.lines())
    assert 'llmgw_engine_prefix_cache_queries_total{replica="r1"} 900' in text
    assert 'llmgw_engine_prefix_cache_hits_total{replica="r1"} 850' in text
    assert "hit_ratio" not in text  # a ratio is the reader's: rate(hits) / rate(queries)
    assert 'llmgw_engine_polls_total{outcome="ok"} 3' in text


async def test_a_failing_replica_is_skipped_and_counted() -> None:
    async with (
        metrics_replica([None]) as (hanging, _),
        metrics_replica([b"HTTP junk"]) as (junk, _),
        metrics_replica([page(10, 5)]) as (good, _),
    ):
        targets = [
            Target("hang", "m", hanging),
            Target("junk", "m", junk),
            Target("good", "m", good),
            Target("down", "m", "http://127.0.0.1:9", ready=False),  # not READY: not asked
        ]
        async with poller(targets, timeout_s=1.0) as (engines, told):  # slack for a busy CI
            await engines.poll_once()
    assert dict(engines.polls) == {"timeout": 1, "ok": 2}
    assert told == {"good": 364 * 128}
    assert engines.facts("junk") is not None and engines.block_size("junk") == 0


async def test_a_replica_that_leaves_is_forgotten() -> None:
    async with metrics_replica([page(10, 5)]) as (url, _):
        table = RoutingTable([Target("r1", "m", url)])
        told: dict[str, int | None] = {}
        pool = UpstreamPool()
        engines = EnginePoller(table, pool, on_capacity=told.__setitem__)
        try:
            await engines.poll_once()
            assert told == {"r1": 364 * 128}
            table.remove("r1")
            await engines.poll_once()
        finally:
            await pool.close()
    assert told == {"r1": None} and engines.facts("r1") is None


async def test_the_simulated_engine_is_polled_and_bounds_the_approximate_tree() -> None:
    flags = ("--block-size", "16", "--sim-kv-blocks", "500", *NO_TIME)
    async with sim_engine("sim-model", *flags) as url:
        table = RoutingTable([Target("r1", "sim-model", url)])
        gateway = Gateway(table, GatewayConfig(port=0, engine_poll_s=0))
        try:
            await gateway.engines.poll_once()  # the baseline
            prompt = " ".join(f"word{i}" for i in range(300))
            async with httpx.AsyncClient(base_url=url) as client:
                for _ in range(2):
                    request = {"model": "sim-model", "prompt": prompt, "max_tokens": 1}
                    reply = await client.post("/v1/completions", json=request)
                    assert reply.status_code == 200
                counters = parse_engine_metrics((await client.get("/metrics")).text)
            await gateway.engines.poll_once()
        finally:
            await gateway.stop()
    facts = gateway.engines.facts("r1")
    assert facts is not None and facts.block_size == 16 and facts.kv_tokens == 500 * 16
    assert facts.kv_usage is not None and facts.kv_usage == counters.kv_usage
    assert (facts.waiting, facts.running) == (0, 0)  # idle when polled, and said so
    (row,) = replica_rows(gateway, {})
    assert (row.engine_waiting, row.engine_running) == (0, 0)
    assert facts.queried_tokens == counters.queries["0"] > 0
    assert facts.hit_tokens == counters.hits["0"] > 0  # the second request hit the first's
    assert gateway.metrics.reuse["delivered"] == counters.hits["0"]
    assert isinstance(gateway.policy, PrefixPolicy)
    assert gateway.policy.tree("sim-model").replica_limit("r1") == 500 * 16 * 4
