"""Reconnect with jittered, capped exponential backoff, as an async iterator.

::

    retry = Backoff(BackoffPolicy(base_s=0.5, cap_s=15.0))
    async for attempt in retry:
        try:
            await session()
        except ConnectionError as exc:
            retry.failed(exc)
        else:
            retry.succeeded()

The first failure of a streak is logged at WARNING and the rest at DEBUG (but one a minute
at WARNING again, so a long streak stays visible), so a server that is down for an hour
costs a few dozen warnings, not thousands. A failure may carry the server's own hint of when
to come back (``retry_after_s``): the next attempt then waits that long (with jitter) instead
of the exponential delay. The iterator never ends by itself: the caller decides when to stop
(it is cancelled on shutdown).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

REMIND_S = 60.0
"""During a streak of failures, a WARNING at most this often (the rest are DEBUG)."""


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """Delays before reconnecting: ``base_s`` doubling up to ``cap_s``, full jitter."""

    base_s: float = 0.5
    cap_s: float = 15.0
    factor: float = 2.0

    def delay(self, failures: int, rng: random.Random) -> float:
        """The sleep before the next attempt after ``failures`` consecutive failures."""
        if failures <= 0:
            return 0.0
        ceiling = min(self.cap_s, self.base_s * self.factor ** (failures - 1))
        return rng.uniform(ceiling / 2, ceiling)


class Backoff:
    """Yields attempt numbers, sleeping between failures as the policy says."""

    def __init__(self, policy: BackoffPolicy, *, what: str = "server", seed: int | None = None):
        self.policy = policy
        self.what = what
        self.failures = 0
        self.attempts = 0
        self._rng = random.Random(seed)
        self._hint_s: float | None = None  # the server's retry hint for the next attempt
        self._warned_at: float | None = None  # monotonic time of the streak's last WARNING

    def __aiter__(self) -> AsyncIterator[int]:
        return self._attempts()

    async def _attempts(self) -> AsyncIterator[int]:
        while True:
            await asyncio.sleep(self.next_delay())
            self.attempts += 1
            yield self.attempts

    def next_delay(self) -> float:
        """The sleep before the next attempt: the server's hint if it gave one, else the
        policy's delay for the failures so far."""
        hint, self._hint_s = self._hint_s, None
        if hint is not None and self.failures:
            return self._rng.uniform(hint, hint * 1.25)
        return self.policy.delay(self.failures, self._rng)

    def failed(self, exc: BaseException | str, *, retry_after_s: float | None = None) -> None:
        """Count a failure: the next attempt waits longer, or ``retry_after_s`` (the server's
        hint) when given."""
        self.failures += 1
        self._hint_s = retry_after_s if retry_after_s is not None and retry_after_s > 0 else None
        now = time.monotonic()
        remind = self._warned_at is None or now - self._warned_at >= REMIND_S
        level = logging.WARNING if self.failures == 1 or remind else logging.DEBUG
        if level == logging.WARNING:
            self._warned_at = now
        log.log(level, "%s: %s; retrying with backoff (failure #%d)", self.what, exc, self.failures)

    def succeeded(self) -> None:
        """A session worked: the next failure starts a new streak."""
        if self.failures:
            log.info("%s reachable again after %d failures", self.what, self.failures)
        self.failures = 0
        self._warned_at = None
