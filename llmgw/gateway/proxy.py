"""One proxied attempt: a request written to one replica, its response to the client as it comes.

The retry rule (``Gateway`` applies it, ``Exchange`` says which case happened):

* An attempt is given up and the request retried on a replica not tried yet (at most
  ``retries`` more attempts) when **no byte of the response has been sent to the client**
  and either the replica could not be used (no connection, the connection closed or reset,
  a response we cannot read) or the replica answered **502 or 503** and another candidate is
  left. Such an attempt is ``RETRY``.
* Anything else is forwarded as it is: other statuses, and a 502/503 when no other replica
  is left, go to the client with their headers and body (``DONE``).
* Once a byte has reached the client nothing is retried: if the replica then fails, the
  client's connection is closed so it sees the response cut short (``BROKEN``).
* A connection taken from the pool that turns out closed before any response byte is
  retried once on a fresh connection to the same replica first (keep-alive races are not a
  replica failure).

Forwarding: the replica's status, headers and body go through as they arrive, except the
hop-by-hop headers (``Connection`` and the names it lists, ``Keep-Alive``,
``Transfer-Encoding``, ``TE``, ``Trailer``, ``Upgrade``, ``Proxy-*``). A body with a
Content-Length keeps it; any other body is sent chunked (or close-delimited to an HTTP/1.0
client), one chunk per piece read, so server-sent events are not held back. The gateway
adds ``x-llmgw-replica``, the replica that answered, to every forwarded head (as Envoy adds
its upstream host): operators and load tools can tell where a request went and where it
broke; and ``x-llmgw-route`` (why it went there) when the gateway passes one.

Reading the engine's usage: a 200 answer's body is searched, piece by piece as it is
forwarded, for ``"cached_tokens":N`` (vLLM's ``usage.prompt_tokens_details``, in a whole
answer or a stream's final usage chunk) and, for a metered request (``meter``: a tenant
key's), ``"prompt_tokens":N`` and ``"completion_tokens":N`` too; nothing is buffered or
parsed as JSON, and the last match wins (``cached_tokens``, ``prompt_tokens``,
``completion_tokens``; None when the engine said nothing). A key cannot occur inside a JSON
string: there its quotes are escaped. ``upstream_s`` is the time from the request written
to the answer's end (metering's GPU-seconds). ``extra``: header lines the gateway adds to
the forwarded head (a tenant key's ``x-ratelimit-*``).
"""

from __future__ import annotations

import asyncio
import enum
import time

from llmgw.gateway.errors import UpstreamError, UpstreamRefused
from llmgw.gateway.httpconnection import HttpConnection
from llmgw.gateway.httprequest import Request, status_line
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.modelsignals import ModelSignalBook, StreamClock

RETRY_STATUSES = frozenset({502, 503})

_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_NOT_FORWARDED_UP = _HOP_BY_HOP | {b"host", b"content-length", b"authorization", b"expect"}
_NOT_FORWARDED_DOWN = _HOP_BY_HOP | {
    b"content-length",
    b"x-llmgw-replica",
    b"x-llmgw-route",
}  # ours alone
_CACHED_KEY = b'"cached_tokens":'
_PROMPT_KEY = b'"prompt_tokens":'
_COMPLETION_KEY = b'"completion_tokens":'
_TAIL = 64  # bytes of a piece kept to find a key split between two pieces


class Outcome(enum.Enum):
    """How an attempt ended."""

    PENDING = "pending"  # still running
    DONE = "done"  # the response reached the client whole
    RETRY = "retry"  # given up before any byte reached the client: try another replica
    BROKEN = "broken"  # the replica failed after bytes reached the client


def encode_request(request: Request, host_header: bytes, api_key: str) -> bytes:
    """The request as it goes to a replica: our Host and Authorization, a Content-Length."""
    dropped = _NOT_FORWARDED_UP | _connection_tokens(request.headers)
    parts = [request.method, b" ", request.target, b" HTTP/1.1\r\nhost: ", host_header, b"\r\n"]
    for name, value in request.headers:
        if name not in dropped:
            parts += (name, b": ", value, b"\r\n")
    if api_key:
        parts += (b"authorization: Bearer ", api_key.encode("latin-1"), b"\r\n")
    parts.append(b"content-length: %d\r\n\r\n" % len(request.body))
    parts.append(request.body)
    return b"".join(parts)


def _connection_tokens(
    headers: tuple[tuple[bytes, bytes], ...] | list[tuple[bytes, bytes]],
) -> set[bytes]:
    """The header names a ``Connection`` header lists (hop-by-hop by declaration)."""
    tokens: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            tokens.update(token.strip().lower() for token in value.split(b","))
    return tokens


class Exchange:
    """A ``ResponseSink`` that writes one replica's response to the client as it arrives
    (and, with ``signals``, times its first byte and its events for the autoscaler)."""

    __slots__ = (
        "_body_seen",
        "_chunked",
        "_client",
        "_events",
        "_extra",
        "_meter",
        "_may_retry",
        "_metrics",
        "_model",
        "_out",
        "_replica_header",
        "_route_header",
        "_scan",
        "_sent_at",
        "_signals",
        "_stream",
        "_tail",
        "cached_tokens",
        "completion_tokens",
        "error",
        "head_seen",
        "outcome",
        "prompt_tokens",
        "result",
        "reused",
        "status",
        "upstream_s",
    )

    def __init__(  # noqa: PLR0913 (each by keyword: the attempt and its sinks)
        self,
        client: HttpConnection,
        *,
        may_retry: bool,
        metrics: GatewayMetrics,
        model: str,
        stream: bool,
        replica: str,
        route: str = "",
        signals: ModelSignalBook | None = None,
        extra: bytes = b"",
        meter: bool = False,
    ) -> None:
        self._client = client
        self._extra = extra  # more header lines for the client (each ending CRLF)
        self._meter = meter  # read prompt and completion tokens too
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.upstream_s = 0.0
        self._signals = signals  # the model's autoscaling signals (None: not counted)
        self._events: StreamClock | None = None
        self._replica_header = b"x-llmgw-replica: %s\r\n" % _header_value(replica)
        self._route_header = b"x-llmgw-route: %s\r\n" % _header_value(route) if route else b""
        self._scan = False
        self._tail = b""
        self.cached_tokens: int | None = None  # the engine's usage said so (module docstring)
        self._may_retry = may_retry
        self._metrics = metrics
        self._model = model
        self._stream = stream
        self._out: list[bytes] = []
        self._chunked = False
        self._body_seen = False
        self._sent_at = 0.0
        self.outcome = Outcome.PENDING
        self.status = 0
        self.head_seen = False
        self.reused = False  # sent on a connection that had served a request before
        self.error: UpstreamError | None = None
        self.result: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def sent(self) -> None:
        """The request has been written to the replica: the clock starts."""
        self._sent_at = time.perf_counter()

    def upstream_head(
        self, status: int, headers: list[tuple[bytes, bytes]], content_length: int | None
    ) -> None:
        if self.outcome is not Outcome.PENDING:
            return
        self.head_seen = True
        if self._may_retry and status in RETRY_STATUSES:
            self.error = UpstreamRefused(f"answered {status}")
            self._end(Outcome.RETRY)
            return
        self.status = status
        self._scan = status == 200
        self._out.append(self._head(status, headers, content_length))

    def upstream_body(self, data: bytes) -> None:
        if self.outcome is not Outcome.PENDING or not data:
            return
        if not self._body_seen:
            self._first_body_byte()
        if self._events is not None:
            self._events.piece(data, time.perf_counter())
        if self._scan:
            self._find_usage(data)
        if self._chunked:
            self._out += (b"%x\r\n" % len(data), data, b"\r\n")
        else:
            self._out.append(data)

    def _first_body_byte(self) -> None:
        self._body_seen = True
        took = time.perf_counter() - self._sent_at
        if self._stream:
            self._metrics.first_byte(self._model, took)
        if self._signals is not None:
            ok = self.status == 200
            self._signals.first_byte(self._model, took, ok)
            if ok and self._stream:
                self._events = StreamClock(self._signals, self._model)

    def _find_usage(self, data: bytes) -> None:
        """The last ``"cached_tokens":N`` in the body so far, and with ``meter`` the last
        prompt and completion tokens (module docstring)."""
        tail = self._tail
        value = _last_count(data, tail, _CACHED_KEY)
        if value is not None:
            self.cached_tokens = value
        if self._meter:
            value = _last_count(data, tail, _PROMPT_KEY)
            if value is not None:
                self.prompt_tokens = value
            value = _last_count(data, tail, _COMPLETION_KEY)
            if value is not None:
                self.completion_tokens = value
        # the last _TAIL bytes of the body so far (several short pieces may hold them)
        self._tail = data[-_TAIL:] if len(data) >= _TAIL else (self._tail + data)[-_TAIL:]

    def upstream_flush(self) -> None:
        if self._out and self.outcome is Outcome.PENDING:
            out = self._out
            self._client.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()

    def upstream_done(self) -> None:
        if self.outcome is not Outcome.PENDING:
            return
        if self._chunked:
            self._out.append(b"0\r\n\r\n")
        self.upstream_flush()
        self.upstream_s = time.perf_counter() - self._sent_at
        self._metrics.finished(self._model, self.upstream_s)
        self._end(Outcome.DONE)

    def upstream_failed(self, error: UpstreamError) -> None:
        if self.outcome is not Outcome.PENDING:
            return
        self.error = error
        self._end(Outcome.BROKEN if self._client.started else Outcome.RETRY)

    def _end(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self._out.clear()
        if not self.result.done():
            self.result.set_result(None)

    def _head(
        self, status: int, headers: list[tuple[bytes, bytes]], content_length: int | None
    ) -> bytes:
        client = self._client
        dropped = (
            _NOT_FORWARDED_DOWN | _connection_tokens(headers) if headers else _NOT_FORWARDED_DOWN
        )
        parts = [status_line(status)]
        for name, value in headers:
            if name not in dropped:
                parts += (name, b": ", value, b"\r\n")
        parts.append(self._replica_header)
        if self._route_header:
            parts.append(self._route_header)
        if self._extra:
            parts.append(self._extra)
        if content_length is not None:
            parts.append(b"content-length: %d\r\n" % content_length)
        elif status not in (204, 304):
            if client.chunked_ok:
                self._chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
            else:
                client.close_after_response()  # HTTP/1.0: the body ends when we close
        parts.append(client.connection_header())
        parts.append(b"\r\n")
        return b"".join(parts)


def _last_count(data: bytes, tail: bytes, key: bytes) -> int | None:
    """The count after the last ``key`` in ``data``, or in ``tail`` + the start of ``data``
    when the key is split between the last piece and this one."""
    window = data
    at = data.rfind(key)
    if at < 0 and tail:
        window = tail + data[:_TAIL]
        at = window.rfind(key)
    return _read_count(window, at + len(key)) if at >= 0 else None


def _read_count(data: bytes, start: int) -> int | None:
    """The unsigned integer at ``data[start:]`` after blanks; None when there is none or it
    may go on in the next piece."""
    end = len(data)
    while start < end and data[start] in b" \t\r\n":
        start += 1
    stop = start
    while stop < end and 0x30 <= data[stop] <= 0x39:
        stop += 1
    if stop == start or stop == end:
        return None
    return int(data[start:stop])


def _header_value(text: str) -> bytes:
    """``text`` as a header value: printable ASCII kept, anything else (CR/LF) as ``?``."""
    return bytes(c if 0x20 <= c < 0x7F else 0x3F for c in text.encode("utf-8"))


__all__ = ["RETRY_STATUSES", "Exchange", "Outcome", "encode_request"]
