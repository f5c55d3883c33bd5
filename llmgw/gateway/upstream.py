"""The gateway's upstream HTTP/1.1 client: pooled keep-alive connections as asyncio Protocols.

Each connection parses responses with httptools (Content-Length, chunked and close-delimited
bodies) and hands every piece to a ``ResponseSink`` from inside ``data_received``: the head,
each body piece as it arrives, then a flush once per socket read, so the proxy forwards a
streamed event in the same loop iteration that read it, with one write to the client per
read from the replica. TCP_NODELAY is set on every connection. The pool keeps idle
connections per origin (LIFO, at most ``max_idle_per_origin``) and closes those idle longer
than ``idle_timeout_s`` (4 s: vLLM's uvicorn drops idle keep-alive connections after 5 s).
A connection is returned to the pool only after a whole response that allows keep-alive;
anything else (a cancelled request, an error, a partial body) closes it.

Why not aiohttp: in the same bare proxy (httpserver.py in front, a fixed-JSON upstream), an
aiohttp ``ClientSession`` spent several times the CPU per request that this client does
(``python -m bench.gateway`` measures the whole gateway).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

from llmgw.gateway.errors import (
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
)

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
"""The most bytes of status line and headers accepted from a replica."""

MAX_HEADERS = 100


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a replica listens: ``http://HOST:PORT``."""

    host: str
    port: int
    host_header: bytes  # "HOST:PORT" as the Host header carries it

    def __str__(self) -> str:
        return f"http://{self.host_header.decode('ascii', 'replace')}"


def parse_origin(url: str) -> Origin:
    """``http://HOST:PORT`` → Origin; UpstreamConnectError for anything else."""
    try:
        parts = urlsplit(url)
        port = parts.port or 80
    except ValueError as exc:
        raise UpstreamConnectError(f"malformed replica URL {url[:200]!r}: {exc}") from exc
    if parts.scheme != "http" or not parts.hostname:
        raise UpstreamConnectError(f"replica URL {url[:200]!r} is not http://HOST:PORT")
    return Origin(parts.hostname, port, parts.netloc.encode("idna"))


class ResponseSink(Protocol):
    """Where a connection delivers one response, piece by piece, as it reads it."""

    def upstream_head(
        self, status: int, headers: list[tuple[bytes, bytes]], content_length: int | None
    ) -> None:
        """The status and headers (names lower-case); ``content_length`` None: not known."""

    def upstream_body(self, data: bytes) -> None:
        """A piece of the body (de-chunked)."""

    def upstream_flush(self) -> None:
        """The end of one socket read: write what has been gathered."""

    def upstream_done(self) -> None:
        """The response has ended."""

    def upstream_failed(self, error: UpstreamError) -> None:
        """The response cannot be completed; the connection is closed."""


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to a replica; one request at a time."""

    def __init__(self, origin: Origin, on_lost: Callable[[UpstreamConnection], None]) -> None:
        self.origin = origin
        self.closed = False
        self.reusable = False  # the last response ended whole with keep-alive
        self.requests = 0  # requests sent on this connection
        self.idle_since = 0.0
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._sink: ResponseSink | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._head_seen = 0
        self._in_head = False
        self._body_by_close = False
        self._informational = False
        self._paused = False
        self._error: UpstreamError | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        sink = self._sink
        if sink is None:
            log.debug("%s sent %d bytes with no request in flight; closing", self.origin, len(data))
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            error = self._error or UpstreamProtocolError(f"{self.origin}: {exc}")
            self._fail(error)
            return
        if self._in_head:  # a head split over reads: bound what httptools accumulates
            self._head_seen += len(data)
            if self._head_seen > MAX_HEAD_BYTES:
                self._fail(UpstreamProtocolError(f"{self.origin}: response head too large"))
                return
        if self._sink is sink:
            sink.upstream_flush()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        sink, self._sink = self._sink, None
        if sink is not None:
            if self._body_by_close and not self._in_head and exc is None:
                sink.upstream_done()  # a close-delimited body ends here
            else:
                reason = f": {exc}" if exc else ""
                sink.upstream_failed(UpstreamClosed(f"{self.origin} closed the connection{reason}"))
        self._on_lost(self)
        if not self.lost.done():
            self.lost.set_result(None)

    def pause_writing(self) -> None:
        """The request body is large: nothing to pause, the transport buffers it."""

    def resume_writing(self) -> None:
        """See ``pause_writing``."""

    # the request

    def send(self, request: bytes, sink: ResponseSink) -> None:
        """Write one whole request; its response goes to ``sink``."""
        if self.closed or self._transport is None or self._transport.is_closing():
            raise UpstreamClosed(f"{self.origin}: connection already closed")
        self._sink = sink
        self.reusable = False
        self.requests += 1
        if self._paused:  # the last client read slowly until the very end
            self.resume_reading()
        self._transport.write(request)

    def pause_reading(self) -> None:
        """The client reads slower than the replica writes."""
        if self._transport is not None and not self.closed and not self._paused:
            self._paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._transport is not None and not self.closed and self._paused:
            self._paused = False
            self._transport.resume_reading()

    def close(self) -> None:
        """Close now; a response in flight is abandoned (its sink hears nothing more)."""
        self._sink = None
        self.reusable = False
        if self._transport is not None and not self.closed:
            self._transport.close()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._headers = []
        self._head_bytes = 0
        self._head_seen = 0
        self._error = None
        self._in_head = True
        self._body_by_close = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        self._headers.append((name.lower(), value))
        if len(self._headers) > MAX_HEADERS or self._head_bytes > MAX_HEAD_BYTES:
            self._error = UpstreamProtocolError(f"{self.origin}: response head too large")
            raise self._error

    def on_headers_complete(self) -> None:
        self._in_head = False
        status = self._parser.get_status_code()
        self._informational = 100 <= status < 200
        if self._informational or self._sink is None:
            return
        content_length, chunked = _framing(self._headers)
        if content_length is None and not chunked and status not in (204, 304):
            self._body_by_close = True
        self._sink.upstream_head(status, self._headers, content_length)

    def on_body(self, body: bytes) -> None:
        if self._sink is not None and not self._informational:
            self._sink.upstream_body(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        sink, self._sink = self._sink, None
        self.reusable = self._parser.should_keep_alive() and not self.closed
        if sink is not None:
            sink.upstream_done()

    def _fail(self, error: UpstreamError) -> None:
        sink, self._sink = self._sink, None
        self.close()
        if sink is not None:
            sink.upstream_failed(error)


def _framing(headers: list[tuple[bytes, bytes]]) -> tuple[int | None, bool]:
    content_length: int | None = None
    chunked = False
    for name, value in headers:
        if name == b"content-length":
            content_length = int(value)  # httptools has refused anything but digits
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    return (None if chunked else content_length), chunked


class UpstreamPool:
    """Idle keep-alive connections per origin, and new ones within a connect timeout."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        idle_timeout_s: float = 4.0,
        max_idle_per_origin: int = 64,
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._max_idle = max_idle_per_origin
        self._origins: dict[str, Origin] = {}
        self._idle: dict[Origin, list[UpstreamConnection]] = {}
        self._all: set[UpstreamConnection] = set()
        self._closed = False
        self.opened = 0  # connections ever opened (for tests and stats)

    def origin(self, url: str) -> Origin:
        """The parsed ``url``, cached."""
        origin = self._origins.get(url)
        if origin is None:
            if len(self._origins) > 4096:
                self._origins.clear()
            origin = self._origins[url] = parse_origin(url)
        return origin

    async def connection(self, origin: Origin, *, fresh: bool = False) -> UpstreamConnection:
        """An idle connection to ``origin`` (the latest) or, if none or ``fresh``, a new one."""
        if self._closed:
            raise UpstreamConnectError("the gateway is stopping")
        idle = None if fresh else self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return await self._open(origin)

    def release(self, conn: UpstreamConnection) -> None:
        """Keep ``conn`` for the next request if its last response allows it; else close it."""
        if not conn.reusable or conn.closed or self._closed:
            conn.close()
            return
        conn.resume_reading()  # an idle connection must hear the replica close it
        idle = self._idle.setdefault(conn.origin, [])
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)
        if len(idle) > self._max_idle:
            idle.pop(0).close()

    def close_origin(self, url: str) -> None:
        """Close the idle connections to ``url`` (its replica is gone)."""
        origin = self._origins.get(url)
        for conn in self._idle.pop(origin, []) if origin else []:
            conn.close()

    def expire(self, now: float) -> None:
        """Close connections idle since before ``now - idle_timeout_s``."""
        horizon = now - self._idle_timeout_s
        for origin, idle in list(self._idle.items()):
            keep = [conn for conn in idle if conn.idle_since >= horizon and not conn.closed]
            for conn in idle:
                if conn.idle_since < horizon:
                    conn.close()
            if keep:
                self._idle[origin] = keep
            else:
                del self._idle[origin]

    async def close(self) -> None:
        """Close every connection, idle or busy, and wait until they are closed."""
        self._closed = True
        self._idle.clear()
        waits = [conn.lost for conn in self._all]
        for conn in list(self._all):
            conn.close()
        if waits:
            await asyncio.wait(waits, timeout=2.0)

    async def _open(self, origin: Origin) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(origin, self._forget), origin.host, origin.port
                )
        except TimeoutError as exc:
            raise UpstreamConnectError(
                f"{origin}: no connection within {self._connect_timeout_s} s"
            ) from exc
        except OSError as exc:
            raise UpstreamConnectError(f"{origin}: {exc.strerror or exc}") from exc
        self.opened += 1
        if self._closed:
            conn.close()
            raise UpstreamConnectError("the gateway is stopping")
        self._all.add(conn)
        return conn

    def _forget(self, conn: UpstreamConnection) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)


__all__ = [
    "MAX_HEAD_BYTES",
    "Origin",
    "ResponseSink",
    "UpstreamConnection",
    "UpstreamPool",
    "parse_origin",
]
