"""Fan-out of cluster changes to Watch streams: one snapshot, then deltas, forever.

Every change gets the next revision number. Each watcher has a bounded queue; a watcher
that falls behind (its queue full) loses the queued deltas and is sent a fresh snapshot
instead, so a slow console never makes the server's memory grow without bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable

from llmgw.api.llmgw.v1 import Cluster, WatchEvent

log = logging.getLogger(__name__)

DEFAULT_QUEUE = 4096


class _Watcher:
    """One subscriber's pending deltas, and whether it owes a snapshot."""

    __slots__ = ("pending", "resync", "wakeup")

    def __init__(self) -> None:
        self.pending: deque[WatchEvent] = deque()
        self.resync = True
        self.wakeup = asyncio.Event()


class WatchHub:
    """Publishes revisioned deltas to every watcher."""

    def __init__(self, snapshot: Callable[[int], Cluster], *, max_queue: int = DEFAULT_QUEUE):
        self._snapshot = snapshot
        self._max_queue = max_queue
        self._watchers: set[_Watcher] = set()
        self.revision = 0
        self.resyncs = 0

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    def publish(self, event: WatchEvent) -> None:
        """Stamp ``event`` with the next revision and queue it for every watcher."""
        self.revision += 1
        event.revision = self.revision
        for watcher in self._watchers:
            if watcher.resync:
                continue
            if len(watcher.pending) >= self._max_queue:
                watcher.pending.clear()
                watcher.resync = True
                self.resyncs += 1
                log.info("a watcher fell %d events behind; sending a snapshot", self._max_queue)
            else:
                watcher.pending.append(event)
            watcher.wakeup.set()

    async def subscribe(self) -> AsyncIterator[WatchEvent]:
        """Yield a snapshot, then every later delta (or a new snapshot after falling behind)."""
        watcher = _Watcher()
        self._watchers.add(watcher)
        try:
            while True:
                if watcher.resync:
                    watcher.resync = False
                    yield WatchEvent(revision=self.revision, snapshot=self._snapshot(self.revision))
                    continue
                if not watcher.pending:
                    watcher.wakeup.clear()
                    await watcher.wakeup.wait()
                    continue
                yield watcher.pending.popleft()
        finally:
            self._watchers.discard(watcher)
