"""The store keeps profiles, deployments and replica requests across reopens, and migrates
schema 1 databases, on SQLite and on PostgreSQL (``db``: tests/pgcluster.py)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from pgcluster import pg_execute, pg_fetch

from llmgw.server.state.store import Store
from llmgw.server.state.storepg import postgres_ddl
from llmgw.server.state.storeschema import (
    SCHEMA_VERSION,
    AuditRecord,
    StoredDeployment,
    StoredNode,
    StoredProfile,
)

# The schema of version 1 as it shipped, to build an old file with.
_V1 = """
CREATE TABLE nodes (node_id TEXT PRIMARY KEY, info BLOB NOT NULL,
    cordoned INTEGER NOT NULL DEFAULT 0, first_seen INTEGER NOT NULL, last_seen INTEGER NOT NULL);
CREATE TABLE audit (id INTEGER PRIMARY KEY AUTOINCREMENT, at INTEGER NOT NULL,
    actor TEXT NOT NULL, action TEXT NOT NULL, target TEXT NOT NULL, result TEXT NOT NULL);
INSERT INTO nodes VALUES ('n1', x'0a026e31', 1, 10, 20);
INSERT INTO audit (at, actor, action, target, result) VALUES (5, 'op', 'cordon', 'n1', 'ok');
PRAGMA user_version=1;
"""


async def test_profiles_and_deployments_survive_reopen(db: Path | str) -> None:
    p = StoredProfile("chat", b"\x0a\x04chat", "fp-1", 10)
    d = StoredDeployment("web", b"\x0a\x03web", 11)
    async with Store(db) as store:
        await store.save_desired([p], [d])
        await store.save_desired([StoredProfile("chat", b"\x0a\x04chat", "fp-2", 12)], [])
        await store.save_desired([], [StoredDeployment("gone", b"", 13)])
        assert await store.delete_deployment("gone")
        assert not await store.delete_deployment("gone")
    async with Store(db) as store:
        assert await store.load_profiles() == [StoredProfile("chat", b"\x0a\x04chat", "fp-2", 12)]
        assert await store.load_deployments() == [d]


async def _schema_1(db: Path | str) -> None:
    """A database as schema version 1 left it (on PostgreSQL: its version in llmgw_meta)."""
    if isinstance(db, Path):
        with sqlite3.connect(db) as conn:
            conn.executescript(_V1)
        conn.close()
        return
    tables, _ = _V1.split("PRAGMA")
    await pg_execute(
        db,
        postgres_ddl(tables).replace("x'0a026e31'", "'\\x0a026e31'")  # a bytea literal
        + "CREATE TABLE llmgw_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        + "INSERT INTO llmgw_meta VALUES ('schema_version', '1');",
    )


async def _version(db: Path | str) -> int:
    if isinstance(db, Path):
        with sqlite3.connect(db) as conn:
            (version,) = conn.execute("PRAGMA user_version").fetchone()
        conn.close()
        return int(version)
    query = "SELECT value FROM llmgw_meta WHERE key = 'schema_version'"
    ((version,),) = await pg_fetch(db, query)
    return int(str(version))


async def test_schema_1_database_migrates_and_keeps_its_nodes(db: Path | str) -> None:
    await _schema_1(db)
    async with Store(db) as store:
        assert await store.load_nodes() == [StoredNode("n1", b"\x0a\x02n1", True, 10, 20)]
        assert await store.recent_audit() == [AuditRecord(5, "op", "cordon", "n1", "ok")]
        await store.save_desired([StoredProfile("p", b"", "fp", 1)], [])
        assert [p.name for p in await store.load_profiles()] == ["p"]
        assert [t.token_id for t in await store.load_tokens()] == []  # tables of 2-9 are there
        await store.save_node(StoredNode("n2", b"", False, 30, 30, ever_ready=False))
    assert await _version(db) == SCHEMA_VERSION == 10
    async with Store(db) as store:
        assert [n.ever_ready for n in await store.load_nodes()] == [True, False]  # column of 6


async def test_replica_requests_survive_reopen_until_forgotten(db: Path | str) -> None:
    async with Store(db) as store:
        d = StoredDeployment("chat", b"\x0a\x04chat", 11)
        await store.save_desired([], [d], [("chat-1", "retire")])
        await store.save_requests([("chat-2", "replace"), ("chat-3", "replace")])
    async with Store(db) as store:
        assert await store.load_requests() == [
            ("chat-1", "retire"), ("chat-2", "replace"), ("chat-3", "replace"),
        ]  # fmt: skip
        await store.forget_requests(["chat-1", "chat-3"])
        with pytest.raises(ValueError, match="unknown replica request kind 'evict'"):
            await store.save_requests([("chat-4", "evict")])
    async with Store(db) as store:
        assert await store.load_requests() == [("chat-2", "replace")]


async def test_a_refused_request_rolls_back_the_deployment_saved_with_it(
    db: Path | str,
) -> None:
    async with Store(db) as store:
        with pytest.raises(ValueError):
            await store.save_desired([], [StoredDeployment("chat", b"", 1)], [("c-1", "bad")])
        assert await store.load_deployments() == []
