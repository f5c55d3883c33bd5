"""Revoking a token ends the calls already open with it, on both ports (llmgw.server.wire.auth).

Streams that never end by themselves (a console's Watch, a gateway's Feed, an agent's
Connect) run on a native grpclib server and through the gRPC-web bridge; the token is
deleted through a second connection to the state file, as ``llmgw token revoke`` does, and
the stream must end with UNAUTHENTICATED well within a second while other callers' streams
go on. ``refresh_s`` is an hour here: only the revocation watcher can notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import betterproto2
import grpclib.client
import grpclib.server
import httpx
import pytest
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from llmgw.api.llmgw.v1 import (
    ActionResult,
    AgentMessage,
    AgentServiceBase,
    ControlMessage,
    ControlServiceBase,
    ReplicaRequest,
    RouterFeedEvent,
    RouterFeedRequest,
    RouterServiceBase,
    WatchEvent,
    WatchRequest,
)
from llmgw.client import GrpcWebChannel, RpcError
from llmgw.server.state.store import Store
from llmgw.server.state.tokens import Role
from llmgw.server.wire.auth import REVOKED, Authenticator, hash_token, install, new_token
from llmgw.server.wire.grpcweb import GrpcWebApp

WATCH = "/llmgw.v1.ControlService/Watch"
DRAIN = "/llmgw.v1.ControlService/DrainReplica"
FEED = "/llmgw.v1.RouterService/Feed"
CONNECT = "/llmgw.v1.AgentService/Connect"
WATCH_TYPES = (WatchRequest(), WatchEvent)
CUT_WITHIN_S = 1.0
JOIN = "join-secret-for-the-test"


class Streams:
    """Each stream sends one message at once, then one more each time ``more`` is set."""

    def __init__(self) -> None:
        self.more = asyncio.Event()
        self.cancelled = 0  # handlers that saw their cancellation
        self.swallow = False  # the feed catches its cancellation and returns normally

    async def forever(self) -> AsyncIterator[int]:
        n = 1
        try:
            while True:
                yield n
                await self.more.wait()
                self.more.clear()
                n += 1
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


class Control(ControlServiceBase):
    def __init__(self, streams: Streams) -> None:
        self.streams = streams

    async def watch(self, message: WatchRequest) -> AsyncIterator[WatchEvent]:
        async for n in self.streams.forever():
            yield WatchEvent(revision=n)

    async def drain_replica(self, message: ReplicaRequest) -> ActionResult:
        return ActionResult(ok=True)


class Router(RouterServiceBase):
    def __init__(self, streams: Streams) -> None:
        self.streams = streams

    async def feed(self, message: RouterFeedRequest) -> AsyncIterator[RouterFeedEvent]:
        with contextlib.suppress(asyncio.CancelledError):
            async for n in self.streams.forever():
                yield RouterFeedEvent(revision=n)
        if not self.streams.swallow:
            raise asyncio.CancelledError


class Agents(AgentServiceBase):
    def __init__(self, streams: Streams) -> None:
        self.streams = streams

    async def connect(self, messages: AsyncIterator[AgentMessage]) -> AsyncIterator[ControlMessage]:
        async for _ in self.streams.forever():
            yield ControlMessage()


def services(streams: Streams) -> list[Any]:
    return [Control(streams), Router(streams), Agents(streams)]


@pytest.fixture
async def path(tmp_path: Path) -> Path:
    return tmp_path / "server.db"


@pytest.fixture
async def store(path: Path) -> AsyncIterator[Store]:
    async with Store(path) as s:
        yield s


@pytest.fixture
def auth(store: Store) -> Authenticator:
    return Authenticator(
        store, join_token=JOIN, refresh_s=3600, miss_refresh_s=0, revoke_check_s=0.05
    )


@pytest.fixture
def streams() -> Streams:
    return Streams()


@pytest.fixture
async def port(streams: Streams, auth: Authenticator) -> AsyncIterator[int]:
    server = grpclib.server.Server(services(streams))
    install(server, auth)
    await server.start("127.0.0.1", 0)
    try:
        yield server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        server.close()
        await server.wait_closed()


async def add(store: Store, role: Role) -> tuple[int, str]:
    token = new_token()
    return await store.add_token(role, hash_token(token), ""), token


async def revoke(path: Path, token_id: int) -> float:
    """Delete the token through another connection, as ``llmgw token revoke`` does; when."""
    async with Store(path) as other:
        assert await other.delete_token(token_id)
    return time.monotonic()


_TYPES: dict[str, tuple[Cardinality, type[betterproto2.Message], type[betterproto2.Message]]] = {
    WATCH: (Cardinality.UNARY_STREAM, WatchRequest, WatchEvent),
    FEED: (Cardinality.UNARY_STREAM, RouterFeedRequest, RouterFeedEvent),
    CONNECT: (Cardinality.STREAM_STREAM, AgentMessage, ControlMessage),
}


@contextlib.asynccontextmanager
async def native_stream(port: int, method: str, token: str) -> AsyncIterator[Any]:
    """A native call of ``method`` that has received its first message."""
    cardinality, request, reply = _TYPES[method]
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        metadata = {"authorization": f"Bearer {token}"}
        async with channel.request(method, cardinality, request, reply, metadata=metadata) as s:
            # Connect too half-closes: with the agent's side still open, grpclib's server
            # resets the stream right after its trailers, and the client may see the reset
            # before the status.
            await s.send_message(request(), end=True)
            assert await s.recv_message() is not None
            yield s
            if not s._recv_trailing_metadata_done:
                await s.cancel()  # a stream still open ends here
    finally:
        channel.close()


async def ends_unauthenticated(stream: Any, revoked_at: float) -> float:
    """Seconds from the revocation until the stream ended with UNAUTHENTICATED."""
    with pytest.raises(GRPCError) as caught:
        async with asyncio.timeout(5):
            while await stream.recv_message() is not None:
                pass
            await stream.recv_trailing_metadata()  # the status is raised here
    assert (caught.value.status, caught.value.message) == (Status.UNAUTHENTICATED, REVOKED)
    return time.monotonic() - revoked_at


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within 5 s")


async def native_drain(port: int, token: str) -> Status:
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        metadata = {"authorization": f"Bearer {token}"}
        async with channel.request(
            DRAIN, Cardinality.UNARY_UNARY, ReplicaRequest, ActionResult, metadata=metadata
        ) as s:
            await s.send_message(ReplicaRequest(replica_id="r1"), end=True)
            await s.recv_message()
            await s.recv_trailing_metadata()
    except GRPCError as exc:
        return exc.status
    finally:
        channel.close()
    return Status.OK


# --- the native port -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "role"), [(WATCH, Role.VIEWER), (FEED, Role.GATEWAY), (CONNECT, Role.AGENT)]
)
async def test_revoking_a_token_ends_its_open_stream(
    method: str,
    role: Role,
    path: Path,
    store: Store,
    port: int,
    streams: Streams,
    auth: Authenticator,
) -> None:
    token_id, token = await add(store, role)
    async with native_stream(port, method, token) as stream:
        took = await ends_unauthenticated(stream, await revoke(path, token_id))
    assert took < CUT_WITHIN_S
    assert streams.cancelled == 1  # the handler was cancelled, not left running
    assert await native_drain(port, token) is Status.UNAUTHENTICATED  # and it is refused now
    assert auth._watcher is None and not auth._open  # nothing is watched with no call open


async def test_only_the_revoked_tokens_streams_end(
    path: Path, store: Store, port: int, streams: Streams, auth: Authenticator
) -> None:
    gone_id, gone = await add(store, Role.VIEWER)
    _, kept = await add(store, Role.VIEWER)
    async with (
        native_stream(port, WATCH, gone) as cut,
        native_stream(port, WATCH, kept) as stays,
        native_stream(port, CONNECT, JOIN) as agent,  # the join token cannot be revoked
    ):
        assert await ends_unauthenticated(cut, await revoke(path, gone_id)) < CUT_WITHIN_S
        await asyncio.sleep(0.2)  # several more checks of the tokens
        streams.more.set()
        assert (await stays.recv_message()).revision == 2  # still served
        assert await agent.recv_message() is not None
        assert len(auth._open) == 1  # the kept viewer's call; the join token is not kept


async def test_a_handler_that_swallows_its_cancellation_still_ends_unauthenticated(
    path: Path, store: Store, port: int, streams: Streams
) -> None:
    streams.swallow = True
    token_id, token = await add(store, Role.GATEWAY)
    async with native_stream(port, FEED, token) as stream:
        assert await ends_unauthenticated(stream, await revoke(path, token_id)) < 1


async def test_a_client_leaving_is_an_ordinary_cancellation(
    store: Store, port: int, streams: Streams, auth: Authenticator
) -> None:
    _, token = await add(store, Role.VIEWER)
    async with native_stream(port, WATCH, token):
        pass  # leaving cancels the call
    await until(lambda: not auth._open)
    assert streams.cancelled == 1 and auth._watcher is None


async def test_calls_without_authentication_are_not_kept(store: Store, streams: Streams) -> None:
    auth = Authenticator(store, revoke_check_s=0.05)  # no tokens, no join token: off
    server = grpclib.server.Server(services(streams))
    install(server, auth)
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with native_stream(port, WATCH, "anything"):
            assert not auth._open and auth._watcher is None
    finally:
        server.close()
        await server.wait_closed()


# --- the gRPC-web port ---------------------------------------------------------------------


async def test_revoking_a_token_ends_its_watch_on_the_grpc_web_port(
    path: Path, store: Store, streams: Streams, auth: Authenticator
) -> None:
    token_id, token = await add(store, Role.VIEWER)
    app = GrpcWebApp([Control(streams)], authorize=auth.check, guard=auth.guard)
    headers = {"authorization": f"Bearer {token}"}
    transport = httpx.ASGITransport(app=app)  # hands over the body when the call ends
    revisions: list[int] = []

    async def watch() -> None:
        async with GrpcWebChannel("http://localhost", headers=headers, transport=transport) as ch:
            async for event in ch.server_stream(WATCH, *WATCH_TYPES):
                revisions.append(event.revision)  # noqa: PERF401 - kept until the error

    call = asyncio.create_task(watch())
    await until(lambda: bool(auth._open))
    revoked_at = await revoke(path, token_id)
    with pytest.raises(RpcError) as caught:
        await call
    assert time.monotonic() - revoked_at < CUT_WITHIN_S
    assert (caught.value.status, caught.value.message) == (Status.UNAUTHENTICATED, REVOKED)
    assert revisions == [1] and streams.cancelled == 1
    with pytest.raises(RpcError) as refused:
        async with GrpcWebChannel("http://localhost", headers=headers, transport=transport) as ch:
            await ch.unary(DRAIN, ReplicaRequest(replica_id="r1"), ActionResult)
    assert refused.value.status is Status.UNAUTHENTICATED
