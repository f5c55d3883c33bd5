"""bench/chaoskit/load.py: the load takes the gateways in turn and records which it went through."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from bench.chaoskit import load

GATEWAYS = {"gateway": "http://127.0.0.1:12001", "gateway-2": "http://127.0.0.1:12002"}


def _answer(request: httpx.Request) -> httpx.Response:
    """A gateway: 200 from the first, 503 from the second (so failures can be told apart)."""
    if request.url.port == 12002:
        return httpx.Response(503, text="hung")
    body = json.loads(request.content)
    headers = {"x-llmgw-replica": f"{body['model']}-0"}
    if body["stream"]:
        return httpx.Response(200, headers=headers, text='data: {"x": 1}\n\ndata: [DONE]\n\n')
    return httpx.Response(200, headers=headers, json={"choices": [{"text": "hi"}]})


async def _run(seed: int, seen: list[int], seconds: float = 0.4) -> list[load.RequestRecord]:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.port or 0)
        return _answer(request)

    config = load.LoadConfig(rate=100.0)
    run = load.Load(GATEWAYS, config, random.Random(seed), httpx.MockTransport(handler))
    stop = asyncio.Event()
    task = asyncio.create_task(run.run(stop))
    await asyncio.sleep(seconds)
    stop.set()
    await task
    return sorted(run.records, key=lambda r: r.started)


async def test_the_load_alternates_gateways_and_records_the_one_each_went_through() -> None:
    ports: list[int] = []
    records = await _run(3, ports)
    assert len(records) >= 10
    names = [r.gateway for r in records]
    assert names[:4] == ["gateway", "gateway-2", "gateway", "gateway-2"]
    assert abs(names.count("gateway") - names.count("gateway-2")) <= 1
    assert ports[:4] == [12001, 12002, 12001, 12002]  # sent where the record says
    assert all(r.ok == (r.gateway == "gateway") for r in records)
    assert all(r.status == (200 if r.ok else 503) for r in records)
    counts = load.by_gateway(records)
    assert counts["gateway-2"] == (names.count("gateway-2"), names.count("gateway-2"))
    assert counts["gateway"] == (names.count("gateway"), 0)


async def test_the_same_seed_sends_the_same_requests_through_the_same_gateways() -> None:
    first = await _run(11, [])
    second = await _run(11, [])
    other = await _run(12, [])
    n = min(len(first), len(second), len(other))
    assert n >= 8

    def shape(records: list[load.RequestRecord]) -> list[tuple[str, str, bool]]:
        return [(r.gateway, r.model, r.stream) for r in records[:n]]

    assert shape(first) == shape(second)
    assert shape(first) != shape(other)  # the seed decides (models and streaming)


def test_a_load_needs_a_gateway_and_takes_them_in_order() -> None:
    with pytest.raises(ValueError, match="at least one gateway"):
        load.Load({}, load.LoadConfig(), random.Random(1))
    run = load.Load(GATEWAYS, load.LoadConfig(), random.Random(1))
    assert [run.next_gateway()[0] for _ in range(5)] == [
        "gateway", "gateway-2", "gateway", "gateway-2", "gateway"
    ]  # fmt: skip
    one = load.Load({"gateway": GATEWAYS["gateway"]}, load.LoadConfig(), random.Random(1))
    assert {one.next_gateway() for _ in range(3)} == {("gateway", GATEWAYS["gateway"])}
