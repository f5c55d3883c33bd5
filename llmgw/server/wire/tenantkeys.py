"""The operator API's tenant keys (issue #18): ``CreateKey``, ``ListKeys`` and ``RevokeKey``,
which ``ControlService`` delegates to :class:`TenantKeyCalls` (the admin role:
``llmgw.server.wire.auth``).

``CreateKey`` checks every field of the request (:func:`check_create`: the first problem
answers INVALID_ARGUMENT naming the field, and nothing is stored), then makes the key
(:func:`new_key`: ``llmgw_k_`` and 32 random bytes, URL-safe base64, from ``secrets``) and
its public id (``k_`` and 12 random hex digits), stores only its SHA-256
(``ControlPlane.tenant_keys``: ``llmgw.server.state.tenantkeys``) and answers the key, once:
nothing can show it again. ``ListKeys`` answers the live keys (of one tenant, or all), by
creation, never with a digest. ``RevokeKey`` marks a live key revoked; an unknown id answers
NOT_FOUND naming it.

Each create and revoke, refused or not, is audited (the caller, ``key-create`` or
``key-revoke``, the key id as target, the tenant in the result; never the key). Publishing
that audit record on the plane's watch hub is what wakes every router feed, which then
sends its gateway the new ``TenantKeys`` (``llmgw.server.wire.routersvc``): a revoked key
leaves every gateway's set at once.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from typing import Final

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from llmgw.api.llmgw.v1 import (
    ActionResult,
    CreateKeyRequest,
    CreateKeyResponse,
    KeyPriority,
    ListKeysRequest,
    ListKeysResponse,
    RevokeKeyRequest,
    TenantKey,
)
from llmgw.server.errors import quoted
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.storeschema import KEY_PRIORITIES, StoredTenantKey
from llmgw.server.wire.auth import current_actor

__all__ = [
    "KEY_PREFIX",
    "LIMIT_MAX",
    "MAX_MODELS",
    "NOTE_MAX",
    "TenantKeyCalls",
    "check_create",
    "key_digest",
    "key_message",
    "new_key",
]

KEY_PREFIX: Final = "llmgw_k_"
"""How every tenant key begins (so a leaked one is recognised as llmgw's)."""
KEY_ID_PREFIX: Final = "k_"
LIMIT_MAX: Final = 10**9
"""The most ``rpm``, ``tpm`` and ``max_concurrency`` may be."""
MAX_MODELS: Final = 64
MODEL_NAME_MAX: Final = 256  # as a profile's served model name (llmgw.server.core.profiles)
NOTE_MAX: Final = 200
_TENANT: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_TENANT_RULE: Final = "1 to 64 of A-Z a-z 0-9 . _ -, starting with a letter or digit"
_PRIORITIES: Final = dict(
    zip((KeyPriority.INTERACTIVE, KeyPriority.BATCH), KEY_PRIORITIES, strict=True)
)  # each band by the name the store keeps it under
_BY_NAME: Final = {name: priority for priority, name in _PRIORITIES.items()}


class KeyRefused(Exception):
    """A request to refuse: its gRPC status and why (the field named)."""

    def __init__(self, status: Status, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why


def new_key() -> tuple[str, str]:
    """A fresh key and its public id: (``llmgw_k_…``, ``k_`` + 12 hex digits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32), KEY_ID_PREFIX + secrets.token_hex(6)


def key_digest(key: str) -> bytes:
    """What is stored and sent to gateways of a key: its SHA-256."""
    return hashlib.sha256(key.encode("utf-8")).digest()


def _model_problem(name: str) -> str | None:
    if not name:
        return "an empty model name"
    if len(name) > MODEL_NAME_MAX:
        return f"a model name of {len(name)} characters (at most {MODEL_NAME_MAX})"
    if not all(c.isprintable() and not c.isspace() and c != "," for c in name):
        return f"model name {quoted(name)}: printable, no spaces or commas"
    return None


def _check_models(models: list[str]) -> tuple[str, ...]:
    if len(models) > MAX_MODELS:
        raise KeyRefused(
            Status.INVALID_ARGUMENT, f"models: {len(models)} given, at most {MAX_MODELS}"
        )
    seen: set[str] = set()
    for name in models:
        if (why := _model_problem(name)) is not None:
            raise KeyRefused(Status.INVALID_ARGUMENT, f"models: {why}")
        if name in seen:
            raise KeyRefused(Status.INVALID_ARGUMENT, f"models: {quoted(name)} given twice")
        seen.add(name)
    return tuple(models)


def _check_fields(message: CreateKeyRequest, now_ms: int) -> None:
    """The tenant, the limits, the priority, the expiry and the note (not the models)."""
    if not _TENANT.fullmatch(message.tenant):
        raise KeyRefused(
            Status.INVALID_ARGUMENT, f"tenant {quoted(message.tenant)}: {_TENANT_RULE}"
        )
    for field in ("rpm", "tpm", "max_concurrency"):
        value = int(getattr(message, field))
        if value > LIMIT_MAX:
            why = f"{field} {value}: at most {LIMIT_MAX} (0: no limit)"
            raise KeyRefused(Status.INVALID_ARGUMENT, why)
    if message.priority not in _PRIORITIES:
        raise KeyRefused(Status.INVALID_ARGUMENT, f"priority {int(message.priority)}: unknown")
    expires = message.expires_unix_ms
    if expires != 0 and expires <= now_ms:
        why = f"expires_unix_ms {expires}: in the past (now {now_ms}); 0 for never"
        raise KeyRefused(Status.INVALID_ARGUMENT, why)
    note = message.note
    if len(note) > NOTE_MAX or not note.isprintable():
        why = f"note: at most {NOTE_MAX} printable characters, got {quoted(note, 64)}"
        raise KeyRefused(Status.INVALID_ARGUMENT, why)


def check_create(
    message: CreateKeyRequest, *, key_id: str, digest: bytes, now_ms: int
) -> StoredTenantKey:
    """The key ``message`` asks for, as it will be stored; KeyRefused (INVALID_ARGUMENT,
    naming the field) at the first problem."""
    _check_fields(message, now_ms)
    return StoredTenantKey(
        key_id=key_id,
        tenant=message.tenant,
        digest=digest,
        models=_check_models(list(message.models)),
        rpm=message.rpm,
        tpm=message.tpm,
        max_concurrency=message.max_concurrency,
        priority=_PRIORITIES[KeyPriority(message.priority)],
        expires_ms=message.expires_unix_ms,
        created_ms=now_ms,
        note=message.note,
    )


def key_message(key: StoredTenantKey, *, with_digest: bool) -> TenantKey:
    """``key`` on the wire: with its digest for gateways (the router feed), else without."""
    return TenantKey(
        key_id=key.key_id,
        tenant=key.tenant,
        models=list(key.models),
        rpm=key.rpm,
        tpm=key.tpm,
        max_concurrency=key.max_concurrency,
        priority=_BY_NAME.get(key.priority, KeyPriority.INTERACTIVE),
        expires_unix_ms=key.expires_ms,
        created_unix_ms=key.created_ms,
        note=key.note,
        digest=key.digest if with_digest else b"",
    )


class TenantKeyCalls:
    """``CreateKey``, ``ListKeys`` and ``RevokeKey`` over ``plane.tenant_keys``."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    async def create(self, message: CreateKeyRequest) -> CreateKeyResponse:
        key, key_id = new_key()
        now_ms = time.time_ns() // 1_000_000
        try:
            stored = check_create(message, key_id=key_id, digest=key_digest(key), now_ms=now_ms)
        except KeyRefused as exc:
            target = f"tenant/{message.tenant[:64]}"
            await self.plane.audit(current_actor(), "key-create", target, f"refused: {exc.why}")
            raise GRPCError(exc.status, exc.why) from exc
        await self.plane.tenant_keys.add(stored)
        result = f"ok: tenant {stored.tenant}"
        await self.plane.audit(current_actor(), "key-create", key_id, result)
        return CreateKeyResponse(key=key, created=key_message(stored, with_digest=False))

    async def list(self, message: ListKeysRequest) -> ListKeysResponse:
        keys = [
            key_message(key, with_digest=False)
            for key in self.plane.tenant_keys.keys
            if not message.tenant or key.tenant == message.tenant
        ]
        return ListKeysResponse(keys=keys)

    async def revoke(self, message: RevokeKeyRequest) -> ActionResult:
        key_id = message.key_id
        key = self.plane.tenant_keys.get(key_id)
        if key is None or not await self.plane.tenant_keys.revoke(key_id):
            why = f"no live key with id {quoted(key_id)}"
            await self.plane.audit(current_actor(), "key-revoke", key_id[:64], f"refused: {why}")
            raise GRPCError(Status.NOT_FOUND, why)
        await self.plane.audit(current_actor(), "key-revoke", key_id, f"ok: tenant {key.tenant}")
        return ActionResult(ok=True, message=f"key {key_id} of tenant {key.tenant} revoked")
