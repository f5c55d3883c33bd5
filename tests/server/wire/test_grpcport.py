"""llmgw.server.wire.grpcport: connections counted in and out, and grpclib forgets refused ones
(in this test's event loop, on loopback; tests/integration/test_grpc_port_limits_e2e.py
drives a real server)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from llmgw.server.wire.grpcport import ConnectionLimits, LimitedServer

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


async def _until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110  (polling counters the server keeps)
            await asyncio.sleep(0.02)


async def _started(limits: ConnectionLimits) -> tuple[LimitedServer, int]:
    server = LimitedServer([], limits=limits)
    await server.start("127.0.0.1", 0)
    sockets = server._server.sockets if server._server is not None else []  # type: ignore[attr-defined]
    return server, int(sockets[0].getsockname()[1])


async def test_connections_are_counted_in_and_out_and_refused_ones_forgotten() -> None:
    server, port = await _started(ConnectionLimits(max_per_peer=2))
    try:
        streams = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
        for _, writer in streams:
            writer.write(PREFACE)
        await _until(lambda: server.total == 2)
        assert dict(server.by_peer) == {"127.0.0.1": 2}
        for _, writer in streams:
            writer.close()
        await _until(lambda: server.total == 0)
        assert dict(server.by_peer) == {}
        server.__gc_collect__()
        assert server._handlers == set()  # neither refused nor served ones linger
    finally:
        server.close()
        await server.wait_closed()
