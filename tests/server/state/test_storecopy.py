"""Copying an SQLite state database into PostgreSQL (llmgw/server/state/storecopy.py), on
the private PostgreSQL cluster (tests/pgcluster.py): what a ``Store`` reads back equals what
was written, ids and the cluster id included; refusals change nothing."""

from __future__ import annotations

import asyncio
import hashlib
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pgcluster import pg_execute, pg_fetch
from test_kvblocks import PROFILE

from llmgw.server.core.plan import ReplicaPlan, ShardPlan
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord
from llmgw.server.errors import ConfigError, StoreError
from llmgw.server.state.statefile import META_TABLE
from llmgw.server.state.statelock import hold_state_lock
from llmgw.server.state.store import Store
from llmgw.server.state.storebackend import PostgresUrl
from llmgw.server.state.storecopy import (
    copy_sqlite_to_postgres,
    identity_tables,
    parse_source,
    parse_target,
    schema_tables,
)
from llmgw.server.state.storeschema import (
    MIGRATIONS,
    AuditRecord,
    EventRecord,
    RevisionRecord,
    StoredDeployment,
    StoredNode,
    StoredProfile,
    StoredTenantKey,
)
from llmgw.server.state.tokens import Role

pytestmark = pytest.mark.timeout(120)


def _replica(replica_id: str, serial: int) -> ReplicaRecord:
    shard = ShardPlan(f"{replica_id}.0", "n1", 0, ("GPU-0",), 20000 + serial)
    plan = ReplicaPlan(replica_id, "chat", "chat-p", "fp", (shard,))
    return ReplicaRecord(plan, PROFILE, Lifecycle.ACTIVE, serial, api_key="k" * 40)


async def _populate(path: Path) -> str:
    """A state file with rows in every table; its cluster id."""
    async with Store(path) as store:
        await store.save_node(StoredNode("n1", b"\x0a\x02n1", False, 10, 20))
        await store.save_node(StoredNode("n2", b"\x0a\x02n2", False, 11, 21, ever_ready=False))
        await store.set_cordoned("n2", True)
        revision = RevisionRecord("chat", 1, "chat-p", "fp", b"\x01\x02", 30, "op", "apply")
        await store.save_desired(
            [StoredProfile("chat-p", b"\x0a\x06chat-p", "fp", 30)],
            [StoredDeployment("chat", b"\x0a\x04chat", 30)],
            [("chat-1", "retire")],
            [revision],
        )
        await store.save_replicas([_replica("chat-1", 1), _replica("chat-2", 2)])
        await store.append_audits(AuditRecord(i, "op", "cordon", "n2", "ok") for i in range(5))
        first = await store.add_token(Role.ADMIN, hashlib.sha256(b"a").hexdigest(), "admin")
        second = await store.add_token(Role.AGENT, hashlib.sha256(b"b").hexdigest(), "", ["n1"])
        await store.delete_token(first)  # a gap in the ids: they must be kept, not renumbered
        assert second == 2
        events = [EventRecord(i, "chat-1.0", "n1", "Ready", f"m{i}", i % 2 == 0) for i in range(50)]
        await store.append_events(events, keep=40)  # ids 11..50 stay
        for key_id in ("k_live", "k_gone"):
            digest = hashlib.sha256(key_id.encode()).digest()
            await store.add_tenant_key(StoredTenantKey(key_id, "t", digest, ("chat",), rpm=3))
        await store.revoke_tenant_key("k_gone")  # its row is copied too
        return store.cluster_id


async def _contents(store: Store) -> dict[str, Any]:
    return {
        "nodes": await store.load_nodes(),
        "profiles": await store.load_profiles(),
        "deployments": await store.load_deployments(),
        "replicas": await store.load_replicas(),
        "requests": await store.load_requests(),
        "tokens": await store.load_tokens(),
        "audit": await store.recent_audit(1000),
        "revisions": await store.load_revisions(),
        "events": await store.events_of(["chat-1.0"], 1000),
        "tenant_keys": await store.load_tenant_keys(),
    }


async def test_the_table_list_is_every_table_a_new_store_has(tmp_path: Path) -> None:
    async with Store(tmp_path / "s.db"):
        pass
    with sqlite3.connect(tmp_path / "s.db") as conn:
        made = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    conn.close()
    assert set(schema_tables()) == made - {META_TABLE, "sqlite_sequence"}
    assert identity_tables() == {"audit": "id", "tokens": "id", "events": "id", "tenant_keys": "id"}


async def test_a_copy_loads_the_same_and_keeps_ids_and_the_cluster_id(
    tmp_path: Path, pg_url: str
) -> None:
    source = tmp_path / "state.db"
    cluster_id = await _populate(source)
    async with Store(source) as store:
        before = await _contents(store)
    mtime = source.stat().st_mtime_ns
    report = await copy_sqlite_to_postgres(source, PostgresUrl(pg_url))
    assert source.stat().st_mtime_ns == mtime  # read, never written
    counts = {t.table: t.rows for t in report.tables}
    assert counts["events"] == 40 and counts["tokens"] == 1 and counts["audit"] == 5
    assert counts["nodes"] == 2 and counts["replicas"] == 2 and counts["revisions"] == 1
    assert counts["tenant_keys"] == 2  # the revoked key's row too
    assert report.cluster_id == cluster_id
    async with Store(pg_url) as copy:
        assert copy.cluster_id == cluster_id
        assert await _contents(copy) == before
        assert [t.token_id for t in await copy.load_tokens()] == [2]
        # the identity sequences are past the copied ids: new rows do not collide
        assert await copy.add_token(Role.VIEWER, hashlib.sha256(b"c").hexdigest()) == 3
        await copy.append_events([EventRecord(99, "x", "a", "r", "m")], keep=1000)
    (row,) = await pg_fetch(pg_url, "SELECT MAX(id) FROM events")
    assert row[0] == 51


async def test_a_target_holding_llmgw_rows_is_refused_and_left_as_it_was(
    tmp_path: Path, pg_url: str
) -> None:
    source = tmp_path / "state.db"
    await _populate(source)
    async with Store(pg_url) as other:
        await other.save_node(StoredNode("theirs", b"", False, 1, 1))
        theirs = other.cluster_id
    with pytest.raises(StoreError, match=r"already holds llmgw state \(1 nodes rows\)"):
        await copy_sqlite_to_postgres(source, PostgresUrl(pg_url))
    async with Store(pg_url) as other:
        assert other.cluster_id == theirs
        assert [n.node_id for n in await other.load_nodes()] == ["theirs"]
        assert await other.load_profiles() == []


async def test_another_programs_database_is_refused(tmp_path: Path, pg_url: str) -> None:
    source = tmp_path / "state.db"
    await _populate(source)
    await pg_execute(pg_url, "CREATE TABLE accounts (id INT)")
    with pytest.raises(StoreError, match="not an llmgw state database"):
        await copy_sqlite_to_postgres(source, PostgresUrl(pg_url))


async def test_a_failed_copy_leaves_no_row(tmp_path: Path, pg_url: str) -> None:
    source = tmp_path / "state.db"
    await _populate(source)
    with sqlite3.connect(source) as conn:  # SQLite keeps what PostgreSQL's BIGINT refuses
        conn.execute("UPDATE replicas SET updated = 'soon' WHERE replica_id = 'chat-2'")
    conn.close()
    with pytest.raises(StoreError, match="table replicas"):
        await copy_sqlite_to_postgres(source, PostgresUrl(pg_url))
    for table in schema_tables():
        assert (await pg_fetch(pg_url, f"SELECT COUNT(*) FROM {table}"))[0][0] == 0, table


@pytest.fixture
def held_source(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A populated state file whose lock another process holds; the file and its pid."""
    source = tmp_path / "state.db"
    asyncio.run(_populate(source))
    with subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(source)], stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            yield source, holder.pid
        finally:
            holder.kill()


async def test_a_locked_source_is_refused_naming_the_holder(
    held_source: tuple[Path, int], pg_url: str
) -> None:
    source, pid = held_source
    with pytest.raises(StoreError, match=rf"in use by llmgw server pid {pid}"):
        await copy_sqlite_to_postgres(source, PostgresUrl(pg_url))
    tables = "SELECT 1 FROM information_schema.tables WHERE table_schema = current_schema()"
    assert await pg_fetch(pg_url, tables) == []  # the target was not touched


_HOLD = """
import sys, time
from collections.abc import Iterator
from pathlib import Path
from llmgw.server.state.statelock import hold_state_lock
with hold_state_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


async def test_the_lock_is_let_go_after_a_copy(tmp_path: Path, pg_url: str) -> None:
    source = tmp_path / "state.db"
    await _populate(source)
    await copy_sqlite_to_postgres(source, PostgresUrl(pg_url))
    with hold_state_lock(source):  # a server could start on the file again
        pass


def test_bad_sources_and_targets_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        parse_source(f"sqlite:{tmp_path / 'missing.db'}")
    with pytest.raises(ConfigError, match="is not a file"):
        parse_source(str(tmp_path))
    with pytest.raises(ConfigError, match="must be an SQLite file"):
        parse_source("postgresql://u@h/db")
    with pytest.raises(ConfigError, match="only postgresql://"):
        parse_source("mysql://u@h/db")
    (tmp_path / "s.db").write_bytes(b"")
    assert parse_source(f"sqlite:{tmp_path / 's.db'}") == tmp_path / "s.db"
    assert parse_source(str(tmp_path / "s.db")) == tmp_path / "s.db"
    with pytest.raises(ConfigError, match="give a PostgreSQL URL"):
        parse_target(str(tmp_path / "s.db"))
    with pytest.raises(ConfigError, match="only postgresql://") as refused:
        parse_target("mysql://u:secret@h/db")
    assert "secret" not in str(refused.value)
    with pytest.raises(ConfigError, match="no database name"):
        parse_target("postgresql://u:secret@h:5432/")
    assert str(parse_target("postgresql://u:secret@h:5432/db")) == "postgresql://u:***@h:5432/db"


async def test_an_empty_or_foreign_source_file_is_refused(tmp_path: Path, pg_url: str) -> None:
    (tmp_path / "s.db").write_bytes(b"")
    with pytest.raises(StoreError, match="is empty"):
        await copy_sqlite_to_postgres(tmp_path / "s.db", PostgresUrl(pg_url))
    with sqlite3.connect(tmp_path / "other.db") as conn:
        conn.execute("CREATE TABLE accounts (id INTEGER)")
    conn.close()
    other = re.escape(f"{tmp_path / 'other.db'} is not an llmgw state database")
    with pytest.raises(StoreError, match=other):
        await copy_sqlite_to_postgres(tmp_path / "other.db", PostgresUrl(pg_url))


async def test_many_events_copy_in_seconds(tmp_path: Path, pg_url: str) -> None:
    source = tmp_path / "state.db"
    await _populate(source)
    with sqlite3.connect(source) as conn:
        conn.executemany(
            "INSERT INTO events (at, object, actor, reason, message, warning) VALUES (?,?,?,?,?,0)",
            ((i, f"chat-{i % 7}.0", "n1", "Ready", "x" * 40) for i in range(20_000)),
        )
    conn.close()
    started = time.monotonic()
    report = await copy_sqlite_to_postgres(source, PostgresUrl(pg_url))
    assert {t.table: t.rows for t in report.tables}["events"] == 20_040
    assert time.monotonic() - started < 30  # row by row over a socket it takes minutes


def test_the_cli_migrates_and_prints_counts(tmp_path: Path, pg_url: str) -> None:
    source = tmp_path / "state.db"
    cluster_id = asyncio.run(_populate(source))
    url = pg_url.replace("postgresql://llmgw@", "postgresql://llmgw:hunter2@")
    done = subprocess.run(
        [sys.executable, "-m", "llmgw", "db", "migrate", "--from", f"sqlite:{source}", "--to", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "hunter2" not in done.stdout + done.stderr
    lines = done.stdout.splitlines()
    counts = dict(line.split() for line in lines[:-2])
    assert counts["events"] == "40" and counts[META_TABLE] == "2"  # cluster_id, created
    total = sum(int(n) for n in counts.values())
    assert lines[-1].startswith(f"migrated {total} rows from {source} to postgresql://llmgw:***@")
    assert f"cluster {cluster_id}" in done.stdout
    again = subprocess.run(
        [sys.executable, "-m", "llmgw", "db", "migrate", "--from", str(source), "--to", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 1
    assert "already holds llmgw state" in again.stderr and "hunter2" not in again.stderr


async def test_an_older_source_is_copied_at_the_current_schema_and_left_at_its_own(
    tmp_path: Path, pg_url: str
) -> None:
    source = tmp_path / "old.db"
    with sqlite3.connect(source) as conn:  # a file as llmgw's schema version 5 left it
        conn.executescript("".join(MIGRATIONS[v] for v in range(1, 6)) + "PRAGMA user_version=5;")
        conn.execute("INSERT INTO nodes VALUES ('n1', x'0a026e31', 1, 10, 20)")
        conn.execute("INSERT INTO tokens (id, role, hash, created) VALUES (7, 'admin', 'h', 5)")
    conn.close()
    report = await copy_sqlite_to_postgres(source, PostgresUrl(pg_url))
    with sqlite3.connect(f"{source.as_uri()}?mode=ro", uri=True) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (5,)  # the file is as it was
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    conn.close()
    assert META_TABLE not in tables
    async with Store(pg_url) as copy:
        assert copy.cluster_id == report.cluster_id  # the one the snapshot was given
        assert await copy.load_nodes() == [StoredNode("n1", b"\x0a\x02n1", True, 10, 20, True)]
        assert [(t.token_id, t.role) for t in await copy.load_tokens()] == [(7, Role.ADMIN)]


async def test_rows_still_in_the_write_ahead_log_are_copied(tmp_path: Path, pg_url: str) -> None:
    source = tmp_path / "state.db"
    await _populate(source)
    writer = sqlite3.connect(source)  # kept open: its commit stays in state.db-wal
    try:
        writer.execute("PRAGMA wal_autocheckpoint=0")
        writer.execute("INSERT INTO nodes VALUES ('w', x'', 0, 1, 1, 1)")
        writer.commit()
        assert _wal_bytes(source) > 0
        report = await copy_sqlite_to_postgres(source, PostgresUrl(pg_url))
    finally:
        writer.close()
    assert {t.table: t.rows for t in report.tables}["nodes"] == 3


def _wal_bytes(path: Path) -> int:
    return Path(f"{path}-wal").stat().st_size
