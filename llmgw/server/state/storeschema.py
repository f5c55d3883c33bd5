"""The store's schema, version by version, and the rows it hands out.

Schema versions (SQLite's ``PRAGMA user_version``; on PostgreSQL the ``schema_version`` row
of ``llmgw_meta``): 1 holds nodes and the audit log; 2 adds the
profiles and deployments tables; 3 adds the replicas table (each ``ReplicaRecord`` as JSON:
``llmgw.server.state.replicajson``); 4 the replica requests; 5 the tokens; 6 the node ids a
token is bound to and whether a node was ever READY; 7 the event history (``events``: state
changes of shards and nodes, bounded, ``llmgw.server.state.history``), the profile revisions
of deployments (``revisions``) and an index of the audit log by target (what Describe reads);
8 the leader lease (``leases``: which server leads and its epoch, ``llmgw.server.state.lease``);
9 the tenants' gateway keys (``tenant_keys``: their SHA-256 only, never a key; a revoked one
keeps its row with ``revoked_ms`` set, ``llmgw.server.state.tenantkeys``); 10 the metered
usage (``tenant_usage_hourly``: per UTC hour, tenant, key and model, the counters added up).
``MIGRATIONS`` holds the script that
brings a database from each version to the next, in SQLite's types (``storepg.postgres_ddl``
gives PostgreSQL the same tables in its own), and ``COLUMNS_6`` the columns version 6 adds
(each backend adds those a database lacks); ``llmgw.server.state.store`` runs them when it
opens a database. ``upsert`` writes an insert-or-replace both backends run.

The rows: ``StoredNode``, ``StoredProfile``, ``StoredDeployment`` and ``AuditRecord``, and
the kinds of replica request (``REQUEST_KINDS``), ``EventRecord``, ``RevisionRecord`` and
``StoredTenantKey`` (with its priority bands, ``KEY_PRIORITIES``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# --- schema, by version ---------------------------------------------------------------------

SCHEMA_VERSION = 10

_SCHEMA_1 = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id     TEXT PRIMARY KEY,
    info        BLOB NOT NULL,          -- llmgw.v1.NodeInfo, serialized
    cordoned    INTEGER NOT NULL DEFAULT 0,
    first_seen  INTEGER NOT NULL,       -- Unix ms
    last_seen   INTEGER NOT NULL        -- Unix ms
);
CREATE TABLE IF NOT EXISTS audit (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    at      INTEGER NOT NULL,           -- Unix ms
    actor   TEXT NOT NULL,
    action  TEXT NOT NULL,
    target  TEXT NOT NULL,
    result  TEXT NOT NULL
);
"""

_SCHEMA_2 = """
CREATE TABLE IF NOT EXISTS profiles (
    name        TEXT PRIMARY KEY,
    profile     BLOB NOT NULL,          -- llmgw.v1.EngineProfile, serialized
    fingerprint TEXT NOT NULL,          -- profile_fingerprint of it
    updated     INTEGER NOT NULL        -- Unix ms
);
CREATE TABLE IF NOT EXISTS deployments (
    name        TEXT PRIMARY KEY,
    deployment  BLOB NOT NULL,          -- llmgw.v1.Deployment, serialized
    updated     INTEGER NOT NULL        -- Unix ms
);
"""

_SCHEMA_3 = """
CREATE TABLE IF NOT EXISTS replicas (
    replica_id  TEXT PRIMARY KEY,
    record      TEXT NOT NULL,          -- ReplicaRecord as JSON (encode_replica)
    updated     INTEGER NOT NULL        -- Unix ms
);
"""

_SCHEMA_4 = """
CREATE TABLE IF NOT EXISTS replica_requests (
    replica_id  TEXT PRIMARY KEY,
    kind        TEXT NOT NULL,          -- 'retire' or 'replace'
    at          INTEGER NOT NULL        -- Unix ms
);
"""

_SCHEMA_5 = """
CREATE TABLE IF NOT EXISTS tokens (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    role        TEXT NOT NULL,          -- llmgw.server.state.tokens.Role value
    hash        TEXT NOT NULL UNIQUE,   -- SHA-256 of the token, hex; never the token
    created     INTEGER NOT NULL,       -- Unix ms
    note        TEXT NOT NULL DEFAULT ''
);
"""

COLUMNS_6 = (
    ("tokens", "nodes", "TEXT NOT NULL DEFAULT ''"),  # bound node ids, comma-separated
    ("nodes", "ever_ready", "INTEGER NOT NULL DEFAULT 1"),  # a heartbeat ever came
)
"""Version 6 adds columns; SQLite has no ADD COLUMN IF NOT EXISTS, so its backend adds the
ones a file lacks (``storesqlite``); PostgreSQL's uses IF NOT EXISTS."""
_SCHEMA_6 = ""

_SCHEMA_7 = """
CREATE TABLE IF NOT EXISTS events (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    at          INTEGER NOT NULL,       -- Unix ms
    object      TEXT NOT NULL,          -- a replica or shard id, deployment/NAME, node/ID
    actor       TEXT NOT NULL,
    reason      TEXT NOT NULL,
    message     TEXT NOT NULL,
    warning     INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS events_object ON events (object, id);
CREATE INDEX IF NOT EXISTS audit_target ON audit (target, id);
CREATE TABLE IF NOT EXISTS revisions (
    deployment  TEXT NOT NULL,
    revision    INTEGER NOT NULL,
    profile     TEXT NOT NULL,          -- the profile's name
    fingerprint TEXT NOT NULL,
    content     BLOB NOT NULL,          -- llmgw.v1.EngineProfile, serialized, as it was
    at          INTEGER NOT NULL,       -- Unix ms
    actor       TEXT NOT NULL,
    cause       TEXT NOT NULL,
    PRIMARY KEY (deployment, revision)
);
"""

# The script that brings a file from version N-1 to N, by N.
_SCHEMA_8 = """
CREATE TABLE IF NOT EXISTS leases (
    name        TEXT PRIMARY KEY,       -- 'leader'
    holder      TEXT NOT NULL,          -- the holding server process (its id and a random part)
    server_id   TEXT NOT NULL,          -- the holder's server id, as shown
    address     TEXT NOT NULL,          -- the holder's native gRPC HOST:PORT
    epoch       INTEGER NOT NULL,       -- grows by one with every new holder, never lowered
    expires_at  INTEGER NOT NULL        -- Unix ms by the database's clock (0: released)
);
"""

_SCHEMA_9 = """
CREATE TABLE IF NOT EXISTS tenant_keys (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    key_id          TEXT NOT NULL UNIQUE,   -- public: k_ and 12 hex digits
    tenant          TEXT NOT NULL,
    digest          TEXT NOT NULL UNIQUE,   -- SHA-256 of the key, hex; never the key
    models          TEXT NOT NULL DEFAULT '',  -- served model names, comma-separated; '': any
    rpm             INTEGER NOT NULL DEFAULT 0,
    tpm             INTEGER NOT NULL DEFAULT 0,
    max_concurrency INTEGER NOT NULL DEFAULT 0,
    priority        TEXT NOT NULL DEFAULT 'interactive',  -- KEY_PRIORITIES
    expires_ms      INTEGER NOT NULL DEFAULT 0,  -- Unix ms; 0: never
    created_ms      INTEGER NOT NULL,       -- Unix ms
    note            TEXT NOT NULL DEFAULT '',
    revoked_ms      INTEGER                 -- Unix ms; NULL: live
);
"""

_SCHEMA_10 = """
CREATE TABLE IF NOT EXISTS tenant_usage_hourly (
    hour            INTEGER NOT NULL,       -- Unix ms of the UTC hour's start
    tenant          TEXT NOT NULL,
    key_id          TEXT NOT NULL,
    model           TEXT NOT NULL,
    requests        INTEGER NOT NULL DEFAULT 0,
    refused         INTEGER NOT NULL DEFAULT 0,
    prompt_tokens   INTEGER NOT NULL DEFAULT 0,
    cached_tokens   INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    gpu_ms          INTEGER NOT NULL DEFAULT 0,  -- GPU-milliseconds attributed
    PRIMARY KEY (hour, tenant, key_id, model)
);
"""

MIGRATIONS = {
    1: _SCHEMA_1,
    2: _SCHEMA_2,
    3: _SCHEMA_3,
    4: _SCHEMA_4,
    5: _SCHEMA_5,
    6: _SCHEMA_6,
    7: _SCHEMA_7,
    8: _SCHEMA_8,
    9: _SCHEMA_9,
    10: _SCHEMA_10,
}


def upsert(table: str, columns: Sequence[str], keys: int = 1) -> str:
    """``INSERT … ON CONFLICT (key) DO UPDATE`` of ``columns`` (the first ``keys`` of them
    the key), with ``?`` parameters: SQLite's ``INSERT OR REPLACE``, written so that
    PostgreSQL runs it too."""
    marks = ", ".join("?" * len(columns))
    rest = ", ".join(f"{c} = excluded.{c}" for c in columns[keys:])
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})"
        f" ON CONFLICT ({', '.join(columns[:keys])}) DO UPDATE SET {rest}"
    )


# --- rows -----------------------------------------------------------------------------------


REQUEST_KINDS = ("retire", "replace")
"""What an operator asked of a replica: retire it (a drain), or replace it (a node drain)."""


@dataclass(frozen=True, slots=True)
class StoredNode:
    """A node as the store remembers it."""

    node_id: str
    info: bytes
    cordoned: bool
    first_seen_ms: int
    last_seen_ms: int
    ever_ready: bool = True  # a heartbeat came on one of its streams (never-READY ones are pruned)


@dataclass(frozen=True, slots=True)
class StoredProfile:
    """An engine profile as the store keeps it."""

    name: str
    profile: bytes  # llmgw.v1.EngineProfile, serialized
    fingerprint: str
    updated_ms: int


@dataclass(frozen=True, slots=True)
class StoredDeployment:
    """A deployment as the store keeps it."""

    name: str
    deployment: bytes  # llmgw.v1.Deployment, serialized
    updated_ms: int


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One operator action: who did what to which target, when, and how it ended."""

    at_ms: int
    actor: str
    action: str
    target: str
    result: str


@dataclass(frozen=True, slots=True)
class EventRecord:
    """One state change of an object (a shard an agent reported, a node the server saw)."""

    at_ms: int
    object: str
    actor: str
    reason: str
    message: str
    warning: bool = False


@dataclass(frozen=True, slots=True)
class RevisionRecord:
    """One profile a deployment used: its number, the profile as it was, who and why."""

    deployment: str
    revision: int
    profile: str
    fingerprint: str
    content: bytes  # llmgw.v1.EngineProfile, serialized
    at_ms: int
    actor: str
    cause: str


def audit_warning(action: str, result: str) -> bool:
    """Whether an audit record, read as an event, is a warning: a refusal, a failure, or a
    deployment that cannot be placed."""
    return action == "unplaceable" or result.startswith(("refused", "failed"))


KEY_PRIORITIES = ("interactive", "batch")
"""A tenant key's priority band as stored (``llmgw.v1.KeyPriority``, in the same order)."""


@dataclass(frozen=True, slots=True)
class StoredTenantKey:
    """A live tenant key as the store keeps it: its SHA-256, never the key itself."""

    key_id: str
    tenant: str
    digest: bytes  # SHA-256 of the key (32 bytes)
    models: tuple[str, ...] = ()  # served model names it may use; empty: any
    rpm: int = 0  # requests per minute; 0: no limit
    tpm: int = 0  # tokens per minute; 0: no limit
    max_concurrency: int = 0  # requests in flight at once; 0: no limit
    priority: str = KEY_PRIORITIES[0]
    expires_ms: int = 0  # Unix ms; 0: never
    created_ms: int = 0  # Unix ms
    note: str = ""
