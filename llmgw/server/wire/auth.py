"""Who may call what: bearer tokens with roles, checked in one place for every RPC.

Roles: ``viewer`` reads (GetCluster, Watch, ListProfiles, GetRouterStats, Describe,
RolloutHistory); ``operator`` is a viewer that also acts on replicas, deployments' counts
and revisions (ScaleDeployment, RolloutUndo) and nodes, and reads engine logs (StreamLogs:
engine output may hold prompts); ``admin`` is an operator that also applies and deletes
deployments and nodes, manages tenants' gateway keys (CreateKey, ListKeys, RevokeKey; ``llmgw key``)
and manages tokens (through ``llmgw token`` on the server's file);
only an admin reads profiles' env values: other roles see their names, each value
:data:`REDACTED` (:func:`sees_secrets`).
``agent`` may only join (``AgentService.Connect``; a token made with ``--node`` only as
those node ids) and ``gateway`` may only follow the router
feed (``RouterService.Feed``, which carries replica API keys) and report its routing figures
(``RouterService.Report``); an admin is neither.

Tokens are ``llmgw_`` plus 32 random bytes in URL-safe base64. Only their SHA-256 is stored
(``tokens`` in the server's SQLite; a fast hash is enough for tokens this random); the join
token from ``--join-token-file`` is compared in constant time and grants ``agent``.

Authentication is on when the store holds any token or a join token is given, and off
otherwise (every call then passes, recorded as the actor ``operator``). The store is
re-read at most every ``refresh_s`` and, on an unknown token, at most every
``miss_refresh_s``, so a token made by ``llmgw token create`` on a running server works at
once, the first one turns authentication on within ``refresh_s``, and a revoked token stops
working within ``refresh_s``. While the store cannot be read (a PostgreSQL server gone), the
tokens last read go on being checked, said once at WARNING; the first read must succeed.

**Revocation ends calls already open.** A call let in with a stored token runs its handler
through :meth:`Authenticator.guard`, which keeps the handler's task under the token's
:class:`Principal` while it runs: a Watch (console), a router Feed (gateway), an agent's
Connect made with an ``agent`` token, and unary calls alike. While any such call is open, one
task re-reads the tokens every ``revoke_check_s`` (one small query per interval, never per
message; it stops when the last call ends), and every re-read, whoever triggers it, cancels
the calls of tokens no longer stored: each ends with UNAUTHENTICATED "the bearer token was
revoked", and new calls with that token are refused. ``llmgw token revoke`` writes the
server's file, so an open stream ends within about ``revoke_check_s`` of it. The join token
(``--join-token-file``) lives in the server's configuration, not the store: it cannot be
revoked while the server runs, so calls made with it are not kept.

The native port calls :meth:`Authenticator.check` from a grpclib ``RecvRequest`` event and
wraps the handler in :meth:`Authenticator.guard` there (:func:`install`); the gRPC-web port
calls ``check`` before dispatching and runs the handler through ``guard``. A missing or unknown
token answers UNAUTHENTICATED, a known token of a role that may not call the method
PERMISSION_DENIED naming the role needed. The caller of an authorized call is kept in a
context variable (:func:`current_actor`) for the audit log. Tokens never reach a log.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

import grpclib.events
import grpclib.server
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from llmgw.server.errors import StoreError
from llmgw.server.state.tokens import Role, StoredToken

log = logging.getLogger(__name__)

TOKEN_PREFIX = "llmgw_"
ANONYMOUS_ACTOR = "operator"
"""The audit actor when authentication is off."""
REVOKED = "the bearer token was revoked"
"""The message of UNAUTHENTICATED for a call cut because its token was revoked."""

REDACTED = "<redacted>"
"""What a caller that may not read secrets sees instead of each profile env value."""

HandlerFunc = Callable[[Any], Coroutine[Any, Any, None]]
"""A grpclib handler function (``Handler.func``): it serves one call on its stream."""
_F = TypeVar("_F", bound=HandlerFunc)


_GRANTS: Mapping[Role, frozenset[Role]] = {
    Role.VIEWER: frozenset({Role.VIEWER}),
    Role.OPERATOR: frozenset({Role.VIEWER, Role.OPERATOR}),
    Role.ADMIN: frozenset({Role.VIEWER, Role.OPERATOR, Role.ADMIN}),
    Role.AGENT: frozenset({Role.AGENT}),
    Role.GATEWAY: frozenset({Role.GATEWAY}),
}

_CONTROL = "/llmgw.v1.ControlService/"
METHOD_ROLES: Mapping[str, Role] = {
    _CONTROL + "GetCluster": Role.VIEWER,
    _CONTROL + "Watch": Role.VIEWER,
    _CONTROL + "ListProfiles": Role.VIEWER,
    _CONTROL + "GetRouterStats": Role.VIEWER,
    _CONTROL + "StartReplica": Role.OPERATOR,
    _CONTROL + "DrainReplica": Role.OPERATOR,
    _CONTROL + "ReprofileReplica": Role.OPERATOR,
    _CONTROL + "CordonNode": Role.OPERATOR,
    _CONTROL + "UncordonNode": Role.OPERATOR,
    _CONTROL + "DrainNode": Role.OPERATOR,
    _CONTROL + "StreamLogs": Role.OPERATOR,  # engine output may hold prompts
    _CONTROL + "ApplyDeployment": Role.ADMIN,
    _CONTROL + "DeleteDeployment": Role.ADMIN,
    _CONTROL + "DeleteNode": Role.ADMIN,
    _CONTROL + "Describe": Role.VIEWER,
    _CONTROL + "ScaleDeployment": Role.OPERATOR,
    _CONTROL + "RolloutHistory": Role.VIEWER,
    _CONTROL + "RolloutUndo": Role.OPERATOR,
    _CONTROL + "CreateKey": Role.ADMIN,  # tenants' gateway keys (issue #18)
    _CONTROL + "ListKeys": Role.ADMIN,
    _CONTROL + "RevokeKey": Role.ADMIN,
    _CONTROL + "GetUsage": Role.ADMIN,
    "/llmgw.v1.AgentService/Connect": Role.AGENT,
    "/llmgw.v1.RouterService/Feed": Role.GATEWAY,
    "/llmgw.v1.RouterService/Report": Role.GATEWAY,
}
"""The role each RPC needs; a method missing here is refused to everyone."""


def may_call(role: Role, method: str) -> bool:
    """Whether a token of ``role`` may call ``method`` (a gRPC path)."""
    needed = METHOD_ROLES.get(method)
    return needed is not None and needed in _GRANTS[role]


def new_token() -> str:
    """A fresh random token (shown once, stored only as :func:`hash_token`)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """The stored form of a token: SHA-256, hex."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def bearer(authorization: str | None) -> str | None:
    """The token of an ``authorization: Bearer TOKEN`` value; None when there is none."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who made a call: a token's id and note, and its role."""

    token_id: int | None  # None: the join token
    role: Role
    note: str = ""
    token_hash: str = field(default="", repr=False)  # the stored hash; "" for the join token
    nodes: frozenset[str] = frozenset()  # the node ids an agent token may register; empty: any

    @property
    def actor(self) -> str:
        """How the audit log names this caller."""
        name = "join-token" if self.token_id is None else f"token:{self.token_id}"
        return f"{name} ({self.note})" if self.note else name


_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "llmgw_principal", default=None
)


def current_principal() -> Principal | None:
    """The caller of the call being served; None when authentication is off."""
    return _principal.get()


def current_actor() -> str:
    """The audit actor of the call being served (``operator`` when authentication is off)."""
    principal = _principal.get()
    return ANONYMOUS_ACTOR if principal is None else principal.actor


def sees_secrets() -> bool:
    """Whether the caller being served may read secrets: profile env values (HF tokens go
    there). Admins only, and anyone while authentication is off (anyone may apply then)."""
    principal = _principal.get()
    return principal is None or principal.role is Role.ADMIN


class TokenSource(Protocol):
    """Where tokens are kept (``llmgw.server.state.store.Store``)."""

    async def load_tokens(self) -> list[StoredToken]: ...


class Authenticator:
    """Checks every call's bearer token against the stored tokens and the join token."""

    def __init__(
        self,
        tokens: TokenSource,
        *,
        join_token: str | None = None,
        refresh_s: float = 2.0,
        miss_refresh_s: float = 0.25,
        revoke_check_s: float = 0.5,
    ) -> None:
        self._source = tokens
        self._join_hash = hash_token(join_token) if join_token else None
        self._refresh_s = refresh_s
        self._miss_refresh_s = miss_refresh_s
        self._revoke_check_s = revoke_check_s
        self._by_hash: dict[str, StoredToken] = {}
        self._loaded_at: float | None = None
        self._stale = False  # the latest re-read failed: the tokens read before are used
        self._open: dict[Principal, set[asyncio.Task[Any]]] = {}  # calls by their caller
        self._cut: set[asyncio.Task[Any]] = set()  # open calls cancelled for a revoked token
        self._watcher: asyncio.Task[None] | None = None  # re-reads tokens while calls are open

    async def enabled(self) -> bool:
        """Whether calls need a token: a join token is set, or the store holds tokens."""
        await self._refresh(self._refresh_s)
        return self._join_hash is not None or bool(self._by_hash)

    async def check(self, method: str, authorization: str | None) -> Principal | None:
        """The caller of ``method``, or GRPCError; None (anyone) when authentication is off.

        Also records the caller for :func:`current_actor` in the current context.
        """
        if not await self.enabled():
            _principal.set(None)
            return None
        principal = await self._identify(bearer(authorization))
        if not may_call(principal.role, method):
            raise GRPCError(Status.PERMISSION_DENIED, _denied(principal.role, method))
        _principal.set(principal)
        return principal

    async def _identify(self, token: str | None) -> Principal:
        if token is None:
            raise GRPCError(Status.UNAUTHENTICATED, "a bearer token is required")
        digest = hash_token(token)
        if self._join_hash is not None and hmac.compare_digest(digest, self._join_hash):
            return Principal(None, Role.AGENT)
        stored = self._by_hash.get(digest)
        if stored is None:
            await self._refresh(self._miss_refresh_s)
            stored = self._by_hash.get(digest)
        if stored is None or not hmac.compare_digest(stored.hash, digest):
            raise GRPCError(Status.UNAUTHENTICATED, "the bearer token is not valid")
        return Principal(stored.token_id, stored.role, stored.note, stored.hash, stored.nodes)

    async def _refresh(self, max_age_s: float) -> None:
        now = time.monotonic()
        if self._loaded_at is not None and now - self._loaded_at < max_age_s:
            return
        before, self._loaded_at = self._loaded_at, now
        try:
            await self._reload()
        except StoreError as exc:
            if before is None:
                raise  # never read: nothing to check against
            if not self._stale:
                log.warning("re-reading the tokens failed (the last read ones apply): %s", exc)
            self._stale = True
            return
        if self._stale:
            log.warning("the tokens are read again")
        self._stale = False

    async def _reload(self) -> None:
        """Read the tokens again; cut the open calls of every token no longer stored."""
        tokens = await self._source.load_tokens()
        self._by_hash = {t.hash: t for t in tokens}
        for principal, tasks in self._open.items():
            if principal.token_hash not in self._by_hash:
                self._cut_calls(principal, tasks)

    def _cut_calls(self, principal: Principal, tasks: set[asyncio.Task[Any]]) -> None:
        fresh = [task for task in tasks if task not in self._cut]
        for task in fresh:
            self._cut.add(task)
            task.cancel(REVOKED)
        if fresh:
            log.info("%s was revoked: %d open call(s) ended", principal.actor, len(fresh))

    async def on_native_request(self, event: grpclib.events.RecvRequest) -> None:
        """The grpclib ``RecvRequest`` hook: check the call, then run it through :meth:`guard`."""
        values = event.metadata.getall("authorization", [])
        value = values[-1] if values else None
        await self.check(event.method_name, value if isinstance(value, str) else None)
        event.method_func = self.guard(event.method_func)

    # --- calls open with a token that may be revoked ----------------------------------------

    def guard(self, func: _F) -> _F:
        """``func``, ended with UNAUTHENTICATED once the token that opened its call is revoked.

        Reads the caller that :meth:`check` recorded in this context; a call without a
        stored token (authentication off, the join token) runs untouched.
        """

        async def guarded(stream: Any) -> None:
            principal = _principal.get()
            if principal is None or not principal.token_hash:
                await func(stream)
            else:
                await self._run_revocable(func, stream, principal)

        return cast(_F, guarded)

    async def _run_revocable(self, func: HandlerFunc, stream: Any, principal: Principal) -> None:
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - grpclib and the bridge always run handlers in tasks
            raise RuntimeError("a handler must run in a task")
        self._hold(principal, task)
        try:
            await func(stream)
        except asyncio.CancelledError:
            if task not in self._cut:
                raise
        finally:
            cut = self._release(principal, task)
        if cut:  # the handler ended (or swallowed the cancellation) because of the revocation
            if task.uncancel() > 0:  # cancelled for another reason too: let that win
                raise asyncio.CancelledError
            raise GRPCError(Status.UNAUTHENTICATED, REVOKED)

    def _hold(self, principal: Principal, task: asyncio.Task[Any]) -> None:
        self._open.setdefault(principal, set()).add(task)
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(), name="auth-revocations")

    def _release(self, principal: Principal, task: asyncio.Task[Any]) -> bool:
        """Forget ``task``; whether it was cut. The watcher stops with the last open call."""
        tasks = self._open.get(principal, set())
        tasks.discard(task)
        if not tasks:
            self._open.pop(principal, None)
        if not self._open and self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        cut = task in self._cut
        self._cut.discard(task)
        return cut

    async def _watch(self) -> None:
        """Re-read the tokens every ``revoke_check_s`` while calls are open."""
        while True:
            await asyncio.sleep(self._revoke_check_s)
            try:
                await self._reload()
                self._loaded_at = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store is unreadable now: keep the calls, try again
                log.warning("re-reading the tokens failed: %s", exc)


def install(server: grpclib.server.Server, auth: Authenticator) -> None:
    """Check every call on ``server`` (the native gRPC port) with ``auth``."""
    grpclib.events.listen(server, grpclib.events.RecvRequest, auth.on_native_request)


def _denied(role: Role, method: str) -> str:
    needed = METHOD_ROLES.get(method)
    name = method.rsplit("/", 1)[-1] or method
    if needed is None:
        return f"{name} is not open to any token"
    return f"{name} needs the {needed.value} role; this token has the {role.value} role"
