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

The first failure of a streak is logged at WARNING and the rest at DEBUG, so a server that
is down for an hour costs one warning, not thousands. The iterator never ends by itself:
the caller decides when to stop (it is cancelled on shutdown).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

log = logging.getLogger(__name__)


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

    def __aiter__(self) -> AsyncIterator[int]:
        return self._attempts()

    async def _attempts(self) -> AsyncIterator[int]:
        while True:
            await asyncio.sleep(self.policy.delay(self.failures, self._rng))
            self.attempts += 1
            yield self.attempts

    def failed(self, exc: BaseException | str) -> None:
        """Count a failure: the next attempt waits longer."""
        self.failures += 1
        level = logging.WARNING if self.failures == 1 else logging.DEBUG
        log.log(level, "%s: %s; retrying with backoff (failure #%d)", self.what, exc, self.failures)

    def succeeded(self) -> None:
        """A session worked: the next failure starts a new streak."""
        if self.failures:
            log.info("%s reachable again after %d failures", self.what, self.failures)
        self.failures = 0
