"""The store keeps nodes and the audit log across restarts, on SQLite and on PostgreSQL
(``db``: tests/pgcluster.py), and refuses what it cannot open."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
from pgcluster import pg_execute, pg_fetch

from llmgw.addresses import free_port
from llmgw.server.errors import StoreError
from llmgw.server.state.store import Store
from llmgw.server.state.storeschema import AuditRecord, StoredNode


async def test_nodes_and_audit_survive_reopen(db: Path | str) -> None:
    async with Store(db) as store:
        await store.save_node(StoredNode("n1", b"\x0a\x02n1", False, 10, 10))
        await store.set_cordoned("n1", True)
        await store.save_node(StoredNode("n1", b"\x0a\x02n1", False, 99, 20))  # re-register
        await store.touch_nodes([("n1", 30)])
        await store.append_audit(AuditRecord(5, "op", "cordon", "n1", "ok"))
        made = store.cluster_id
    async with Store(db) as store:
        (node,) = await store.load_nodes()
        assert (node.node_id, node.cordoned, node.first_seen_ms, node.last_seen_ms) == (
            "n1",
            True,
            10,
            30,
        )
        assert await store.recent_audit() == [AuditRecord(5, "op", "cordon", "n1", "ok")]
        assert store.cluster_id == made


async def test_nodes_load_oldest_first_and_deletes_say_whether_one_was_there(
    db: Path | str,
) -> None:
    async with Store(db) as store:
        for at, node_id in enumerate(["n3", "n1", "n2"]):
            await store.save_node(StoredNode(node_id, b"", False, 100 + at, 100 + at))
        assert [n.node_id for n in await store.load_nodes()] == ["n3", "n1", "n2"]
        assert await store.delete_node("n1")
        assert not await store.delete_node("n1")
        await store.mark_ever_ready("n2")
        assert [n.node_id for n in await store.load_nodes()] == ["n3", "n2"]


async def _set_version(db: Path | str, version: int) -> None:
    if isinstance(db, Path):
        with sqlite3.connect(db) as conn:
            conn.execute(f"PRAGMA user_version={version}")
        conn.close()
    else:
        await pg_execute(
            db, f"UPDATE llmgw_meta SET value = '{version}' WHERE key = 'schema_version'"
        )


async def test_newer_schema_is_refused_by_name(db: Path | str) -> None:
    async with Store(db):
        pass
    await _set_version(db, 99)
    with pytest.raises(StoreError, match="schema version 99"):
        async with Store(db):
            pass


async def test_unopenable_path_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(StoreError, match="cannot open"):
        async with Store(tmp_path / "dir.db"):
            pass
    # aiosqlite stops its worker after a failed connect without waiting for it; let it
    # finish before this test's loop closes, or it reports "Event loop is closed".
    for thread in threading.enumerate():
        if "_connection_worker_thread" in thread.name:
            thread.join(timeout=5)


async def test_an_unreachable_or_missing_postgresql_database_is_a_store_error(
    pg_url: str,
) -> None:
    nobody = f"postgresql://llmgw:secret@127.0.0.1:{free_port()}/x"
    with pytest.raises(StoreError, match="cannot open the state database") as caught:
        async with Store(nobody):
            pass
    assert "secret" not in str(caught.value) and "llmgw:***@" in str(caught.value)
    missing = pg_url.rsplit("/", 1)[0] + "/no_such_database"
    with pytest.raises(StoreError, match="no_such_database"):
        async with Store(missing):
            pass


async def test_another_programs_postgresql_database_is_refused_untouched(pg_url: str) -> None:
    await pg_execute(pg_url, "CREATE TABLE orders (id INTEGER PRIMARY KEY)")
    with pytest.raises(StoreError, match="not an llmgw state database .*orders"):
        async with Store(pg_url):
            pass
    tables = "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
    assert await pg_fetch(pg_url, tables) == [("orders",)]  # nothing was written to it
    await pg_execute(pg_url, "DROP TABLE orders")
    async with Store(pg_url) as store:
        assert await store.load_nodes() == []
