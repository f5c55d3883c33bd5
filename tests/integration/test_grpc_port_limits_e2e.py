"""The native gRPC port's connection limits (issue 13, hole 5), over raw sockets against a
real ``llmgw server``:

- a socket that sends nothing (no HTTP/2 preface) is dropped after ``--grpc-handshake-timeout``;
- one that sends the preface but opens no stream is sent GOAWAY and closed after
  ``--grpc-idle-timeout``, while one with an open call (a Watch) keeps its connection;
- on a TLS port, a socket that never starts its handshake is dropped after the same timeout;
- beyond ``--grpc-max-connections-per-peer`` from 127.0.0.1 a connection is closed at once,
  while 127.0.0.2 still connects and a real RPC from it works.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Iterator

import grpclib.client
import pytest
from grpclib.protocol import H2Protocol
from procs import Cluster, wait_for
from tlspki import Pki

from llmgw.api.llmgw.v1 import ControlServiceStub, GetClusterRequest, WatchRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HANDSHAKE_S, IDLE_S, PER_PEER = 2.0, 4.0, 3
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = struct.pack(">I", 0)[1:] + b"\x04\x00" + b"\x00\x00\x00\x00"
GOAWAY = 0x7


@pytest.fixture
def server(cluster: Cluster) -> Iterator[Cluster]:
    cluster.start_server(
        *("--grpc-handshake-timeout", str(HANDSHAKE_S), "--grpc-idle-timeout", str(IDLE_S)),
        *("--grpc-max-connections-per-peer", str(PER_PEER)),
    )
    yield cluster


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _read_until_closed(s: socket.socket, within_s: float) -> tuple[bytes, float | None]:
    """What the server sent, and how long after the call it closed (None: still open)."""
    started, got = time.monotonic(), b""
    s.settimeout(0.2)
    while time.monotonic() - started < within_s:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got, time.monotonic() - started
        if not chunk:
            return got, time.monotonic() - started
        got += chunk
    return got, None


def _frame_types(data: bytes) -> list[int]:
    types, at = [], 0
    while at + 9 <= len(data):
        length = int.from_bytes(data[at : at + 3], "big")
        types.append(data[at + 3])
        at += 9 + length
    return types


def test_a_socket_that_sends_nothing_is_dropped(server: Cluster) -> None:
    with _connect(server.grpc_port) as silent:
        _, closed_after = _read_until_closed(silent, HANDSHAKE_S + 4)
    assert closed_after is not None, "a silent socket was kept"
    assert HANDSHAKE_S - 0.5 < closed_after < HANDSHAKE_S + 4


async def _watch_open(port: int, opened: asyncio.Event, stop: asyncio.Event) -> None:
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        async for _ in ControlServiceStub(channel).watch(WatchRequest()):  # the snapshot first
            opened.set()
            await stop.wait()
            break
    finally:
        channel.close()


async def _idle_and_busy(port: int) -> tuple[bytes, float | None, bool]:
    opened, stop = asyncio.Event(), asyncio.Event()
    watch = asyncio.create_task(_watch_open(port, opened, stop))
    await asyncio.wait_for(opened.wait(), 10)
    with _connect(port) as idle:
        idle.sendall(PREFACE + EMPTY_SETTINGS)
        got, closed_after = await asyncio.to_thread(_read_until_closed, idle, IDLE_S + 6)
    busy_alive = not watch.done()  # past the idle timeout with its call open
    stop.set()
    await asyncio.wait_for(watch, 10)
    return got, closed_after, busy_alive


def test_a_connection_without_streams_is_closed_after_the_idle_timeout(server: Cluster) -> None:
    got, closed_after, busy_alive = asyncio.run(_idle_and_busy(server.grpc_port))
    assert closed_after is not None, "an idle connection was kept"
    assert IDLE_S - 0.5 < closed_after < IDLE_S + 6
    assert GOAWAY in _frame_types(got)
    assert busy_alive


class _FromSource(grpclib.client.Channel):
    """A grpclib channel whose connection leaves from ``source`` (127.0.0.2)."""

    def __init__(self, host: str, port: int, source: str) -> None:
        super().__init__(host, port)
        self._source = source

    async def _create_connection(self) -> H2Protocol:
        _, protocol = await self._loop.create_connection(
            self._protocol_factory, self._host, self._port, local_addr=(self._source, 0)
        )
        return protocol


async def _cluster_from(port: int, source: str) -> int:
    channel = _FromSource("127.0.0.1", port, source)
    try:
        reply = await asyncio.wait_for(
            ControlServiceStub(channel).get_cluster(GetClusterRequest()), 10
        )
    finally:
        channel.close()
    return len(reply.nodes)


def test_connections_over_the_per_peer_cap_are_refused_and_others_served(
    server: Cluster,
) -> None:
    held = [_connect(server.grpc_port) for _ in range(PER_PEER)]
    try:
        for s in held:
            s.sendall(PREFACE + EMPTY_SETTINGS)  # past the handshake: they count
        with _connect(server.grpc_port) as over:
            got, closed_after = _read_until_closed(over, 2)
        assert closed_after is not None and closed_after < 1.5, "over the cap and kept"
        assert got == b""  # not served at all: no SETTINGS
        with _connect(server.grpc_port, "127.0.0.2") as other:
            got, closed_after = _read_until_closed(other, 1)
        assert closed_after is None and _frame_types(got)[:1] == [0x4]  # its SETTINGS
        assert asyncio.run(_cluster_from(server.grpc_port, "127.0.0.2")) == 0
    finally:
        for s in held:
            s.close()
    assert "refused 1 connection(s), the last from 127.0.0.1" in server.log("server")


def test_a_tls_socket_that_never_finishes_its_handshake_is_dropped(
    cluster: Cluster, pki: Pki
) -> None:
    cluster.spawn(
        "server",
        *("server", "--grpc-listen", f"127.0.0.1:{cluster.grpc_port}"),
        *("--http-listen", f"127.0.0.1:{cluster.http_port}", "--gateway-listen", "off"),
        *("--db", str(cluster.root / "server.db"), "--grpc-handshake-timeout", str(HANDSHAKE_S)),
        *("--tls-cert", str(pki.cert), "--tls-key", str(pki.key)),
    )
    wait_for(lambda: ": gRPC on 127.0.0.1:" in cluster.log("server"), 30, "the server serving")
    with _connect(cluster.grpc_port) as silent:  # not even a ClientHello
        _, closed_after = _read_until_closed(silent, HANDSHAKE_S + 4)
    assert closed_after is not None, "a silent TLS socket was kept"
    assert HANDSHAKE_S - 0.5 < closed_after < HANDSHAKE_S + 4
