"""The control server's durable state: SQLite through aiosqlite.

What is kept: every node ever seen (its last registration, whether it is cordoned, when it
was first and last seen), the audit log of operator actions, and the desired state: engine
profiles and deployments, each as its serialized message; and the replicas the reconciler
decided on (``ReplicaRecord``, as JSON: ``llmgw.server.state.replicajson``; RETIRED ones
are kept, so their shards stay fenced); and the operator requests still to carry out on
replicas (``retire``: drained by an operator; ``replace``: moved off a drained node); and
the tokens of ``llmgw.server.wire.auth`` (their SHA-256 only, never the tokens).

Schema versions (``PRAGMA user_version``): the tables of each, the migrations between
them and the rows read from them are in ``llmgw.server.state.storeschema``.
Opening an older file migrates it forward step by step in one transaction; a newer one is
refused. Beside the versioned schema, the ``llmgw_meta`` table holds the database's
identity (its cluster id: ``llmgw.server.state.statefile``, which also says which files are
refused and how a new one is made).

Secrets at rest: the file holds engine API keys and profile environments, so its directory
is 0700 and the file, its ``-wal`` and ``-shm`` 0600 (``llmgw.statefiles``); looser modes
found on open are tightened, and said so in the log.

Durability: WAL with ``synchronous=FULL``, so a write that returned survives a kill -9 of
the server at any later moment. Heartbeat times are written in batches (they are advisory:
a restarted server waits for agents to reconnect anyway); registrations, cordons, audit
records, applied profiles and deployments and replica requests are written before the RPC
that caused them answers (an apply's profiles and deployment in one transaction, a drain's
lowered count and its retire request in one); replica records are
written, one round's in one transaction, before any command of that round is sent.

The event history and the profile revisions are read and written by ``HistoryRows``
(``llmgw.server.state.storehistory``), which ``Store`` is.

Writes run one at a time through ``Store.health`` (``llmgw.server.state.storehealth``): one that
sqlite refuses because the disk is full or read-only (or an I/O error) is rolled back and
raises StoreUnwritable, and ``health`` says so until a write commits again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Concatenate, ParamSpec, TypeVar

import aiosqlite

from llmgw.server.core.reconcile_state import ReplicaRecord
from llmgw.server.errors import StoreError
from llmgw.server.state.replicajson import decode_replica, encode_replica
from llmgw.server.state.statefile import (
    check_llmgw_tables,
    ensure_cluster_id,
    new_cluster_id,
    refuse_foreign_file,
    unreadable_row,
)
from llmgw.server.state.storehealth import WriteHealth
from llmgw.server.state.storehistory import HistoryRows, put_revisions
from llmgw.server.state.storeschema import (
    COLUMNS_6,
    MIGRATIONS,
    REQUEST_KINDS,
    SCHEMA_VERSION,
    AuditRecord,
    RevisionRecord,
    StoredDeployment,
    StoredNode,
    StoredProfile,
    add_columns,
)
from llmgw.server.state.tokens import Role, StoredToken
from llmgw.statefiles import owner_only_umask, private_dir, private_files, sidecars

log = logging.getLogger(__name__)


def now_ms() -> int:
    """Wall-clock Unix milliseconds, for records people read (ages use time.monotonic)."""
    return time.time_ns() // 1_000_000


_P = ParamSpec("_P")
_T = TypeVar("_T")


def _write(
    method: Callable[Concatenate[Store, _P], Awaitable[_T]],
) -> Callable[Concatenate[Store, _P], Awaitable[_T]]:
    """A write of the store, through ``Store.health`` (``llmgw.server.state.storehealth``): one
    at a time, rolled back on failure, StoreUnwritable when the disk is full or read-only."""

    @functools.wraps(method)
    async def write(store: Store, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        async with store.health.writing(store._rollback, store._changes):
            return await method(store, *args, **kwargs)

    return write


class Store(HistoryRows):
    """The SQLite file behind the control server. Use as an async context manager.

    Every write goes through ``health`` (``llmgw.server.state.storehealth.WriteHealth``): a disk
    that is full or read-only raises StoreUnwritable and shows in ``health.problem``.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._db: aiosqlite.Connection | None = None
        self.health = WriteHealth()
        self._cluster_id = ""

    async def __aenter__(self) -> Store:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def open(self) -> None:
        """Open (creating if needed) the database and bring its schema up to date.

        A file that is not an llmgw state database is refused before anything is written
        to it (``llmgw.server.state.statefile``); a missing one is created whole.
        """
        try:
            private_dir(self._path.parent)
            with owner_only_umask():  # the file and its -wal/-shm are 0600 from the start
                if not self._path.exists():
                    await self._create()
                refuse_foreign_file(self._path)  # before anything touches a foreign file
                private_files(sidecars(self._path))
                self._db = await aiosqlite.connect(self._path)
                await check_llmgw_tables(self._db, self._path, newest=SCHEMA_VERSION)
                await self._prepare(self._db)
            private_files(sidecars(self._path))  # those made before (or by the lock) too
        except (OSError, aiosqlite.Error) as exc:
            await self.close()
            raise StoreError(f"cannot open the state database {self._path}: {exc}") from exc
        except BaseException:
            await self.close()
            raise

    async def _prepare(self, db: aiosqlite.Connection) -> None:
        await self._migrate(db)  # first: a newer file is refused before anything is written
        await db.execute("PRAGMA journal_mode=WAL")
        await db.execute("PRAGMA synchronous=FULL")
        self._cluster_id = await ensure_cluster_id(db, self._path, created_ms=now_ms())

    # --- identity (llmgw.server.state.statefile) ------------------------------------------------

    @property
    def path(self) -> Path:
        """The database file."""
        return self._path

    @property
    def cluster_id(self) -> str:
        """The cluster id stored in the database (known once it is open)."""
        if not self._cluster_id:
            raise StoreError("the state database is not open")
        return self._cluster_id

    async def _create(self) -> None:
        """Build a new database under a temporary name beside the path, then link it into
        place: a start cut short leaves no half-made file at the path. Another process
        that created it first wins; its file is used."""
        temp = self._path.with_name(f".{self._path.name}.new-{os.getpid()}-{new_cluster_id()[:8]}")
        try:
            os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            db = await aiosqlite.connect(temp)
            try:
                await self._prepare(db)
            finally:
                await db.close()
            with contextlib.suppress(FileExistsError):
                os.link(temp, self._path)
            _sync_directory(self._path.parent)
        finally:
            for leftover in (temp, Path(f"{temp}-wal"), Path(f"{temp}-shm")):
                leftover.unlink(missing_ok=True)
        log.info("%s: a new state database (cluster %s)", self._path, self._cluster_id)
        self._cluster_id = ""

    async def _migrate(self, db: aiosqlite.Connection) -> None:
        async with db.execute("PRAGMA user_version") as cursor:
            row = await cursor.fetchone()
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self._path} has schema version {version}; this llmgw knows up to "
                f"{SCHEMA_VERSION}: use a newer llmgw or another --db"
            )
        if version == SCHEMA_VERSION:
            return
        script = "".join(MIGRATIONS[v] for v in range(version + 1, SCHEMA_VERSION + 1))
        script += await add_columns(db, COLUMNS_6)
        # One transaction: a migration cut short leaves the file at its old version.
        await db.executescript(f"BEGIN;\n{script}\nPRAGMA user_version={SCHEMA_VERSION};\nCOMMIT;")
        if version:
            log.info(
                "%s: schema migrated from version %d to %d", self._path, version, SCHEMA_VERSION
            )

    async def close(self) -> None:
        """Close the database; safe to call twice."""
        if self._db is not None:
            db, self._db = self._db, None
            await db.close()

    async def _rollback(self) -> None:
        if self._db is not None:
            await self._db.rollback()

    def _changes(self) -> int:
        return self._db.total_changes if self._db is not None else 0

    async def probe_write(self) -> None:
        """Write the schema version again, unchanged: whether the file takes writes now."""
        async with self.health.writing(self._rollback):  # a page is written, no row changes
            async with self._conn.execute("PRAGMA user_version") as cursor:
                row = await cursor.fetchone()
            await self._conn.execute(f"PRAGMA user_version={int(row[0]) if row else 0}")

    @property
    def _conn(self) -> aiosqlite.Connection:
        if self._db is None:
            raise StoreError("the state database is not open")
        return self._db

    async def load_nodes(self) -> list[StoredNode]:
        """Every node ever seen, oldest first."""
        query = (
            "SELECT node_id, info, cordoned, first_seen, last_seen, ever_ready FROM nodes"
            " ORDER BY rowid"
        )
        async with self._conn.execute(query) as cursor:
            rows = await cursor.fetchall()
        return [
            StoredNode(r[0], bytes(r[1]), bool(r[2]), int(r[3]), int(r[4]), bool(r[5]))
            for r in rows
        ]

    @_write
    async def save_node(self, node: StoredNode) -> None:
        """Insert or replace a node's registration; keeps its first-seen time, its cordon
        and whether it was ever READY."""
        await self._conn.execute(
            "INSERT INTO nodes (node_id, info, cordoned, first_seen, last_seen, ever_ready)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(node_id) DO UPDATE SET"
            " info = excluded.info, last_seen = excluded.last_seen",
            (
                node.node_id,
                node.info,
                int(node.cordoned),
                node.first_seen_ms,
                node.last_seen_ms,
                int(node.ever_ready),
            ),
        )
        await self._conn.commit()

    @_write
    async def mark_ever_ready(self, node_id: str) -> None:
        """Record that a heartbeat came from a node (it is no longer pruned as never READY)."""
        await self._conn.execute("UPDATE nodes SET ever_ready = 1 WHERE node_id = ?", (node_id,))
        await self._conn.commit()

    @_write
    async def delete_node(self, node_id: str) -> bool:
        """Forget a node; False when there was none with that id."""
        async with self._conn.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,)) as cur:
            deleted = cur.rowcount > 0
        await self._conn.commit()
        return deleted

    @_write
    async def set_cordoned(self, node_id: str, cordoned: bool) -> None:
        """Record whether a node is cordoned."""
        await self._conn.execute(
            "UPDATE nodes SET cordoned = ? WHERE node_id = ?", (int(cordoned), node_id)
        )
        await self._conn.commit()

    @_write
    async def touch_nodes(self, seen: Iterable[tuple[str, int]]) -> None:
        """Record last-seen times (node id, Unix ms) in one transaction."""
        rows = [(at, node_id) for node_id, at in seen]
        if not rows:
            return
        await self._conn.executemany("UPDATE nodes SET last_seen = ? WHERE node_id = ?", rows)
        await self._conn.commit()

    @_write
    async def append_audit(self, record: AuditRecord) -> None:
        """Append one operator action to the audit log."""
        await self._conn.execute(
            "INSERT INTO audit (at, actor, action, target, result) VALUES (?, ?, ?, ?, ?)",
            (record.at_ms, record.actor, record.action, record.target, record.result),
        )
        await self._conn.commit()

    @_write
    async def append_audits(self, records: Iterable[AuditRecord]) -> None:
        """Append audit records in one transaction."""
        rows = [(r.at_ms, r.actor, r.action, r.target, r.result) for r in records]
        if not rows:
            return
        await self._conn.executemany(
            "INSERT INTO audit (at, actor, action, target, result) VALUES (?, ?, ?, ?, ?)", rows
        )
        await self._conn.commit()

    async def recent_audit(self, limit: int = 100) -> list[AuditRecord]:
        """The newest ``limit`` audit records, oldest first."""
        query = "SELECT at, actor, action, target, result FROM audit ORDER BY id DESC LIMIT ?"
        async with self._conn.execute(query, (limit,)) as cursor:
            rows = await cursor.fetchall()
        return [AuditRecord(int(r[0]), r[1], r[2], r[3], r[4]) for r in reversed(list(rows))]

    # --- tokens ---------------------------------------------------------------------

    @_write
    async def add_token(
        self, role: Role, token_hash: str, note: str = "", nodes: Iterable[str] = ()
    ) -> int:
        """Store a token's hash with its role (and the node ids it is bound to); its id."""
        async with self._conn.execute(
            "INSERT INTO tokens (role, hash, created, note, nodes) VALUES (?, ?, ?, ?, ?)",
            (role.value, token_hash, now_ms(), note, ",".join(sorted(set(nodes)))),
        ) as cursor:
            token_id = cursor.lastrowid
        await self._conn.commit()
        if token_id is None:
            raise StoreError("the token was not stored")
        return int(token_id)

    async def load_tokens(self) -> list[StoredToken]:
        """Every stored token, by id; a row with an unknown role is a StoreError naming it
        (skipped, it could leave no token and so turn authentication off)."""
        query = "SELECT id, role, hash, created, note, nodes FROM tokens ORDER BY id"
        async with self._conn.execute(query) as cursor:
            rows = await cursor.fetchall()
        tokens = []
        for token_id, role, digest, created, note, nodes in rows:
            bound = frozenset(filter(None, str(nodes).split(",")))
            try:
                tokens.append(
                    StoredToken(
                        int(token_id), Role(role), str(digest), int(created), str(note), bound
                    )
                )
            except ValueError as exc:
                raise unreadable_row(self._path, "tokens", str(token_id), exc) from exc
        return tokens

    @_write
    async def delete_token(self, token_id: int) -> bool:
        """Forget a token; False when there was none with that id."""
        async with self._conn.execute("DELETE FROM tokens WHERE id = ?", (token_id,)) as cur:
            deleted = cur.rowcount > 0
        await self._conn.commit()
        return deleted

    # --- desired state ---------------------------------------------------------------

    @_write
    async def save_desired(
        self,
        profiles: Iterable[StoredProfile],
        deployments: Iterable[StoredDeployment],
        requests: Iterable[tuple[str, str]] = (),
        revisions: Sequence[RevisionRecord] = (),
    ) -> None:
        """Insert or replace profiles, deployments, replica requests (``(replica_id,
        kind)``) and profile revisions, all in one transaction."""
        db = self._conn
        try:
            await self._put_requests(db, requests)
            await put_revisions(db, revisions)
            await db.executemany(
                "INSERT OR REPLACE INTO profiles (name, profile, fingerprint, updated)"
                " VALUES (?, ?, ?, ?)",
                [(p.name, p.profile, p.fingerprint, p.updated_ms) for p in profiles],
            )
            await db.executemany(
                "INSERT OR REPLACE INTO deployments (name, deployment, updated) VALUES (?, ?, ?)",
                [(d.name, d.deployment, d.updated_ms) for d in deployments],
            )
            await db.commit()
        except BaseException:
            await db.rollback()
            raise

    @staticmethod
    async def _put_requests(db: aiosqlite.Connection, requests: Iterable[tuple[str, str]]) -> None:
        rows = [(replica_id, kind, now_ms()) for replica_id, kind in requests]
        for _, kind, _ in rows:
            if kind not in REQUEST_KINDS:
                raise ValueError(f"unknown replica request kind {kind!r}")
        await db.executemany(
            "INSERT OR REPLACE INTO replica_requests (replica_id, kind, at) VALUES (?, ?, ?)", rows
        )

    @_write
    async def save_requests(self, requests: Iterable[tuple[str, str]]) -> None:
        """Insert or replace replica requests (``(replica_id, kind)``) in one transaction."""
        db = self._conn
        try:
            await self._put_requests(db, requests)
            await db.commit()
        except BaseException:
            await db.rollback()
            raise

    @_write
    async def forget_requests(self, replica_ids: Iterable[str]) -> None:
        """Drop the requests of these replicas (carried out, or moot)."""
        rows = [(replica_id,) for replica_id in replica_ids]
        if rows:
            await self._conn.executemany("DELETE FROM replica_requests WHERE replica_id = ?", rows)
            await self._conn.commit()

    async def load_requests(self) -> list[tuple[str, str]]:
        """Every stored replica request as ``(replica_id, kind)``, by id; a kind this llmgw
        does not know is a StoreError naming the row."""
        query = "SELECT replica_id, kind FROM replica_requests ORDER BY replica_id"
        async with self._conn.execute(query) as cursor:
            rows = await cursor.fetchall()
        for replica_id, kind in rows:
            if kind not in REQUEST_KINDS:
                why = f"unknown request kind {str(kind)[:64]!r}"
                raise unreadable_row(self._path, "replica_requests", str(replica_id), why)
        return [(str(r[0]), str(r[1])) for r in rows]

    @_write
    async def delete_deployment(self, name: str) -> bool:
        """Forget a deployment and its revisions; False when there was none by that name."""
        async with self._conn.execute("DELETE FROM deployments WHERE name = ?", (name,)) as cur:
            deleted = cur.rowcount > 0
        await self._conn.execute("DELETE FROM revisions WHERE deployment = ?", (name,))
        await self._conn.commit()
        return deleted

    async def load_profiles(self) -> list[StoredProfile]:
        """Every stored profile, by name."""
        query = "SELECT name, profile, fingerprint, updated FROM profiles ORDER BY name"
        async with self._conn.execute(query) as cursor:
            rows = await cursor.fetchall()
        return [StoredProfile(r[0], bytes(r[1]), r[2], int(r[3])) for r in rows]

    async def load_deployments(self) -> list[StoredDeployment]:
        """Every stored deployment, by name."""
        query = "SELECT name, deployment, updated FROM deployments ORDER BY name"
        async with self._conn.execute(query) as cursor:
            rows = await cursor.fetchall()
        return [StoredDeployment(r[0], bytes(r[1]), int(r[2])) for r in rows]

    # --- replicas --------------------------------------------------------------------

    @_write
    async def save_replicas(self, records: Iterable[ReplicaRecord]) -> None:
        """Insert or replace replica records, all in one transaction."""
        at = now_ms()
        rows = [(r.replica_id, encode_replica(r), at) for r in records]
        if not rows:
            return
        db = self._conn
        try:
            await db.executemany(
                "INSERT OR REPLACE INTO replicas (replica_id, record, updated) VALUES (?, ?, ?)",
                rows,
            )
            await db.commit()
        except BaseException:
            await db.rollback()
            raise

    async def load_replicas(self) -> list[ReplicaRecord]:
        """Every stored replica record, by id; a row that cannot be read is a StoreError
        naming it (``llmgw.server.state.statefile.unreadable_row``)."""
        query = "SELECT replica_id, record FROM replicas ORDER BY replica_id"
        async with self._conn.execute(query) as cursor:
            rows = await cursor.fetchall()
        records = []
        for replica_id, text in rows:
            try:
                record = decode_replica(text)
            except Exception as exc:  # whatever the row holds, it is named, never dropped
                raise unreadable_row(self._path, "replicas", str(replica_id), exc) from exc
            if record.replica_id != replica_id:
                why = f"it holds the record of replica {record.replica_id!r}"
                raise unreadable_row(self._path, "replicas", str(replica_id), why)
            records.append(record)
        return records


def _sync_directory(folder: Path) -> None:
    """Make a new name in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
