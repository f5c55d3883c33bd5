"""One client connection of the gateway's HTTP/1.1 server (``httpserver``), over httptools.

What it does: keep-alive; request bodies by Content-Length or chunked (httptools de-chunks);
``Expect: 100-continue``; pipelined requests answered one after another in order (reading
pauses while more than one is queued); TCP_NODELAY. The limits (``httplimits.ServerLimits``:
head size and count, head and body timeouts, idle timeout, connection caps in all and per
peer, a budget of body bytes buffered across connections) are enforced here; a body too
large is 413 (a body up to 1 MiB over is read and dropped so the client can read the
answer, a larger one is answered at once and the connection closed). A malformed request is
answered 400 and the connection closed. When the client goes away (EOF or reset), the
handler's task is cancelled.

With ``admit``, each request's head is shown to it as soon as it is complete, before any of
the body is read or buffered: a ``Refusal`` it returns is the answer (an API key checked
before a 32 MiB body is taken in).

Browsers: as soon as a request's head has arrived it is put to the server's ``guard``
(``llmgw.httpguard.HttpGuard``); a foreign Host (DNS rebinding) or an Origin that is neither
``--cors-origin`` nor the port's own is answered 403 (a missing or repeated Host or Origin
400) in OpenAI's error shape, and the connection closed: no handler runs and no body is
kept. Requests from a ``--cors-origin`` origin get its CORS headers on their response
(``connection_header`` adds them), and its preflights (OPTIONS with
``Access-Control-Request-Method``) are answered 204 here.

Here: ``HttpConnection`` (its sections: the asyncio Protocol, what handlers use, the
httptools callbacks, running requests, limits), ``Handler`` and ``ServerSide``, what a
connection uses of its ``httpserver.HttpServer``. What handlers get and give (``Request``,
``status_line``...) is in ``httprequest``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol, cast

import httptools

from llmgw.gateway.httplimits import BodyBudget, PeerCount, ServerLimits
from llmgw.gateway.httprequest import (
    JSON_TYPE,
    Admit,
    Producer,
    Request,
    content_length,
    cors_lines,
    error_type,
    is_preflight,
    status_line,
)
from llmgw.gateway.openai import error_body
from llmgw.httpguard import HttpGuard
from llmgw.httpguard import Refusal as BrowserRefusal

log = logging.getLogger("llmgw.gateway.httpserver")  # the server's records, wherever made

DRAIN_LIMIT = 1 << 20
"""How much of a refused body is read and dropped before the connection is simply closed."""

_TOKEN_LIST = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_, ")
_PREFLIGHT_MAX_AGE = 86400
_TWO_HOSTS = BrowserRefusal(400, "a request carries at most one Host and one Origin header")

Handler = Callable[[Request, "HttpConnection"], Awaitable[None]]


class ServerSide(Protocol):
    """What a connection uses of its server (``httpserver.HttpServer``)."""

    handler: Handler
    guard: HttpGuard
    cors: bool
    refused: Callable[[int], None] | None
    admit: Admit | None
    limits: ServerLimits
    connections: set[HttpConnection]
    peers: PeerCount
    budget: BodyBudget
    stopping: bool
    loop: asyncio.AbstractEventLoop


class HttpConnection(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: ServerSide) -> None:
        self._server = server
        self._limits = server.limits
        self._loop = server.loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._peer: str | None = None  # the client's IP address, once it is taken in
        self._url: list[bytes] = []
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._head_bytes = 0
        self._head_seen = 0
        self._body_bytes = 0
        self._in_head = False
        self._in_body = False
        self._head_done = 0.0  # loop time the current request's head ended
        self._refused: tuple[int, bytes] | None = None
        self._drain = 0  # body bytes read and dropped after a refusal, at most
        self._running_body = 0  # bytes of the server's body budget the running request holds
        self._pending: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._keep_alive = True
        self._producer: Producer | None = None
        self._writing_paused = False
        self._closing = False
        self.lost = False
        self.started = False  # a byte of the current response was written
        self._current_cors: bytes | None = None  # the current request's --cors-origin
        self._origin: str | None = None  # the Origin of the request being read
        self.deadline = math.inf  # loop time after which the server's sweep closes us

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if not self._take_in(_peer_host(transport)):
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.deadline = self._loop.time() + self._limits.idle_timeout_s
        self._server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._peer is None:
            return  # refused at accept: nothing of it is read
        in_head = self._in_head
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse_now(400, "protocol upgrades are not supported")
            return
        except httptools.HttpParserError as exc:
            if self._refused is not None:
                self._refuse_body(*self._refused)
            else:
                self._refuse_now(400, f"malformed HTTP request: {exc}")
            return
        if in_head and self._in_head:  # a head split over reads: bound what httptools holds
            self._head_seen += len(data)
            if self._head_seen > self._limits.max_head_bytes:
                self._refuse_now(431, self._head_too_large())

    def eof_received(self) -> bool:
        return False  # a client that half-closes has gone: close, connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._drop_pending()
        self._drop_body()
        if self._peer is not None:
            self._server.peers.remove(self._peer)
            self._peer = None
        self._server.connections.discard(self)
        if self._task is not None:
            self._task.cancel()
        if self._producer is not None:
            self._producer.resume_reading()
            self._producer = None

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self._producer is not None:
            self._producer.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._producer is not None:
            self._producer.resume_reading()
        waiter, self._drained = self._drained, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # what handlers use

    _drained: asyncio.Future[None] | None = None

    @property
    def keep_alive(self) -> bool:
        """Whether the connection stays open after the current response."""
        return self._keep_alive and not self._server.stopping

    @property
    def chunked_ok(self) -> bool:
        """Whether the client reads chunked responses (HTTP/1.1)."""
        return self._current_http11

    @property
    def peer(self) -> tuple[str, int] | None:
        """The client's address and port."""
        if self._transport is None:
            return None
        address = self._transport.get_extra_info("peername")
        return (str(address[0]), int(address[1])) if isinstance(address, tuple) else None

    def write(self, data: bytes) -> None:
        """Bytes of the response (head included) to the client, now."""
        if not self.lost and self._transport is not None:
            self.started = True
            self._transport.write(data)

    async def drain(self) -> None:
        """Wait while the client's socket buffer is full (a streaming response's pace)."""
        if self._writing_paused and not self.lost:
            if self._drained is None:
                self._drained = self._loop.create_future()
            await self._drained

    def respond(
        self, status: int, body: bytes, content_type: bytes = JSON_TYPE, *, headers: bytes = b""
    ) -> None:
        """A whole response with ``body``; ``headers``: more header lines, each ending CRLF."""
        head = status_line(status) + b"content-type: %s\r\ncontent-length: %d\r\n%s" % (
            content_type,
            len(body),
            headers,
        )
        self.write(head + self.connection_header() + b"\r\n" + body)

    def close_after_response(self) -> None:
        """Close the connection once the current response has been written."""
        self._keep_alive = False

    def connection_header(self) -> bytes:
        """The header lines the server adds to the current response: ``Connection`` when it
        is needed, and the CORS ones for a ``--cors-origin`` origin."""
        cors = b"" if self._current_cors is None else cors_lines(self._current_cors)
        if not self.keep_alive:
            return cors + b"connection: close\r\n"
        return cors + (b"" if self._current_http11 else b"connection: keep-alive\r\n")

    def set_producer(self, producer: Producer | None) -> None:
        """Pause ``producer`` whenever the client's socket buffer is full."""
        self._producer = producer
        if producer is not None and self._writing_paused:
            producer.pause_reading()

    def abort(self) -> None:
        """Close the connection: the response cannot be finished."""
        self._keep_alive = False
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    def shutdown(self) -> None:
        """The server is stopping: cancel the handler and close."""
        if self._task is not None:
            self._task.cancel()
        if self._task is None and self._transport is not None:
            self._transport.close()

    def expire(self, now: float) -> None:
        """Called by the server's sweep once ``deadline`` has passed."""
        if self._task is not None:
            return
        if self._in_head or self._in_body:
            self._refuse_now(408, "the request was not received in time")
        elif self._transport is not None:
            self._transport.close()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._url = []
        self._headers = []
        if self._held_body:
            self._drop_body()
        else:
            self._body = []
            self._body_bytes = 0
        self._head_bytes = 0
        self._head_seen = 0
        self._in_head = True
        self._refused = None
        if self._task is None:
            self.deadline = self._loop.time() + self._limits.head_timeout_s

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))
        self._count_head(len(name) + len(value) + 4)
        if len(self._headers) > self._limits.max_headers:
            self._refuse_at_once(431, f"more than {self._limits.max_headers} request headers")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._in_body = True
        self._head_done = self._loop.time()
        if self._task is None:
            self.deadline = self._head_done + self._limits.body_timeout_s
        declared = content_length(self._headers)
        expect = next((v for k, v in self._headers if k == b"expect"), None)
        refusal = self._browser_refusal()
        if refusal is not None:  # before anything else: a foreign page learns nothing more
            self._refuse_foreign(refusal, declared, expect)
            return
        if self._server.admit is not None:
            self._admit()
        if self._refused is None and declared > self._limits.max_body_bytes:
            self._refuse_later(413, self._too_large_message(), self._limits.max_body_bytes)
        if declared > self._drain and self._refused is not None:
            raise ValueError("refused")  # answered at once, connection closed
        if self._refused is None and declared and not self._hold(declared):
            self._refuse_at_once(503, self._budget_message())
        if expect is not None and expect.lower() == b"100-continue":
            self._continue()

    def _refuse_foreign(self, refusal: BrowserRefusal, declared: int, expect: bytes | None) -> None:
        """Refuse a browser page's request: a small body is read and dropped, so that the
        client reads the answer; anything else is answered at once, the connection closed."""
        self._refuse_later(refusal.status, refusal.message, 0)
        sized = any(k == b"content-length" for k, _ in self._headers)
        if not sized or declared > DRAIN_LIMIT or expect is not None:
            raise ValueError("refused")

    def _continue(self) -> None:
        """Answer ``Expect: 100-continue``: close a refused request, else ask for the body."""
        if self._refused is not None:
            raise ValueError("refused")
        if self._task is None:  # never inside another request's response
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.started = False

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._task is None:
            self.deadline = self._limits.body_deadline(self._head_done, self._body_bytes)
        if self._refused is None and self._body_bytes > self._limits.max_body_bytes:
            self._drop_body()
            self._refuse_later(413, self._too_large_message(), self._limits.max_body_bytes)
        if self._refused is not None:
            if self._body_bytes > self._drain:
                raise ValueError("refused")
            return
        if self._body_bytes > self._held_body and not self._hold(len(body)):  # chunked
            self._drop_body()
            self._refuse_at_once(503, self._budget_message())
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        if self._closing:  # refused earlier: what follows in the same read is dropped
            return
        if self._refused is not None:
            self._refuse_body(*self._refused)  # read whole: the client can read the answer
            return
        target = b"".join(self._url)
        path, _, _ = target.partition(b"?")
        request = Request(
            method=self._parser.get_method(),
            path=path.decode("latin-1"),
            target=target,
            headers=tuple(self._headers),
            body=b"".join(self._body),
            keep_alive=self._parser.should_keep_alive(),
            http11=self._parser.get_http_version() == "1.1",
            cors_origin=self._cors_origin(),
        )
        self._body = []
        self._body_bytes = 0
        self._held_body = 0  # now the request's, given back when its handler ends
        if self._task is None:
            self.deadline = math.inf
            self._start(request)
        else:
            self._pending.append(request)
            if self._transport is not None and len(self._pending) > 1:
                self._transport.pause_reading()

    # running requests

    _current_http11 = True

    def _start(self, request: Request) -> None:
        self._keep_alive = request.keep_alive
        self._current_http11 = request.http11
        self._current_cors = request.cors_origin
        self._running_body = len(request.body)
        self.started = False
        self._task = self._loop.create_task(self._run(request))

    async def _run(self, request: Request) -> None:
        try:
            if is_preflight(request):
                self._answer_preflight(request)
            else:
                await self._server.handler(request, self)
        except asyncio.CancelledError:
            self._keep_alive = False
            raise
        except Exception:
            log.exception("error answering %s %s", request.method, request.path)
            if not self.started:
                self.respond(
                    500, error_body("internal error in the gateway", "InternalServerError", 500)
                )
            self._keep_alive = False
        finally:
            self._task = None
            self._producer = None
            if self._running_body:
                self._give(self._running_body)
                self._running_body = 0
            self._next()

    def _next(self) -> None:
        if self.lost or self._transport is None:
            return
        if not self.keep_alive:
            self._transport.close()
            return
        if self._pending:
            self._start(self._pending.popleft())
            if not self._pending:
                self._transport.resume_reading()
            return
        now = self._loop.time()
        if self._in_head:  # the next request's head began during the response
            self.deadline = now + self._limits.head_timeout_s
        elif self._in_body:
            self.deadline = max(now, self._limits.body_deadline(self._head_done, self._body_bytes))
        else:
            self.deadline = now + self._limits.idle_timeout_s

    # limits

    _held_body = 0  # bytes of the server's body budget taken for the body being read

    def _take_in(self, peer: str) -> bool:
        """Count the new connection against the caps; over one, answer 503 and close."""
        why = self._server.peers.refusal(peer)
        if why is None:
            self._server.peers.add(peer)
            self._peer = peer
            return True
        log.debug("refused a connection: %s", why)
        self._closing = True
        self._current_http11 = True
        self._keep_alive = False
        self.respond(503, error_body(why, "ServiceUnavailableError", 503))
        if self._server.refused is not None:
            self._server.refused(503)
        if self._transport is not None:
            self._transport.close()
        return False

    def _admit(self) -> None:
        """Show the head to the server's ``admit`` before any of the body is read."""
        if self._server.admit is None:
            return
        path = b"".join(self._url).partition(b"?")[0].decode("latin-1")
        refusal = self._server.admit(self._parser.get_method(), path, tuple(self._headers))
        if refusal is not None:
            self._refused = (refusal.status, refusal.body)
            self._drain = DRAIN_LIMIT

    def _hold(self, size: int) -> bool:
        """Take ``size`` bytes of the server's body budget for the body being read."""
        if not self._server.budget.take(size):
            return False
        self._held_body += size
        return True

    def _give(self, size: int) -> None:
        self._server.budget.give(size)

    def _drop_body(self) -> None:
        """Forget the body being read, giving its bytes back."""
        self._body = []
        self._body_bytes = 0
        self._give(self._held_body)
        self._held_body = 0

    def _drop_pending(self) -> None:
        """Forget the requests queued behind the running one, giving their bodies back."""
        while self._pending:
            self._give(len(self._pending.popleft().body))

    def _browser_refusal(self) -> BrowserRefusal | None:
        host = origin = None
        for name, value in self._headers:
            if name == b"host":
                if host is not None:
                    return _TWO_HOSTS
                host = value.decode("latin-1")
            elif name == b"origin":
                if origin is not None:
                    return _TWO_HOSTS
                origin = value.decode("latin-1")
        self._origin = origin
        return self._server.guard.refusal(
            host, origin, http11=self._parser.get_http_version() != "1.0"
        )

    def _cors_origin(self) -> bytes | None:
        origin = self._origin
        if not self._server.cors or origin is None or not self._server.guard.cors_allows(origin):
            return None
        return origin.encode("latin-1")

    def _answer_preflight(self, request: Request) -> None:
        asked = request.header(b"access-control-request-headers") or b""
        head = status_line(204) + (
            b"access-control-allow-methods: GET, POST, OPTIONS\r\n"
            b"access-control-max-age: %d\r\n" % _PREFLIGHT_MAX_AGE
        )
        if asked and all(c in _TOKEN_LIST for c in asked):
            head += b"access-control-allow-headers: %s\r\n" % asked
        self.write(head + self.connection_header() + b"\r\n")

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self._limits.max_head_bytes:
            self._refuse_at_once(431, self._head_too_large())

    def _head_too_large(self) -> str:
        return f"the request head is larger than {self._limits.max_head_bytes} bytes"

    def _too_large_message(self) -> str:
        return f"the request body is larger than {self._limits.max_body_bytes} bytes"

    def _budget_message(self) -> str:
        return (
            f"the server holds {self._server.budget.limit} bytes of request bodies, its limit; "
            "retry later"
        )

    def _refuse_later(self, status: int, message: str, read: int) -> None:
        """Refuse the request once its body is read and dropped (up to ``read`` + 1 MiB)."""
        self._refused = (status, error_body(message, error_type(status), status))
        self._drain = read + DRAIN_LIMIT

    def _refuse_at_once(self, status: int, message: str) -> None:
        """Refuse the request now, reading no more (raised out of a parser callback)."""
        self._refused = (status, error_body(message, error_type(status), status))
        raise ValueError(message)

    def _refuse_now(self, status: int, message: str) -> None:
        """Answer ``status`` (unless a response is running) and close the connection."""
        self._refuse_body(status, error_body(message, error_type(status), status))

    def _refuse_body(self, status: int, body: bytes) -> None:
        self._keep_alive = False
        self._closing = True
        self._in_head = self._in_body = False
        self._drop_pending()
        self._drop_body()
        if self._task is None and not self.lost:
            self._current_cors = None
            self.respond(status, body)
            if self._server.refused is not None:
                self._server.refused(status)
        if self._task is None and self._transport is not None:
            self._transport.close()


def _peer_host(transport: asyncio.BaseTransport) -> str:
    address = transport.get_extra_info("peername")
    if isinstance(address, tuple) and address:
        return str(address[0])
    return str(address)  # a Unix socket: one peer


__all__ = ["DRAIN_LIMIT", "Handler", "HttpConnection", "ServerSide"]
