"""The SQLite store keeps nodes and the audit log across restarts."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from llmgw.server.errors import StoreError
from llmgw.server.state.store import Store
from llmgw.server.state.storeschema import AuditRecord, StoredNode


async def test_nodes_and_audit_survive_reopen(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    async with Store(db) as store:
        await store.save_node(StoredNode("n1", b"\x0a\x02n1", False, 10, 10))
        await store.set_cordoned("n1", True)
        await store.save_node(StoredNode("n1", b"\x0a\x02n1", False, 99, 20))  # re-register
        await store.touch_nodes([("n1", 30)])
        await store.append_audit(AuditRecord(5, "op", "cordon", "n1", "ok"))
    async with Store(db) as store:
        (node,) = await store.load_nodes()
        assert (node.node_id, node.cordoned, node.first_seen_ms, node.last_seen_ms) == (
            "n1",
            True,
            10,
            30,
        )
        assert await store.recent_audit() == [AuditRecord(5, "op", "cordon", "n1", "ok")]


async def test_newer_schema_is_refused_by_name(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA user_version=99")
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
