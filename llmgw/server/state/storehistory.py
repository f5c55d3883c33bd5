"""The store's tables of history: the event history and the profile revisions of
deployments (schema 7, ``llmgw.server.state.storeschema``; what they hold and why:
``llmgw.server.state.history``). ``HistoryRows`` is a part of
:class:`~llmgw.server.state.store.Store`: its writes go through the store's ``health``
like every other write (one at a time, StoreUnwritable on a full or read-only disk).
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.server.state.storebackend import Backend
from llmgw.server.state.storehealth import WriteHealth
from llmgw.server.state.storeschema import EventRecord, RevisionRecord, audit_warning, upsert

__all__ = ["REVISIONS_KEPT", "HistoryRows", "put_revisions"]

REVISIONS_KEPT = 20
"""Profile revisions kept per deployment (the newest); older ones are pruned as new come."""


_REVISION_COLUMNS = (
    "deployment", "revision", "profile", "fingerprint", "content", "at", "actor", "cause"
)  # fmt: skip


async def put_revisions(db: Backend, revisions: Sequence[RevisionRecord]) -> None:
    """Insert revisions and drop those beyond the newest ``REVISIONS_KEPT`` of their
    deployment (inside the caller's transaction)."""
    await db.executemany(
        upsert("revisions", _REVISION_COLUMNS, keys=2),
        [
            (r.deployment, r.revision, r.profile, r.fingerprint, r.content, r.at_ms, r.actor,
             r.cause)
            for r in revisions
        ],
    )  # fmt: skip
    await db.executemany(  # the newest REVISIONS_KEPT of each deployment stay
        "DELETE FROM revisions WHERE deployment = ? AND revision <= ?",
        [(r.deployment, r.revision - REVISIONS_KEPT) for r in revisions],
    )


class HistoryRows:
    """The event history and the revisions, read and written on the store's connection."""

    health: WriteHealth

    @property
    def _db(self) -> Backend:
        raise NotImplementedError  # the store's

    async def load_revisions(self, deployment: str | None = None) -> list[RevisionRecord]:
        """The stored profile revisions (of one deployment, or all), by deployment and number."""
        query = (
            "SELECT deployment, revision, profile, fingerprint, content, at, actor, cause"
            " FROM revisions" + (" WHERE deployment = ?" if deployment is not None else "")
        )
        params = (deployment,) if deployment is not None else ()
        rows = await self._db.fetch(query + " ORDER BY deployment, revision", params)
        return [
            RevisionRecord(r[0], int(r[1]), r[2], r[3], bytes(r[4]), int(r[5]), r[6], r[7])
            for r in rows
        ]

    async def append_events(self, records: Sequence[EventRecord], *, keep: int) -> None:
        """Append events and drop the oldest beyond the newest ``keep``, in one transaction
        (a write through ``health``, as every write of the store)."""
        if not records:
            return
        db = self._db
        async with self.health.writing(db.changes), db.transaction():
            await db.executemany(
                "INSERT INTO events (at, object, actor, reason, message, warning)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                [(e.at_ms, e.object, e.actor, e.reason, e.message, int(e.warning))
                 for e in records],
            )  # fmt: skip
            await db.execute(
                "DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?", (keep,)
            )

    async def events_of(self, objects: Sequence[str], limit: int) -> list[EventRecord]:
        """The newest ``limit`` events and audit records about ``objects``, oldest first
        (an audit record as an event: its action the reason, its result the message)."""
        if not objects:
            return []
        marks = ",".join("?" * len(objects))
        query = (
            f"SELECT at, target, actor, action, result, -1, id FROM audit WHERE target IN ({marks})"
            " UNION ALL SELECT at, object, actor, reason, message, warning, id FROM events"
            f" WHERE object IN ({marks}) ORDER BY 1 DESC, 7 DESC LIMIT ?"
        )
        rows = await self._db.fetch(query, (*objects, *objects, limit))
        return [
            EventRecord(int(at), obj, actor, reason, message,
                        bool(warn) if warn >= 0 else audit_warning(reason, message))
            for at, obj, actor, reason, message, warn, _ in reversed(rows)
        ]  # fmt: skip

    async def count_events(self) -> int:
        """How many rows the event history holds."""
        rows = await self._db.fetch("SELECT COUNT(*) FROM events")
        return int(rows[0][0]) if rows else 0
