"""The leader lease: which server of a database leads, and its epoch (schema 8, ``leases``).

Several servers may share one PostgreSQL database; exactly one leads: it runs the reconciler
and the autoscaler and sends agents their commands. The lease is a **row**, not an advisory
lock. An advisory lock lives as long as its session, so a leader that is stopped (SIGSTOP,
a VM paused, a process stuck in I/O) keeps its connection and so its lock for ever: no one
could take over while it is frozen, and when it wakes it would still hold it. A row with an
expiry by the database's clock is lost by a frozen holder after its time to live, whatever
its connection does, and a woken holder learns from its own monotonic clock that its term
ran out before it asks the database (``llmgw.server.leadership``).

The row's ``epoch`` grows by one with every new holder and is never lowered: a leader's
commands carry it, agents refuse older ones (``ControlMessage.leader_epoch``), and the
leader's writes of its decisions check it in their own transaction (:func:`fence_sql`), so
a deposed leader's writes never commit after a successor has taken the row (on PostgreSQL
the check's row lock makes a concurrent takeover wait for the write, or the write fail).

One claim is one statement (an insert-or-update guarded by "mine, or expired"), atomic on
PostgreSQL's row lock. SQLite has one server per file (``statelock``): it takes the lease
outright at start (:func:`take_lease`), which still moves the epoch on.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.server.state.storebackend import Backend

LEASE = "leader"

_FENCE_SQL = "SELECT epoch FROM leases WHERE name = 'leader' AND holder = ? AND epoch = ?"


def fence_sql(db: Backend) -> str:
    """Reads the lease row only while ``holder`` still holds it at ``epoch``, locking it on
    PostgreSQL (``FOR UPDATE``: a takeover waits for the write's commit): inside a write's
    transaction, no row means the writer was deposed (``Store`` then rolls back). A read,
    not a write: it changes nothing a full disk could refuse, nor the store's count of
    changes."""
    return _FENCE_SQL + db.lock_rows_sql


_COLUMNS = "holder, server_id, address, epoch, expires_at"


@dataclass(frozen=True, slots=True)
class LeaseView:
    """The lease row as read now: who holds it, where, at which epoch, for how long."""

    holder: str  # the holding process ("" when no server ever led)
    server_id: str
    address: str
    epoch: int
    remaining_ms: int  # until it expires by the database's clock (<= 0: expired or released)

    def held_by(self, holder: str) -> bool:
        return self.holder == holder and self.remaining_ms > 0


NO_LEASE = LeaseView("", "", "", 0, 0)


def _claim_sql(now: str, forced: bool) -> str:
    """Insert the row at epoch 1, or update it: a renewal keeps the epoch, a takeover (and
    every forced take) moves it on; unforced, only while it is the claimant's or expired."""
    epoch = (
        "leases.epoch + 1"
        if forced
        else "CASE WHEN leases.holder = excluded.holder THEN leases.epoch ELSE leases.epoch + 1 END"
    )
    guard = "" if forced else f" WHERE leases.holder = excluded.holder OR leases.expires_at < {now}"
    return (
        f"INSERT INTO leases (name, {_COLUMNS}) VALUES ('leader', ?, ?, ?, 1, {now} + ?)"
        " ON CONFLICT (name) DO UPDATE SET holder = excluded.holder,"
        " server_id = excluded.server_id, address = excluded.address,"
        f" epoch = {epoch}, expires_at = excluded.expires_at{guard}"
    )


async def claim_lease(
    db: Backend, holder: str, server_id: str, address: str, ttl_ms: int
) -> LeaseView:
    """Take or renew the lease for ``ttl_ms`` when it is ``holder``'s or has expired (one
    statement, committed on its own); the row as it then stands, whoever holds it."""
    async with db.transaction():
        await db.execute(
            _claim_sql(db.now_ms_sql, forced=False), (holder, server_id, address, ttl_ms)
        )
    return await read_lease(db)


async def take_lease(
    db: Backend, holder: str, server_id: str, address: str, ttl_ms: int
) -> LeaseView:
    """Take the lease whoever holds it (SQLite: the file's lock already makes this server
    the only one); the epoch moves on. Run inside a write of the store."""
    await db.execute(_claim_sql(db.now_ms_sql, forced=True), (holder, server_id, address, ttl_ms))
    return await read_lease(db)


async def read_lease(db: Backend) -> LeaseView:
    """The lease row now (:data:`NO_LEASE` while no server ever led)."""
    rows = await db.fetch(
        f"SELECT {_COLUMNS}, expires_at - {db.now_ms_sql} FROM leases WHERE name = 'leader'"
    )
    if not rows:
        return NO_LEASE
    holder, server_id, address, epoch, _, remaining = rows[0]
    return LeaseView(str(holder), str(server_id), str(address), int(epoch), int(remaining))


async def release_lease(db: Backend, holder: str) -> bool:
    """Give the lease up now (a clean stop), keeping its epoch, so a follower takes over
    without waiting for it to expire; False when ``holder`` did not hold it."""
    async with db.transaction():
        changed = await db.execute(
            "UPDATE leases SET expires_at = 0 WHERE name = 'leader' AND holder = ?", (holder,)
        )
    return changed > 0
