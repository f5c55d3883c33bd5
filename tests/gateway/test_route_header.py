"""``x-llmgw-route`` on answers, the ring of decisions, and the engine's cached tokens read
from the body as it passes (llmgw.gateway.app, proxy, routelog, reusecheck, stats).

The gateway runs on 127.0.0.1:0 in front of a stand-in replica that answers with a usage
block whose ``"cached_tokens":`` key it writes split over two pieces, with a pause between.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.gateway.apikeys import ApiKeys
from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.openai import render_messages
from llmgw.gateway.proxy import Exchange
from llmgw.gateway.reusecheck import ReuseCheck
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.gateway.stats import router_stats

NO_KEYS = ApiKeys()
CLIENT, EXPLAINER = "sk-client-7a1f", "sk-ops-52c9d0"
MESSAGES: list[Any] = [{"role": "user", "content": "hello there"}]
CHAT = {"model": "m", "messages": MESSAGES}
HEAD = b'{"object":"chat.completion","choices":[],"usage":{"prompt_tokens":40,"prompt_tokens_'
TAIL = b'details":{"cached_tokens":32}}}'


class Replica:
    """Answers every request with HEAD then TAIL, in two writes (``"cached_tokens"`` whole
    in TAIL; the split is inside ``prompt_tokens_details``); streamed as chunks when
    ``chunked``, so the split reaches the gateway as two pieces."""

    def __init__(self, *, chunked: bool) -> None:
        self.chunked = chunked
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in head[1:] if ": " in line)
        await reader.readexactly(int(headers.get("content-length", "0")))
        split = len(TAIL) // 2  # in the middle of "cached_tokens"
        first, second = HEAD + TAIL[:split], TAIL[split:]
        if self.chunked:
            writer.write(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
            )
            for piece in (first, second):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
                await asyncio.sleep(0.05)
            writer.write(b"0\r\n\r\n")
        else:
            length = len(first) + len(second)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % length
            )
            writer.write(first)
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(second)
        await writer.drain()
        writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture(params=[False, True], ids=["whole", "chunked"])
async def replica(request: pytest.FixtureRequest) -> AsyncIterator[Replica]:
    up = Replica(chunked=request.param)
    try:
        yield up
    finally:
        await up.stop()


async def serve(
    replica: Replica, api_keys: ApiKeys = NO_KEYS, explain_keys: ApiKeys = NO_KEYS
) -> tuple[Gateway, str]:
    table = RoutingTable([Target("r1", "m", await replica.start())])
    config = GatewayConfig(port=0, engine_poll_s=0, api_keys=api_keys, explain_keys=explain_keys)
    gateway = Gateway(table, config)
    host, port = await gateway.start()
    return gateway, f"http://{host}:{port}"


def asking(key: str | None = None) -> dict[str, str]:
    headers = {"x-llmgw-explain": "1"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return headers


async def test_an_open_gateway_explains_only_when_asked(replica: Replica) -> None:
    gateway, url = await serve(replica)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            asked = await http.post("/v1/chat/completions", json=CHAT, headers=asking())
            plain = await http.post("/v1/chat/completions", json=CHAT)
            again = await http.post("/v1/chat/completions", json=CHAT, headers=asking())
        assert plain.status_code == asked.status_code == 200
        assert "x-llmgw-route" not in plain.headers
        route = asked.headers["x-llmgw-route"]
        assert route.startswith("tier=load; replica=r1; matched=0/")
        assert route.endswith("reason=fallback-approximate-miss because no_events")
        text = len(render_messages(MESSAGES))  # what the tree learnt
        assert again.headers["x-llmgw-route"] == (
            f"tier=approximate; replica=r1; matched={text}/{text} chars; "
            "reason=fallback-approximate-hit because no_events"
        )
        assert asked.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    finally:
        await gateway.stop()


async def test_with_client_keys_only_an_explain_key_sees_the_route(replica: Replica) -> None:
    gateway, url = await serve(replica, ApiKeys.of([CLIENT]), ApiKeys.of([EXPLAINER]))
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            client = await http.post("/v1/chat/completions", json=CHAT, headers=asking(CLIENT))
            ops = await http.post("/v1/chat/completions", json=CHAT, headers=asking(EXPLAINER))
            wrong = await http.post("/v1/chat/completions", json=CHAT, headers=asking("sk-no"))
        assert client.status_code == 200 and "x-llmgw-route" not in client.headers
        assert ops.status_code == 200 and "replica=r1" in ops.headers["x-llmgw-route"]
        assert wrong.status_code == 401 and "x-llmgw-route" not in wrong.headers
    finally:
        await gateway.stop()


async def test_client_keys_without_explain_keys_explain_to_nobody(replica: Replica) -> None:
    gateway, url = await serve(replica, api_keys=ApiKeys.of([CLIENT]))
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            answer = await http.post("/v1/chat/completions", json=CHAT, headers=asking(CLIENT))
        assert answer.status_code == 200 and "x-llmgw-route" not in answer.headers
    finally:
        await gateway.stop()


async def test_decisions_are_kept_with_the_cached_tokens_the_engine_reported(
    replica: Replica,
) -> None:
    gateway, url = await serve(replica)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for _ in range(3):
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            metrics = (await http.get("/metrics")).text
        stats = router_stats(gateway, 0)
        assert len(stats.recent_decisions) == 3
        last = stats.recent_decisions[-1]
        assert (last.model, last.replica_id, last.cached_tokens) == ("m", "r1", 32)
        assert last.fallback == "no_events" and last.predicted_tokens is None
        assert [c.replica_id for c in last.candidates] == ["r1"]
        assert 'llmgw_route_cached_tokens_total{tier="load"} 32' in metrics  # the first
        assert 'llmgw_route_cached_tokens_total{tier="approximate"} 64' in metrics
        assert 'llmgw_route_answers_total{tier="approximate"} 2' in metrics
    finally:
        await gateway.stop()


def test_the_gap_is_counted_per_checked_request() -> None:
    check = ReuseCheck()
    check.answered("precise", 96, 96, 100)  # as predicted
    check.answered("precise", 0, 96, 100)  # predicted 96, the engine found nothing
    check.answered("precise", None, 96, 100)  # the engine said nothing: not checked
    check.answered("approximate", 64, None, 0)  # counted, not checked
    totals = check.totals()
    assert (totals.predicted, totals.cached, totals.gap, totals.checked, totals.prompt) == (
        192,
        96,
        96,
        2,
        200,
    )
    text = "\n".join(check.lines())
    assert 'llmgw_route_reuse_gap_ratio_bucket{tier="precise",le="0.0"} 1' in text
    assert 'llmgw_route_reuse_gap_ratio_bucket{tier="precise",le="0.5"} 1' in text
    assert 'llmgw_route_reuse_gap_ratio_bucket{tier="precise",le="1.0"} 2' in text
    assert 'llmgw_route_cached_tokens_total{tier="approximate"} 64' in text


class _Client:
    """The least of an HttpConnection an Exchange writes to."""

    started = False
    chunked_ok = True

    def write(self, data: bytes) -> None:
        pass

    def connection_header(self) -> bytes:
        return b""


@settings(max_examples=200, deadline=None)
@given(
    before=st.binary(max_size=300).map(lambda b: b.replace(b'"', b"'")),
    value=st.integers(0, 10**9),
    spaces=st.sampled_from([b"", b" ", b"\n  "]),
    cuts=st.lists(st.integers(0, 400), max_size=6),
)
async def test_the_cached_tokens_are_found_however_the_body_is_cut(
    before: bytes, value: int, spaces: bytes, cuts: list[int]
) -> None:
    body = before + b'"cached_tokens":' + spaces + str(value).encode() + b"}}}"
    exchange = Exchange(
        _Client(),  # type: ignore[arg-type]
        may_retry=False,
        metrics=GatewayMetrics(),
        model="m",
        stream=False,
        replica="r1",
    )
    exchange.upstream_head(200, [], len(body))
    edges = sorted({0, len(body), *(c for c in cuts if c < len(body))})
    for start, end in itertools.pairwise(edges):
        exchange.upstream_body(body[start:end])
    assert exchange.cached_tokens == value


async def test_a_failed_answer_is_not_searched() -> None:
    exchange = Exchange(
        _Client(),  # type: ignore[arg-type]
        may_retry=False,
        metrics=GatewayMetrics(),
        model="m",
        stream=False,
        replica="r1",
    )
    exchange.upstream_head(400, [], None)
    exchange.upstream_body(b'{"error": {"message": "\\"cached_tokens\\":5"}, "cached_tokens":7}')
    assert exchange.cached_tokens is None
