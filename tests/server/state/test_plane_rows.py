"""A stored row the control plane cannot read stops its start, named (never dropped)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from llmgw.api.llmgw.v1 import Deployment, EngineProfile, NodeInfo
from llmgw.server.errors import StoreError
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store

PROFILE = bytes(EngineProfile(name="p", engine="sim"))
DEPLOYMENT = bytes(Deployment(name="d", profile="p", replicas=1))
NODE = bytes(NodeInfo(node_id="n1"))

# (table, SQL that puts one bad row in, the row named)
BAD_ROWS = [
    ("profiles", "INSERT INTO profiles VALUES ('p', x'ffff', 'fp', 0)", "'p'"),
    ("profiles", "INSERT INTO profiles VALUES ('q', ?, 'fp', 0)", "'q'"),  # holds 'p'
    ("deployments", "INSERT INTO deployments VALUES ('d', x'0a', 0)", "'d'"),
    ("nodes", "INSERT INTO nodes VALUES ('n1', x'ff01', 0, 0, 0, 1)", "'n1'"),
    ("nodes", "INSERT INTO nodes VALUES ('n2', ?, 0, 0, 0, 1)", "'n2'"),  # holds n1
    ("replicas", "INSERT INTO replicas VALUES ('r1', '{\"replica_id\": 1', 0)", "'r1'"),
    ("replica_requests", "INSERT INTO replica_requests VALUES ('r1', 'explode', 0)", "'r1'"),
    ("tokens", "INSERT INTO tokens (role, hash, created) VALUES ('root', 'h', 0)", "'1'"),
]


@pytest.mark.parametrize(("table", "sql", "row"), BAD_ROWS)
async def test_an_unreadable_row_stops_the_load_naming_it(
    tmp_path: Path, table: str, sql: str, row: str
) -> None:
    db = tmp_path / "s.db"
    async with Store(db):
        pass
    with sqlite3.connect(db) as conn:
        blob = PROFILE if table == "profiles" else NODE
        conn.execute(sql, (blob,) if "?" in sql else ())
    conn.close()
    async with Store(db) as store:
        with pytest.raises(StoreError, match=f"table {table}, row {row} cannot be read"):
            await ControlPlane(store).load()
            await store.load_tokens()


async def test_readable_rows_load(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    async with Store(db):
        pass
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO profiles VALUES ('p', ?, 'fp', 0)", (PROFILE,))
        conn.execute("INSERT INTO deployments VALUES ('d', ?, 0)", (DEPLOYMENT,))
        conn.execute("INSERT INTO nodes VALUES ('n1', ?, 0, 0, 0, 1)", (NODE,))
    conn.close()
    async with Store(db) as store:
        plane = ControlPlane(store)
        await plane.load()
        assert set(plane.desired.profiles) == {"p"} and set(plane.desired.deployments) == {"d"}
        assert set(plane.inventory.nodes) == {"n1"}
