"""Requests in flight per replica, counted at decision time.

The caller acquires right after a policy chooses a replica and releases when the upstream
request ends (success, failure or client gone), so a burst of decisions sees the load that
the earlier decisions of the same burst added, and spreads.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class LoadTracker:
    """In-flight request counts per replica id (absent = 0)."""

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}

    def acquire(self, replica_id: str) -> None:
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1

    def release(self, replica_id: str) -> None:
        """Undo one `acquire`; a release without an acquire is logged and ignored."""
        count = self._in_flight.get(replica_id, 0)
        if count <= 0:
            logger.warning("release without acquire for replica %s", replica_id)
        elif count == 1:
            del self._in_flight[replica_id]
        else:
            self._in_flight[replica_id] = count - 1

    def in_flight(self, replica_id: str) -> int:
        return self._in_flight.get(replica_id, 0)

    def snapshot(self) -> dict[str, int]:
        """A copy of the non-zero counts."""
        return dict(self._in_flight)
