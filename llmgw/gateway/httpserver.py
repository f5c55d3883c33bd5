"""The gateway's HTTP/1.1 server: an asyncio Protocol over httptools' request parser.

Not ASGI: in the same bare proxy this server spent less CPU per request than uvicorn's ASGI
server, and the proxy writes the replica's bytes straight to the client transport, in the
loop iteration that read them.

Here: ``HttpServer``, which listens, keeps the connections and sweeps the idle and slow ones.
Each connection is an ``httpconnection.HttpConnection`` (what it does, its limits and its
browser checks are said there); what handlers get and give is in ``httprequest``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl as _ssl
from collections.abc import Callable

from llmgw.gateway.httpconnection import Handler, HttpConnection
from llmgw.gateway.httplimits import BodyBudget, PeerCount, ServerLimits
from llmgw.gateway.httprequest import Admit
from llmgw.httpguard import LOOPBACK_ONLY, HttpGuard


class HttpServer:
    """Listens, keeps the connections, sweeps the idle and slow ones once a second."""

    def __init__(
        self,
        handler: Handler,
        limits: ServerLimits,
        *,
        tick: Callable[[float], None] | None = None,
        refused: Callable[[int], None] | None = None,
        guard: HttpGuard = LOOPBACK_ONLY,
        cors: bool = True,
        admit: Admit | None = None,
    ) -> None:
        self.handler = handler
        self.guard = guard  # which Host and Origin headers are answered (llmgw.httpguard)
        self.cors = cors  # False: the handler writes CORS headers and answers preflights
        self.refused = refused  # told the status of every request refused before its handler
        self.admit = admit
        self._tick = tick
        self.limits = limits
        self.connections: set[HttpConnection] = set()
        self.peers = PeerCount(limits)
        self.budget = BodyBudget(limits.max_body_buffer_bytes)
        self.stopping = False
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(
        self, host: str, port: int, *, ssl: _ssl.SSLContext | None = None
    ) -> tuple[str, int]:
        """Listen on ``host:port`` (TLS only, with ``ssl``); the bound address (port 0 → the
        chosen one). A connection reaches ``HttpConnection`` once its handshake is done (it
        must be within ``head_timeout_s``)."""
        self._server = await self.loop.create_server(
            lambda: HttpConnection(self),
            host,
            port,
            reuse_address=True,
            backlog=1024,
            ssl=ssl,
            ssl_handshake_timeout=None if ssl is None else self.limits.head_timeout_s,
        )
        self._sweeper = self.loop.create_task(self._sweep(), name="http-sweep")
        sockname = self._server.sockets[0].getsockname()
        return str(sockname[0]), int(sockname[1])

    async def stop(self) -> None:
        """Stop listening, cancel handlers, close every connection."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for conn in list(self.connections):
            conn.shutdown()
        for _ in range(100):  # cancelled handlers close their connections as they unwind
            if not self.connections:
                break
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = self.loop.time()
            for conn in [c for c in self.connections if c.deadline < now]:
                conn.expire(now)
            if self._tick is not None:
                self._tick(now)


__all__ = ["HttpServer"]
