"""Scale from zero at the gateway (llmgw.gateway.holding): a request for a scalable model
with no READY replica is held, answered once a replica is READY, 503 with Retry-After after
the hold limit or when its queue is full, and dropped when its client leaves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
from simserve import NO_TIME, sim_engine

from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.holding import HoldConfig
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.gateway.stats import model_signals

BODY = {"model": "m", "prompt": "hello", "max_tokens": 2}


@asynccontextmanager
async def held_gateway(**hold: object) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    """A gateway whose table knows model "m" as scalable, with no replica of it yet."""
    table = RoutingTable()
    table.set_scalable(["m"])
    config = GatewayConfig(port=0, engine_poll_s=0, hold=HoldConfig(**hold))  # type: ignore[arg-type]
    gateway = Gateway(table, config)
    host, port = await gateway.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=10) as client:
            yield gateway, client
    finally:
        await gateway.stop()


async def until(check: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what}: not within 5 s")


def waiting(gateway: Gateway) -> int:
    return gateway.holding.waiting().get("m", 0)


async def test_held_requests_are_answered_once_a_replica_is_ready() -> None:
    async with sim_engine("m", *NO_TIME) as url, held_gateway() as (gateway, client):
        held = [asyncio.create_task(client.post("/v1/completions", json=BODY)) for _ in range(3)]
        await until(lambda: waiting(gateway) == 3, "three requests held")
        (signals,) = model_signals(gateway)
        assert (signals.model, signals.arrivals, signals.waiting) == ("m", 3, 3)
        gateway.table.upsert(Target("m-1", "m", url, ready=False))  # starting: still held
        await asyncio.sleep(0.05)
        assert waiting(gateway) == 3 and not any(task.done() for task in held)
        gateway.table.upsert(Target("m-1", "m", url, ready=True))
        replies = await asyncio.gather(*held)
        assert [r.status_code for r in replies] == [200, 200, 200]
        assert {r.headers["x-llmgw-replica"] for r in replies} == {"m-1"}
        (signals,) = model_signals(gateway)
        assert (signals.waiting, signals.held_answered, signals.answered) == (0, 3, 3)
        metrics = (await client.get("/metrics")).text
    assert 'llmgw_held_requests_total{model="m",outcome="ready"} 3' in metrics
    assert "# TYPE llmgw_held_requests gauge" in metrics


async def test_a_hold_past_its_limit_is_a_503_with_retry_after() -> None:
    async with held_gateway(timeout_s=0.2, retry_after_s=7) as (gateway, client):
        reply = await client.post("/v1/completions", json=BODY)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "7"
        error = reply.json()["error"]
        assert "no replica of model `m` became ready within 0.2 s" in error["message"]
        assert error["type"] == "ServiceUnavailableError"
        (signals,) = model_signals(gateway)
        assert (signals.held_timeouts, signals.waiting) == (1, 0)
        assert (await client.get("/healthz")).status_code == 200  # it goes on serving


async def test_a_full_queue_answers_503_at_once() -> None:
    async with held_gateway(max_per_model=2) as (gateway, client):
        held = [asyncio.create_task(client.post("/v1/completions", json=BODY)) for _ in range(2)]
        await until(lambda: waiting(gateway) == 2, "two requests held")
        reply = await client.post("/v1/completions", json=BODY)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "5"
        assert "2 requests already wait for one" in reply.json()["error"]["message"]
        assert waiting(gateway) == 2  # the two held stay held
        gateway.table.set_scalable([])  # the deployment left mode "act": withdrawn
        replies = await asyncio.gather(*held)
        assert [r.status_code for r in replies] == [404, 404]  # no replica of it at all
        assert gateway.holding.ended == {("m", "full"): 1, ("m", "withdrawn"): 2}


async def test_a_gateway_that_holds_none_says_so() -> None:
    async with held_gateway(max_per_model=0) as (gateway, client):
        reply = await client.post("/v1/completions", json=BODY)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "5"
        assert "holds no requests (--hold-queue 0)" in reply.json()["error"]["message"]
        assert gateway.holding.waiting() == {}


async def test_a_client_that_leaves_is_dropped_from_the_queue() -> None:
    async with held_gateway() as (gateway, client):
        task = asyncio.create_task(client.post("/v1/completions", json=BODY))
        await until(lambda: waiting(gateway) == 1, "a request held")
        task.cancel()  # the client closes its connection
        await asyncio.gather(task, return_exceptions=True)
        await until(lambda: waiting(gateway) == 0, "the queue emptied")
        assert gateway.holding.ended == {("m", "gone"): 1}


async def test_models_that_are_not_scalable_are_not_held() -> None:
    async with held_gateway() as (gateway, client):
        gateway.table.upsert(Target("o-1", "other", "http://127.0.0.1:9", ready=False))
        reply = await client.post("/v1/completions", json={**BODY, "model": "other"})
        assert reply.status_code == 503 and "retry-after" not in reply.headers
        reply = await client.post("/v1/completions", json={**BODY, "model": "nope"})
        assert reply.status_code == 404
        assert gateway.holding.ended == {}


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"max_per_model": -1}, "max_per_model"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"retry_after_s": 0}, "retry_after_s"),
    ],
)
def test_hold_limits_are_checked(fields: dict[str, float], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        HoldConfig(**fields)  # type: ignore[arg-type]
