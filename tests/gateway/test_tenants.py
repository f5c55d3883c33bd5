"""Tenants' keys at the gateway (llmgw.gateway.tenants, tenantmeter; issue #18's gateway half).

The feed's TenantKeys replace the registry's set; a gateway on 127.0.0.1:0 in front of a
small upstream that answers with the engine's ``usage`` (whole or streamed) shows 401 (unknown,
expired), 403 (a model outside the key's), 429 with Retry-After and ``x-ratelimit-*`` for
rpm, tpm and concurrency on a fake clock, tpm corrected by usage, the metering on /metrics
and in the report's rows, and flat keys working beside tenant keys.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from llmgw.api.llmgw.v1 import (
    KeyAllowance,
    RouterFeedEvent,
    RouterReport,
    RouterReportAck,
    RouterSnapshot,
    TenantKey,
    TenantKeys,
)
from llmgw.gateway.apikeys import UNAUTHORIZED_BODY, ApiKeys
from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.errors import RateLimited
from llmgw.gateway.feed import apply_feed_event
from llmgw.gateway.openai import render_messages
from llmgw.gateway.reporter import ReportConfig, report_once
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.gateway.stats import tenant_usage
from llmgw.gateway.tenantmeter import Usage
from llmgw.gateway.tenants import EXPIRED_BODY, TenantRegistry, Window, estimate_tokens

SECRET_A = "sk-tenant-a-5e1f09"
SECRET_B = "sk-tenant-b-77c3aa"
FLAT = "sk-flat-client-0d41"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
EST = estimate_tokens(render_messages(CHAT["messages"]), 10)  # type: ignore[arg-type]
"""CHAT's admission estimate: its rendered prompt's characters / 4 + max_tokens."""
USAGE = {
    "prompt_tokens": 40,
    "completion_tokens": 7,
    "prompt_tokens_details": {"cached_tokens": 32},
}


def tenant_key(
    secret: str, key_id: str = "k1", tenant: str = "acme", **limits: object
) -> TenantKey:
    digest = hashlib.sha256(secret.encode()).digest()
    return TenantKey(key_id=key_id, tenant=tenant, digest=digest, **limits)  # type: ignore[arg-type]


def keys_event(*keys: TenantKey) -> RouterFeedEvent:
    return RouterFeedEvent(revision=1, tenant_keys=TenantKeys(keys=list(keys)))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0  # monotonic seconds
        self.wall = 1_800_000_000.0  # seconds since the epoch


# --- the pure parts ------------------------------------------------------------------------


def test_the_feed_replaces_the_set_and_a_kept_key_keeps_its_window() -> None:
    table, clock = RoutingTable(), Clock()
    registry = TenantRegistry(clock=lambda: clock.now, wall=lambda: clock.wall)
    gateway = Gateway(table, GatewayConfig(port=0, engine_poll_s=0), tenants=registry)
    assert gateway.tenants is registry and not registry.required
    apply_feed_event(table, keys_event(tenant_key(SECRET_A, rpm=5), tenant_key(SECRET_B, "k2")))
    a = registry.lookup(f"Bearer {SECRET_A}".encode())
    assert a is not None and a.key.key_id == "k1" and registry.required
    registry.admit(a, "m", "m", 1).close()
    apply_feed_event(table, RouterFeedEvent(snapshot=RouterSnapshot()))  # keys stay
    apply_feed_event(table, keys_event(tenant_key(SECRET_A, rpm=5)))  # k2 revoked
    assert registry.lookup(f"Bearer {SECRET_B}".encode()) is None
    again = registry.lookup(f"Bearer {SECRET_A}".encode())
    assert again is a and len(a.requests.entries) == 1  # its minute goes on
    apply_feed_event(table, keys_event())
    assert not registry.required and registry.lookup(f"Bearer {SECRET_A}".encode()) is None


def test_a_key_without_a_digest_is_ignored() -> None:
    registry = TenantRegistry()
    registry.replace([TenantKey(key_id="bad", tenant="t", digest=b"short")])
    assert not registry.required


def test_the_31st_request_of_a_minute_at_rpm_30_is_refused_until_the_first_leaves() -> None:
    clock = Clock()
    registry = TenantRegistry(clock=lambda: clock.now)
    registry.replace([tenant_key(SECRET_A, rpm=30)])
    state = registry.lookup(f"Bearer {SECRET_A}".encode())
    assert state is not None
    start = clock.now
    for i in range(30):
        clock.now = start + i  # one a second
        registry.admit(state, "m", "m", 0).close()
    clock.now = start + 59.5
    with pytest.raises(RateLimited) as refused:
        registry.admit(state, "m", "m", 0)
    assert refused.value.retry_after_s == 1
    assert b"x-ratelimit-remaining-requests: 0\r\n" in refused.value.headers
    clock.now = start + 60.0  # the first request has left the window
    registry.admit(state, "m", "m", 0).close()
    with pytest.raises(RateLimited, match="30 per minute"):
        registry.admit(state, "m", "m", 0)


def test_tpm_is_corrected_to_the_engines_usage() -> None:
    clock = Clock()
    registry = TenantRegistry(clock=lambda: clock.now)
    registry.replace([tenant_key(SECRET_A, tpm=100)])
    state = registry.lookup(f"Bearer {SECRET_A}".encode())
    assert state is not None
    ticket = registry.admit(state, "m", "m", 90)
    with pytest.raises(RateLimited, match="tokens: 100 per minute"):
        registry.admit(state, "m", "m", 20)
    ticket.answered(Usage(prompt=30, completion=10, cached=0), 0.5)
    ticket.close()
    assert state.tokens.total == 40
    registry.admit(state, "m", "m", 60).close()  # 40 + 60 fits exactly
    with pytest.raises(RateLimited, match="exceed the 100 per minute") as too_big:
        registry.admit(state, "m", "m", 101)
    assert too_big.value.retry_after_s == 60


def test_a_window_says_when_it_has_room() -> None:
    window = Window()
    for at, amount in ((0.0, 10), (20.0, 30), (40.0, 5)):
        window.add(at, amount)
    assert window.wait_for(35, 50.0) == pytest.approx(30.0)  # after the second leaves
    window.expire(60.0)
    assert window.total == 35 and window.reset_s(60.0) == pytest.approx(40.0)


def test_the_estimate_is_chars_over_4_plus_max_tokens() -> None:
    assert estimate_tokens("x" * 9, 10) == 13 and estimate_tokens("", 0) == 0


# --- the gateway over loopback -------------------------------------------------------------


class Upstream:
    """A replica stand-in answering with usage, whole or streamed; ``gate`` holds answers."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.gate: asyncio.Event | None = None
        self.arrived = asyncio.Event()  # set once a request has been read
        self.seen = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in head[1:] if ": " in line)
        body = json.loads(await reader.readexactly(int(headers.get("content-length", "0"))))
        self.seen += 1
        self.arrived.set()
        if self.gate is not None:
            await self.gate.wait()
        if body.get("stream"):
            chunks = [
                b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n',
                b'data: {"choices":[],"usage":{"prompt_tok',  # a key split between pieces
                b'ens":40,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":32}}}\n\n',
                b"data: [DONE]\n\n",
            ]
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
            )
            for chunk in chunks:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        else:
            answer = json.dumps({"object": "chat.completion", "choices": [], "usage": USAGE})
            data = answer.encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(data), data)
            )
        await writer.drain()
        writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    try:
        yield up
    finally:
        await up.stop()


async def serve(
    upstream: Upstream, clock: Clock, *keys: TenantKey, flat: ApiKeys | None = None
) -> tuple[Gateway, str]:
    url = await upstream.start()
    table = RoutingTable([Target("r1", "m", url), Target("r2", "other", url)])
    registry = TenantRegistry(clock=lambda: clock.now, wall=lambda: clock.wall)
    config = GatewayConfig(
        port=0, policy="round_robin", engine_poll_s=0, api_keys=flat or ApiKeys()
    )
    gateway = Gateway(table, config, tenants=registry)
    apply_feed_event(table, keys_event(*keys))
    host, port = await gateway.start()
    return gateway, f"http://{host}:{port}"


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


async def test_unknown_expired_and_forbidden_model(upstream: Upstream) -> None:
    clock = Clock()
    expiring = tenant_key(SECRET_B, "k2", expires_unix_ms=int(clock.wall * 1000) + 5000)
    gateway, url = await serve(upstream, clock, tenant_key(SECRET_A, models=["m"]), expiring)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for headers in ({}, bearer("sk-nobody")):
                answer = await http.post("/v1/chat/completions", json=CHAT, headers=headers)
                assert answer.status_code == 401 and answer.content == UNAUTHORIZED_BODY
            assert (await http.get("/healthz")).status_code == 200
            ok = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(SECRET_B))
            assert ok.status_code == 200
            clock.wall += 5  # the key's expiry
            late = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(SECRET_B))
            assert late.status_code == 401 and late.content == EXPIRED_BODY
            assert "expired" in late.json()["error"]["message"]
            other = {**CHAT, "model": "other"}
            forbidden = await http.post(
                "/v1/chat/completions", json=other, headers=bearer(SECRET_A)
            )
            error = forbidden.json()["error"]
            assert forbidden.status_code == 403 and error["type"] == "PermissionDeniedError"
            assert "`other`" in error["message"] and error["param"] == "model"
            models = await http.get("/v1/models", headers=bearer(SECRET_A))
            assert [m["id"] for m in models.json()["data"]] == ["m"]
            apply_feed_event(gateway.table, keys_event(expiring))  # k1 revoked: refused at once
            gone = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(SECRET_A))
            assert gone.status_code == 401
            metrics = (await http.get("/metrics")).text
    finally:
        await gateway.stop()
    refused = 'llmgw_tenant_refused_total{tenant="acme",key="k1",model="other",reason="model"} 1'
    assert refused in metrics


async def test_429_with_retry_after_and_ratelimit_headers(upstream: Upstream) -> None:
    clock = Clock()
    gateway, url = await serve(upstream, clock, tenant_key(SECRET_A, rpm=2, tpm=1000))
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            first = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(SECRET_A))
            assert first.status_code == 200
            assert first.headers["x-ratelimit-limit-requests"] == "2"
            assert first.headers["x-ratelimit-remaining-requests"] == "1"
            assert first.headers["x-ratelimit-reset-requests"] == "1m0s"
            assert first.headers["x-ratelimit-limit-tokens"] == "1000"
            # admitted at the estimate, then corrected to 47 by the usage
            assert first.headers["x-ratelimit-remaining-tokens"] == str(1000 - EST)
            clock.now += 30
            second = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(SECRET_A))
            assert second.headers["x-ratelimit-remaining-tokens"] == str(1000 - 47 - EST)
            assert second.headers["x-ratelimit-reset-requests"] == "1m0s"
            clock.now += 10.5
            third = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(SECRET_A))
            assert third.status_code == 429
            assert third.headers["retry-after"] == "20"  # the first leaves at 60 s (19.5 up)
            assert third.headers["x-ratelimit-remaining-requests"] == "0"
            error = third.json()["error"]
            assert error["type"] == "RateLimitError" and error["code"] == "rate_limit_exceeded"
            clock.now += 19.5
            fourth = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(SECRET_A))
            assert fourth.status_code == 200
    finally:
        await gateway.stop()
    assert upstream.seen == 3


async def test_tpm_refusal_counts_streamed_usage(upstream: Upstream) -> None:
    clock = Clock()
    gateway, url = await serve(upstream, clock, tenant_key(SECRET_A, tpm=100))
    streamed = {**CHAT, "stream": True}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            one = await http.post("/v1/chat/completions", json=streamed, headers=bearer(SECRET_A))
            assert one.status_code == 200 and "[DONE]" in one.text
            two = await http.post("/v1/chat/completions", json=streamed, headers=bearer(SECRET_A))
            assert two.status_code == 200
            assert two.headers["x-ratelimit-remaining-tokens"] == str(100 - 47 - EST)
            # 94 counted by usage: EST more no longer fit
            three = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(SECRET_A))
            assert three.status_code == 429 and three.headers["retry-after"] == "60"
    finally:
        await gateway.stop()
    state = gateway.tenants.lookup(f"Bearer {SECRET_A}".encode())
    assert state is not None and state.tokens.total == 94


async def test_concurrency_limit(upstream: Upstream) -> None:
    clock = Clock()
    gateway, url = await serve(upstream, clock, tenant_key(SECRET_A, max_concurrency=1))
    upstream.gate = asyncio.Event()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            held = asyncio.create_task(
                http.post("/v1/chat/completions", json=CHAT, headers=bearer(SECRET_A))
            )
            await asyncio.wait_for(upstream.arrived.wait(), 5)
            refused = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(SECRET_A))
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert "in flight" in refused.json()["error"]["message"]
            upstream.gate.set()
            assert (await held).status_code == 200
            again = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(SECRET_A))
            assert again.status_code == 200
            metrics = (await http.get("/metrics")).text
    finally:
        await gateway.stop()
    labels = 'tenant="acme",key="k1",model="m"'
    assert f'llmgw_tenant_refused_total{{{labels},reason="concurrency"}} 1' in metrics


async def test_metering_on_metrics_and_in_the_report(upstream: Upstream) -> None:
    clock = Clock()
    gateway, url = await serve(
        upstream, clock, tenant_key(SECRET_A), tenant_key(SECRET_B, "k2", "beta", rpm=1)
    )
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for body in (CHAT, {**CHAT, "stream": True}):
                answer = await http.post(
                    "/v1/chat/completions", json=body, headers=bearer(SECRET_A)
                )
                assert (
                    answer.status_code == 200 and "x-ratelimit-limit-requests" not in answer.headers
                )
            for status in (200, 429):
                answer = await http.post(
                    "/v1/chat/completions", json=CHAT, headers=bearer(SECRET_B)
                )
                assert answer.status_code == status
            metrics = (await http.get("/metrics")).text
    finally:
        await gateway.stop()
    a = 'tenant="acme",key="k1",model="m"'
    assert f"llmgw_tenant_requests_total{{{a}}} 2" in metrics
    assert f'llmgw_tenant_tokens_total{{{a},kind="prompt_cached"}} 64' in metrics
    assert f'llmgw_tenant_tokens_total{{{a},kind="prompt_uncached"}} 16' in metrics
    assert f'llmgw_tenant_tokens_total{{{a},kind="completion"}} 14' in metrics
    assert f"llmgw_tenant_gpu_seconds_total{{{a}}} " in metrics
    b = 'tenant="beta",key="k2",model="m"'
    assert f'llmgw_tenant_refused_total{{{b},reason="rpm"}} 1' in metrics
    rows = {(r.tenant, r.key_id, r.model): r for r in tenant_usage(gateway)}
    row = rows["acme", "k1", "m"]
    assert (row.requests, row.refused, row.prompt_tokens) == (2, 0, 80)
    assert (row.cached_prompt_tokens, row.completion_tokens) == (64, 14)
    assert row.gpu_seconds > 0
    assert (rows["beta", "k2", "m"].requests, rows["beta", "k2", "m"].refused) == (1, 1)


async def test_flat_keys_keep_working_beside_tenant_keys(upstream: Upstream) -> None:
    clock = Clock()
    gateway, url = await serve(
        upstream, clock, tenant_key(SECRET_A, models=["other"]), flat=ApiKeys.of([FLAT])
    )
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            flat = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(FLAT))
            assert flat.status_code == 200 and "x-ratelimit-limit-tokens" not in flat.headers
            models = await http.get("/v1/models", headers=bearer(FLAT))
            assert [m["id"] for m in models.json()["data"]] == ["m", "other"]
            assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 401
            mine = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(SECRET_A))
            assert mine.status_code == 403
        apply_feed_event(gateway.table, keys_event())  # no tenant keys: the flat file alone
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 401
            again = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(FLAT))
            assert again.status_code == 200
    finally:
        await gateway.stop()
    assert tenant_usage(gateway)[0].refused == 1


async def test_the_report_carries_the_usage_rows(upstream: Upstream) -> None:
    clock = Clock()
    gateway, url = await serve(upstream, clock, tenant_key(SECRET_A, rpm=1))
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for _ in range(2):
                await http.post("/v1/chat/completions", json=CHAT, headers=bearer(SECRET_A))
    finally:
        await gateway.stop()
    sent: list[RouterReport] = []

    class Stub:  # a server answering this gateway its part: rpm 7 of the key's
        async def report(self, report: RouterReport, **_: object) -> RouterReportAck:
            sent.append(report)
            return RouterReportAck(allowances=[KeyAllowance(key_id="k1", rpm=7)])

    config = ReportConfig(gateway_id="g1", started_at_unix_ms=1)
    await report_once(Stub(), gateway, config)  # type: ignore[arg-type]
    [row] = sent[0].usage
    assert (row.tenant, row.key_id, row.model, row.requests, row.refused) == (
        "acme",
        "k1",
        "m",
        1,
        1,
    )
    assert (row.prompt_tokens, row.cached_prompt_tokens, row.completion_tokens) == (40, 32, 7)
    [window] = sent[0].windows  # what it holds of the key's budget, for the split
    assert (window.key_id, window.requests, window.asked_requests) == ("k1", 1, 2)
    [state] = gateway.tenants._by_digest.values()
    assert state.rpm == 7  # the ack's part is what it enforces now
