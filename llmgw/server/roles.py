"""Turns of a server as the leader and as a follower, as its lease gives them
(``llmgw.server.state.leadership``).

``take_turns`` runs one turn at a time until the server stops: a term as the leader while
the lease is this server's, ended the moment it runs out (by the server's own clock, no
claim needed), and a turn as a follower while it is not, ended the moment the lease is won.
What a turn serves is the caller's (``llmgw.server.app``: every port, the plane loaded
afresh, the reconciler; or the follower's refusals). The first turn's error (a ConfigError,
a StoreError: the start) ends the server as it is; a later turn's StoreError (the database
gone while a turn began or ended, or ``Deposed``: a write after the lease ran out) is
logged and the next turn begins, so a database outage never ends a server.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable

from llmgw.server.errors import Deposed, StoreError
from llmgw.server.state.leadership import Leadership

log = logging.getLogger(__name__)

RETRY_TURN_S = 0.5  # the pause after a turn the database ended

Turn = Callable[[asyncio.Event], Awaitable[None]]
"""A turn: serve until the event is set."""


async def take_turns(
    leadership: Leadership, stop: asyncio.Event, *, lead: Turn, follow: Turn, first_claim_s: float
) -> None:
    """Lead or follow, turn after turn, until ``stop``; the lease's keeper runs meanwhile
    (on PostgreSQL; the sole server of an SQLite file leads for good)."""
    helpers: list[asyncio.Task[None]] = []
    first = True
    try:
        if not leadership.leading():
            helpers.append(asyncio.create_task(leadership.keep()))
            await first_of(leadership.wait_until(True), stop, first_claim_s)
        while not stop.is_set():
            over = asyncio.Event()
            leading = leadership.leading()
            watch = (
                _watch_term(leadership, stop, over)
                if leading
                else _watch_follow(leadership, stop, over)
            )
            watcher = asyncio.create_task(watch)
            try:
                await (lead if leading else follow)(over)
            except (StoreError, ExceptionGroup) as exc:  # a term's tasks raise in a group
                failed = store_failure(exc)
                if failed is None or (first and not isinstance(failed, Deposed)):
                    raise
                log.warning("this turn ended: %s; the next begins", failed)
                await first_of(asyncio.sleep(RETRY_TURN_S), stop, RETRY_TURN_S)
            finally:
                watcher.cancel()
            first = False
    finally:
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)


def store_failure(exc: BaseException) -> StoreError | None:
    """The StoreError that ended a turn (alone, or every one of a group's), else None."""
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        found = [store_failure(e) for e in exc.exceptions]
        return found[0] if found and all(found) else None
    return None


async def first_of(waiting: Awaitable[None], stop: asyncio.Event, timeout_s: float) -> None:
    """Wait for ``waiting``, ``stop`` or ``timeout_s``, whichever comes first."""
    tasks = [asyncio.ensure_future(waiting), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def _watch_term(leadership: Leadership, stop: asyncio.Event, over: asyncio.Event) -> None:
    """End the leader's term the moment its lease runs out (or the server stops)."""
    await first_of(leadership.wait_until(False), stop, math.inf)
    if not stop.is_set():
        log.warning("the leader lease ran out: this server stops acting now")
    over.set()


async def _watch_follow(leadership: Leadership, stop: asyncio.Event, over: asyncio.Event) -> None:
    """End a follower's turn the moment the lease is won (or the server stops)."""
    await first_of(leadership.wait_until(True), stop, math.inf)
    over.set()
