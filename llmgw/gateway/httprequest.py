"""What the gateway's HTTP server (``httpserver``) and its handlers exchange.

A handler gets the ``Request`` and the ``HttpConnection`` (``httpconnection``) and writes the
response bytes itself (``write``), head included; ``respond`` writes a whole small response.
The handler returning means the response is complete; ``abort`` closes the connection instead
(a response that cannot be finished). ``admit`` sees each head before its body and may answer
a ``Refusal``.

Here: those types (``Request``, ``Refusal``, ``Admit``, ``Producer``), ``status_line``, and
what the connection reads of a request or writes of a response (``content_length``,
``is_preflight``, ``cors_lines``, ``error_type``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol

JSON_TYPE = b"application/json"


@dataclass(frozen=True, slots=True)
class Refusal:
    """What ``admit`` answers instead of the handler: ``status`` with ``body`` (JSON)."""

    status: int
    body: bytes


Admit = Callable[[bytes, str, tuple[tuple[bytes, bytes], ...]], Refusal | None]
"""Sees a request's method, path and headers (names lower-case) before its body is read."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request as received: names of headers lower-case, body whole and de-chunked."""

    method: bytes
    path: str  # without the query
    target: bytes  # the request target as sent (path and query)
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    keep_alive: bool
    http11: bool
    cors_origin: bytes | None = None  # the Origin, when it is one of --cors-origin

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower-case)."""
        for key, value in self.headers:
            if key == name:
                return value
        return None


class Producer(Protocol):
    """Something whose reading pauses while the client's socket buffer is full."""

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


def status_line(status: int) -> bytes:
    """``HTTP/1.1 200 OK\\r\\n``."""
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))


def is_preflight(request: Request) -> bool:
    """A CORS preflight from a ``--cors-origin`` origin (others were refused already)."""
    return (
        request.method == b"OPTIONS"
        and request.cors_origin is not None
        and request.header(b"access-control-request-method") is not None
    )


def cors_lines(origin: bytes) -> bytes:
    return b"access-control-allow-origin: %s\r\nvary: origin\r\n" % origin


def content_length(headers: list[tuple[bytes, bytes]]) -> int:
    """The declared body size (httptools has checked the value's form); 0: none declared."""
    declared = next((v for k, v in headers if k == b"content-length"), None)
    return 0 if declared is None else int(declared)


def error_type(status: int) -> str:
    phrase = _REASONS.get(status, b"Error").decode()
    return "".join(word.capitalize() for word in phrase.replace("-", " ").split()) + "Error"


__all__ = [
    "JSON_TYPE",
    "Admit",
    "Producer",
    "Refusal",
    "Request",
    "content_length",
    "cors_lines",
    "error_type",
    "is_preflight",
    "status_line",
]
