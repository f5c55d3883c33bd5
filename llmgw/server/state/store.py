"""The control server's durable state, in SQLite or PostgreSQL.

What is kept: every node ever seen (its last registration, whether it is cordoned, when it
was first and last seen), the audit log of operator actions, and the desired state: engine
profiles and deployments, each as its serialized message; and the replicas the reconciler
decided on (``ReplicaRecord``, as JSON: ``llmgw.server.state.replicajson``; RETIRED ones
are kept, so their shards stay fenced); and the operator requests still to carry out on
replicas (``retire``: drained by an operator; ``replace``: moved off a drained node); and
the tokens of ``llmgw.server.wire.auth`` (their SHA-256 only, never the tokens); and the
tenants' gateway keys (``tenant_keys``: their SHA-256 only; a revoke marks the row).
Metered usage: ``add_usage`` adds a batch of per-hour deltas (``tenant_usage_hourly``, fenced),
``load_usage`` reads the hours from a time on.

Two backends behind one interface (``llmgw.server.state.storebackend``): ``--db PATH`` is
an SQLite file (``llmgw.server.state.storesqlite``: its modes, WAL, the temporary file a
new one is built in), ``--db postgresql://…`` a PostgreSQL database
(``llmgw.server.state.storepg``). The SQL here is written once, for both.

Schema versions (SQLite's ``PRAGMA user_version``, PostgreSQL's ``llmgw_meta`` row): the
tables of each, the migrations between them and the rows read from them are in
``llmgw.server.state.storeschema``. Opening an older database migrates it forward step by
step in one transaction; a newer one is refused. Beside the versioned schema, the
``llmgw_meta`` table holds the database's identity (its cluster id:
``llmgw.server.state.statefile``, which also says which databases are refused).

Secrets at rest: the database holds engine API keys and profile environments (an SQLite
file is owner-only: ``storesqlite``).

Durability: a write that returned survives a kill -9 of the server at any later moment
(SQLite: WAL with ``synchronous=FULL``; PostgreSQL: its commit). Heartbeat times are
written in batches (they are advisory: a restarted server waits for agents to reconnect
anyway); registrations, cordons, audit records, applied profiles and deployments and
replica requests are written before the RPC that caused them answers (an apply's profiles
and deployment in one transaction, a drain's lowered count and its retire request in one);
replica records are written, one round's in one transaction, before any command of that
round is sent.

The event history and the profile revisions are read and written by ``HistoryRows``
(``llmgw.server.state.storehistory``), which ``Store`` is.

Writes run one at a time through ``Store.health`` (``llmgw.server.state.storehealth``),
each in one transaction of its backend: one the database refuses because it cannot be
written now (a full or read-only disk, an I/O error, a PostgreSQL server gone) is rolled
back and raises StoreUnwritable, and ``health`` says so until a write commits again.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Concatenate, ParamSpec, TypeVar

from llmgw.server.core.reconcile_state import ReplicaRecord
from llmgw.server.errors import Deposed, StoreError
from llmgw.server.state.lease import LeaseView, fence_sql, take_lease
from llmgw.server.state.replicajson import decode_replica, encode_replica
from llmgw.server.state.statefile import ensure_cluster_id, unreadable_row
from llmgw.server.state.storebackend import Backend, DbTarget, PostgresUrl, parse_db
from llmgw.server.state.storehealth import WriteHealth
from llmgw.server.state.storehistory import HistoryRows, put_revisions
from llmgw.server.state.storepg import PgBackend, PgTimeouts
from llmgw.server.state.storeschema import (
    KEY_PRIORITIES,
    MIGRATIONS,
    REQUEST_KINDS,
    SCHEMA_VERSION,
    AuditRecord,
    RevisionRecord,
    StoredDeployment,
    StoredNode,
    StoredProfile,
    StoredTenantKey,
    upsert,
)
from llmgw.server.state.storesqlite import SqliteBackend
from llmgw.server.state.tokens import Role, StoredToken
from llmgw.server.state.usage import UsageCounts, UsageKey

log = logging.getLogger(__name__)


def now_ms() -> int:
    """Wall-clock Unix milliseconds, for records people read (ages use time.monotonic)."""
    return time.time_ns() // 1_000_000


_PG_TIMEOUTS = PgTimeouts()
_P = ParamSpec("_P")
_T = TypeVar("_T")


def _write(
    method: Callable[Concatenate[Store, _P], Awaitable[_T]],
) -> Callable[Concatenate[Store, _P], Awaitable[_T]]:
    """A write of the store, through ``Store.health`` (``llmgw.server.state.storehealth``): one
    at a time, in one transaction, rolled back on failure, StoreUnwritable when the database
    cannot be written now; Deposed (nothing written) once ``Store.fence`` names a lease this
    server no longer holds."""
    return _writing(method, fenced=True)


def _any_server_writes(
    method: Callable[Concatenate[Store, _P], Awaitable[_T]],
) -> Callable[Concatenate[Store, _P], Awaitable[_T]]:
    """A write as :func:`_write`, but of rows that are no leader's to keep (the tokens, which
    ``llmgw token`` and a follower's own gateway write): not fenced."""
    return _writing(method, fenced=False)


def _writing(
    method: Callable[Concatenate[Store, _P], Awaitable[_T]], *, fenced: bool
) -> Callable[Concatenate[Store, _P], Awaitable[_T]]:
    @functools.wraps(method)
    async def write(store: Store, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        db = store._db
        async with store.health.writing(db.changes), db.transaction():
            fence = store.fence if fenced else None
            if fence is not None and not await db.fetch(fence_sql(db), fence):
                held = f"holds the leader lease at epoch {fence[1]}" if fence[1] >= 0 else "leads"
                raise Deposed(f"{store.path_text}: this server no longer {held}: nothing written")
            return await method(store, *args, **kwargs)

    return write


_USAGE_NAMES = (
    "requests", "refused", "prompt_tokens", "cached_tokens", "completion_tokens", "gpu_ms",
)  # fmt: skip
_USAGE = ", ".join(_USAGE_NAMES)

_KEY_COLUMNS = (
    "key_id", "tenant", "digest", "models", "rpm", "tpm", "max_concurrency", "priority",
    "expires_ms", "created_ms", "note",
)  # fmt: skip


def _tenant_key(row: Sequence[object]) -> StoredTenantKey:
    """A ``tenant_keys`` row (``_KEY_COLUMNS``) as a key; ValueError saying what is wrong."""
    key_id, tenant, digest, models, rpm, tpm, concurrency, priority, expires, created, note = row
    raw = bytes.fromhex(str(digest))
    if len(raw) != 32:
        raise ValueError(f"a digest of {len(raw)} bytes, not a SHA-256")
    if priority not in KEY_PRIORITIES:
        raise ValueError(f"unknown priority {str(priority)[:64]!r}")
    return StoredTenantKey(
        key_id=str(key_id),
        tenant=str(tenant),
        digest=raw,
        models=tuple(filter(None, str(models).split(","))),
        rpm=int(str(rpm)),
        tpm=int(str(tpm)),
        max_concurrency=int(str(concurrency)),
        priority=str(priority),
        expires_ms=int(str(expires)),
        created_ms=int(str(created)),
        note=str(note),
    )


class Store(HistoryRows):
    """The database behind the control server: an SQLite file, or a PostgreSQL database
    (``db``: a path, a :class:`PostgresUrl`, or ``--db``'s text). Use as an async context
    manager.

    Every write goes through ``health`` (``llmgw.server.state.storehealth.WriteHealth``): a
    database that cannot be written now raises StoreUnwritable and shows in
    ``health.problem``.
    """

    def __init__(self, db: DbTarget | str, *, pg_timeouts: PgTimeouts = _PG_TIMEOUTS) -> None:
        target = parse_db(db) if isinstance(db, str) else db
        self._target = target
        self._backend: SqliteBackend | PgBackend = (
            PgBackend(target, self._prepare, pg_timeouts)
            if isinstance(target, PostgresUrl)
            else SqliteBackend(target, self._prepare)
        )
        self.health = WriteHealth()
        self._cluster_id = ""
        # (holder, epoch) of this server's leader lease while it leads: every write checks
        # it in its own transaction (llmgw.server.state.lease.fence_sql); None: unfenced
        self.fence: tuple[str, int] | None = None

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

        A database that is not an llmgw state database is refused before anything is
        written to it (``llmgw.server.state.statefile``, ``storepg``); a missing SQLite file
        is created whole.
        """
        await self._backend.open()

    async def _prepare(self, db: Backend) -> None:
        """Migrate (a newer schema is refused before anything is written), make the
        database durable, then read or make its cluster id."""
        await self._migrate(db)
        await db.durable()
        cluster_id, made = await ensure_cluster_id(db, self.path_text, created_ms=now_ms())
        if made:
            log.info("%s: a new state database (cluster %s)", self.path_text, cluster_id)
        self._cluster_id = cluster_id

    # --- identity (llmgw.server.state.statefile) ------------------------------------------------

    @property
    def path(self) -> Path | str:
        """The database: its file, or its URL with the password hidden (for messages)."""
        return self._target if isinstance(self._target, Path) else self.path_text

    @property
    def path_text(self) -> str:
        """The database in words: the file's path, or the URL with the password hidden."""
        return self._backend.where

    @property
    def backend(self) -> SqliteBackend | PgBackend:
        """The backend the database is opened through."""
        return self._backend

    @property
    def cluster_id(self) -> str:
        """The cluster id stored in the database (known once it is open)."""
        if not self._cluster_id:
            raise StoreError("the state database is not open")
        return self._cluster_id

    async def _migrate(self, db: Backend) -> None:
        version = await db.schema_version()
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path_text} has schema version {version}; this llmgw knows up to "
                f"{SCHEMA_VERSION}: use a newer llmgw or another --db"
            )
        if version == SCHEMA_VERSION:
            return
        await db.migrate(
            [MIGRATIONS[v] for v in range(version + 1, SCHEMA_VERSION + 1)], SCHEMA_VERSION
        )
        if version:
            log.info(
                "%s: schema migrated from version %d to %d", self.path_text, version, SCHEMA_VERSION
            )

    async def close(self) -> None:
        """Close the database; safe to call twice."""
        await self._backend.close()

    @property
    def _db(self) -> Backend:
        return self._backend

    async def probe_write(self) -> None:
        """A write that changes nothing (the schema version again): whether the database
        takes writes now."""
        async with self.health.writing():
            await self._backend.probe_write()

    async def load_nodes(self) -> list[StoredNode]:
        """Every node ever seen, oldest first."""
        query = (
            "SELECT node_id, info, cordoned, first_seen, last_seen, ever_ready FROM nodes"
            f" ORDER BY {self._backend.nodes_order}"
        )
        return [
            StoredNode(r[0], bytes(r[1]), bool(r[2]), int(r[3]), int(r[4]), bool(r[5]))
            for r in await self._db.fetch(query)
        ]

    @_write
    async def save_node(self, node: StoredNode) -> None:
        """Insert or replace a node's registration; keeps its first-seen time, its cordon
        and whether it was ever READY."""
        await self._db.execute(
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

    @_write
    async def mark_ever_ready(self, node_id: str) -> None:
        """Record that a heartbeat came from a node (it is no longer pruned as never READY)."""
        await self._db.execute("UPDATE nodes SET ever_ready = 1 WHERE node_id = ?", (node_id,))

    @_write
    async def delete_node(self, node_id: str) -> bool:
        """Forget a node; False when there was none with that id."""
        return await self._db.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,)) > 0

    @_write
    async def set_cordoned(self, node_id: str, cordoned: bool) -> None:
        """Record whether a node is cordoned."""
        await self._db.execute(
            "UPDATE nodes SET cordoned = ? WHERE node_id = ?", (int(cordoned), node_id)
        )

    @_write
    async def touch_nodes(self, seen: Iterable[tuple[str, int]]) -> None:
        """Record last-seen times (node id, Unix ms) in one transaction."""
        rows = [(at, node_id) for node_id, at in seen]
        await self._db.executemany("UPDATE nodes SET last_seen = ? WHERE node_id = ?", rows)

    @_write
    async def append_audit(self, record: AuditRecord) -> None:
        """Append one operator action to the audit log."""
        await self._db.execute(
            "INSERT INTO audit (at, actor, action, target, result) VALUES (?, ?, ?, ?, ?)",
            (record.at_ms, record.actor, record.action, record.target, record.result),
        )

    @_write
    async def append_audits(self, records: Iterable[AuditRecord]) -> None:
        """Append audit records in one transaction."""
        rows = [(r.at_ms, r.actor, r.action, r.target, r.result) for r in records]
        await self._db.executemany(
            "INSERT INTO audit (at, actor, action, target, result) VALUES (?, ?, ?, ?, ?)", rows
        )

    async def recent_audit(self, limit: int = 100) -> list[AuditRecord]:
        """The newest ``limit`` audit records, oldest first."""
        query = "SELECT at, actor, action, target, result FROM audit ORDER BY id DESC LIMIT ?"
        rows = await self._db.fetch(query, (limit,))
        return [AuditRecord(int(r[0]), r[1], r[2], r[3], r[4]) for r in reversed(rows)]

    # --- tokens ---------------------------------------------------------------------

    @_any_server_writes
    async def add_token(
        self, role: Role, token_hash: str, note: str = "", nodes: Iterable[str] = ()
    ) -> int:
        """Store a token's hash with its role (and the node ids it is bound to); its id."""
        rows = await self._db.fetch(
            "INSERT INTO tokens (role, hash, created, note, nodes) VALUES (?, ?, ?, ?, ?)"
            " RETURNING id",
            (role.value, token_hash, now_ms(), note, ",".join(sorted(set(nodes)))),
        )
        if not rows:
            raise StoreError("the token was not stored")
        return int(rows[0][0])

    async def load_tokens(self) -> list[StoredToken]:
        """Every stored token, by id; a row with an unknown role is a StoreError naming it
        (skipped, it could leave no token and so turn authentication off)."""
        query = "SELECT id, role, hash, created, note, nodes FROM tokens ORDER BY id"
        tokens = []
        for token_id, role, digest, created, note, nodes in await self._db.fetch(query):
            bound = frozenset(filter(None, str(nodes).split(",")))
            try:
                tokens.append(
                    StoredToken(
                        int(token_id), Role(role), str(digest), int(created), str(note), bound
                    )
                )
            except ValueError as exc:
                raise unreadable_row(self.path, "tokens", str(token_id), exc) from exc
        return tokens

    @_any_server_writes
    async def delete_token(self, token_id: int) -> bool:
        """Forget a token; False when there was none with that id."""
        return await self._db.execute("DELETE FROM tokens WHERE id = ?", (token_id,)) > 0

    # --- tenants' gateway keys (llmgw.server.state.tenantkeys) -------------------------

    @_write
    async def add_tenant_key(self, key: StoredTenantKey) -> None:
        """Store a new tenant key (its digest, never the key), live."""
        if key.priority not in KEY_PRIORITIES:
            raise ValueError(f"unknown key priority {key.priority!r}")
        await self._db.execute(
            f"INSERT INTO tenant_keys ({', '.join(_KEY_COLUMNS)})"
            f" VALUES ({', '.join('?' * len(_KEY_COLUMNS))})",
            (
                key.key_id, key.tenant, key.digest.hex(), ",".join(key.models), key.rpm,
                key.tpm, key.max_concurrency, key.priority, key.expires_ms, key.created_ms,
                key.note,
            ),
        )  # fmt: skip

    async def load_tenant_keys(self) -> list[StoredTenantKey]:
        """Every live (not revoked) tenant key, by creation; a row that cannot be read is a
        StoreError naming it (skipped, a key would stop working without a word)."""
        query = (
            f"SELECT {', '.join(_KEY_COLUMNS)} FROM tenant_keys"
            " WHERE revoked_ms IS NULL ORDER BY id"
        )
        keys = []
        for row in await self._db.fetch(query):
            try:
                keys.append(_tenant_key(row))
            except ValueError as exc:
                raise unreadable_row(self.path, "tenant_keys", str(row[0]), exc) from exc
        return keys

    @_write
    async def revoke_tenant_key(self, key_id: str) -> bool:
        """Mark a live key revoked (its row stays); False when no live key has that id."""
        return (
            await self._db.execute(
                "UPDATE tenant_keys SET revoked_ms = ? WHERE key_id = ? AND revoked_ms IS NULL",
                (now_ms(), key_id),
            )
            > 0
        )

    # --- metered usage (llmgw.server.state.usage) ---------------------------------------

    @_write
    async def add_usage(self, batch: Mapping[UsageKey, UsageCounts]) -> None:
        """Add a batch of per-hour deltas into ``tenant_usage_hourly``, in one transaction."""
        for key, c in batch.items():
            await self._db.execute(
                f"INSERT INTO tenant_usage_hourly (hour, tenant, key_id, model, {_USAGE})"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (hour, tenant, key_id, model) DO UPDATE SET "
                + ", ".join(f"{n} = tenant_usage_hourly.{n} + excluded.{n}" for n in _USAGE_NAMES),
                (*key, c.requests, c.refused, c.prompt_tokens, c.cached_tokens,
                 c.completion_tokens, c.gpu_ms),
            )  # fmt: skip

    async def load_usage(self, since_ms: int = 0) -> dict[UsageKey, UsageCounts]:
        """The stored rows of the hours from ``since_ms`` on."""
        rows = await self._db.fetch(
            f"SELECT hour, tenant, key_id, model, {_USAGE} FROM tenant_usage_hourly"
            " WHERE hour >= ? ORDER BY hour, tenant, key_id, model",
            (since_ms,),
        )
        return {
            (int(r[0]), str(r[1]), str(r[2]), str(r[3])): UsageCounts(*(int(v) for v in r[4:]))
            for r in rows
        }

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
        db = self._db
        await self._put_requests(db, requests)
        await put_revisions(db, revisions)
        await db.executemany(
            upsert("profiles", ("name", "profile", "fingerprint", "updated")),
            [(p.name, p.profile, p.fingerprint, p.updated_ms) for p in profiles],
        )
        await db.executemany(
            upsert("deployments", ("name", "deployment", "updated")),
            [(d.name, d.deployment, d.updated_ms) for d in deployments],
        )

    @staticmethod
    async def _put_requests(db: Backend, requests: Iterable[tuple[str, str]]) -> None:
        rows = [(replica_id, kind, now_ms()) for replica_id, kind in requests]
        for _, kind, _ in rows:
            if kind not in REQUEST_KINDS:
                raise ValueError(f"unknown replica request kind {kind!r}")
        await db.executemany(upsert("replica_requests", ("replica_id", "kind", "at")), rows)

    @_write
    async def save_requests(self, requests: Iterable[tuple[str, str]]) -> None:
        """Insert or replace replica requests (``(replica_id, kind)``) in one transaction."""
        await self._put_requests(self._db, requests)

    @_write
    async def forget_requests(self, replica_ids: Iterable[str]) -> None:
        """Drop the requests of these replicas (carried out, or moot)."""
        rows = [(replica_id,) for replica_id in replica_ids]
        await self._db.executemany("DELETE FROM replica_requests WHERE replica_id = ?", rows)

    async def load_requests(self) -> list[tuple[str, str]]:
        """Every stored replica request as ``(replica_id, kind)``, by id; a kind this llmgw
        does not know is a StoreError naming the row."""
        query = "SELECT replica_id, kind FROM replica_requests ORDER BY replica_id"
        rows = await self._db.fetch(query)
        for replica_id, kind in rows:
            if kind not in REQUEST_KINDS:
                why = f"unknown request kind {str(kind)[:64]!r}"
                raise unreadable_row(self.path, "replica_requests", str(replica_id), why)
        return [(str(r[0]), str(r[1])) for r in rows]

    @_write
    async def delete_deployment(self, name: str) -> bool:
        """Forget a deployment and its revisions; False when there was none by that name."""
        deleted = await self._db.execute("DELETE FROM deployments WHERE name = ?", (name,)) > 0
        await self._db.execute("DELETE FROM revisions WHERE deployment = ?", (name,))
        return deleted

    async def load_profiles(self) -> list[StoredProfile]:
        """Every stored profile, by name."""
        query = "SELECT name, profile, fingerprint, updated FROM profiles ORDER BY name"
        rows = await self._db.fetch(query)
        return [StoredProfile(r[0], bytes(r[1]), r[2], int(r[3])) for r in rows]

    async def load_deployments(self) -> list[StoredDeployment]:
        """Every stored deployment, by name."""
        query = "SELECT name, deployment, updated FROM deployments ORDER BY name"
        rows = await self._db.fetch(query)
        return [StoredDeployment(r[0], bytes(r[1]), int(r[2])) for r in rows]

    # --- the leader lease (llmgw.server.state.lease) -----------------------------------

    async def take_lease(self, holder: str, server_id: str, address: str) -> LeaseView:
        """Take the leader lease outright, its epoch moved on (SQLite's one server), and
        fence every later write on it."""
        async with self.health.writing(self._db.changes), self._db.transaction():
            view = await take_lease(self._db, holder, server_id, address, ttl_ms=0)
        self.fence = (holder, view.epoch)
        return view

    # --- replicas --------------------------------------------------------------------

    @_write
    async def save_replicas(self, records: Iterable[ReplicaRecord]) -> None:
        """Insert or replace replica records, all in one transaction."""
        at = now_ms()
        rows = [(r.replica_id, encode_replica(r), at) for r in records]
        await self._db.executemany(upsert("replicas", ("replica_id", "record", "updated")), rows)

    async def load_replicas(self) -> list[ReplicaRecord]:
        """Every stored replica record, by id; a row that cannot be read is a StoreError
        naming it (``llmgw.server.state.statefile.unreadable_row``)."""
        query = "SELECT replica_id, record FROM replicas ORDER BY replica_id"
        records = []
        for replica_id, text in await self._db.fetch(query):
            try:
                record = decode_replica(text)
            except Exception as exc:  # whatever the row holds, it is named, never dropped
                raise unreadable_row(self.path, "replicas", str(replica_id), exc) from exc
            if record.replica_id != replica_id:
                why = f"it holds the record of replica {record.replica_id!r}"
                raise unreadable_row(self.path, "replicas", str(replica_id), why)
            records.append(record)
        return records
