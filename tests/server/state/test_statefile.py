"""The state database's identity: which files ``Store`` takes, and its cluster id."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from pathlib import Path

import pytest

from llmgw.server.errors import StoreError
from llmgw.server.state.statefile import valid_cluster_id
from llmgw.server.state.store import Store
from llmgw.server.state.storeschema import _SCHEMA_1, _SCHEMA_2


async def test_a_new_database_has_a_cluster_id_that_stays(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    async with Store(db) as store:
        made = store.cluster_id
    assert valid_cluster_id(made)
    async with Store(db) as store:
        assert store.cluster_id == made
    assert sorted(os.listdir(tmp_path)) == ["s.db"]  # no temporary left


async def test_two_databases_have_different_cluster_ids(tmp_path: Path) -> None:
    async with Store(tmp_path / "a.db") as a, Store(tmp_path / "b.db") as b:
        assert a.cluster_id != b.cluster_id


async def test_an_older_llmgw_database_gets_a_cluster_id_and_keeps_its_rows(
    tmp_path: Path,
) -> None:
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:
        conn.executescript(f"{_SCHEMA_1}{_SCHEMA_2}PRAGMA user_version=2;")
        conn.execute("INSERT INTO nodes VALUES ('n1', x'0a026e31', 1, 5, 6)")
    conn.close()
    async with Store(db) as store:
        made = store.cluster_id
        (node,) = await store.load_nodes()
    assert valid_cluster_id(made) and node.node_id == "n1" and node.cordoned
    async with Store(db) as store:
        assert store.cluster_id == made


async def test_two_creators_at_once_share_one_database(tmp_path: Path) -> None:
    db = tmp_path / "s.db"

    async def open_one() -> str:
        async with Store(db) as store:
            return store.cluster_id

    ids = await asyncio.gather(*(open_one() for _ in range(4)))
    assert len(set(ids)) == 1


async def test_a_damaged_cluster_id_is_named(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    async with Store(db):
        pass
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE llmgw_meta SET value = 'x' WHERE key = 'cluster_id'")
    conn.close()
    with pytest.raises(StoreError, match="table llmgw_meta, row 'cluster_id'"):
        async with Store(db):
            pass


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "is empty: not an llmgw state database"),
        (b"\x89PNG\r\n\x1a\n" + bytes(100), "not an SQLite file"),
        (b"hello\n", "not an SQLite file"),
    ],
    ids=["empty", "png", "text"],
)
async def test_a_file_that_is_not_sqlite_is_refused_unchanged(
    tmp_path: Path, content: bytes, said: str
) -> None:
    db = tmp_path / "s.db"
    db.write_bytes(content)
    with pytest.raises(StoreError, match=said):
        async with Store(db):
            pass
    assert db.read_bytes() == content
    assert sorted(os.listdir(tmp_path)) == ["s.db"]


async def test_another_programs_sqlite_is_refused_unchanged(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE nodes (x)")  # one table of the same name is not enough
        conn.execute("PRAGMA user_version=3")
    conn.close()
    before = db.read_bytes()
    with pytest.raises(StoreError, match=r"no llmgw_meta table; it holds the tables nodes"):
        async with Store(db):
            pass
    assert db.read_bytes() == before
