"""A gRPC-web channel over httpx: how the CLI and the console reach the control server.

Requests are ``application/grpc-web+proto`` POSTs carrying one frame
``[flag:1][length:4 big-endian][message]``. Replies are data frames then one trailer frame
(flag 0x80) with ``grpc-status`` and ``grpc-message``; a trailers-only reply may carry them
as HTTP headers instead. Frames are parsed as the bytes arrive, so a server stream yields
each message as soon as it is complete.

TLS: an ``https://`` URL means TLS, the server's certificate verified against the channel's
``ca_file`` (else ``trusted_ca``, which the CLI sets from ``--ca-file`` or
``$LLMGW_CA_FILE``, else the system's trust store) and its name against the URL's host.
A certificate that does not verify, a plaintext URL for a TLS port and the reverse are
``ServerUnreachable`` saying so.

Timeouts: a unary call has ``Timeouts.call`` in all (sent to the server as ``grpc-timeout``
too); a server stream has only the connect timeout and no read timeout, since a quiet watch
is healthy.
"""

from __future__ import annotations

import asyncio
import contextvars
import ssl
import warnings
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Final, Generic, Self, TypeVar

import betterproto2
import httpx
from grpclib.const import Status
from grpclib.metadata import decode_grpc_message, encode_timeout

from llmgw.client.errors import ClientError, ProtocolViolation, RpcError, ServerUnreachable
from llmgw.tls import TlsFileError, client_context, describe_tls_error, find_tls_error

__all__ = ["GrpcWebChannel", "Timeouts", "bearer_token", "trusted_ca"]

T = TypeVar("T", bound=betterproto2.Message)

_CONTENT_TYPE: Final = "application/grpc-web+proto"
_DATA_FLAG: Final = 0x00
_TRAILER_FLAG: Final = 0x80
_PREFIX_BYTES: Final = 5
_DEFAULT_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
# https://github.com/grpc/grpc/blob/master/doc/http-grpc-status-mapping.md
_HTTP_TO_GRPC: Final = {
    400: Status.INTERNAL,
    401: Status.UNAUTHENTICATED,
    403: Status.PERMISSION_DENIED,
    404: Status.UNIMPLEMENTED,
    429: Status.UNAVAILABLE,
    502: Status.UNAVAILABLE,
    503: Status.UNAVAILABLE,
    504: Status.UNAVAILABLE,
}


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds. ``connect``: to open a connection; ``call``: a whole unary call."""

    connect: float = 3.0
    call: float = 10.0


bearer_token: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "llmgw_bearer_token", default=None
)
"""The token a channel sends as ``authorization: Bearer`` when its headers carry none (the
CLI sets it from ``--token``, ``--token-file`` or ``$LLMGW_TOKEN``)."""


trusted_ca: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "llmgw_trusted_ca", default=None
)
"""The CA file a channel to an ``https://`` URL verifies the server against when it is given
none itself (the CLI sets it from ``--ca-file`` or ``$LLMGW_CA_FILE``)."""


def _with_token(headers: Mapping[str, str] | None) -> dict[str, str]:
    merged = dict(headers or {})
    token = bearer_token.get()
    if token and not any(name.lower() == "authorization" for name in merged):
        merged["authorization"] = f"Bearer {token}"
    return merged


class GrpcWebChannel:
    """Unary and server-streaming gRPC-web calls to one server; an async context manager."""

    def __init__(
        self,
        base_url: str,
        *,
        timeouts: Timeouts = Timeouts(),
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_message_bytes: int = _DEFAULT_MAX_MESSAGE_BYTES,
        ca_file: Path | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeouts = timeouts
        self._max_message_bytes = max_message_bytes
        verify = _verify(self.base_url, ca_file or trusted_ca.get())  # may raise: not open yet
        self._closed = False
        with _translate_transport_errors(self.base_url, None):
            self._http = httpx.AsyncClient(
                base_url=self.base_url,
                headers={
                    "content-type": _CONTENT_TYPE,
                    "accept": _CONTENT_TYPE,
                    "x-grpc-web": "1",
                    "x-user-agent": "llmgw-client",
                    **_with_token(headers),
                },
                timeout=httpx.Timeout(None, connect=timeouts.connect, pool=timeouts.connect),
                transport=transport,
                trust_env=True,  # operators behind an HTTP proxy set HTTPS_PROXY
                verify=verify,
            )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        await self._http.aclose()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1, source=self)

    def __repr__(self) -> str:
        return f"<GrpcWebChannel {self.base_url}>"

    async def unary(self, path: str, request: betterproto2.Message, reply_type: type[T]) -> T:
        """Call a unary method; RpcError for a non-OK status."""
        call = self._timeouts.call
        with _translate_transport_errors(self.base_url, call):
            async with asyncio.timeout(call):
                replies = await self._collect(path, request, reply_type)
        if len(replies) != 1:
            raise ProtocolViolation(f"{path} answered {len(replies)} messages, not one")
        return replies[0]

    async def server_stream(
        self, path: str, request: betterproto2.Message, reply_type: type[T]
    ) -> AsyncIterator[T]:
        """Call a server-streaming method, yielding each message as it arrives."""
        with _translate_transport_errors(self.base_url, None):
            async with self._open(path, request, reply_type, None) as (response, decoder):
                async for chunk in response.aiter_bytes():
                    for reply in decoder.feed(chunk):
                        yield reply
                decoder.finish()

    async def _collect(
        self, path: str, request: betterproto2.Message, reply_type: type[T]
    ) -> list[T]:
        replies: list[T] = []
        async with self._open(path, request, reply_type, self._timeouts.call) as (
            response,
            decoder,
        ):
            async for chunk in response.aiter_bytes():
                replies.extend(decoder.feed(chunk))
            decoder.finish()
        return replies

    @asynccontextmanager
    async def _open(
        self,
        path: str,
        request: betterproto2.Message,
        reply_type: type[T],
        grpc_timeout: float | None,
    ) -> AsyncIterator[tuple[httpx.Response, _ReplyDecoder[T]]]:
        """Send the request; the response once its head says it is a gRPC-web reply.

        ``grpc_timeout`` only tells the server; the caller enforces it with asyncio.timeout.
        """
        if self._closed:
            raise ClientError(f"{self!r} is closed")
        headers = {} if grpc_timeout is None else {"grpc-timeout": encode_timeout(grpc_timeout)}
        body = _frame(_DATA_FLAG, bytes(request))
        replied = False
        try:
            async with self._http.stream("POST", path, content=body, headers=headers) as response:
                replied = True
                header_status = _check_head(response)
                yield response, _ReplyDecoder(reply_type, self._max_message_bytes, header_status)
        except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
            if replied:
                raise
            raise _NoReply(exc) from exc


def _verify(url: str, ca_file: Path | None) -> ssl.SSLContext | bool:
    """How to verify an ``https://`` server (``True``: unused, the URL is plaintext)."""
    if not url.lower().startswith("https://"):
        return True
    try:
        return client_context(ca_file)
    except TlsFileError as exc:
        raise ClientError(str(exc)) from exc


@contextmanager
def _translate_transport_errors(url: str, call_timeout: float | None) -> Iterator[None]:
    """The one place where httpx's (and asyncio's timeout) exceptions become ours."""
    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise ServerUnreachable(url, _connect_failure(exc)) from exc
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
        raise ClientError(f"{url}: not a usable server URL ({exc})") from exc
    except (httpx.TimeoutException, TimeoutError) as exc:
        within = "" if call_timeout is None else f" within {call_timeout:g} s"
        raise RpcError(Status.DEADLINE_EXCEEDED, f"no reply{within}") from exc
    except _NoReply as exc:
        raise ServerUnreachable(url, _hung_up(url, exc.cause)) from exc.cause
    except httpx.TransportError as exc:
        raise ServerUnreachable(url, f"connection lost ({_describe(exc)})") from exc


def _describe(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


def _connect_failure(exc: Exception) -> str:
    words = describe_tls_error(exc)
    if words is None:
        return f"cannot connect ({_describe(exc)})"
    if isinstance(find_tls_error(exc), ssl.SSLCertVerificationError):
        return f"{words}; give the CA that signed it (--ca-file or $LLMGW_CA_FILE)"
    return f"{words}; does this port serve TLS? (an http:// URL is plaintext)"


class _NoReply(Exception):
    """The connection was closed or reset before any reply head arrived."""

    def __init__(self, cause: httpx.TransportError) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _hung_up(url: str, exc: Exception) -> str:
    """A TLS port hangs up on a plaintext request without a word: a clean close or a reset,
    whichever the kernel makes of the unread bytes. Say that TLS may be why."""
    plaintext = url.lower().startswith("http://")
    hint = "; if the server uses TLS, use an https:// URL" if plaintext else ""
    return f"connection lost ({_describe(exc)}){hint}"


def _frame(flag: int, payload: bytes) -> bytes:
    return bytes([flag]) + len(payload).to_bytes(4, "big") + payload


def _check_head(response: httpx.Response) -> tuple[Status, str] | None:
    """Refuse a reply that is not gRPC-web; the status if it came as HTTP headers."""
    header_status = _status_from(response.headers)
    if response.status_code != 200:
        if header_status is not None:
            raise RpcError(*header_status)
        status = _HTTP_TO_GRPC.get(response.status_code, Status.UNKNOWN)
        raise RpcError(status, f"HTTP {response.status_code} {response.reason_phrase}")
    content_type = response.headers.get("content-type", "")
    if not content_type.startswith("application/grpc-web") or "-text" in content_type:
        raise ProtocolViolation(f"unexpected content-type {content_type!r}")
    return header_status


def _status_from(fields: Mapping[str, str]) -> tuple[Status, str] | None:
    """``grpc-status`` and ``grpc-message`` from headers or trailers, if there."""
    raw = fields.get("grpc-status")
    if raw is None:
        return None
    try:
        code = int(raw.strip())
    except ValueError:
        raise ProtocolViolation(f"grpc-status {raw!r} is not a number") from None
    try:
        status = Status(code)
    except ValueError:
        status = Status.UNKNOWN  # a code newer than grpclib's list
    return status, decode_grpc_message(fields.get("grpc-message", "").strip())


def _parse_trailer(payload: bytes) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in payload.decode("latin-1").split("\r\n"):
        if not line:
            continue
        key, colon, value = line.partition(":")
        if not colon:
            raise ProtocolViolation(f"malformed trailer line {line!r}")
        fields[key.strip().lower()] = value.strip()
    return fields


class _ReplyDecoder(Generic[T]):
    """Frames to messages, as the bytes arrive; the status at the end (no I/O here)."""

    def __init__(
        self, reply_type: type[T], max_message_bytes: int, header_status: tuple[Status, str] | None
    ) -> None:
        self._reply_type = reply_type
        self._max = max_message_bytes
        self._status = header_status
        self._trailer_seen = False
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[T]:
        self._buffer += chunk
        replies = []
        while (frame := self._next_frame()) is not None:
            flag, payload = frame
            if self._trailer_seen:
                raise ProtocolViolation("a frame arrived after the trailers")
            if flag == _TRAILER_FLAG:
                self._trailer_seen = True
                self._status = _status_from(_parse_trailer(payload))
            elif flag == _DATA_FLAG:
                replies.append(self._decode(payload))
            else:
                raise ProtocolViolation(f"unexpected frame flag 0x{flag:02x}")
        return replies

    def finish(self) -> None:
        """Raise for a truncated reply, a missing status, or a non-OK status."""
        if self._buffer:
            raise ProtocolViolation(f"the reply ended inside a frame ({len(self._buffer)} bytes)")
        if self._status is None:
            raise ProtocolViolation("the reply ended without a grpc-status")
        status, message = self._status
        if status is not Status.OK:
            raise RpcError(status, message)

    def _next_frame(self) -> tuple[int, bytes] | None:
        if len(self._buffer) < _PREFIX_BYTES:
            return None
        length = int.from_bytes(self._buffer[1:5], "big")
        if length > self._max:
            raise RpcError(
                Status.RESOURCE_EXHAUSTED,
                f"reply message of {length} bytes exceeds the limit of {self._max} bytes",
            )
        end = _PREFIX_BYTES + length
        if len(self._buffer) < end:
            return None
        flag, payload = self._buffer[0], bytes(self._buffer[_PREFIX_BYTES:end])
        del self._buffer[:end]
        return flag, payload

    def _decode(self, payload: bytes) -> T:
        try:
            return self._reply_type.parse(payload)
        except Exception as exc:  # betterproto2 raises many kinds on bad bytes
            name = self._reply_type.__name__
            raise ProtocolViolation(f"cannot decode {name}: {_describe(exc)}") from exc
