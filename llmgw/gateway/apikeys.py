"""Client API keys for the gateway's OpenAI routes, as vLLM's ``--api-key`` does it.

With keys configured, every request whose path starts with ``/v1`` must carry
``Authorization: Bearer KEY`` with one of them, else it is answered 401 with an
OpenAI-shaped error (``{"error": {"message", "type": "AuthenticationError", "param",
"code": 401}}``; vLLM itself answers ``{"error": "Unauthorized"}``). ``/healthz`` and
``/metrics`` stay open, as vLLM leaves ``/health`` and ``/metrics``. Like vLLM's middleware
the check compares SHA-256 digests with :func:`hmac.compare_digest` against every key
without stopping at the first match, so its time does not depend on which key matched or
how much of one did. Only the digests are kept; no key is ever logged or shown in a repr.

Keys come from ``--api-key-file`` / ``--gateway-api-key-file`` (one key per line; blank
lines and lines starting with ``#`` are skipped) or, without a file, from
``$LLMGW_GATEWAY_API_KEY`` (one key): :func:`parse_key_file`.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from llmgw.gateway.openai import error_body

__all__ = ["API_KEY_ENV", "UNAUTHORIZED_BODY", "ApiKeys", "parse_key_file"]

API_KEY_ENV = "LLMGW_GATEWAY_API_KEY"
UNAUTHORIZED_BODY = error_body(
    "Unauthorized: send a valid API key as `Authorization: Bearer KEY`",
    "AuthenticationError",
    401,
)
"""The 401 answer's body (OpenAI's error shape, as the gateway's other errors)."""
_GUARDED_PREFIX = "/v1"


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The accepted client keys, as SHA-256 digests; none means every request is let in."""

    digests: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, keys: Iterable[str]) -> ApiKeys:
        """The digests of ``keys`` (each stripped; empty ones dropped)."""
        return cls(tuple(_digest(k.strip().encode()) for k in keys if k.strip()))

    @property
    def required(self) -> bool:
        return bool(self.digests)

    def guards(self, path: str) -> bool:
        """Whether a request for ``path`` needs a key (``/v1`` and below, when keys are set)."""
        return self.required and path.startswith(_GUARDED_PREFIX)

    def allows(self, authorization: bytes | None) -> bool:
        """Whether an ``Authorization`` header value carries one of the keys (constant time)."""
        scheme, _, token = (authorization or b"").strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        presented = _digest(token.strip())
        match = False
        for digest in self.digests:
            match |= hmac.compare_digest(presented, digest)
        return match

    def __repr__(self) -> str:
        return f"ApiKeys({len(self.digests)} key(s))"


def parse_key_file(text: str) -> tuple[str, ...]:
    """The keys of a key file; ValueError naming the line of a key that cannot be one.

    A key is printable ASCII without spaces (it travels in an HTTP header). The message
    never repeats the key.
    """
    keys: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not line.isascii() or not line.isprintable() or any(c.isspace() for c in line):
            raise ValueError(f"line {number}: a key must be printable ASCII without spaces")
        keys.append(line)
    if not keys:
        raise ValueError("it holds no key (one per line; '#' starts a comment)")
    return tuple(keys)
