"""The gRPC-web bridge, through httpx's ASGI transport and over the gRPC-web port's server."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError

from llmgw.api.llmgw.v1 import (
    ActionResult,
    Cluster,
    ControlServiceBase,
    GetClusterRequest,
    NodeRequest,
    WatchEvent,
    WatchRequest,
)
from llmgw.gateway.httplimits import ServerLimits
from llmgw.gateway.httpserver import HttpServer
from llmgw.httpguard import BrowserAccess, HttpGuard
from llmgw.server.wire.asgihttp import AsgiHandler
from llmgw.server.wire.grpcweb import BrowserGate, GrpcWebApp

GET_CLUSTER = "/llmgw.v1.ControlService/GetCluster"
CORDON_NODE = "/llmgw.v1.ControlService/CordonNode"
WATCH = "/llmgw.v1.ControlService/Watch"
INSPECT = "/test.Inspect/Inspect"
UPLOAD = "/test.Inspect/Upload"
LIMIT = 1000
BINARY = {"content-type": "application/grpc-web+proto", "x-grpc-web": "1"}
TEXT = {"content-type": "application/grpc-web-text", "x-grpc-web": "1"}


class Control(ControlServiceBase):
    def __init__(self) -> None:
        self.watch_events = 3
        self.watch_forever = False
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.calls = 0  # GetCluster calls that reached the handler

    async def get_cluster(self, message: GetClusterRequest) -> Cluster:
        self.calls += 1
        return Cluster(revision=7)

    async def cordon_node(self, message: NodeRequest) -> ActionResult:
        if message.node_id == "missing":
            raise GRPCError(Status.NOT_FOUND, "no node named 'missing' – ever\n100%")
        if message.node_id == "bug":
            raise RuntimeError("a bug")
        if message.node_id == "slow":
            await asyncio.sleep(30)
        return ActionResult(ok=True, message=message.node_id)

    async def watch(self, message: WatchRequest) -> AsyncIterator[WatchEvent]:
        for revision in range(1, self.watch_events + 1):
            yield WatchEvent(revision=revision)
        if self.watch_forever:
            try:
                await self.release.wait()
                yield WatchEvent(revision=100)
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise


class Inspect:
    """A hand-written servable whose handler sees the stream itself."""

    async def inspect(self, stream: Any) -> None:
        request = await stream.recv_message()
        assert await stream.recv_message() is None
        seen = {
            "node_id": request.node_id,
            "metadata": sorted(
                (k, v if isinstance(v, str) else repr(v)) for k, v in stream.metadata.items()
            ),
            "peer": list(stream.peer.addr()),
            "deadline": stream.deadline is not None,
            "user_agent": stream.user_agent,
        }
        await stream.send_message(ActionResult(ok=True, message=json.dumps(seen)))

    async def upload(self, stream: Any) -> None:
        raise AssertionError("never called")

    def __mapping__(self) -> dict[str, Handler]:
        return {
            INSPECT: Handler(self.inspect, Cardinality.UNARY_UNARY, NodeRequest, ActionResult),
            UPLOAD: Handler(self.upload, Cardinality.STREAM_UNARY, NodeRequest, ActionResult),
        }


# --- framing helpers -----------------------------------------------------------------------


def frame(payload: bytes, flag: int = 0) -> bytes:
    return bytes([flag]) + len(payload).to_bytes(4, "big") + payload


def split_frames(body: bytes) -> list[tuple[int, bytes]]:
    frames = []
    while body:
        assert len(body) >= 5, body
        length = int.from_bytes(body[1:5], "big")
        frames.append((body[0], body[5 : 5 + length]))
        body = body[5 + length :]
    return frames


def decode_text(body: bytes) -> bytes:
    chunks = re.findall(rb"[A-Za-z0-9+/]+={0,2}", body)
    return b"".join(base64.b64decode(chunk) for chunk in chunks)


def parse_trailer(payload: bytes) -> dict[str, str]:
    lines = payload.decode("ascii").split("\r\n")
    pairs = (line.split(":", 1) for line in lines if line)
    return {key: unquote(value) for key, value in pairs}


class Reply:
    def __init__(self, response: httpx.Response, *, text: bool = False) -> None:
        self.response = response
        frames = split_frames(decode_text(response.content) if text else response.content)
        assert frames and frames[-1][0] == 0x80, frames
        assert all(flag == 0 for flag, _ in frames[:-1])
        self.messages = [payload for _, payload in frames[:-1]]
        self.trailer = parse_trailer(frames[-1][1])

    @property
    def status(self) -> Status:
        return Status(int(self.trailer["grpc-status"]))

    @property
    def message(self) -> str | None:
        return self.trailer.get("grpc-message")


@pytest.fixture
def control() -> Control:
    return Control()


@pytest.fixture
async def client(control: Control) -> AsyncIterator[httpx.AsyncClient]:
    app = GrpcWebApp([control, Inspect()], max_message_bytes=LIMIT)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        yield client


async def post(
    client: httpx.AsyncClient, path: str, body: bytes, headers: dict[str, str] | None = None
) -> Reply:
    response = await client.post(path, content=body, headers=headers or BINARY)
    assert response.status_code == 200, response.text
    return Reply(response)


# --- unary -------------------------------------------------------------------------------


async def test_unary_binary(client: httpx.AsyncClient) -> None:
    reply = await post(client, GET_CLUSTER, frame(bytes(GetClusterRequest())))
    assert reply.status is Status.OK
    assert [Cluster.parse(m) for m in reply.messages] == [Cluster(revision=7)]
    assert reply.response.headers["content-type"] == "application/grpc-web+proto"
    assert "access-control-allow-origin" not in reply.response.headers  # no CORS by default


async def test_unary_text(client: httpx.AsyncClient) -> None:
    body = base64.b64encode(frame(bytes(NodeRequest(node_id="gpu-7"))))
    response = await client.post(CORDON_NODE, content=body, headers=TEXT)
    assert response.headers["content-type"] == "application/grpc-web-text"
    assert re.fullmatch(rb"[A-Za-z0-9+/=]+", response.content)
    reply = Reply(response, text=True)
    assert reply.status is Status.OK
    assert ActionResult.parse(reply.messages[0]) == ActionResult(ok=True, message="gpu-7")


async def test_text_body_of_several_padded_chunks(client: httpx.AsyncClient) -> None:
    data = frame(bytes(NodeRequest(node_id="gpu-12")))
    body = base64.b64encode(data[:4]) + base64.b64encode(data[4:])
    assert body.count(b"=") >= 2
    response = await client.post(CORDON_NODE, content=body, headers=TEXT)
    reply = Reply(response, text=True)
    assert ActionResult.parse(reply.messages[0]).message == "gpu-12"


async def test_handler_sees_metadata_peer_deadline_and_user_agent(
    client: httpx.AsyncClient,
) -> None:
    headers = {
        **BINARY,
        "authorization": "Bearer t0k",
        "x-user-agent": "grpc-web-javascript/0.1",
        "trace-bin": base64.b64encode(b"\x00\x01").decode().rstrip("="),
        "grpc-timeout": "5S",
        "connection": "keep-alive",
    }
    reply = await post(client, INSPECT, frame(bytes(NodeRequest(node_id="n1"))), headers)
    seen = json.loads(ActionResult.parse(reply.messages[0]).message)
    metadata = dict(seen["metadata"])
    assert metadata["authorization"] == "Bearer t0k"
    assert metadata["trace-bin"] == "b'\\x00\\x01'"
    assert "connection" not in metadata and "host" not in metadata
    assert not any(key.startswith("grpc-") or key == "content-type" for key in metadata)
    assert seen["node_id"] == "n1"
    assert seen["peer"] == ["127.0.0.1", 123]
    assert seen["deadline"] is True
    assert seen["user_agent"] == "grpc-web-javascript/0.1"


# --- errors ------------------------------------------------------------------------------


async def test_grpc_error_status_and_message_in_trailers(client: httpx.AsyncClient) -> None:
    reply = await post(client, CORDON_NODE, frame(bytes(NodeRequest(node_id="missing"))))
    assert reply.messages == []
    assert reply.status is Status.NOT_FOUND
    assert reply.message == "no node named 'missing' – ever\n100%"
    raw = split_frames(reply.response.content)[-1][1]
    assert raw.startswith(b"grpc-status:5\r\ngrpc-message:no node named 'missing' %E2%80%93")


async def test_handler_bug_answers_internal(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    reply = await post(client, CORDON_NODE, frame(bytes(NodeRequest(node_id="bug"))))
    assert (reply.status, reply.message) == (Status.INTERNAL, "internal error")
    assert "a bug" in caplog.text
    assert (await post(client, GET_CLUSTER, frame(b""))).status is Status.OK


async def test_unknown_method(client: httpx.AsyncClient) -> None:
    reply = await post(client, "/llmgw.v1.ControlService/Explode", frame(b""))
    assert reply.status is Status.UNIMPLEMENTED
    assert reply.message is not None and "/llmgw.v1.ControlService/Explode" in reply.message


async def test_client_streaming_method_is_refused(client: httpx.AsyncClient) -> None:
    reply = await post(client, UPLOAD, frame(b""))
    assert reply.status is Status.UNIMPLEMENTED
    assert reply.message == "gRPC-web does not carry client streams; use the native gRPC port"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (frame(b"\xff\xff\xff"), "cannot decode llmgw.v1.NodeRequest: truncated varint"),
        (frame(b"\x08\x05"), "cannot decode llmgw.v1.NodeRequest: field node_id (1) is string"),
        (b"\x00\x00", "no complete frame"),
        (frame(b"") + frame(b""), "one frame"),
        (frame(b"", flag=0x80), "unexpected frame flag 0x80"),
    ],
    ids=["garbage", "wrong-wire-type", "short", "two-frames", "trailer-flag"],
)
async def test_malformed_body_answers_invalid_argument(
    client: httpx.AsyncClient, body: bytes, expected: str
) -> None:
    reply = await post(client, CORDON_NODE, body)
    assert reply.status is Status.INVALID_ARGUMENT
    assert reply.message is not None and expected in reply.message
    assert (await post(client, GET_CLUSTER, frame(b""))).status is Status.OK


async def test_invalid_base64_answers_invalid_argument(client: httpx.AsyncClient) -> None:
    response = await client.post(CORDON_NODE, content=b"AAA*AAAA", headers=TEXT)
    reply = Reply(response, text=True)
    assert (reply.status, reply.message) == (
        Status.INVALID_ARGUMENT,
        "request body is not valid base64",
    )


async def test_compressed_frame_is_refused(client: httpx.AsyncClient) -> None:
    reply = await post(client, GET_CLUSTER, frame(b"", flag=0x01))
    assert reply.status is Status.UNIMPLEMENTED


async def test_oversized_body_answers_resource_exhausted(client: httpx.AsyncClient) -> None:
    body = frame(bytes(NodeRequest(node_id="n" * LIMIT)))
    reply = await post(client, CORDON_NODE, body)
    assert reply.status is Status.RESOURCE_EXHAUSTED
    assert (
        reply.message
        == f"request body of {LIMIT + 8} bytes exceeds the limit of {LIMIT} bytes per message"
    )
    text = await client.post(CORDON_NODE, content=base64.b64encode(body), headers=TEXT)
    assert Reply(text, text=True).status is Status.RESOURCE_EXHAUSTED


async def test_oversized_body_is_refused_without_reading_it_all(control: Control) -> None:
    app = GrpcWebApp([control], max_message_bytes=LIMIT)
    chunks_read = 0

    async def receive() -> dict[str, Any]:
        nonlocal chunks_read
        chunks_read += 1
        body = frame(b"")[:1] + (10**9).to_bytes(4, "big") if chunks_read == 1 else b"x" * 4096
        return {"type": "http.request", "body": body, "more_body": True}

    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": CORDON_NODE,
        "headers": [(b"host", b"127.0.0.1:8080"), (b"content-type", b"application/grpc-web")],
        "client": ("127.0.0.1", 5),
    }
    await app(scope, receive, send)
    assert chunks_read == 1
    trailer = parse_trailer(split_frames(sent[-1]["body"])[-1][1])
    assert trailer["grpc-status"] == str(Status.RESOURCE_EXHAUSTED.value)
    assert trailer["grpc-message"] == f"message of {10**9} bytes exceeds the limit of {LIMIT} bytes"
    assert sent[-1]["more_body"] is False


async def test_declared_content_length_over_the_limit_is_refused(
    client: httpx.AsyncClient,
) -> None:
    headers = {**BINARY, "content-length": str(10**9)}
    request = client.build_request("POST", CORDON_NODE, content=b"", headers=headers)
    reply = Reply(await client.send(request))
    assert reply.status is Status.RESOURCE_EXHAUSTED


async def test_deadline_exceeded(client: httpx.AsyncClient) -> None:
    headers = {**BINARY, "grpc-timeout": "50m"}
    started = asyncio.get_running_loop().time()
    reply = await post(client, CORDON_NODE, frame(bytes(NodeRequest(node_id="slow"))), headers)
    assert (reply.status, reply.message) == (Status.DEADLINE_EXCEEDED, "deadline exceeded")
    assert asyncio.get_running_loop().time() - started < 5


async def test_invalid_timeout_header(client: httpx.AsyncClient) -> None:
    reply = await post(client, GET_CLUSTER, frame(b""), {**BINARY, "grpc-timeout": "soon"})
    assert reply.status is Status.INVALID_ARGUMENT


# --- plain HTTP: content types, CORS, health, lifespan -----------------------------------


async def test_wrong_content_type_is_415(client: httpx.AsyncClient) -> None:
    response = await client.post(GET_CLUSTER, content=frame(b""), headers={"content-type": "x/y"})
    assert response.status_code == 415


async def test_get_on_a_method_is_405(client: httpx.AsyncClient) -> None:
    response = await client.get(GET_CLUSTER)
    assert response.status_code == 405


@asynccontextmanager
async def opened_to(control: Control, origin: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app opened with ``--cors-origin origin``."""
    browsers = HttpGuard(BrowserAccess.parse([origin], []))
    app = GrpcWebApp([control], max_message_bytes=LIMIT, browsers=browsers)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        yield client


async def test_cors_preflight(control: Control) -> None:
    headers = {
        "origin": "https://console.example",
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type,x-grpc-web,authorization",
    }
    async with opened_to(control, "https://console.example:443") as client:
        response = await client.options(GET_CLUSTER, headers=headers)
    assert response.status_code == 204
    assert response.headers["access-control-allow-origin"] == "https://console.example"
    assert response.headers["access-control-allow-methods"] == "POST, OPTIONS"
    allowed = {h.strip() for h in response.headers["access-control-allow-headers"].split(",")}
    assert {
        "content-type",
        "x-grpc-web",
        "x-user-agent",
        "grpc-timeout",
        "authorization",
    } <= allowed
    assert int(response.headers["access-control-max-age"]) > 0
    assert response.headers["access-control-expose-headers"] == "grpc-status, grpc-message"


async def test_cors_with_an_allow_list(control: Control) -> None:
    async with opened_to(control, "https://ok.test") as c:
        ok = await c.post(
            GET_CLUSTER, content=frame(b""), headers={**BINARY, "origin": "https://ok.test"}
        )
        assert ok.headers["access-control-allow-origin"] == "https://ok.test"
        assert ok.headers["vary"] == "origin"
        evil = {**BINARY, "origin": "https://evil.test"}
        refused = await c.post(GET_CLUSTER, content=frame(b""), headers=evil)
        assert refused.status_code == 403 and "--cors-origin" in refused.text
        assert "access-control-allow-origin" not in refused.headers
        preflight = await c.options(GET_CLUSTER, headers={"origin": "https://evil.test"})
        assert preflight.status_code == 403
    assert control.calls == 1  # the refused call reached no handler


async def test_default_refuses_every_origin_and_foreign_host(client: httpx.AsyncClient) -> None:
    ask = {"origin": "https://console.example", "access-control-request-method": "POST"}
    assert (await client.options(GET_CLUSTER, headers=ask)).status_code == 403
    body = frame(bytes(GetClusterRequest()))
    for headers in ({"origin": "null"}, {"host": "evil.example:8080"}, {"host": "10.0.0.1"}):
        response = await client.post(GET_CLUSTER, content=body, headers={**BINARY, **headers})
        assert response.status_code == 403, headers
        assert "access-control-allow-origin" not in response.headers
    own = {**BINARY, "host": "127.0.0.1:8080", "origin": "http://127.0.0.1:8080"}
    assert (await client.post(GET_CLUSTER, content=body, headers=own)).status_code == 200
    twice = [
        ("host", "localhost"),
        ("host", "evil.example"),
        ("content-type", BINARY["content-type"]),
    ]
    assert (await client.post(GET_CLUSTER, content=body, headers=twice)).status_code == 400


async def test_browser_gate_guards_what_it_wraps() -> None:
    reached: list[str] = []

    async def inner(scope: MutableMapping[str, Any], receive: object, send: Any) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    gate = BrowserGate(inner, HttpGuard())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gate), base_url="http://[::1]"
    ) as c:
        assert (await c.post("/x", headers={"origin": "http://evil.example"})).status_code == 403
        assert (await c.post("/x", headers={"host": "evil.example"})).status_code == 403
        assert reached == []
        assert (await c.post("/x")).status_code == 299
    assert reached == ["/x"]


@pytest.mark.parametrize(
    ("problem", "code", "text"),
    [(None, 200, "ok"), ("disk full", 503, "unhealthy: disk full")],
)
async def test_healthz(control: Control, problem: str | None, code: int, text: str) -> None:
    async def health() -> str | None:
        return problem

    app = GrpcWebApp([control], max_message_bytes=LIMIT, health=health)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://localhost"
    ) as c:
        response = await c.get("/healthz")
    assert (response.status_code, response.text) == (code, text)


async def test_healthz_failing_check_is_503(
    control: Control, caplog: pytest.LogCaptureFixture
) -> None:
    async def health() -> str | None:
        raise OSError("database gone")

    app = GrpcWebApp([control], max_message_bytes=LIMIT, health=health)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://localhost"
    ) as c:
        assert (await c.get("/healthz")).status_code == 503
    assert "database gone" in caplog.text


async def test_lifespan(control: Control) -> None:
    app = GrpcWebApp([control], max_message_bytes=LIMIT)
    inbox: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    for kind in ("lifespan.startup", "lifespan.shutdown"):
        inbox.put_nowait({"type": kind})
    sent: list[str] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message["type"])

    await app({"type": "lifespan"}, inbox.get, send)
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def test_two_services_serving_one_path_are_refused(control: Control) -> None:
    with pytest.raises(ValueError, match="two services serve"):
        GrpcWebApp([control, Control()], max_message_bytes=LIMIT)


# --- server streaming ----------------------------------------------------------------------


async def test_server_streaming_over_asgi_transport(
    client: httpx.AsyncClient, control: Control
) -> None:
    reply = await post(client, WATCH, frame(b""))
    assert reply.status is Status.OK
    assert [WatchEvent.parse(m).revision for m in reply.messages] == [1, 2, 3]


async def test_server_streaming_deadline_after_some_messages(
    client: httpx.AsyncClient, control: Control
) -> None:
    control.watch_forever = True
    reply = await post(client, WATCH, frame(b""), {**BINARY, "grpc-timeout": "100m"})
    assert [WatchEvent.parse(m).revision for m in reply.messages] == [1, 2, 3]
    assert reply.status is Status.DEADLINE_EXCEEDED
    assert control.cancelled.is_set()


@asynccontextmanager
async def http_server(app: GrpcWebApp) -> AsyncIterator[str]:
    """``app`` on the HTTP server the gRPC-web port runs on (llmgw.server.wire.asgihttp)."""
    server = HttpServer(AsgiHandler(app), ServerLimits())
    host, port = await server.start("127.0.0.1", 0)
    try:
        yield f"http://{host}:{port}"
    finally:
        await server.stop()


async def next_frame(chunks: AsyncIterator[bytes], buffer: bytearray) -> tuple[int, bytes]:
    while len(buffer) < 5 or len(buffer) < 5 + int.from_bytes(buffer[1:5], "big"):
        buffer += await anext(chunks)
    length = int.from_bytes(buffer[1:5], "big")
    flag, payload = buffer[0], bytes(buffer[5 : 5 + length])
    del buffer[: 5 + length]
    return flag, payload


async def wait_for(event: Callable[[], Awaitable[object]]) -> None:
    await asyncio.wait_for(event(), timeout=5)


async def test_streaming_and_disconnect_over_http(control: Control) -> None:
    control.watch_forever = True
    app = GrpcWebApp([control], max_message_bytes=LIMIT)
    async with http_server(app) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", WATCH, content=frame(b""), headers=BINARY) as response:
            assert response.status_code == 200
            chunks = response.aiter_raw()
            buffer = bytearray()
            revisions = [
                WatchEvent.parse((await next_frame(chunks, buffer))[1]).revision for _ in range(3)
            ]
            assert revisions == [1, 2, 3]
            control.release.set()  # only now does the handler send the next one
            assert WatchEvent.parse((await next_frame(chunks, buffer))[1]).revision == 100
            assert not control.cancelled.is_set()
        await wait_for(control.cancelled.wait)  # the client went away: the handler is cancelled
        reply = await http.post(GET_CLUSTER, content=frame(b""), headers=BINARY)
        assert Reply(reply).status is Status.OK
