"""Tenants' keys at the gateway: who a request is, what it may use, and its limits (issue #18).

The router feed's ``TenantKeys`` event (every live key, as SHA-256 digests; never a key)
replaces a :class:`TenantRegistry`'s set whole: a key absent from the latest set (revoked)
is refused from the next request on. A key that stays (same ``key_id`` and digest) keeps its
limit windows and its requests in flight, so the set the server sends after each snapshot
does not reset anyone's minute. :func:`apply_feed_event` reaches the registry of a table
through :func:`bind_registry` (the Gateway binds its own), so the in-server gateway and
``llmgw gateway`` are fed through the one entry point they already call.

Authentication (:func:`admit_head`, on the request's head alone): once the registry holds
any key, or flat keys exist (apikeys.py, ``--api-key-file``), a ``/v1`` request needs
``Authorization: Bearer KEY`` matching one. A tenant key is looked up by its digest in a
dict (O(1)); an expired one (``expires_unix_ms`` passed, by the wall clock) is answered 401
saying it expired; an unknown one falls through to the flat keys, as today.

Per key, then (:meth:`TenantRegistry.admit`, after the body is read): a model outside the
key's ``models`` is answered 403 ``PermissionDeniedError`` naming it; then its limits as
this gateway enforces them. They hold fleet-wide: each report this gateway sends carries
its windows (:meth:`TenantRegistry.windows`) and the server answers its part of every
limited key's budget (``KeyAllowance``; llmgw.server.core.tenantsplit says how it is split),
which :meth:`TenantRegistry.apply_allowances` sets until the next answer; a gateway cut off
from the server keeps enforcing its last part. Until its first answer a gateway enforces the
key's whole limits (a gateway that starts while others are busy may admit up to a report
interval's worth over the fleet's budget). A part of 0 refuses. A refusal by a part that is
not the whole says Retry-After at most ``REBALANCE_WAIT_S``, as the next rebalance may move
room here:

- ``max_concurrency``: requests in flight at once;
- ``rpm``: requests in a sliding minute (the 31st of a minute at rpm 30 is refused until the
  first leaves the window, 60 s after it was admitted);
- ``tpm``: tokens in a sliding minute. A request is counted at admission with an estimate,
  its prompt's characters / 4 plus its ``max_tokens`` (or ``max_completion_tokens``; 0 when
  it names neither), and corrected to the engine's ``usage`` (prompt + completion tokens)
  when its answer ends, streamed or not; an answer without usage keeps the estimate. A
  request whose estimate alone is over the limit is refused, with Retry-After 60.

Over a limit: 429 ``RateLimitError`` (code ``rate_limit_exceeded``) with ``Retry-After``
(whole seconds, at least 1: when the window will have room) and OpenAI's ``x-ratelimit-*``
headers, which every answer to a keyed request carries too: ``limit`` (this gateway's
part), ``remaining`` (after this request) and ``reset`` (until the window is empty again,
Go-duration style like OpenAI's: ``1.5s``, ``6m0s``), for ``requests`` when the key has an
rpm and ``tokens`` when it has a tpm. Every check is O(1) amortized per request (a window
drops what left it; only a refusal walks a window to say when it has room). Limits use an
injectable monotonic clock, expiry an injectable wall clock (tests pass fakes).

Metering (tenantmeter.py) counts each admitted request's answer and each refusal.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from llmgw.api.llmgw.v1 import KeyAllowance, KeyWindow, TenantKey
from llmgw.gateway.apikeys import UNAUTHORIZED_BODY, ApiKeys
from llmgw.gateway.errors import PermissionDenied, RateLimited
from llmgw.gateway.httprequest import Refusal
from llmgw.gateway.openai import error_body
from llmgw.gateway.routing.table import RoutingTable
from llmgw.gateway.tenantmeter import TenantMeter, Usage

log = logging.getLogger(__name__)

WINDOW_S = 60.0
"""The rate limits' sliding window: one minute."""
REBALANCE_WAIT_S = 2.0
"""The longest Retry-After of a refusal by a part of a fleet-wide limit (about the reports'
interval, after which the server may have moved room here)."""
CHARS_PER_TOKEN = 4
"""The admission estimate's characters per prompt token."""
EXPIRED_BODY = error_body("Unauthorized: this API key has expired", "AuthenticationError", 401)
_GUARDED_PREFIX = "/v1"
_DIGEST_BYTES = 32


def digest_of(authorization: bytes | None) -> bytes | None:
    """The SHA-256 of a ``Bearer`` token in an ``Authorization`` value; None without one."""
    scheme, _, token = (authorization or b"").strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return None
    return hashlib.sha256(token).digest()


class _Entry:
    __slots__ = ("amount", "at")

    def __init__(self, at: float, amount: int) -> None:
        self.at = at
        self.amount = amount


class Window:
    """A sliding minute of entries (when, how much) and their sum."""

    __slots__ = ("entries", "total")

    def __init__(self) -> None:
        self.entries: deque[_Entry] = deque()
        self.total = 0

    def expire(self, now: float) -> None:
        """Drop the entries a minute old or older (amortized O(1))."""
        entries = self.entries
        while entries and entries[0].at <= now - WINDOW_S:
            self.total -= entries.popleft().amount

    def add(self, now: float, amount: int) -> _Entry:
        entry = _Entry(now, amount)
        self.entries.append(entry)
        self.total += amount
        return entry

    def correct(self, entry: _Entry, amount: int, now: float) -> None:
        """``entry`` counts ``amount`` from now on, if it is still in the window."""
        self.expire(now)
        if entry.at > now - WINDOW_S:
            self.total += amount - entry.amount
        entry.amount = amount

    def wait_for(self, room: int, now: float) -> float:
        """Seconds until the sum has dropped by ``room`` (walks the window: refusals only)."""
        freed = 0
        for entry in self.entries:
            freed += entry.amount
            if freed >= room:
                return entry.at + WINDOW_S - now
        return WINDOW_S

    def reset_s(self, now: float) -> float:
        """Seconds until the window is empty."""
        return max(0.0, self.entries[-1].at + WINDOW_S - now) if self.entries else 0.0


class KeyState:
    """One live key: its feed record, this gateway's allowance of its limits, its windows."""

    __slots__ = (
        "allowance", "asked_requests", "asked_tokens", "in_flight", "key", "models",
        "requests", "tokens",
    )  # fmt: skip

    def __init__(self, key: TenantKey) -> None:
        self.key = key
        self.models = frozenset(key.models)
        # this gateway's part of the fleet-wide limits (None: none received, the whole)
        self.allowance: KeyAllowance | None = None
        self.in_flight = 0
        self.requests = Window()
        self.tokens = Window()
        self.asked_requests = 0  # cumulative: admitted or refused by a limit
        self.asked_tokens = 0

    @property
    def rpm(self) -> int:
        """Requests this gateway admits in its sliding minute; 0: no limit."""
        return _part(self.key.rpm, self.allowance, "rpm")

    @property
    def tpm(self) -> int:
        return _part(self.key.tpm, self.allowance, "tpm")

    @property
    def max_concurrency(self) -> int:
        return _part(self.key.max_concurrency, self.allowance, "max_concurrency")

    @property
    def partial(self) -> bool:
        """Whether this gateway holds a part of the key's limits (the next rebalance may
        grow it), not the whole."""
        return self.allowance is not None and not self.allowance.whole

    def may_use(self, model: str) -> bool:
        return not self.models or model in self.models


def _part(limit: int, allowance: KeyAllowance | None, kind: str) -> int:
    """A limit as this gateway enforces it: 0 stays none; else its allowance, which may be
    0 (nothing left here) but is then enforced as "refuse" (-1 stands for it)."""
    if limit == 0:
        return 0
    if allowance is None:
        return limit
    part = int(getattr(allowance, kind))
    return part if part > 0 else -1


@dataclass(slots=True)
class Ticket:
    """An admitted keyed request: released (and its tokens corrected) once, by ``close``."""

    state: KeyState
    registry: TenantRegistry
    model: str
    entry: _Entry
    headers: bytes  # the x-ratelimit-* lines for its answer
    closed: bool = False

    def answered(self, usage: Usage, upstream_s: float) -> None:
        """A replica answered: meter it and correct the tokens to the engine's usage."""
        self.registry.meter.answered(self.state.key, self.model, usage, upstream_s)
        if usage.prompt is not None or usage.completion is not None:
            spent = (usage.prompt or 0) + (usage.completion or 0)
            self.state.tokens.correct(self.entry, spent, self.registry.clock())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.state.in_flight -= 1


class TenantRegistry:
    """Every live tenant key by digest, and the metering of their requests."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock  # seconds, monotonic: the limit windows
        self.wall = wall  # seconds since the epoch: expiry
        self.meter = TenantMeter()
        self._by_digest: dict[bytes, KeyState] = {}

    @property
    def required(self) -> bool:
        """Whether any key is live (then /v1 needs a key)."""
        return bool(self._by_digest)

    def replace(self, keys: Iterable[TenantKey]) -> None:
        """The feed's set replaces ours; a key that stays keeps its windows (docstring)."""
        kept = {(s.key.key_id, digest): s for digest, s in self._by_digest.items()}
        new: dict[bytes, KeyState] = {}
        for key in keys:
            digest = bytes(key.digest)
            if len(digest) != _DIGEST_BYTES:
                log.warning("tenant key %r has no SHA-256 digest; ignored", key.key_id)
                continue
            state = kept.get((key.key_id, digest))
            if state is None:
                state = KeyState(key)
            else:
                state.key, state.models = key, frozenset(key.models)
            new[digest] = state
        self._by_digest = new

    def keys(self) -> tuple[TenantKey, ...]:
        return tuple(s.key for s in self._by_digest.values())

    def windows(self) -> list[KeyWindow]:
        """What this gateway holds now of each limited key's budget (``RouterReport.windows``)."""
        now = self.clock()
        out = []
        for state in self._by_digest.values():
            key = state.key
            if not (key.rpm or key.tpm or key.max_concurrency):
                continue
            state.requests.expire(now)
            state.tokens.expire(now)
            out.append(
                KeyWindow(
                    key_id=key.key_id,
                    requests=len(state.requests.entries),
                    tokens=max(0, state.tokens.total),
                    in_flight=state.in_flight,
                    asked_requests=state.asked_requests,
                    asked_tokens=state.asked_tokens,
                )  # fmt: skip
            )
        return out

    def apply_allowances(self, allowances: Iterable[KeyAllowance]) -> None:
        """The server's split (``RouterReportAck.allowances``): each key named enforces its
        part until the next; a key not named keeps what it had."""
        by_id = {a.key_id: a for a in allowances}
        for state in self._by_digest.values():
            found = by_id.get(state.key.key_id)
            if found is not None:
                state.allowance = found

    def lookup(self, authorization: bytes | None) -> KeyState | None:
        """The live key an ``Authorization`` value carries (O(1)), or None."""
        if not self._by_digest:
            return None
        digest = digest_of(authorization)
        return None if digest is None else self._by_digest.get(digest)

    def expired(self, state: KeyState) -> bool:
        expires = state.key.expires_unix_ms
        return expires != 0 and self.wall() * 1000 >= expires

    def admit(self, state: KeyState, model: str, label: str, estimate: int) -> Ticket:
        """Admit a request for ``model`` (metered as ``label``) with ``estimate`` tokens, or
        raise PermissionDenied / RateLimited (counted as refused)."""
        key = state.key
        if not state.may_use(model):
            self.meter.refused(key, label, "model")
            raise PermissionDenied(
                f"this API key may not use the model `{model[:256]}`", param="model"
            )
        now = self.clock()
        state.requests.expire(now)
        state.tokens.expire(now)
        state.asked_requests += 1
        state.asked_tokens += estimate
        refusal = _over_limit(state, estimate, now)
        if refusal is not None:
            reason, message, wait = refusal
            self.meter.refused(key, label, reason)
            retry = max(1, math.ceil(wait))
            raise RateLimited(message, retry_after_s=retry, headers=_headers(state, now))
        state.requests.add(now, 1)
        entry = state.tokens.add(now, estimate)
        state.in_flight += 1
        return Ticket(state, self, label, entry, _headers(state, now))


def _over_limit(state: KeyState, estimate: int, now: float) -> tuple[str, str, float] | None:
    """Which limit a request would go over: (reason, message, seconds until room). A part
    of a fleet-wide limit (``state.partial``) may grow at the next rebalance, so its wait is
    at most ``REBALANCE_WAIT_S``."""
    wait_cap = REBALANCE_WAIT_S if state.partial else WINDOW_S
    concurrency = state.max_concurrency
    if concurrency and state.in_flight >= max(concurrency, 0):
        return (
            "concurrency",
            f"this API key has {max(concurrency, 0)} requests in flight at most",
            1.0,
        )
    rpm = state.rpm
    window = state.requests
    if rpm and len(window.entries) >= max(rpm, 0):
        wait = window.wait_for(len(window.entries) - max(rpm, 0) + 1, now)
        return (
            "rpm",
            f"Rate limit reached for requests: {_shown(rpm)} per minute",
            min(wait, wait_cap),
        )
    tpm = state.tpm
    tokens = state.tokens
    if tpm and tokens.total + estimate > max(tpm, 0):
        if estimate > state.key.tpm:
            message = (
                f"the request's {estimate} tokens (estimated) exceed the {state.key.tpm} per minute"
            )
            return "tpm", message, WINDOW_S
        wait = tokens.wait_for(tokens.total + estimate - max(tpm, 0), now)
        return (
            "tpm",
            f"Rate limit reached for tokens: {_shown(tpm)} per minute",
            min(wait, wait_cap),
        )
    return None


def _shown(limit: int) -> int:
    return max(limit, 0)


def _headers(state: KeyState, now: float) -> bytes:
    """OpenAI's ``x-ratelimit-*`` lines for the key's limits (module docstring)."""
    parts: list[bytes] = []
    rpm = _shown(state.rpm)
    if state.rpm:
        left = max(0, rpm - len(state.requests.entries))
        parts.append(
            b"x-ratelimit-limit-requests: %d\r\nx-ratelimit-remaining-requests: %d\r\n"
            b"x-ratelimit-reset-requests: %s\r\n" % (rpm, left, duration(state.requests, now))
        )
    tpm = _shown(state.tpm)
    if state.tpm:
        left = max(0, tpm - state.tokens.total)
        parts.append(
            b"x-ratelimit-limit-tokens: %d\r\nx-ratelimit-remaining-tokens: %d\r\n"
            b"x-ratelimit-reset-tokens: %s\r\n" % (tpm, left, duration(state.tokens, now))
        )
    return b"".join(parts)


def duration(window: Window, now: float) -> bytes:
    """Until ``window`` is empty, as OpenAI writes it: ``0s``, ``1.5s``, ``6m0s``."""
    seconds = window.reset_s(now)
    if seconds >= WINDOW_S:
        whole = math.ceil(seconds)
        return b"%dm%ds" % divmod(whole, 60)
    text = f"{seconds:.3f}".rstrip("0").rstrip(".")
    return f"{text}s".encode()


def estimate_tokens(text: str, max_tokens: int) -> int:
    """The admission estimate: the prompt's characters / 4 (rounded up) + ``max_tokens``."""
    return -(-len(text) // CHARS_PER_TOKEN) + max_tokens


def admit_head(
    path: str,
    authorization: bytes | None,
    flat: ApiKeys,
    explain: ApiKeys,
    tenants: TenantRegistry,
) -> Refusal | None:
    """The key check on a request's head (module docstring); None lets it in."""
    if not path.startswith(_GUARDED_PREFIX) or not (flat.required or tenants.required):
        return None  # /healthz and /metrics stay open, and so does a gateway without keys
    state = tenants.lookup(authorization)
    if state is not None:
        return Refusal(401, EXPIRED_BODY) if tenants.expired(state) else None
    if flat.allows(authorization) or explain.allows(authorization):
        return None
    return Refusal(401, UNAUTHORIZED_BODY)


_REGISTRIES: weakref.WeakKeyDictionary[RoutingTable, TenantRegistry] = weakref.WeakKeyDictionary()


def bind_registry(table: RoutingTable, registry: TenantRegistry) -> None:
    """Feed events applied to ``table`` give their tenant keys to ``registry``."""
    _REGISTRIES[table] = registry


def registry_of(table: RoutingTable) -> TenantRegistry | None:
    """The registry bound to ``table`` (None: its feed's tenant keys are dropped)."""
    return _REGISTRIES.get(table)


__all__ = [
    "CHARS_PER_TOKEN",
    "EXPIRED_BODY",
    "WINDOW_S",
    "KeyState",
    "TenantRegistry",
    "Ticket",
    "Window",
    "admit_head",
    "bind_registry",
    "digest_of",
    "duration",
    "estimate_tokens",
    "registry_of",
]
