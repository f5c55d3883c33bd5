"""The store keeps tenants' gateway keys (schema 9) across reopens, on SQLite and PostgreSQL
(``db``: tests/pgcluster.py): only live ones are loaded, a revoke marks the row, an
unreadable row is named, writes are fenced on the leader lease, and a schema 8 database
gets the table."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest
from pgcluster import pg_execute

from llmgw.server.errors import Deposed, StoreError
from llmgw.server.state.store import Store
from llmgw.server.state.storeschema import MIGRATIONS, SCHEMA_VERSION, StoredTenantKey
from llmgw.server.state.tenantkeys import TenantKeyBook


def _key(key_id: str, tenant: str = "team-a", **kw: object) -> StoredTenantKey:
    digest = hashlib.sha256(key_id.encode()).digest()
    return StoredTenantKey(key_id, tenant, digest, created_ms=5, **kw)  # type: ignore[arg-type]


async def test_keys_survive_reopen_and_a_revoke_removes_one(db: Path | str) -> None:
    full = _key(
        "k_1", models=("chat", "code"), rpm=30, tpm=1000, max_concurrency=4,
        priority="batch", expires_ms=99, note="ci jobs",
    )  # fmt: skip
    async with Store(db) as store:
        await store.add_tenant_key(full)
        await store.add_tenant_key(_key("k_2", "team-b"))
        await store.add_tenant_key(_key("k_3"))
        assert await store.revoke_tenant_key("k_2")
        assert not await store.revoke_tenant_key("k_2")  # revoked already
        assert not await store.revoke_tenant_key("k_nope")
    async with Store(db) as store:
        assert await store.load_tenant_keys() == [full, _key("k_3")]


async def test_an_unknown_priority_is_refused_before_it_is_stored(db: Path | str) -> None:
    async with Store(db) as store:
        with pytest.raises(ValueError, match="unknown key priority 'urgent'"):
            await store.add_tenant_key(_key("k_1", priority="urgent"))
        assert await store.load_tenant_keys() == []


async def test_an_unreadable_row_is_named(db: Path | str) -> None:
    async with Store(db) as store:
        await store.add_tenant_key(_key("k_bad"))
        await store.backend.execute("UPDATE tenant_keys SET digest = 'abcd' WHERE key_id = 'k_bad'")
        with pytest.raises(StoreError, match=r"table tenant_keys, row 'k_bad'.*2 bytes"):
            await store.load_tenant_keys()


async def test_key_writes_are_fenced_on_the_lease(db: Path | str) -> None:
    async with Store(db) as store:
        await store.take_lease("me", "s1", "127.0.0.1:1")
        await store.add_tenant_key(_key("k_1"))
        assert store.fence is not None
        store.fence = (store.fence[0], store.fence[1] + 1)  # an epoch this server never held
        with pytest.raises(Deposed):
            await store.add_tenant_key(_key("k_2"))
        with pytest.raises(Deposed):
            await store.revoke_tenant_key("k_1")
        assert [k.key_id for k in await store.load_tenant_keys()] == ["k_1"]


async def test_the_book_holds_live_keys_and_moves_its_generation(db: Path | str) -> None:
    async with Store(db) as store:
        await store.add_tenant_key(_key("k_old"))
        book = TenantKeyBook(store)
        await book.load()
        first = book.generation
        await book.add(_key("k_new"))
        assert [k.key_id for k in book.keys] == ["k_old", "k_new"]
        assert await book.revoke("k_old") and book.get("k_old") is None
        assert not await book.revoke("k_old")
        assert book.generation == first + 2
        assert [k.key_id for k in await store.load_tenant_keys()] == ["k_new"]


async def test_a_schema_8_database_gets_the_table(db: Path | str) -> None:
    if isinstance(db, Path):
        with sqlite3.connect(db) as conn:
            for version in range(1, 9):
                conn.executescript(MIGRATIONS[version])
            conn.execute("ALTER TABLE tokens ADD COLUMN nodes TEXT NOT NULL DEFAULT ''")
            conn.execute("ALTER TABLE nodes ADD COLUMN ever_ready INTEGER NOT NULL DEFAULT 1")
            conn.execute("PRAGMA user_version = 8")
        conn.close()
    else:
        from llmgw.server.state.storepg import postgres_ddl

        scripts = "".join(postgres_ddl(MIGRATIONS[v]) for v in range(1, 9))
        await pg_execute(
            db,
            scripts
            + "ALTER TABLE tokens ADD COLUMN nodes TEXT NOT NULL DEFAULT '';"
            + "ALTER TABLE nodes ADD COLUMN ever_ready BIGINT NOT NULL DEFAULT 1;"
            + "CREATE TABLE llmgw_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
            + "INSERT INTO llmgw_meta VALUES ('schema_version', '8');",
        )
    async with Store(db) as store:
        assert await store.load_tenant_keys() == []
        await store.add_tenant_key(_key("k_1"))
        assert [k.key_id for k in await store.load_tenant_keys()] == ["k_1"]
    assert SCHEMA_VERSION >= 9


async def test_a_schema_9_database_gets_the_usage_table(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    with sqlite3.connect(db) as conn:
        for version in range(1, 10):
            conn.executescript(MIGRATIONS[version])
        conn.execute("ALTER TABLE tokens ADD COLUMN nodes TEXT NOT NULL DEFAULT ''")
        conn.execute("ALTER TABLE nodes ADD COLUMN ever_ready INTEGER NOT NULL DEFAULT 1")
        conn.execute("PRAGMA user_version = 9")
    conn.close()
    async with Store(db) as store:
        assert [k.key_id for k in await store.load_tenant_keys()] == []
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
        assert conn.execute("SELECT count(*) FROM tenant_usage_hourly").fetchone() == (0,)
    conn.close()
