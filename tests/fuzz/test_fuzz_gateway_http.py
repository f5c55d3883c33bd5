"""Fuzzing the gateway over real sockets on 127.0.0.1: arbitrary bytes from clients to its
HTTP/1.1 server (request lines, headers, Content-Length and chunked bodies, pipelining,
Expect, upgrades), and arbitrary answers from an engine to the clients the gateway runs
against replicas (the precise tier's ``/tokenize`` client, the ``/metrics`` poller).

What must hold: a client gets well-formed HTTP/1.1 responses with a status the gateway
documents, never a 500, or a closed connection; other clients go on being served; a
thousand malformed requests leave no memory behind. A tokenize call returns tokens or one
of its documented failure reasons within its timeout; a poll ends with a counted outcome.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from fuzzkit import async_growth, examples, openai_bodies
from hypothesis import event, example, given
from hypothesis import strategies as st

from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.engines import QUERIES, EnginePoller, PollerConfig
from llmgw.gateway.httplimits import ServerLimits
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.gateway.tokenize import TokenizeClient, TokenizeConfig
from llmgw.gateway.upstream import UpstreamPool

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(120)]

ANSWERED = {100, 200, 400, 403, 404, 405, 408, 413, 431, 502, 503, 504}
COMPLETION = json.dumps({"id": "c", "choices": [{"text": "Paris"}]}).encode()
COMPLETED = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
COMPLETED = COMPLETED % len(COMPLETION) + COMPLETION


# --- a replica whose answers the test scripts ----------------------------------------------


@dataclass
class FakeEngine:
    """Answers completions with JSON; ``/tokenize`` and ``/metrics`` with scripted raw bytes
    (then closes: a scripted answer may leave the connection in any state)."""

    scripted: deque[bytes] = field(default_factory=deque)
    server: asyncio.Server | None = None
    port: int = 0
    requests: int = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests += 1
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                if head.startswith((b"POST /tokenize", b"GET /metrics")) and self.scripted:
                    writer.write(self.scripted.popleft())
                    await writer.drain()
                    return
                writer.write(COMPLETED)
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine()
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


@dataclass
class Running:
    gateway: Gateway
    port: int
    engine: FakeEngine


@pytest.fixture
async def running(engine: FakeEngine) -> AsyncIterator[Running]:
    table = RoutingTable([Target("r1", "m", engine.url)])
    config = GatewayConfig(
        port=0, engine_poll_s=0, limits=ServerLimits(max_body_bytes=4096), policy="session"
    )
    async with Gateway(table, config) as gateway:
        assert gateway._server is not None
        port = next(iter(gateway._server._server.sockets)).getsockname()[1]  # type: ignore[union-attr]
        yield Running(gateway, port, engine)


# --- talking to it raw ---------------------------------------------------------------------


async def exchange(port: int, pieces: list[bytes], idle_s: float = 0.15) -> bytes:
    """Send ``pieces`` (one write each) and read until the gateway closes or goes quiet."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = bytearray()
    try:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
        while True:
            try:
                async with asyncio.timeout(idle_s):
                    chunk = await reader.read(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            received += chunk
    except ConnectionError:
        pass  # reset after a refusal: what was read still counts
    finally:
        writer.close()
        await asyncio.gather(writer.wait_closed(), return_exceptions=True)
    return bytes(received)


_STATUS = re.compile(rb"HTTP/1\.1 (\d{3}) [^\r\n]*\r\n")


def responses(data: bytes) -> list[int]:
    """The statuses of the complete responses in ``data``; the gateway frames every body
    with Content-Length. A response cut short at the end is allowed (the connection closed)."""
    statuses = []
    while data:
        match = _STATUS.match(data)
        assert match is not None, data[:200]
        head_end = data.find(b"\r\n\r\n")
        if head_end < 0:
            break
        head, data = data[: head_end + 4], data[head_end + 4 :]
        status = int(match.group(1))
        statuses.append(status)
        length = re.search(rb"(?i)\r\ncontent-length: (\d+)\r\n", head)
        assert length is not None or status == 100, head
        data = data[int(length.group(1)) if length else 0 :]
    return statuses


def post(body: bytes, headers: bytes = b"") -> bytes:
    """A well-formed completions request carrying ``body``."""
    head = b"POST /v1/completions HTTP/1.1\r\nhost: [::1]\r\n%scontent-length: %d\r\n\r\n"
    return head % (headers, len(body)) + body


async def healthy(port: int) -> None:
    request = b"GET /healthz HTTP/1.1\r\nhost: [::1]\r\nconnection: close\r\n\r\n"
    reply = await exchange(port, [request])
    assert responses(reply) == [200], reply


# --- what clients send ---------------------------------------------------------------------

_METHODS = st.sampled_from([b"POST", b"GET", b"PUT", b"HEAD", b"OPTIONS", b"post", b"G\x00T", b""])
_TARGETS = st.sampled_from(
    [b"/v1/completions", b"/v1/chat/completions", b"/v1/models", b"/metrics", b"/healthz",
     b"/x", b"*", b"http://h/v1/models", b"/v1/completions?x=1", b"/%00", b"/" + b"a" * 5000]
) | st.binary(max_size=8)  # fmt: skip
_VERSIONS = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b"", b"http/1.1"])
_GOOD_HEADERS = st.sampled_from(
    [b"host: [::1]", b"connection: close", b"connection: keep-alive", b"expect: 100-continue",
     b"x-session-id: s\xff", b"x-session-id: a", b"content-type: application/json",
     b"accept: */*", b"user-agent: fuzz", b"x-a:\tb "]
)  # fmt: skip
_ODD_HEADERS = st.sampled_from(
    [b"connection: upgrade", b"upgrade: websocket", b"expect: 200-ok", b"content-length: 0",
     b"content-length: 5", b"content-length: -1", b"content-length: 99999999999999999999",
     b"content-length: 0x10", b"content-length: 5\r\ncontent-length: 6",
     b"transfer-encoding: chunked", b"transfer-encoding: gzip, chunked",
     b"transfer-encoding: identity", b"no colon here", b" folded: continuation",
     b"x: " + b"v" * 70_000, b"\x00: \x00"]
) | st.binary(max_size=12)  # fmt: skip
_HEADERS = st.one_of(_GOOD_HEADERS, _GOOD_HEADERS, _GOOD_HEADERS, _GOOD_HEADERS, _ODD_HEADERS)


@st.composite
def _body(draw: st.DrawFn) -> bytes:
    body = draw(openai_bodies() | st.binary(max_size=40))
    framing = draw(st.sampled_from(["length"] * 5 + ["chunked"] * 2 + ["bad-chunked", "raw"]))
    if framing == "length":
        return b"content-length: %d\r\n\r\n%s" % (len(body), body)
    if framing == "chunked":
        return b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    if framing == "bad-chunked":
        size = draw(st.sampled_from([b"zz", b"-1", b"ffffffffffffffffffff", b"1;ext=\x00", b""]))
        return b"transfer-encoding: chunked\r\n\r\n" + size + b"\r\n" + body + b"\r\n0\r\n\r\n"
    return b"\r\n" + body


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    line = b" ".join([draw(_METHODS), draw(_TARGETS), draw(_VERSIONS)])
    if draw(st.integers(0, 3)):  # mostly a well-formed start
        line = b"POST " + draw(st.sampled_from([b"/v1/completions", b"/v1/chat/completions"]))
        line += b" HTTP/1.1"
    headers = b"".join(h + b"\r\n" for h in draw(st.lists(_HEADERS, max_size=4)))
    return line + b"\r\n" + headers + draw(_body())


@st.composite
def conversations(draw: st.DrawFn) -> list[bytes]:
    """One to three requests, pipelined, maybe with trailing garbage, cut into writes."""
    data = b"".join(draw(st.lists(requests(), min_size=1, max_size=3)))
    data += draw(st.just(b"") | st.binary(max_size=8))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=2)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


# --- the gateway's own server ------------------------------------------------------------


@examples(60, shared_fixture=True)
@given(conversations())
@example([post(b'{"model":"m","prompt":"a","user":"\\udc00"}')])
@example([post(b'{"model":"m","prompt":"\\ud800"}', b"connection: close\r\n")])
@example([b"POST /v1/completions HTTP/1.1\r\nhost: [::1]\r\ntransfer-encoding: chunked\r\n\r\n"
          b"ffffffffffffffffffff\r\n"])  # fmt: skip
async def test_any_bytes_get_documented_answers_and_the_gateway_keeps_serving(
    running: Running, pieces: list[bytes]
) -> None:
    """The first example was found by this suite: with the session policy a well-formed
    request whose "user" held a lone surrogate was answered 500."""
    statuses = responses(await exchange(running.port, pieces))
    event(f"statuses: {sorted(set(statuses))}")
    assert set(statuses) <= ANSWERED, statuses
    assert len([s for s in statuses if s != 100]) <= 3
    await healthy(running.port)


async def test_a_thousand_malformed_requests_leave_no_memory_behind(running: Running) -> None:
    malformed = [b"GARBAGE %d\r\n\r\n" % i for i in range(1000)]

    async def send_all() -> None:
        for request in malformed:
            assert responses(await exchange(running.port, [request], idle_s=5)) == [400]

    assert await async_growth(send_all, rounds=1) < 256 * 1024
    await healthy(running.port)


async def test_clients_that_never_finish_do_not_stop_others_being_served(
    running: Running,
) -> None:
    stalled = []
    started = b"POST /v1/completions HTTP/1.1\r\nhost: [::1]\r\ncontent-length: 100\r\n\r\n{"
    for i in range(20):
        _, writer = await asyncio.open_connection("127.0.0.1", running.port)
        writer.write(started * (i % 2))
        stalled.append(writer)
    try:
        body = b'{"model":"m","prompt":"hi"}'
        head = b"POST /v1/completions HTTP/1.1\r\nhost: [::1]\r\nconnection: close\r\n"
        head += b"content-length: %d\r\n\r\n"
        reply = await exchange(running.port, [head % len(body) + body], idle_s=5)
        assert responses(reply) == [200] and reply.endswith(COMPLETION)
    finally:
        for writer in stalled:
            writer.close()


# --- what replicas answer ------------------------------------------------------------------

_TOKENS_JSON = st.one_of(
    st.lists(st.integers(0, 2**32 - 1), max_size=8).map(lambda t: {"tokens": t, "count": len(t)}),
    st.fixed_dictionaries({}, optional={"tokens": st.lists(st.integers() | st.floats() | st.text(
        max_size=2), max_size=4) | st.integers(), "count": st.integers(-1, 9)}),
).map(lambda d: json.dumps(d).encode())  # fmt: skip
_STATUS_LINES = st.sampled_from(
    [b"HTTP/1.1 200 OK"] * 4 + [b"HTTP/1.1 500 Internal Server Error", b"HTTP/1.0 200 OK",
     b"HTTP/1.1 200", b"HTTP/1.1 999 X", b"HTTP/2 200", b"garbage", b"",
     b"HTTP/1.1 101 Switching Protocols", b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK",
     b"HTTP/1.1 204 No Content", b"HTTP/1.1 200 OK\r\n" + b"x: y\r\n" * 200]
)  # fmt: skip


@st.composite
def answers(draw: st.DrawFn, bodies: st.SearchStrategy[bytes]) -> bytes:
    """A replica's raw HTTP answer: any status line, framing right or wrong, any body."""
    body = draw(bodies)
    framing = draw(
        st.sampled_from(["length"] * 4 + ["short", "long", "chunked", "bad-chunked", "none",
                                           "huge-length", "two-lengths", "huge-chunk"])
    )  # fmt: skip
    head = draw(_STATUS_LINES) + b"\r\ncontent-type: application/json\r\n"
    if framing == "length":
        return head + b"content-length: %d\r\n\r\n%s" % (len(body), body)
    if framing == "short":
        return head + b"content-length: %d\r\n\r\n%s" % (max(0, len(body) - 3), body)
    if framing == "long":
        return head + b"content-length: %d\r\n\r\n%s" % (len(body) + 50, body)
    if framing == "chunked":
        return head + b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    if framing == "bad-chunked":
        return head + b"transfer-encoding: chunked\r\n\r\nzz\r\n" + body
    if framing == "huge-length":
        return head + b"content-length: 99999999999\r\n\r\n" + body
    if framing == "two-lengths":
        return head + b"content-length: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    if framing == "huge-chunk":
        return head + b"transfer-encoding: chunked\r\n\r\nfffffffffff\r\n" + body
    return head + b"\r\n" + body


TOKENIZE_FAILURES = {"timeout", "connect", "closed", "protocol", "status", "malformed"}


@examples(80, shared_fixture=True)
@given(answers(_TOKENS_JSON | st.binary(max_size=30)), st.integers(0, 10**9))
async def test_any_tokenize_answer_gives_tokens_or_a_failure_reason(
    engine: FakeEngine, answer: bytes, salt: int
) -> None:
    async with asyncio.timeout(5):
        pool = UpstreamPool(connect_timeout_s=1.0)
        try:
            client = TokenizeClient(pool, TokenizeConfig(timeout_s=0.3, max_tokens=6))
            engine.scripted.append(answer)
            body = json.dumps({"model": "m", "prompt": f"p{salt}"}).encode()
            result = await client.tokenize(engine.url, "key", body)
        finally:
            engine.scripted.clear()
            await pool.close()
    event(f"tokenize: {result.failure or 'tokens'}")
    if result.tokens is None:
        assert result.failure in TOKENIZE_FAILURES, result
    else:
        assert not result.failure and len(result.tokens) <= 6
        assert all(0 <= t < 2**32 for t in result.tokens)


_METRICS_PAGES = st.lists(
    st.tuples(
        st.sampled_from([QUERIES, "vllm:prefix_cache_hits_total", "vllm:cache_config_info"]),
        st.sampled_from(["", '{engine="0"}', '{block_size="16",num_gpu_blocks="8"}', "{"]),
        st.integers(-(10**20), 10**20).map(str) | st.sampled_from(["x", "1e30", "0.5", ""]),
    ).map(lambda t: f"{t[0]}{t[1]} {t[2]}"),
    max_size=6,
).map(lambda lines: "\n".join(lines).encode())
POLL_OUTCOMES = {"ok", "timeout", "connect", "closed", "protocol", "status", "malformed"}


@examples(60, shared_fixture=True)
@given(st.lists(answers(_METRICS_PAGES | st.binary(max_size=30)), min_size=1, max_size=3))
async def test_any_metrics_answers_end_each_poll_with_a_counted_outcome(
    engine: FakeEngine, pages: list[bytes]
) -> None:
    table = RoutingTable([Target("r1", "m", engine.url)])
    pool = UpstreamPool(connect_timeout_s=1.0)
    poller = EnginePoller(table, pool, PollerConfig(timeout_s=0.3, max_bytes=4096))
    try:
        for page in pages:
            engine.scripted.append(page)
            async with asyncio.timeout(5):
                await poller.poll_once()
    finally:
        engine.scripted.clear()
        await pool.close()
    event(f"polls: {sorted(poller.polls)}")
    assert set(poller.polls) <= POLL_OUTCOMES and sum(poller.polls.values()) == len(pages)
    assert "".join(poller.lines())  # the metric families still render
