"""Whether the state database takes writes, and what the server does while it does not.

Each backend maps its driver's failures to StoreUnwritable in one place: SQLite's here
(:func:`unwritable`), PostgreSQL's in ``llmgw.server.state.storepg`` (a server that cannot
be reached, a lost connection, a read-only or full cluster). For SQLite: a full disk
(``SQLITE_FULL``), a read-only file or file system (``SQLITE_READONLY``), an I/O error
(``SQLITE_IOERR``, what a file system remounted read-only after errors gives) or a file
that cannot be opened for writing (``SQLITE_CANTOPEN``, ``SQLITE_PERM``) is an
outside condition that passes: :func:`unwritable` maps sqlite's exception to
:class:`~llmgw.server.errors.StoreUnwritable` in this one place, and every other sqlite
error stays what it is (our bug). :meth:`WriteHealth.writing` wraps each write of
``llmgw.server.state.store``: writes run one at a time (a failed one is rolled back by its
backend's transaction without taking another's statements with it), and each outcome sets
the health ``/healthz``
reports (503 with :attr:`WriteHealth.problem` while writes fail, 200 after the next one
that commits). The first failure of a streak is logged at WARNING, the rest at DEBUG.

An I/O error is different in one way: after the kernel reported one for a file, a later
write to it may return success without reaching the disk (the page cache took it; the
error was reported once: what PostgreSQL calls fsync failure), and a file system that
failed is read-only (``errors=remount-ro``) until an unmount and a fsck. So after an I/O
error every write is refused, without trying, until the server restarts (but for those
that only say there is no room); a full disk and a read-only file are retried, and the
next write that commits ends them.

The server stays up meanwhile: mutating RPCs answer UNAVAILABLE ``state database
full/read-only: <sqlite's message>`` (:func:`unavailable_when_unwritable` on the gRPC-web
port, :func:`install` on the native one), nothing is acknowledged before it committed, and
reads, the gateway and agents' streams go on. The plane keeps what is only in memory
(heartbeat times, registrations, audit records nobody waits for) and writes it once writes
work again, retrying with :class:`WriteRetry` (capped, jittered backoff).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar, cast

import grpclib.events
import grpclib.server
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from llmgw.server.errors import StoreUnwritable

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Coroutine[Any, Any, Any]])

# sqlite's primary result codes (the low byte of an extended code) that mean "not now".
_UNWRITABLE_CODES: Final = {
    3: "SQLITE_PERM",
    8: "SQLITE_READONLY",
    10: "SQLITE_IOERR",
    13: "SQLITE_FULL",
    14: "SQLITE_CANTOPEN",
}
_IOERR: Final = 10
_SPACE_IOERRS: Final = frozenset({4874, 3082})  # SQLITE_IOERR_SHMSIZE (no room), _NOMEM
UNAVAILABLE_PREFIX: Final = "state database full/read-only"
STICKY: Final = (
    "; writes are refused until the server restarts"
    " (after an I/O error a write may seem to commit and not reach the disk)"
)


def unwritable(exc: sqlite3.Error) -> StoreUnwritable | None:
    """``exc`` as a StoreUnwritable when it says the database cannot be written now; None
    when it is any other sqlite error."""
    code = _primary_code(exc)
    if code not in _UNWRITABLE_CODES:
        return None
    sticky = _sticky(exc)
    return StoreUnwritable(
        f"{UNAVAILABLE_PREFIX}: {exc}" + (STICKY if sticky else ""), sticky=sticky
    )


def _primary_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def _sticky(exc: sqlite3.Error) -> bool:
    """An I/O error after which a write may seem to commit and not reach the disk (not one
    that only says there is no room: growing the WAL index of a full disk, memory)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return _primary_code(exc) == _IOERR and code not in _SPACE_IOERRS


class WriteHealth:
    """The outcome of the state database's latest write; serializes writes."""

    def __init__(self) -> None:
        self.problem: str | None = None  # why the latest write failed; None: it committed
        self.failures = 0  # failed writes since the latest that committed
        self.broken: str | None = None  # after an I/O error: why every write is refused
        self._since: float | None = None  # monotonic time of the streak's first failure
        self._lock = asyncio.Lock()

    async def reason(self) -> str | None:
        """Why the server is unhealthy (``/healthz``), or None when writes commit."""
        return self.problem

    @contextlib.asynccontextmanager
    async def writing(self, changes: Callable[[], int] | None = None) -> AsyncIterator[None]:
        """Run one write alone (its backend rolls it back and raises StoreUnwritable when
        the database cannot be written): a StoreUnwritable is noted as the problem, a
        write that commits as healthy.

        With ``changes`` (the connection's count of rows changed), a write that changed no
        row (nothing to write: no page reached the disk) says nothing about the disk."""
        async with self._lock:
            if self.broken is not None:
                self.failed(self.broken)
                raise StoreUnwritable(self.broken, sticky=True)
            before = changes() if changes is not None else None
            try:
                yield
            except StoreUnwritable as exc:
                if exc.sticky:
                    self.broken = str(exc)
                self.failed(str(exc))
                raise
            if before is None or changes is None or changes() != before:
                self.succeeded()

    def failed(self, problem: str) -> None:
        """Note a write that could not be made."""
        self.failures += 1
        if self._since is None:
            self._since = time.monotonic()
            log.warning(
                "%s; mutating calls answer UNAVAILABLE and background writes are retried",
                problem,
            )
        else:
            log.debug("%s (failure #%d)", problem, self.failures)
        self.problem = problem

    def succeeded(self) -> None:
        """Note a write that committed: the database is healthy again."""
        if self._since is not None:
            log.warning(
                "the state database takes writes again after %.1fs (%d failed writes)",
                time.monotonic() - self._since,
                self.failures,
            )
        self.problem, self.failures, self._since = None, 0, None


@dataclass(slots=True)
class WriteRetry:
    """When a background write that failed may be tried again: ``base_s`` doubling per
    failure in a row up to ``cap_s``, jittered into the upper half of each step."""

    base_s: float = 0.5
    cap_s: float = 5.0
    failures: int = 0
    next_at: float = 0.0  # monotonic; 0: now
    rng: random.Random = field(default_factory=random.Random)

    def due(self, now: float) -> bool:
        """Whether to try now."""
        return now >= self.next_at

    def failed(self, now: float) -> None:
        """Count a failure; the next try waits longer."""
        self.failures += 1
        ceiling = min(self.cap_s, self.base_s * 2.0 ** (self.failures - 1))
        self.next_at = now + self.rng.uniform(ceiling / 2, ceiling)

    def succeeded(self) -> None:
        """A write committed: the next failure starts a new streak."""
        self.failures, self.next_at = 0, 0.0


def unavailable_when_unwritable(func: _F) -> _F:
    """``func`` (a grpclib handler function), answering UNAVAILABLE instead of INTERNAL
    when the state database cannot be written."""

    @functools.wraps(func)
    async def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return await func(*args, **kwargs)
        except StoreUnwritable as exc:
            raise GRPCError(Status.UNAVAILABLE, str(exc)) from exc

    return cast(_F, guarded)


async def _on_native_request(event: grpclib.events.RecvRequest) -> None:
    event.method_func = unavailable_when_unwritable(event.method_func)


def install(server: grpclib.server.Server) -> None:
    """Answer UNAVAILABLE on ``server`` (the native gRPC port) for calls whose write failed."""
    grpclib.events.listen(server, grpclib.events.RecvRequest, _on_native_request)
