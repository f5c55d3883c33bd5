"""gRPC-web for grpclib service handlers, as an ASGI application.

The console, browsers and ``buf curl --protocol grpcweb`` reach the very service objects
that the native gRPC port serves: ``GrpcWebApp`` takes their ``__mapping__()`` and runs the
generated ``__rpc_*`` handlers with a small stream object (``grpcwebcall.WebStream``) in
place of grpclib's HTTP/2 stream.

Here: ``GrpcWebApp`` (browser checks, CORS, health and ``/metrics``, then the call),
``BrowserGate``, reading a call's request (its headers, metadata, deadline and body, the
base64 and the frame) and the plain HTTP answers. A call's stream, its reply and the run of
its handler are in ``grpcwebcall``.

Wire format (https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-WEB.md): a POST whose
body is frames ``[flag:1][length:4 big-endian][payload]``; the reply is HTTP 200 with data
frames (flag 0x00) and one trailer frame (flag 0x80) holding ``grpc-status`` and
``grpc-message`` as HTTP/1 header lines. The ``-text`` content types carry the same frames
in base64; each reply frame is encoded on its own as it is sent. gRPC-web carries unary and
server-streaming calls only.

With ``authorize`` (``llmgw.server.wire.auth.Authenticator.check``), every call is checked with
its ``authorization`` header before its body is read; a refusal answers its status. With
``guard`` (``Authenticator.guard``) every handler runs wrapped in it (it ends a call whose
token is revoked, with the status the wrapper raises).

**Browsers.** Before anything else, every request is put to ``browsers``
(``llmgw.httpguard.HttpGuard``): one with a Host that is not an address of this server
(DNS rebinding) or with an Origin that is neither ``--cors-origin`` nor the port's own is
answered 403 (a missing or repeated Host or Origin 400) and goes no further. Only the
``--cors-origin`` origins get CORS headers and preflights (204); other preflights get 403.

With ``metrics`` (``llmgw.server.wire.metrics.server_metrics``), ``GET /metrics`` answers what it
returns as Prometheus text; like ``/healthz`` it needs no token (it carries no secrets).
With ``health``, ``GET /healthz`` answers 503 ``unhealthy: REASON`` while it returns a
reason (the state database takes no writes: ``llmgw.server.state.storehealth``), else 200 ``ok``.

A call ends with its handler, with the client going away (the handler is cancelled), or with
its ``grpc-timeout`` (the handler is cancelled and the call answers DEADLINE_EXCEEDED).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import re
from collections.abc import (
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
)
from typing import Any, Final, Protocol

from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.metadata import Deadline, decode_metadata
from multidict import MultiDict

from llmgw.httpguard import LOOPBACK_ONLY, HttpGuard, Refusal
from llmgw.server.wire.codec import DEFAULT_MAX_MESSAGE_BYTES
from llmgw.server.wire.grpcwebcall import (
    DATA_FLAG,
    Headers,
    Peer,
    Receive,
    Reply,
    Scope,
    Send,
    WebStream,
    invoke,
    run_until_disconnect,
)

__all__ = ["BrowserGate", "GrpcWebApp", "most_body_bytes"]

logger = logging.getLogger(__name__)

Authorize = Callable[[str, str | None], Awaitable[object]]
"""Checks a call (method path, ``authorization`` header); raises GRPCError to refuse it."""
HandlerFunc = Callable[[Any], Coroutine[Any, Any, None]]
Guard = Callable[[HandlerFunc], HandlerFunc]
"""Wraps a call's handler function (runs in the context ``authorize`` ran in)."""

_BINARY_TYPES: Final = frozenset({"application/grpc-web", "application/grpc-web+proto"})
_TEXT_TYPES: Final = frozenset({"application/grpc-web-text", "application/grpc-web-text+proto"})
_HOP_HEADERS: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_COMPRESSED_FLAG: Final = 0x01
_PREFIX_BYTES: Final = 5
# Runs of base64 characters, each but the last ended by one or two "=": unambiguous, so
# matching takes linear time ("(?:[...]+={0,2})*" backtracked exponentially on "AAAA…A!").
_BASE64_BODY: Final = re.compile(rb"(?:[A-Za-z0-9+/]+(?:={1,2}[A-Za-z0-9+/]+)*={0,2})?")
_BASE64_CHUNK: Final = re.compile(rb"[A-Za-z0-9+/]+={0,2}")
_ALLOW_HEADERS: Final = b"content-type, x-grpc-web, x-user-agent, grpc-timeout, authorization"
_EXPOSE_HEADERS: Final = b"grpc-status, grpc-message"
_PREFLIGHT_MAX_AGE: Final = b"86400"


class Servable(Protocol):
    """A grpclib service object: the generated ``*ServiceBase`` subclasses."""

    def __mapping__(self) -> Mapping[str, Handler]: ...


class _ClientGone(Exception):
    """The client disconnected before the request body arrived."""


class GrpcWebApp:
    """ASGI3 application serving grpclib handlers over gRPC-web, with CORS and ``/healthz``."""

    def __init__(
        self,
        services: Iterable[Servable],
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        browsers: HttpGuard = LOOPBACK_ONLY,
        health: Callable[[], Awaitable[str | None]] | None = None,
        authorize: Authorize | None = None,
        guard: Guard | None = None,
        metrics: Callable[[], bytes] | None = None,
    ) -> None:
        self._handlers: dict[str, Handler] = {}
        for service in services:
            for path, handler in service.__mapping__().items():
                if path in self._handlers:
                    raise ValueError(f"two services serve {path}")
                self._handlers[path] = handler
        self._max_message_bytes = max_message_bytes
        self._browsers = browsers
        self._health = health
        self._authorize = authorize
        self._guard = guard
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _serve_lifespan(receive, send)
        elif scope["type"] == "http":
            await self._serve_http(scope, receive, send)

    async def _serve_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = browser_refusal(self._browsers, scope)
        if refusal is not None:
            await _refuse(send, refusal)
            return
        headers = _header_dict(scope)
        cors = self._cors_headers(headers.get("origin"))
        method, path = scope["method"], scope["path"]
        if method == "OPTIONS":
            await self._preflight(send, cors)
        elif path == "/healthz" and method == "GET":
            problem = await self._health_problem()
            text = "ok" if problem is None else f"unhealthy: {problem}"
            await _plain(send, 200 if problem is None else 503, text, cors)
        elif path == "/metrics" and method == "GET" and self._metrics is not None:
            await _prometheus(send, self._metrics(), cors)
        elif method != "POST":
            await _plain(send, 405, "method not allowed", [*cors, (b"allow", b"POST, OPTIONS")])
        else:
            await self._serve_call(scope, receive, send, headers, cors)

    # --- CORS and health -------------------------------------------------------------------

    def _cors_headers(self, origin: str | None) -> Headers:
        """CORS response headers for a ``--cors-origin`` origin; none for any other."""
        if origin is None or not self._browsers.cors_allows(origin):
            return []
        return [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-expose-headers", _EXPOSE_HEADERS),
            (b"vary", b"origin"),
        ]

    async def _preflight(self, send: Send, cors: Headers) -> None:
        if not cors:
            message = "only a CORS preflight from a --cors-origin origin is answered"
            await _plain(send, 403, message, [])
            return
        headers = [
            *cors,
            (b"access-control-allow-methods", b"POST, OPTIONS"),
            (b"access-control-allow-headers", _ALLOW_HEADERS),
            (b"access-control-max-age", _PREFLIGHT_MAX_AGE),
        ]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    async def _health_problem(self) -> str | None:
        """Why the server is unhealthy (``health``'s answer), or None when it is healthy."""
        if self._health is None:
            return None
        try:
            return await self._health()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("health check failed")
            return f"the health check failed: {exc}"

    # --- calls -----------------------------------------------------------------------------

    async def _serve_call(
        self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str], cors: Headers
    ) -> None:
        content_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if content_type not in _BINARY_TYPES | _TEXT_TYPES:
            await _plain(send, 415, f"unsupported content-type {content_type!r}", cors)
            return
        reply = Reply(send, text=content_type in _TEXT_TYPES, content_type=content_type, cors=cors)
        try:
            stream, handler = await self._prepare(scope, receive, headers, reply)
        except _ClientGone:
            return
        except GRPCError as exc:
            await reply.finish(exc.status, exc.message)
            return
        outcome = await run_until_disconnect(invoke(handler, stream, scope["path"]), receive)
        if outcome is not None:
            await reply.finish(*outcome)

    async def _prepare(
        self, scope: Scope, receive: Receive, headers: dict[str, str], reply: Reply
    ) -> tuple[WebStream, Handler]:
        """Resolve the method, read and unframe the body; GRPCError for the client's faults."""
        if self._authorize is not None:
            await self._authorize(scope["path"], headers.get("authorization"))
        handler = self._handler(scope["path"])
        if self._guard is not None:
            handler = handler._replace(func=self._guard(handler.func))
        deadline = _deadline(headers)
        raw = await _read_body(receive, headers, reply.text, self._max_message_bytes)
        body = _decode_base64(raw) if reply.text else raw
        payload = _unframe_request(body, self._max_message_bytes)
        stream = WebStream(
            payload=payload,
            handler=handler,
            reply=reply,
            metadata=_metadata(scope),
            peer=Peer(_client_address(scope)),
            deadline=deadline,
            user_agent=headers.get("x-user-agent") or headers.get("user-agent"),
        )
        return stream, handler

    def _handler(self, path: str) -> Handler:
        handler = self._handlers.get(path)
        if handler is None:
            raise GRPCError(Status.UNIMPLEMENTED, f"method {path} is not implemented here")
        if handler.cardinality not in (Cardinality.UNARY_UNARY, Cardinality.UNARY_STREAM):
            raise GRPCError(
                Status.UNIMPLEMENTED,
                "gRPC-web does not carry client streams; use the native gRPC port",
            )
        return handler


class BrowserGate:
    """An ASGI application behind the same browser checks as ``GrpcWebApp`` (for what the
    gRPC-web port serves beside it: the test hooks)."""

    def __init__(
        self, app: Callable[[Scope, Receive, Send], Awaitable[None]], browsers: HttpGuard
    ) -> None:
        self._app = app
        self._browsers = browsers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = browser_refusal(self._browsers, scope) if scope["type"] == "http" else None
        if refusal is not None:
            await _refuse(send, refusal)
        else:
            await self._app(scope, receive, send)


def browser_refusal(browsers: HttpGuard, scope: Scope) -> Refusal | None:
    """Why the request of ``scope`` is not answered (``HttpGuard.refusal``), or None."""
    hosts = [v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"host"]
    origins = [v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"origin"]
    if len(hosts) > 1 or len(origins) > 1:
        return Refusal(400, "a request carries at most one Host and one Origin header")
    http11 = scope.get("http_version", "1.1") != "1.0"
    host, origin = (hosts[0] if hosts else None), (origins[0] if origins else None)
    return browsers.refusal(host, origin, http11=http11)


async def _refuse(send: Send, refusal: Refusal) -> None:
    await _plain(send, refusal.status, refusal.message, [(b"vary", b"origin")])


# --- request parsing ---------------------------------------------------------------------


def _header_dict(scope: Scope) -> dict[str, str]:
    """Request headers by lowercase name (the last of repeated ones)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _metadata(scope: Scope) -> MultiDict[str | bytes]:
    """Request headers as grpclib metadata: no hop headers, ``-bin`` values decoded."""
    pairs = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]]
    try:
        return decode_metadata([(k, v) for k, v in pairs if k not in _HOP_HEADERS])
    except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, f"malformed -bin metadata: {exc}") from exc


def _deadline(headers: dict[str, str]) -> Deadline | None:
    value = headers.get("grpc-timeout")
    if value is None:
        return None
    try:
        return Deadline.from_headers([("grpc-timeout", value)])
    except ValueError as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, f"invalid grpc-timeout {value!r}") from exc


def _client_address(scope: Scope) -> tuple[str, int] | None:
    client = scope.get("client")
    return None if client is None else (str(client[0]), int(client[1]))


async def _read_body(receive: Receive, headers: dict[str, str], text: bool, limit: int) -> bytes:
    """The request body, refused as soon as it is known to carry more than ``limit``."""
    most = _most_body_bytes(text, limit)
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > most:
        raise _too_big(f"request body of {declared} bytes", limit, per_message=True)
    body = bytearray()
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        body += message.get("body", b"")
        more = bool(message.get("more_body", False))
        announced = _announced_length(body, text)
        if announced is not None and announced > limit:
            raise _too_big(f"message of {announced} bytes", limit)
        if len(body) > most:
            raise _too_big(f"request body of {len(body)}+ bytes", limit, per_message=True)
    return bytes(body)


def _most_body_bytes(text: bool, limit: int) -> int:
    """The largest body that can hold one message of ``limit`` bytes."""
    framed = _PREFIX_BYTES + limit
    return -(-framed // 3) * 4 + 64 if text else framed


def most_body_bytes(limit: int) -> int:
    """The largest request body of any content type that can hold one message of ``limit``
    bytes: the HTTP server's bound on the body it reads for this app."""
    return _most_body_bytes(True, limit)


def _announced_length(head: bytearray, text: bool) -> int | None:
    """The length in the first frame's prefix, once enough of the body has arrived."""
    if text:
        if len(head) < 8 or b"=" in head[:8]:
            return None
        try:
            prefix = base64.b64decode(bytes(head[:8]), validate=True)
        except binascii.Error:
            return None  # refused later, with the whole body's error
    elif len(head) < _PREFIX_BYTES:
        return None
    else:
        prefix = bytes(head[:_PREFIX_BYTES])
    return int.from_bytes(prefix[1:5], "big")


def _too_big(what: str, limit: int, *, per_message: bool = False) -> GRPCError:
    unit = " per message" if per_message else ""
    return GRPCError(Status.RESOURCE_EXHAUSTED, f"{what} exceeds the limit of {limit} bytes{unit}")


def _decode_base64(text: bytes) -> bytes:
    """Decode a grpc-web-text body: one or more base64 chunks, each padded or not."""
    text = re.sub(rb"\s+", b"", text)
    if _BASE64_BODY.fullmatch(text) is None:
        raise GRPCError(Status.INVALID_ARGUMENT, "request body is not valid base64")
    decoded = bytearray()
    for chunk in _BASE64_CHUNK.findall(text):
        try:
            decoded += base64.b64decode(chunk + b"=" * (-len(chunk) % 4), validate=True)
        except binascii.Error as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, "request body is not valid base64") from exc
    return bytes(decoded)


def _unframe_request(body: bytes, limit: int) -> bytes:
    """The one message a unary or server-streaming request carries."""
    if len(body) < _PREFIX_BYTES:
        raise GRPCError(Status.INVALID_ARGUMENT, "the request body holds no complete frame")
    flag, length = body[0], int.from_bytes(body[1:5], "big")
    if flag & _COMPRESSED_FLAG:
        raise GRPCError(Status.UNIMPLEMENTED, "compressed messages are not supported")
    if flag != DATA_FLAG:
        raise GRPCError(Status.INVALID_ARGUMENT, f"unexpected frame flag 0x{flag:02x}")
    if length > limit:
        raise _too_big(f"message of {length} bytes", limit)
    if len(body) != _PREFIX_BYTES + length:
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"the request must be one frame of {length} bytes, the body holds {len(body) - 5}",
        )
    return body[_PREFIX_BYTES:]


# --- plain HTTP --------------------------------------------------------------------------


async def _plain(send: Send, status: int, text: str, headers: Headers) -> None:
    body = text.encode("utf-8")
    start_headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode("ascii")),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": start_headers})
    await send({"type": "http.response.body", "body": body})


async def _prometheus(send: Send, body: bytes, headers: Headers) -> None:
    start_headers = [
        (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
        (b"content-length", str(len(body)).encode("ascii")),
        *headers,
    ]
    await send({"type": "http.response.start", "status": 200, "headers": start_headers})
    await send({"type": "http.response.body", "body": body})


async def _serve_lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
