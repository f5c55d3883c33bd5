"""The gateway over real sockets: fake engines on 127.0.0.1:0, httpx and raw sockets as clients.

The fake engine is a few lines of asyncio streams that record what reaches it (connections,
requests, when its connection closes) and answer as each test tells it: JSON, server-sent
events held back until the test lets them go, an error status, a hang, a dropped connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import pytest
from simserve import sim_engine

from llmgw.addresses import free_port
from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.httplimits import ServerLimits
from llmgw.gateway.routing.policy import make_policy
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.httpguard import BrowserAccess

COMPLETION = {"model": "m", "prompt": "The capital of France is", "max_tokens": 4}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@dataclass
class Seen:
    """One request as the fake engine received it."""

    method: str
    target: str
    headers: dict[str, str]
    body: bytes


Behaviour = Callable[
    ["FakeEngine", Seen, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]
]


async def answer_json(
    engine: FakeEngine, seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    body = json.dumps({"engine": engine.name, "path": seen.target}).encode()
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-engine: %s\r\n"
        b"content-length: %d\r\n\r\n%s" % (engine.name.encode(), len(body), body)
    )


def answer_status(status: int, body: bytes = b'{"error":"busy"}') -> Behaviour:
    async def behave(
        engine: FakeEngine, seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(
            b"HTTP/1.1 %d Whatever\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"\r\n%s" % (status, len(body), body)
        )

    return behave


async def drop_connection(
    engine: FakeEngine, seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    raise ConnectionResetError("the fake engine drops the connection")


async def hang(
    engine: FakeEngine, seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    await reader.read(1)  # until the gateway closes the connection
    engine.peer_closed.set()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
EVENT_1 = b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n'
EVENT_2 = b'data: {"choices":[{"delta":{"content":"lo"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


def stream_held(gate: asyncio.Event, *, die_after_first: bool = False) -> Behaviour:
    """SSE: the head and a first event at once, the rest only once ``gate`` is set."""

    async def behave(
        engine: FakeEngine, seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(SSE_HEAD + chunk(EVENT_1))
        await writer.drain()
        if die_after_first:
            raise ConnectionResetError("the fake engine dies mid-stream")
        eof = asyncio.ensure_future(reader.read(1))
        opened = asyncio.ensure_future(gate.wait())
        await asyncio.wait([eof, opened], return_when=asyncio.FIRST_COMPLETED)
        if eof.done():
            opened.cancel()
            engine.peer_closed.set()
            raise ConnectionResetError("the gateway went away")
        writer.write(chunk(EVENT_2) + chunk(DONE) + b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0)
        eof.cancel()

    return behave


@dataclass
class FakeEngine:
    """An HTTP/1.1 server on 127.0.0.1:0 that records what reaches it."""

    name: str
    behaviour: Behaviour = answer_json
    connections: int = 0
    requests: list[Seen] = field(default_factory=list)
    peer_closed: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> FakeEngine:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            while True:
                seen = await _read_request(reader)
                self.requests.append(seen)
                await self.behaviour(self, seen, reader, writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            self._tasks.discard(task)


async def _read_request(reader: asyncio.StreamReader) -> Seen:
    head = await reader.readuntil(b"\r\n\r\n")
    line, *lines = head.decode("latin-1").split("\r\n")
    method, target, _ = line.split(" ")
    headers: dict[str, str] = {}
    for text in lines:
        if text:
            name, _, value = text.partition(":")
            assert name.lower() not in headers, f"header {name} sent twice"
            headers[name.lower()] = value.strip()
    assert "transfer-encoding" not in headers  # the gateway always sends a Content-Length
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Seen(method, target, headers, body)


@contextlib.asynccontextmanager
async def running(
    targets: list[Target], config: GatewayConfig | None = None, policy: str = "round_robin"
) -> AsyncIterator[tuple[Gateway, str]]:
    config = config or GatewayConfig(port=0, policy=policy)
    gateway = Gateway(RoutingTable(targets), config)
    host, port = await gateway.start()
    try:
        yield gateway, f"http://{host}:{port}"
    finally:
        await gateway.stop()


@contextlib.asynccontextmanager
async def engines(
    *names: str, behaviour: Behaviour = answer_json
) -> AsyncIterator[list[FakeEngine]]:
    started = [await FakeEngine(name, behaviour).start() for name in names]
    try:
        yield started
    finally:
        for engine in started:
            await engine.close()


async def test_routes_by_model_to_ready_replicas_only() -> None:
    async with engines("a1", "a2-draining", "b1") as (a1, a2, b1):
        targets = [
            Target("r-a1", "model-a", a1.url),
            Target("r-a2", "model-a", a2.url, ready=False),
            Target("r-b1", "model-b", b1.url),
        ]
        async with running(targets) as (gateway, url), httpx.AsyncClient(base_url=url) as client:
            for _ in range(4):
                reply = await client.post(
                    "/v1/completions", json={**COMPLETION, "model": "model-a"}
                )
                assert reply.status_code == 200
                assert reply.json() == {"engine": "a1", "path": "/v1/completions"}
                assert reply.headers["content-type"] == "application/json"
                assert reply.headers["x-engine"] == "a1"
                assert reply.headers["x-llmgw-replica"] == "r-a1"  # where it went
            reply = await client.post("/v1/chat/completions", json={**CHAT, "model": "model-b"})
            assert reply.json() == {"engine": "b1", "path": "/v1/chat/completions"}
            assert reply.headers.get_list("x-llmgw-replica") == ["r-b1"]
            assert gateway.load.snapshot() == {}
    assert len(a1.requests) == 4
    assert a2.requests == []
    assert len(b1.requests) == 1
    assert json.loads(b1.requests[0].body) == {**CHAT, "model": "model-b"}  # forwarded as is


async def test_adds_the_replica_key_and_drops_hop_by_hop_headers() -> None:
    async with engines("e") as (engine,):
        targets = [Target("r1", "m", engine.url, api_key="sk-replica")]
        async with running(targets) as (_, url):
            host, port = url.removeprefix("http://").split(":")
            body = json.dumps(COMPLETION).encode()
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: [::1]\r\n"
                b"Authorization: Bearer client\r\n"
                b"Connection: keep-alive, x-private\r\nX-Private: secret\r\nKeep-Alive: 5\r\n"
                b"X-Request-Id: abc\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            writer.close()
            await writer.wait_closed()
    seen = engine.requests[0]
    assert seen.target == "/v1/completions?x=1"
    assert seen.headers["authorization"] == "Bearer sk-replica"
    assert seen.headers["x-request-id"] == "abc"
    assert seen.headers["host"] == engine.url.removeprefix("http://")
    assert "x-private" not in seen.headers
    assert "keep-alive" not in seen.headers
    assert seen.body == body


async def test_no_authorization_header_without_a_key() -> None:
    async with engines("e") as (engine,), running([Target("r1", "m", engine.url)]) as (_, url):
        async with httpx.AsyncClient(base_url=url, headers={"authorization": "Bearer c"}) as client:
            assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert "authorization" not in engine.requests[0].headers


async def test_sse_chunks_reach_the_client_before_the_upstream_finishes() -> None:
    gate = asyncio.Event()
    async with engines("e", behaviour=stream_held(gate)) as (engine,):
        async with running([Target("r1", "m", engine.url)]) as (gateway, url):
            async with httpx.AsyncClient(base_url=url) as client:
                async with client.stream("POST", "/v1/chat/completions", json=CHAT) as reply:
                    assert reply.status_code == 200
                    assert reply.headers["content-type"] == "text/event-stream; charset=utf-8"
                    assert reply.headers["transfer-encoding"] == "chunked"
                    pieces = reply.aiter_raw()
                    first = await asyncio.wait_for(anext(pieces), 5)
                    assert first == EVENT_1  # arrived while the engine still holds the rest
                    assert not gate.is_set()
                    gate.set()
                    rest = b"".join([piece async for piece in pieces])
                    assert rest == EVENT_2 + DONE
            assert gateway.load.snapshot() == {}


async def test_client_going_away_closes_the_upstream_connection() -> None:
    gate = asyncio.Event()  # never set: the engine waits until its connection closes
    async with engines("e", behaviour=stream_held(gate)) as (engine,):
        async with running([Target("r1", "m", engine.url)]) as (gateway, url):
            async with httpx.AsyncClient(base_url=url) as client:
                async with client.stream("POST", "/v1/chat/completions", json=CHAT) as reply:
                    assert await anext(reply.aiter_raw()) == EVENT_1
                    assert gateway.load.in_flight("r1") == 1
            # leaving the stream early closes the client's connection
            await asyncio.wait_for(engine.peer_closed.wait(), 5)
            assert gateway.load.snapshot() == {}
            assert gateway.metrics.requests == {499: 1}
            assert gateway.pool.opened == 1
            # the cancelled connection was not pooled: the next request opens a new one
            engine.behaviour = answer_json
            async with httpx.AsyncClient(base_url=url) as client:
                assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
            assert engine.connections == 2


async def test_retries_another_replica_when_one_refuses_connections() -> None:
    async with engines("ok") as (ok,):
        dead = Target("r0-dead", "m", f"http://127.0.0.1:{free_port()}")
        async with running([dead, Target("r1-ok", "m", ok.url)]) as (gateway, url):
            async with httpx.AsyncClient(base_url=url) as client:
                for _ in range(3):  # round robin starts on the dead one at least once
                    reply = await client.post("/v1/completions", json=COMPLETION)
                    assert reply.status_code == 200
                    assert reply.json()["engine"] == "ok"
            assert gateway.metrics.failures["connect"] >= 1
            assert gateway.load.snapshot() == {}
    assert len(ok.requests) == 3


@pytest.mark.parametrize("status", [502, 503])
async def test_retries_another_replica_on_502_and_503_before_any_byte(status: int) -> None:
    async with engines("busy", "ok") as (busy, ok):
        busy.behaviour = answer_status(status)
        targets = [Target("r0", "m", busy.url), Target("r1", "m", ok.url)]
        async with running(targets) as (gateway, url), httpx.AsyncClient(base_url=url) as client:
            reply = await client.post("/v1/completions", json=COMPLETION)
            assert reply.status_code == 200
            assert reply.json()["engine"] == "ok"
            assert reply.headers.get_list("x-llmgw-replica") == ["r1"]  # the one that answered
            assert gateway.metrics.failures == {"status": 1}
    assert len(busy.requests) == 1
    assert len(ok.requests) == 1


async def test_a_503_from_the_last_replica_is_forwarded_as_is() -> None:
    async with engines("busy", behaviour=answer_status(503, b'{"error":"mine"}')) as (busy,):
        async with running([Target("r0", "m", busy.url)]) as (_, url):
            async with httpx.AsyncClient(base_url=url) as client:
                reply = await client.post("/v1/completions", json=COMPLETION)
    assert reply.status_code == 503
    assert reply.content == b'{"error":"mine"}'
    assert reply.headers["x-llmgw-replica"] == "r0"


async def test_no_retry_after_the_first_byte() -> None:
    gate = asyncio.Event()
    async with engines("dies", "spare") as (dies, spare):
        dies.behaviour = stream_held(gate, die_after_first=True)
        targets = [Target("r0", "m", dies.url), Target("r1", "m", spare.url)]
        async with running(targets) as (gateway, url), httpx.AsyncClient(base_url=url) as client:
            async with client.stream("POST", "/v1/chat/completions", json=CHAT) as reply:
                assert reply.status_code == 200
                assert reply.headers["x-llmgw-replica"] == "r0"  # where it broke
                with pytest.raises(httpx.RemoteProtocolError):
                    await reply.aread()  # cut short: the client can tell
            assert gateway.load.snapshot() == {}
            assert gateway.metrics.requests == {502: 1}
    assert spare.requests == []


async def test_503_when_every_replica_fails() -> None:
    dead = [Target(f"r{i}", "m", f"http://127.0.0.1:{free_port()}") for i in range(2)]
    async with running(dead) as (gateway, url), httpx.AsyncClient(base_url=url) as client:
        reply = await client.post("/v1/completions", json=COMPLETION)
        assert reply.status_code == 503
        assert "x-llmgw-replica" not in reply.headers  # the gateway's own answer
        error = reply.json()["error"]
        assert error["type"] == "ServiceUnavailableError"
        assert error["code"] == 503
        assert error["message"] == (
            "no replica of model `m` could take the request (r0: no connection; r1: no connection)"
        )  # no replica addresses
        assert gateway.metrics.failures == {"connect": 2}
        assert gateway.metrics.requests == {503: 1}


async def test_503_when_no_replica_of_the_model_is_ready() -> None:
    targets = [Target("r0", "m", "http://127.0.0.1:9", ready=False)]
    async with running(targets) as (_, url), httpx.AsyncClient(base_url=url) as client:
        reply = await client.post("/v1/completions", json=COMPLETION)
    assert reply.status_code == 503
    assert reply.json()["error"]["message"] == "no replica of model `m` is ready"


async def test_unknown_model_is_404_in_vllm_shape() -> None:
    async with running([]) as (_, url), httpx.AsyncClient(base_url=url) as client:
        reply = await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert reply.status_code == 404
    assert reply.json() == {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


@pytest.mark.parametrize(
    ("body", "names"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"prompt": "x"}', "`model`"),
        (b'{"model": "m", "messages": "hi"}', "`messages`"),
        (b'{"model": "m", "messages": [{"role": "user"}], "stream": "yes"}', "`stream`"),
    ],
)
async def test_malformed_bodies_are_400_naming_the_fault(body: bytes, names: str) -> None:
    async with running([]) as (gateway, url), httpx.AsyncClient(base_url=url) as client:
        reply = await client.post("/v1/chat/completions", content=body)
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["type"] == "BadRequestError"
        assert names in error["message"]
        assert gateway.metrics.requests == {400: 1}
        # the connection stays usable
        assert (await client.get("/healthz")).text == "ok"


async def test_bodies_over_the_limit_are_413() -> None:
    config = GatewayConfig(port=0, limits=ServerLimits(max_body_bytes=1024))
    async with (
        engines("e") as (engine,),
        running([Target("r1", "m", engine.url)], config) as (gateway, url),
    ):
        async with httpx.AsyncClient(base_url=url) as client:
            big = {**COMPLETION, "prompt": "x" * 2000}
            reply = await client.post("/v1/completions", json=big)
            assert reply.status_code == 413
            assert "1024" in reply.json()["error"]["message"]

            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(20):
                    yield b" " * 100

            reply = await client.post("/v1/completions", content=chunks())
            assert reply.status_code == 413
            ok = await client.post("/v1/completions", json=COMPLETION)
            assert ok.status_code == 200
        assert gateway.metrics.requests == {413: 2, 200: 1}
    assert len(engine.requests) == 1


async def test_chunked_request_bodies_are_forwarded_whole() -> None:
    body = json.dumps({**COMPLETION, "prompt": "y" * 5000}).encode()

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 700):
            yield body[start : start + 700]

    async with engines("e") as (engine,), running([Target("r1", "m", engine.url)]) as (_, url):
        async with httpx.AsyncClient(base_url=url) as client:
            reply = await client.post(
                "/v1/completions", content=pieces(), headers={"content-type": "application/json"}
            )
            assert reply.status_code == 200
    assert engine.requests[0].body == body
    assert engine.requests[0].headers["content-length"] == str(len(body))


async def test_request_timeout_is_504_and_closes_the_upstream() -> None:
    config = GatewayConfig(port=0, request_timeout_s=0.3)
    async with engines("slow", behaviour=hang) as (slow,):
        async with running([Target("r1", "m", slow.url)], config) as (gateway, url):
            async with httpx.AsyncClient(base_url=url) as client:
                reply = await client.post("/v1/completions", json=COMPLETION)
                assert reply.status_code == 504
                assert reply.json()["error"]["type"] == "GatewayTimeoutError"
            await asyncio.wait_for(slow.peer_closed.wait(), 5)
            assert gateway.load.snapshot() == {}


async def test_keep_alive_reuses_one_upstream_connection() -> None:
    async with engines("e") as (engine,), running([Target("r1", "m", engine.url)]) as (_, url):
        async with httpx.AsyncClient(base_url=url) as client:
            for _ in range(6):
                assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert len(engine.requests) == 6
    assert engine.connections == 1


async def test_a_pooled_connection_closed_by_the_replica_is_replaced() -> None:
    """The keep-alive race: the replica closes an idle connection as a request arrives on it."""
    served: set[int] = set()

    async def one_request_per_connection(
        engine: FakeEngine, seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if id(writer) in served:
            raise ConnectionResetError("closing an idle keep-alive connection, as uvicorn does")
        served.add(id(writer))
        await answer_json(engine, seen, reader, writer)

    async with engines("e", behaviour=one_request_per_connection) as (engine,):
        async with running([Target("r1", "m", engine.url)]) as (gateway, url):
            async with httpx.AsyncClient(base_url=url) as client:
                for _ in range(3):
                    assert (
                        await client.post("/v1/completions", json=COMPLETION)
                    ).status_code == 200
            assert gateway.metrics.failures == {}  # not counted against the replica
    assert engine.connections == 3
    assert len(engine.requests) == 5  # two of them met a closing connection


async def test_streams_from_the_simulated_engine_with_its_api_key() -> None:
    flags = ("--api-key", "sk-sim", "--sim-decode-ms-per-token", "1")
    async with sim_engine("sim-model", *flags) as url:
        targets = [Target("r1", "sim-model", url, api_key="sk-sim")]
        async with running(targets) as (_, gw), httpx.AsyncClient(base_url=gw) as client:
            request = {**CHAT, "model": "sim-model", "max_tokens": 5}
            async with client.stream("POST", "/v1/chat/completions", json=request) as reply:
                assert reply.status_code == 200
                lines = [line async for line in reply.aiter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
            assert chunks[0]["object"] == "chat.completion.chunk"
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        wrong = [Target("r1", "sim-model", url, api_key="sk-wrong")]
        async with running(wrong) as (_, gw), httpx.AsyncClient(base_url=gw) as client:
            reply = await client.post("/v1/completions", json={**COMPLETION, "model": "sim-model"})
            assert reply.status_code == 401  # the engine's answer, forwarded as is


async def test_a_slow_client_pauses_the_upstream_and_the_connection_is_reused() -> None:
    big = b"x" * (16 << 20)

    async def answer_big(
        engine: FakeEngine, seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big))
        writer.write(big)

    async with engines("e", behaviour=answer_big) as (engine,):
        async with running([Target("r1", "m", engine.url)]) as (_, url):
            host, port = url.removeprefix("http://").split(":")
            body = json.dumps(COMPLETION).encode()
            for _ in range(2):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nhost: [::1]\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(body), body)
                )
                await asyncio.sleep(0.3)  # read nothing meanwhile: the gateway must hold off
                await reader.readuntil(b"\r\n\r\n")
                assert await asyncio.wait_for(reader.readexactly(len(big)), 10) == big
                writer.close()
                await writer.wait_closed()
    assert engine.connections == 1


async def test_an_http10_client_gets_the_stream_close_delimited() -> None:
    gate = asyncio.Event()
    gate.set()
    async with engines("e", behaviour=stream_held(gate)) as (engine,):
        async with running([Target("r1", "m", engine.url)]) as (_, url):
            host, port = url.removeprefix("http://").split(":")
            body = json.dumps(CHAT).encode()
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/chat/completions HTTP/1.0\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            answer = await asyncio.wait_for(reader.read(), 5)  # until the gateway closes
            writer.close()
            await writer.wait_closed()
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower()
    assert b"connection: close" in head.lower()
    assert rest == EVENT_1 + EVENT_2 + DONE


async def test_models_healthz_and_unknown_routes() -> None:
    targets = [
        Target("r1", "beta", "http://127.0.0.1:9"),
        Target("r2", "alpha", "http://127.0.0.1:9"),
        Target("r3", "gamma", "http://127.0.0.1:9", ready=False),
    ]
    async with running(targets) as (_, url), httpx.AsyncClient(base_url=url) as client:
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == ["alpha", "beta"]
        assert all(m["object"] == "model" for m in models["data"])
        health = await client.get("/healthz")
        assert (health.status_code, health.text) == (200, "ok")
        assert (await client.get("/v2/nothing")).status_code == 404
        assert (await client.get("/v1/completions")).status_code == 405
        assert (await client.post("/v1/models")).status_code == 405


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with engines("e") as (engine,), running([Target("r1", "m", engine.url)]) as (_, url):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        one = json.dumps(COMPLETION).encode()
        request = b"POST /v1/completions HTTP/1.1\r\nhost: [::1]\r\ncontent-length: %d\r\n\r\n%s"
        writer.write(request % (len(one), one) + b"GET /healthz HTTP/1.1\r\nhost: [::1]\r\n\r\n")
        first = await reader.readuntil(b"\r\n\r\n")
        length = int(first.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        assert json.loads(await reader.readexactly(length))["engine"] == "e"
        second = await reader.readuntil(b"\r\n\r\n")
        assert second.startswith(b"HTTP/1.1 200 OK")
        assert await reader.readexactly(2) == b"ok"
        writer.close()
        await writer.wait_closed()


async def test_oversized_and_malformed_heads_are_refused() -> None:
    async with running([]) as (_, url):
        host, port = url.removeprefix("http://").split(":")
        for request, status in (
            (b"GET /healthz HTTP/1.1\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n", b"431"),
            (b"NONSENSE\r\n\r\n", b"400"),
        ):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(request)
            answer = await asyncio.wait_for(reader.read(), 5)  # answered, then closed
            assert answer.split(b" ")[1] == status
            writer.close()
            await writer.wait_closed()


async def test_expect_100_continue_gets_its_interim_answer() -> None:
    async with engines("e") as (engine,), running([Target("r1", "m", engine.url)]) as (_, url):
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps(COMPLETION).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: [::1]\r\nexpect: 100-continue\r\n"
            b"content-length: %d\r\n\r\n" % len(body)
        )
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")
        writer.close()
        await writer.wait_closed()
    assert engine.requests[0].body == body
    assert "expect" not in engine.requests[0].headers


async def test_a_request_that_arrives_too_slowly_is_408() -> None:
    config = GatewayConfig(port=0, limits=ServerLimits(head_timeout_s=0.2, idle_timeout_s=0.2))
    async with running([], config) as (_, url):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: [::1]\r\n")  # and no more
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 408 ")
        writer.close()
        await writer.wait_closed()
        idle_reader, idle_writer = await asyncio.open_connection(host, int(port))
        assert await asyncio.wait_for(idle_reader.read(), 5) == b""  # idle: closed silently
        idle_writer.close()
        await idle_writer.wait_closed()


async def test_stop_closes_client_and_upstream_connections() -> None:
    gate = asyncio.Event()
    async with engines("e", behaviour=stream_held(gate)) as (engine,):
        gateway = Gateway(RoutingTable([Target("r1", "m", engine.url)]), GatewayConfig(port=0))
        host, port = await gateway.start()
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
            async with client.stream("POST", "/v1/chat/completions", json=CHAT) as reply:
                pieces = reply.aiter_raw()
                assert await anext(pieces) == EVENT_1
                await gateway.stop()
                with pytest.raises(httpx.RemoteProtocolError):
                    [piece async for piece in pieces]  # cut short
        await asyncio.wait_for(engine.peer_closed.wait(), 5)
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient() as client:
                await client.get(f"http://{host}:{port}/healthz")


async def test_prefix_policy_keeps_a_conversation_on_one_replica() -> None:
    async with engines("a", "b") as (a, b):
        targets = [Target("r-a", "m", a.url), Target("r-b", "m", b.url)]
        gateway = Gateway(
            RoutingTable(targets), GatewayConfig(port=0), policy=make_policy("prefix")
        )
        host, port = await gateway.start()
        try:
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
                history = [{"role": "system", "content": "You are terse. " * 40}]
                for turn in range(4):
                    history.append({"role": "user", "content": f"question {turn}"})
                    reply = await client.post(
                        "/v1/chat/completions", json={"model": "m", "messages": history}
                    )
                    history.append({"role": "assistant", "content": reply.json()["engine"]})
            assert gateway.metrics.decisions.get(("approximate", "hit"), 0) == 3
        finally:
            await gateway.stop()
    assert sorted([len(a.requests), len(b.requests)]) == [0, 4]


async def test_the_replica_header_cannot_carry_a_line_break() -> None:
    async with engines("e") as (engine,):  # ids are checked names; this one never is
        async with running([Target("r\r\nx-evil: 1 é", "m", engine.url)]) as (_, url):
            async with httpx.AsyncClient(base_url=url) as client:
                reply = await client.post("/v1/completions", json=COMPLETION)
    assert reply.status_code == 200
    assert reply.headers["x-llmgw-replica"] == "r??x-evil: 1 ??"
    assert "x-evil" not in reply.headers


async def test_a_replica_cannot_name_itself_in_the_replica_header() -> None:
    async def forged(
        engine: FakeEngine, seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nx-llmgw-replica: forged\r\ncontent-length: 2\r\n\r\n{}")

    async with engines("e", behaviour=forged) as (engine,):
        async with running([Target("r1", "m", engine.url)]) as (_, url):
            async with httpx.AsyncClient(base_url=url) as client:
                reply = await client.post("/v1/completions", json=COMPLETION)
    assert reply.headers.get_list("x-llmgw-replica") == ["r1"]


# --- browsers: foreign pages and foreign Host names (llmgw.httpguard) --------------------


async def test_a_foreign_page_reaches_no_replica() -> None:
    console = "https://console.example"
    opened = GatewayConfig(port=0, browsers=BrowserAccess.parse([console], []))
    async with engines("a1") as (a1,), running([Target("r1", "m", a1.url)], opened) as (_, url):
        host = url.removeprefix("http://")
        async with httpx.AsyncClient(base_url=url) as client:
            for headers in (
                {"origin": "http://evil.example"},
                {"origin": "http://127.0.0.1:3000"},  # another port is another origin
                {"host": f"evil.example:{host.partition(':')[2]}"},  # DNS rebinding
            ):
                reply = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
                assert reply.status_code == 403, headers
                assert reply.json()["error"]["type"] == "ForbiddenError"
                assert "access-control-allow-origin" not in reply.headers
            assert a1.requests == []  # nothing was forwarded

            ask = {"origin": "http://evil.example", "access-control-request-method": "POST"}
            assert (await client.options("/v1/chat/completions", headers=ask)).status_code == 403
            ask = {
                "origin": console,
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type",
            }
            preflight = await client.options("/v1/chat/completions", headers=ask)
            assert preflight.status_code == 204
            assert preflight.headers["access-control-allow-origin"] == console
            assert (
                preflight.headers["access-control-allow-headers"]
                == ask["access-control-request-headers"]
            )

            proxied = await client.post(
                "/v1/completions", json=COMPLETION, headers={"origin": console}
            )
            assert proxied.status_code == 200 and proxied.json()["engine"] == "a1"
            assert proxied.headers["access-control-allow-origin"] == console
            assert proxied.headers["vary"] == "origin"
            plain = await client.post("/v1/completions", json=COMPLETION)  # SDKs send no Origin
            assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
            assert len(a1.requests) == 2


@pytest.mark.parametrize(
    "framing", [b"content-length: 100000000", b"content-length: 10\r\nexpect: 100-continue"]
)
async def test_a_refused_request_body_is_not_read_whole(framing: bytes) -> None:
    async with running([]) as (_, url):
        host, _, port = url.removeprefix("http://").partition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\norigin: http://evil.example\r\n"
            b"%s\r\n\r\n" % framing
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.read(12), 5)  # answered before any body byte
        assert head == b"HTTP/1.1 403"
        writer.close()
