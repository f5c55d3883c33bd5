"""An ASGI application (the gRPC-web port's ``GrpcWebApp``) on our HTTP/1.1 server.

The gRPC-web port is served by ``llmgw.gateway.httpserver.HttpServer``, the gateway's
server, under the same ``ServerLimits`` (head size and count, head, body and idle
timeouts, connection caps in all and per peer, a budget of buffered body bytes). uvicorn,
which served it before, kept a connection that sent a header byte a second, or nothing,
open for ever and took unbounded request heads before any handler ran; and it cost more CPU
per request (BENCHMARKS.md, "gRPC-web HTTP server").

What the application sees, per request: an ``http`` scope (no lifespan: the server's own
start and stop are the process's); ``receive`` gives the whole body at once (the server has
read it within its limits), then waits until the client goes away, when the request's task
is cancelled. ``send`` writes the response: a whole body with its content-length; a body in
several parts with its own content-length, or chunked to an HTTP/1.1 client (to an
HTTP/1.0 one: until the connection closes), each part written before ``send`` returns and
paced by the client's reading. A response the application leaves unfinished closes the
connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import unquote

from llmgw.gateway import HttpConnection, Request, status_line

__all__ = ["AsgiApp", "AsgiHandler"]

log = logging.getLogger(__name__)

AsgiMessage = MutableMapping[str, Any]
AsgiApp = Callable[
    [
        MutableMapping[str, Any],
        Callable[[], Awaitable[AsgiMessage]],
        Callable[[AsgiMessage], Awaitable[None]],
    ],
    Awaitable[None],
]

_OWN_HEADERS = frozenset({b"connection", b"keep-alive", b"transfer-encoding"})


class AsgiHandler:
    """An ``HttpServer`` handler that runs one ASGI application per request."""

    def __init__(self, app: AsgiApp, *, scheme: str = "http") -> None:
        self._app = app
        self._scheme = scheme

    async def __call__(self, request: Request, conn: HttpConnection) -> None:
        response = _Response(conn, head_only=request.method == b"HEAD")
        delivered = False

        async def receive() -> AsgiMessage:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await asyncio.get_running_loop().create_future()  # until cancelled: client gone
            return {"type": "http.disconnect"}  # not reached

        try:
            await self._app(self._scope(request, conn), receive, response.send)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("error answering %s %s", request.method.decode(), request.path)
            response.fail()
            return
        response.end()

    def _scope(self, request: Request, conn: HttpConnection) -> MutableMapping[str, Any]:
        _, _, query = request.target.partition(b"?")
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1" if request.http11 else "1.0",
            "method": request.method.decode("latin-1"),
            "scheme": self._scheme,
            "path": unquote(request.path),
            "raw_path": request.target.partition(b"?")[0],
            "query_string": query,
            "root_path": "",
            "headers": list(request.headers),
            "client": conn.peer,
            "server": None,
        }


class _Response:
    """One ASGI response written to the connection."""

    def __init__(self, conn: HttpConnection, *, head_only: bool) -> None:
        self._conn = conn
        self._head_only = head_only
        self._head: bytes | None = None  # status line and headers, until the first part
        self._length: int | None = None  # content-length the application gave
        self._chunked = False
        self._started = False
        self._done = False

    async def send(self, message: AsgiMessage) -> None:
        kind = message["type"]
        if kind == "http.response.start" and not self._started:
            self._start(int(message["status"]), message.get("headers", []))
        elif kind == "http.response.body" and self._started and not self._done:
            await self._body(bytes(message.get("body", b"")), bool(message.get("more_body")))
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} in this state")

    def end(self) -> None:
        """The application returned: a response it left unfinished closes the connection."""
        if not self._done:
            self.fail()

    def fail(self) -> None:
        if self._conn.started:
            self._conn.abort()
        else:
            self._conn.close_after_response()
            self._conn.respond(500, b"internal error", b"text/plain; charset=utf-8")

    def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._started = True
        lines = [status_line(status)]
        for name, value in headers:
            lower = name.lower()
            if lower == b"content-length":
                self._length = int(value)
            if lower not in _OWN_HEADERS:
                lines.append(b"%s: %s\r\n" % (name, value))
        self._head = b"".join(lines)

    async def _body(self, body: bytes, more: bool) -> None:
        head, self._head = self._head, None
        out = b""
        if head is not None:
            out = head + self._framing(len(body), more) + self._conn.connection_header() + b"\r\n"
        if not self._head_only:
            out += b"%x\r\n%s\r\n" % (len(body), body) if self._chunked and body else body
            if self._chunked and not more:
                out += b"0\r\n\r\n"
        self._done = not more
        self._conn.write(out)
        if more:
            await self._conn.drain()

    def _framing(self, size: int, more: bool) -> bytes:
        """The framing header the first part needs, given what the application declared."""
        if self._length is not None:
            return b"content-length: %d\r\n" % self._length
        if not more:
            return b"content-length: %d\r\n" % size
        if self._conn.chunked_ok:
            self._chunked = True
            return b"transfer-encoding: chunked\r\n"
        self._conn.close_after_response()  # HTTP/1.0: the body ends when the connection does
        return b""
