"""The operator client against the real gRPC-web bridge (in memory and over its server)."""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

import httpx
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from llmgw.api.llmgw.v1 import (
    ActionResult,
    ApplyDeploymentRequest,
    Cluster,
    ControlServiceBase,
    DeleteDeploymentRequest,
    DeleteNodeRequest,
    Deployment,
    EngineProfile,
    GetClusterRequest,
    ListProfilesRequest,
    ListProfilesResponse,
    NodeRequest,
    ReplicaRequest,
    ReprofileReplicaRequest,
    WatchEvent,
    WatchRequest,
)
from llmgw.client import (
    ClientError,
    ControlClient,
    GrpcWebChannel,
    ProtocolViolation,
    RpcError,
    ServerUnreachable,
    Timeouts,
)
from llmgw.gateway.httplimits import ServerLimits
from llmgw.gateway.httpserver import HttpServer
from llmgw.server.wire.asgihttp import AsgiHandler
from llmgw.server.wire.grpcweb import GrpcWebApp


class Control(ControlServiceBase):
    """Answers every RPC and records what it was asked."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.watch_forever = False
        self.watch_cancelled = asyncio.Event()

    async def _record(self, message: Any) -> ActionResult:
        self.requests.append(message)
        return ActionResult(ok=True, message=type(message).__name__)

    async def get_cluster(self, message: GetClusterRequest) -> Cluster:
        return Cluster(revision=7)

    async def watch(self, message: WatchRequest) -> AsyncIterator[WatchEvent]:
        for revision in (1, 2, 3):
            yield WatchEvent(revision=revision)
        if self.watch_forever:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.watch_cancelled.set()
                raise

    async def cordon_node(self, message: NodeRequest) -> ActionResult:
        if message.node_id == "missing":
            raise GRPCError(Status.NOT_FOUND, "no node named 'missing' – ever")
        if message.node_id == "slow":
            await asyncio.sleep(30)
        return await self._record(message)

    uncordon_node = drain_node = cordon_node
    apply_deployment = delete_deployment = delete_node = _record
    start_replica = drain_replica = reprofile_replica = _record

    async def list_profiles(self, message: ListProfilesRequest) -> ListProfilesResponse:
        return ListProfilesResponse(profiles=[EngineProfile(name="h100-tp2")])


@pytest.fixture
def control() -> Control:
    return Control()


@pytest.fixture
async def channel(control: Control) -> AsyncIterator[GrpcWebChannel]:
    transport = httpx.ASGITransport(app=GrpcWebApp([control], max_message_bytes=1 << 20))
    async with GrpcWebChannel("http://127.0.0.1", transport=transport) as channel:
        yield channel


# --- calls -------------------------------------------------------------------------------


async def test_unary(channel: GrpcWebChannel) -> None:
    assert await ControlClient(channel).get_cluster() == Cluster(revision=7)


MUTATIONS: list[tuple[str, tuple[Any, ...], dict[str, object], Any]] = [
    ("cordon_node", ("n1",), {}, NodeRequest(node_id="n1")),
    ("uncordon_node", ("n1",), {}, NodeRequest(node_id="n1")),
    ("drain_node", ("n1",), {}, NodeRequest(node_id="n1")),
    (
        "apply_deployment",
        (ApplyDeploymentRequest(deployment=Deployment(name="chat"), dry_run=True),),
        {},
        ApplyDeploymentRequest(deployment=Deployment(name="chat"), dry_run=True),
    ),
    ("delete_deployment", ("chat",), {}, DeleteDeploymentRequest(name="chat")),
    ("delete_node", ("n1",), {"force": True}, DeleteNodeRequest(node_id="n1", force=True)),
    ("start_replica", ("chat",), {}, ReplicaRequest(deployment="chat")),
    (
        "drain_replica",
        ("r1",),
        {"deployment": "chat"},
        ReplicaRequest(replica_id="r1", deployment="chat"),
    ),
    (
        "reprofile_replica",
        ("r1",),
        {"profile": "h100-tp4"},
        ReprofileReplicaRequest(replica_id="r1", profile="h100-tp4"),
    ),
]


@pytest.mark.parametrize(
    ("method", "args", "kwargs", "sent"), MUTATIONS, ids=[m[0] for m in MUTATIONS]
)
async def test_every_mutation_reaches_its_rpc(
    channel: GrpcWebChannel,
    control: Control,
    method: str,
    args: tuple[Any, ...],
    kwargs: dict[str, str],
    sent: Any,
) -> None:
    result = await getattr(ControlClient(channel), method)(*args, **kwargs)
    assert result == ActionResult(ok=True, message=type(sent).__name__)
    assert control.requests == [sent]


async def test_reads(channel: GrpcWebChannel) -> None:
    client = ControlClient(channel, read_only=True)
    assert [p.name for p in await client.list_profiles()] == ["h100-tp2"]
    with pytest.raises(RpcError) as caught:  # the test service leaves it unimplemented
        await client.get_router_stats()
    assert caught.value.status is Status.UNIMPLEMENTED


async def test_error_status_raises_rpc_error(channel: GrpcWebChannel) -> None:
    with pytest.raises(RpcError) as caught:
        await ControlClient(channel).cordon_node("missing")
    assert caught.value.status is Status.NOT_FOUND
    assert caught.value.message == "no node named 'missing' – ever"
    assert str(caught.value) == "NOT_FOUND: no node named 'missing' – ever"


async def test_call_timeout_is_deadline_exceeded(control: Control) -> None:
    transport = httpx.ASGITransport(app=GrpcWebApp([control], max_message_bytes=1 << 20))
    timeouts = Timeouts(connect=1.0, call=0.1)
    async with GrpcWebChannel(
        "http://127.0.0.1", transport=transport, timeouts=timeouts
    ) as channel:
        with pytest.raises(RpcError) as caught:
            await ControlClient(channel).cordon_node("slow")
    assert caught.value.status is Status.DEADLINE_EXCEEDED


async def test_server_streaming(channel: GrpcWebChannel) -> None:
    async with aclosing(ControlClient(channel).watch()) as events:  # type: ignore[type-var]
        assert [event.revision async for event in events] == [1, 2, 3]


async def test_read_only_refuses_every_mutation_without_sending(control: Control) -> None:
    sent: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(500)

    transport = httpx.MockTransport(handle)
    async with GrpcWebChannel("http://127.0.0.1", transport=transport) as channel:
        client = ControlClient(channel, read_only=True)
        assert client.read_only
        for method, args, kwargs, _ in MUTATIONS:
            with pytest.raises(ClientError, match=r"^refused: this client is read-only$"):
                await getattr(client, method)(*args, **kwargs)
    assert sent == []


# --- transport failures and malformed replies --------------------------------------------


async def test_unreachable_server() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    async with GrpcWebChannel(url, timeouts=Timeouts(connect=2.0)) as channel:
        with pytest.raises(ServerUnreachable) as caught:
            await ControlClient(channel).get_cluster()
        assert caught.value.url == url
        assert url in str(caught.value)
        with pytest.raises(ServerUnreachable):
            async with aclosing(ControlClient(channel).watch()) as events:  # type: ignore[type-var]
                await anext(events)
    assert isinstance(caught.value.__cause__, httpx.ConnectError)


class _BrokenBody(httpx.AsyncByteStream):
    """A reply body whose connection resets after the head."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        raise httpx.ReadError("[Errno 104] Connection reset by peer")
        yield b""  # an async generator


@pytest.mark.parametrize(
    "hang_up",
    [
        httpx.RemoteProtocolError("Server disconnected without sending a response."),
        httpx.ReadError("[Errno 104] Connection reset by peer"),  # the kernel's take on it
    ],
)
async def test_a_hang_up_before_any_reply_hints_at_tls_on_plaintext_urls(
    hang_up: httpx.TransportError,
) -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        raise hang_up

    transport = httpx.MockTransport(handle)
    for url, hinted in (("http://127.0.0.1", True), ("https://127.0.0.1", False)):
        async with GrpcWebChannel(url, transport=transport) as channel:
            with pytest.raises(ServerUnreachable) as caught:
                await ControlClient(channel).get_cluster()
            with pytest.raises(ServerUnreachable) as streaming:
                async with aclosing(ControlClient(channel).watch()) as events:  # type: ignore[type-var]
                    await anext(events)
        for error in (caught.value, streaming.value):
            assert error.reason.startswith(f"connection lost ({hang_up})")
            assert error.reason.endswith("; if the server uses TLS, use an https:// URL") is hinted
            assert error.__cause__ is hang_up


async def test_a_reset_after_the_reply_head_is_no_tls_hint() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers=GRPC_WEB, stream=_BrokenBody())

    transport = httpx.MockTransport(handle)
    async with GrpcWebChannel("http://127.0.0.1", transport=transport) as channel:
        with pytest.raises(ServerUnreachable) as caught:
            await ControlClient(channel).get_cluster()
    assert caught.value.reason == "connection lost ([Errno 104] Connection reset by peer)"


def data_frame(payload: bytes, flag: int = 0) -> bytes:
    return bytes([flag]) + len(payload).to_bytes(4, "big") + payload


OK_TRAILER = data_frame(b"grpc-status:0\r\n", flag=0x80)
GRPC_WEB = {"content-type": "application/grpc-web+proto"}


async def call_mock(response: httpx.Response) -> tuple[Cluster, httpx.Request]:
    requests: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return response

    transport = httpx.MockTransport(handle)
    headers = {"authorization": "Bearer t0k"}
    async with GrpcWebChannel("http://127.0.0.1/", transport=transport, headers=headers) as channel:
        cluster = await ControlClient(channel).get_cluster()
    return cluster, requests[0]


async def test_request_shape() -> None:
    body = data_frame(bytes(Cluster(revision=9))) + OK_TRAILER
    cluster, request = await call_mock(httpx.Response(200, headers=GRPC_WEB, content=body))
    assert cluster.revision == 9
    assert request.url == "http://127.0.0.1/llmgw.v1.ControlService/GetCluster"
    assert request.method == "POST"
    assert request.headers["content-type"] == "application/grpc-web+proto"
    assert request.headers["x-grpc-web"] == "1"
    assert request.headers["authorization"] == "Bearer t0k"
    assert request.headers["grpc-timeout"] == "10000m"
    assert request.content == data_frame(b"")


@pytest.mark.parametrize(
    ("response", "error", "expected"),
    [
        (httpx.Response(503, text="down"), RpcError, "UNAVAILABLE: HTTP 503 Service Unavailable"),
        (httpx.Response(404), RpcError, "UNIMPLEMENTED: HTTP 404 Not Found"),
        (httpx.Response(200, html="<p>hi</p>"), ProtocolViolation, "unexpected content-type"),
        (
            httpx.Response(
                200, headers={**GRPC_WEB, "grpc-status": "7", "grpc-message": "no%20way"}
            ),
            RpcError,
            "PERMISSION_DENIED: no way",
        ),
        (
            httpx.Response(200, headers=GRPC_WEB, content=OK_TRAILER),
            ProtocolViolation,
            "0 messages",
        ),
        (
            httpx.Response(200, headers=GRPC_WEB, content=data_frame(b"")),
            ProtocolViolation,
            "without a grpc-status",
        ),
        (
            httpx.Response(200, headers=GRPC_WEB, content=data_frame(b"")[:3]),
            ProtocolViolation,
            "ended inside a frame",
        ),
        (
            httpx.Response(200, headers=GRPC_WEB, content=data_frame(b"\x30\x80") + OK_TRAILER),
            ProtocolViolation,
            "cannot decode Cluster",
        ),
        (
            httpx.Response(200, headers=GRPC_WEB, content=OK_TRAILER + data_frame(b"")),
            ProtocolViolation,
            "after the trailers",
        ),
        (
            httpx.Response(200, headers=GRPC_WEB, content=data_frame(b"grpc-status", flag=0x80)),
            ProtocolViolation,
            "malformed trailer line",
        ),
        (
            httpx.Response(200, headers=GRPC_WEB, content=data_frame(b"grpc-status:99\r\n", 0x80)),
            RpcError,
            "UNKNOWN",
        ),
    ],
    ids=[
        "http-503",
        "http-404",
        "html",
        "trailers-only",
        "no-message",
        "no-trailers",
        "truncated",
        "undecodable",
        "frame-after-trailers",
        "bad-trailer",
        "unknown-status",
    ],
)
async def test_malformed_or_failed_replies(
    response: httpx.Response, error: type[ClientError], expected: str
) -> None:
    with pytest.raises(error, match=expected):
        await call_mock(response)


async def test_closed_channel_refuses_calls(channel: GrpcWebChannel) -> None:
    await channel.aclose()
    with pytest.raises(ClientError, match="is closed"):
        await ControlClient(channel).get_cluster()


def test_unclosed_channel_warns() -> None:
    channel = GrpcWebChannel("http://127.0.0.1")
    with pytest.warns(ResourceWarning, match="unclosed <GrpcWebChannel http://127.0.0.1>"):
        del channel
        gc.collect()


# --- a real server -----------------------------------------------------------------------


@asynccontextmanager
async def http_server(app: GrpcWebApp) -> AsyncIterator[str]:
    """``app`` on the HTTP server the gRPC-web port runs on (llmgw.server.wire.asgihttp)."""
    server = HttpServer(AsgiHandler(app), ServerLimits())
    host, port = await server.start("127.0.0.1", 0)
    try:
        yield f"http://{host}:{port}"
    finally:
        await server.stop()


async def wait_for(event: Callable[[], Awaitable[object]]) -> None:
    await asyncio.wait_for(event(), timeout=5)


async def test_watch_streams_over_http_and_closing_cancels_the_handler(
    control: Control,
) -> None:
    control.watch_forever = True
    app = GrpcWebApp([control], max_message_bytes=1 << 20)
    async with http_server(app) as url, GrpcWebChannel(url) as channel:
        client = ControlClient(channel)
        async with aclosing(client.watch()) as events:  # type: ignore[type-var]
            revisions = [(await anext(events)).revision for _ in range(3)]
        assert revisions == [1, 2, 3]
        await wait_for(control.watch_cancelled.wait)
        assert (await client.get_cluster()).revision == 7
