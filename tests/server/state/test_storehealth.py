"""A state database that cannot be written: sqlite's errors mapped, what the plane keeps and
writes later, what it refuses, and UNAVAILABLE on both ports; on SQLite and on PostgreSQL
(``db``: tests/pgcluster.py).

``_Disk`` makes a real SQLite store's writes fail with sqlite's own SQLITE_FULL error (taken
from a real database over its page limit), while reads go through: what a full disk does.
tests/integration/test_disk_full_e2e.py does it with a real full file system. On
PostgreSQL, ``_PgDisk`` turns the real private cluster read-only
(``default_transaction_read_only``, reloaded): its writes are refused with SQLSTATE 25006
while reads go on. The PostgreSQL server gone (stopped as by a crash, or a connection
terminated) is its own case, at the end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from pathlib import Path
from typing import Any

import asyncpg
import grpclib.client
import grpclib.server
import httpx
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from test_kvblocks import _register_message

from bench.pgcluster import PrivateCluster
from llmgw.api.llmgw.v1 import (
    ApplyDeploymentRequest,
    ControlServiceStub,
    Heartbeat,
    NodeRequest,
)
from llmgw.client import ControlClient, GrpcWebChannel, RpcError
from llmgw.server.core.profiles import parse_document
from llmgw.server.errors import StoreUnwritable
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.state.storehealth import (
    WriteRetry,
    install,
    unavailable_when_unwritable,
    unwritable,
)
from llmgw.server.state.storepg import PgTimeouts
from llmgw.server.state.storeschema import AuditRecord
from llmgw.server.state.storesqlite import SqliteBackend
from llmgw.server.state.tokens import Role
from llmgw.server.wire.auth import Authenticator, hash_token
from llmgw.server.wire.controlsvc import ControlService
from llmgw.server.wire.grpcweb import GrpcWebApp

DOCUMENT = """
[profiles.chat-sim]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/chat"
served_model_name = "chat"

[deployments.chat]
profile = "chat-sim"
replicas = 1
"""


def _sqlite_full() -> sqlite3.OperationalError:
    db = sqlite3.connect(":memory:")
    db.execute("PRAGMA max_page_count=1")
    try:
        db.execute("CREATE TABLE t (a)")
    except sqlite3.OperationalError as exc:
        return exc
    finally:
        db.close()
    raise AssertionError("sqlite took a table beyond its page limit")


def _sqlite_read_only(tmp_path: Path) -> sqlite3.OperationalError:
    sqlite3.connect(tmp_path / "ro.db").execute("CREATE TABLE t (a)").connection.close()
    db = sqlite3.connect(f"file:{tmp_path / 'ro.db'}?mode=ro", uri=True)
    try:
        db.execute("INSERT INTO t VALUES (1)")
    except sqlite3.OperationalError as exc:
        return exc
    finally:
        db.close()
    raise AssertionError("a read-only database took a write")


def _sqlite_io_error() -> sqlite3.OperationalError:
    """What sqlite raises when the kernel fails a write (SQLITE_IOERR_WRITE)."""
    exc = sqlite3.OperationalError("disk I/O error")
    exc.sqlite_errorcode = 778
    exc.sqlite_errorname = "SQLITE_IOERR_WRITE"
    return exc


def _writes(sql: str) -> bool:
    words = sql.lstrip().upper()
    return words.startswith(("INSERT", "UPDATE", "DELETE")) or (
        words.startswith("PRAGMA") and "=" in words
    )


class _Refused:
    """What ``execute`` gives for a write while the disk is full (awaited or entered)."""

    def __init__(self, error: sqlite3.Error) -> None:
        self._error = error

    def __await__(self) -> Generator[Any, None, None]:
        raise self._error
        yield  # pragma: no cover - makes this a generator

    async def __aenter__(self) -> None:
        raise self._error

    async def __aexit__(self, *exc: object) -> None:
        return None


class _Disk:
    """An SQLite store's connection whose writes fail as on a full disk while ``full``."""

    said = "state database full/read-only: database or disk is full"  # the problem it gives

    def __init__(self, store: Store, error: Callable[[], sqlite3.Error] = _sqlite_full) -> None:
        self.full = False
        self.refused = 0
        self._error = error
        backend = store.backend
        assert isinstance(backend, SqliteBackend)
        self._db = backend.conn
        backend.conn = self  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)

    def _refuse(self) -> _Refused:
        self.refused += 1
        return _Refused(self._error())

    def execute(self, sql: str, *args: Any) -> Any:
        if self.full and _writes(sql):
            return self._refuse()
        return self._db.execute(sql, *args)  # type: ignore[union-attr]

    def executemany(self, sql: str, rows: Any) -> Awaitable[Any]:
        if self.full:
            return self._refuse()
        return self._db.executemany(sql, rows)  # type: ignore[union-attr]

    async def fill(self) -> None:
        self.full = True

    async def free(self) -> None:
        self.full = False


class _PgDisk:
    """The private PostgreSQL cluster read-only while filled: every session's writes are
    refused (SQLSTATE 25006), as a cluster whose disk is full or that an operator made
    read-only; the store's one connection is seen to take the setting before it returns."""

    said = "state database full/read-only: cannot execute"

    def __init__(self, store: Store, cluster: PrivateCluster) -> None:
        self._store = store
        self._admin = cluster.url()

    async def _set(self, value: str) -> None:
        conn = await asyncpg.connect(self._admin, timeout=10)
        try:
            await conn.execute("SET default_transaction_read_only = off")  # this session may
            await conn.execute(f"ALTER SYSTEM SET default_transaction_read_only = {value}")
            await conn.execute("SELECT pg_reload_conf()")
        finally:
            await conn.close()
        for _ in range(500):  # 10 s
            rows = await self._store.backend.fetch("SHOW default_transaction_read_only")
            if rows and rows[0][0] == value:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"the store's connection did not take read-only = {value}")

    async def fill(self) -> None:
        await self._set("on")

    async def free(self) -> None:
        await self._set("off")


@pytest.fixture
async def plane(db: Path | str) -> AsyncIterator[ControlPlane]:
    # One PostgreSQL connection: _PgDisk sees that it took the read-only setting.
    async with Store(db, pg_timeouts=PgTimeouts(pool_size=1)) as store:
        plane = ControlPlane(store)
        await plane.load()
        yield plane


@pytest.fixture
async def disk(
    plane: ControlPlane, request: pytest.FixtureRequest
) -> AsyncIterator[_Disk | _PgDisk]:
    """The plane's database, made to refuse writes (``await disk.fill()``) and take them
    again (``await disk.free()``)."""
    if isinstance(plane.store.backend, SqliteBackend):
        yield _Disk(plane.store)
        return
    pg = _PgDisk(plane.store, request.getfixturevalue("pg_cluster"))
    try:
        yield pg
    finally:
        await pg.free()  # the cluster is the session's: never left read-only


def _apply_request() -> ApplyDeploymentRequest:
    document = parse_document(DOCUMENT, source="test")
    return ApplyDeploymentRequest(
        deployment=document.deployments["chat"],
        profiles=list(document.profiles.values()),
        document=DOCUMENT,
    )


# --- the mapping ------------------------------------------------------------------------


def test_only_a_full_or_read_only_database_is_unwritable(tmp_path: Path) -> None:
    full = unwritable(_sqlite_full())
    assert isinstance(full, StoreUnwritable)
    assert str(full) == "state database full/read-only: database or disk is full"
    read_only = unwritable(_sqlite_read_only(tmp_path))
    assert str(read_only) == "state database full/read-only: attempt to write a readonly database"
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (a PRIMARY KEY)")
    db.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(sqlite3.IntegrityError) as caught:
        db.execute("INSERT INTO t VALUES (1)")
    assert unwritable(caught.value) is None  # our bug, not the disk
    with pytest.raises(sqlite3.OperationalError) as syntax:
        db.execute("SELEC 1")
    assert unwritable(syntax.value) is None


def test_the_retry_backs_off_doubling_to_its_cap_with_jitter() -> None:
    retry = WriteRetry(base_s=0.5, cap_s=5.0)
    delays = []
    for _ in range(8):
        retry.failed(100.0)
        delays.append(retry.next_at - 100.0)
        assert not retry.due(100.0) and retry.due(100.0 + delays[-1])
    ceilings = [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True)), delays
    retry.succeeded()
    assert retry.due(0.0) and retry.failures == 0


# --- the plane --------------------------------------------------------------------------


async def test_what_only_memory_holds_is_written_once_the_disk_takes_writes(
    plane: ControlPlane, disk: _Disk | _PgDisk, db: Path | str
) -> None:
    await disk.fill()
    message = _register_message()
    assert message.node is not None
    connection = await plane.register(message.node, message, peer="127.0.0.1:1")  # served
    assert plane.heartbeat("n1", connection, Heartbeat())
    await plane.audit("operator", "test", "node/n1", "ok")  # its change is done: kept
    await plane.tick()  # neither raises nor loses anything
    await plane.flush(now=True)
    assert (plane.store.health.problem or "").startswith(disk.said)
    assert [e.action for e in plane.snapshot().events] == ["test"]
    failures = plane.store.health.failures
    await plane.flush()  # within the backoff: not tried
    assert plane.store.health.failures == failures

    await disk.free()
    await plane.flush(now=True)
    assert plane.store.health.problem is None
    async with Store(db) as again:
        (node,) = await again.load_nodes()
        audit = await again.recent_audit()
    assert node.node_id == "n1" and node.last_seen_ms >= node.first_seen_ms
    assert [(r.actor, r.action, r.target) for r in audit] == [("operator", "test", "node/n1")]


async def test_a_cordon_of_a_node_whose_registration_waits_stores_both(
    plane: ControlPlane, disk: _Disk | _PgDisk, db: Path | str
) -> None:
    await disk.fill()
    message = _register_message()
    assert message.node is not None
    await plane.register(message.node, message, peer="127.0.0.1:1")
    await disk.free()
    await plane.set_cordoned("n1", True, actor="operator")  # before any flush
    async with Store(db) as again:
        (node,) = await again.load_nodes()
    assert node.node_id == "n1" and node.cordoned


async def test_a_probe_write_turns_healthy_with_nothing_to_write(
    plane: ControlPlane, disk: _Disk | _PgDisk
) -> None:
    await disk.fill()
    with pytest.raises(StoreUnwritable):
        await plane.store.append_audit(AuditRecord(1, "a", "b", "c", "d"))
    assert plane.store.health.problem is not None
    await plane.flush(now=True)  # nothing pending: the probe fails too
    assert plane.store.health.problem is not None
    await disk.free()
    await plane.flush(now=True)
    assert plane.store.health.problem is None


async def test_after_an_io_error_every_write_is_refused_until_a_restart(tmp_path: Path) -> None:
    async with Store(tmp_path / "s.db") as store:  # SQLite's own: PostgreSQL has no such case
        disk = _Disk(store, _sqlite_io_error)
        disk.full = True
        with pytest.raises(StoreUnwritable) as caught:
            await store.append_audit(AuditRecord(1, "a", "b", "c", "d"))
        assert str(caught.value).startswith("state database full/read-only: disk I/O error; ")
        assert "until the server restarts" in str(caught.value)
        disk.full = False  # the next write might seem to commit: it is not even tried
        tried = disk.refused
        with pytest.raises(StoreUnwritable):
            await store.append_audit(AuditRecord(2, "a", "b", "c", "d"))
        await ControlPlane(store).flush(now=True)
        assert disk.refused == tried
        assert "until the server restarts" in (store.health.problem or "")


async def test_a_write_that_fails_changes_nothing_in_memory(
    plane: ControlPlane, disk: _Disk | _PgDisk
) -> None:
    message = _register_message()
    assert message.node is not None
    await plane.register(message.node, message, peer="127.0.0.1:1")
    await disk.fill()
    with pytest.raises(StoreUnwritable):
        await plane.set_cordoned("n1", True, actor="operator")
    assert not plane.inventory.nodes["n1"].cordoned
    control = ControlService(plane)
    with pytest.raises(StoreUnwritable):
        await control.apply_deployment(_apply_request())
    assert plane.desired.deployments == {} and plane.desired.profiles == {}
    await disk.free()
    await plane.set_cordoned("n1", True, actor="operator")
    assert plane.inventory.nodes["n1"].cordoned


# --- both ports -------------------------------------------------------------------------


async def test_both_ports_answer_unavailable_and_keep_reading(
    plane: ControlPlane, disk: _Disk | _PgDisk
) -> None:
    message = _register_message()
    assert message.node is not None
    await plane.register(message.node, message, peer="127.0.0.1:1")
    await disk.fill()
    control = ControlService(plane)
    server = grpclib.server.Server([control])
    install(server)
    await server.start("127.0.0.1", 0)
    channel = grpclib.client.Channel("127.0.0.1", server._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    try:
        stub = ControlServiceStub(channel)
        with pytest.raises(GRPCError) as caught:
            await stub.cordon_node(NodeRequest(node_id="n1"))
        assert caught.value.status is Status.UNAVAILABLE
        assert (caught.value.message or "").startswith(disk.said)
        assert [n.info.node_id for n in (await stub.get_cluster()).nodes if n.info] == ["n1"]
    finally:
        channel.close()
        server.close()
        await server.wait_closed()

    app = GrpcWebApp([control], guard=unavailable_when_unwritable)
    transport = httpx.ASGITransport(app=app)
    async with GrpcWebChannel("http://127.0.0.1", transport=transport) as web:
        client = ControlClient(web)
        with pytest.raises(RpcError) as refused:
            await client.apply_deployment(_apply_request())
        assert refused.value.status is Status.UNAVAILABLE
        assert disk.said in str(refused.value)
        assert (await client.get_cluster()).deployments == []
    assert plane.desired.deployments == {}


# --- PostgreSQL gone --------------------------------------------------------------------

ADMIN_TOKEN = "llmgw-test-admin-token"
GET_CLUSTER = "/llmgw.v1.ControlService/GetCluster"


async def test_postgresql_gone_is_unwritable_and_what_waits_lands_once_it_is_back(
    pg_cluster: PrivateCluster, pg_url: str
) -> None:
    async with Store(pg_url, pg_timeouts=PgTimeouts(connect_s=2.0)) as store:
        plane = ControlPlane(store)
        await plane.load()
        message = _register_message()
        assert message.node is not None
        await plane.register(message.node, message, peer="127.0.0.1:1")
        await store.add_token(Role.ADMIN, hash_token(ADMIN_TOKEN))
        auth = Authenticator(store, refresh_s=0.0)  # re-reads the tokens on every call
        assert await auth.check(GET_CLUSTER, f"Bearer {ADMIN_TOKEN}") is not None
        pg_cluster.stop("immediate")  # as a crash: no goodbye to the connections
        try:
            caller = await auth.check(GET_CLUSTER, f"Bearer {ADMIN_TOKEN}")  # the tokens read
            assert caller is not None and caller.role is Role.ADMIN
            with pytest.raises(StoreUnwritable, match="^state database unreachable: "):
                await store.append_audit(AuditRecord(1, "a", "b", "c", "d"))
            assert (store.health.problem or "").startswith("state database unreachable: ")
            await plane.audit("operator", "test", "node/n1", "ok")  # kept for later
            await plane.flush(now=True)  # refused, nothing raised
            assert store.health.problem is not None
            assert [e.action for e in plane.snapshot().events] == ["test"]  # reads go on
        finally:
            pg_cluster.start()
        await plane.flush(now=True)
        assert store.health.problem is None
        assert [r.action for r in await store.recent_audit()] == ["test"]


async def test_a_terminated_postgresql_connection_is_replaced(
    pg_cluster: PrivateCluster, pg_url: str
) -> None:
    async with Store(pg_url) as store:
        await store.append_audit(AuditRecord(1, "a", "b", "c", "d"))
        database = pg_url.rsplit("/", 1)[1]
        conn = await asyncpg.connect(pg_cluster.url(), timeout=10)
        try:
            ended = await conn.fetch(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
                database,
            )
        finally:
            await conn.close()
        assert ended and all(row[0] for row in ended)
        try:  # the pool may see the connection gone before it is used, or on its use
            await store.append_audit(AuditRecord(2, "a", "b", "c", "d"))
        except StoreUnwritable as exc:
            assert str(exc).startswith("state database unreachable: ")
        await store.append_audit(AuditRecord(3, "a", "b", "c", "d"))
        assert store.health.problem is None
        assert [r.at_ms for r in await store.recent_audit()][-1] == 3


def _cluster_pids(cluster: PrivateCluster) -> list[int]:
    """The postmaster and every process it started."""
    postmaster = int((cluster.data / "postmaster.pid").read_text().split()[0])
    children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split()
    return [postmaster, *map(int, children)]


async def test_a_postgresql_server_that_stops_answering_is_unwritable_within_the_timeout(
    pg_cluster: PrivateCluster, pg_url: str
) -> None:
    timeouts = PgTimeouts(connect_s=1.0, command_s=1.0)
    async with Store(pg_url, pg_timeouts=timeouts) as store:
        await store.append_audit(AuditRecord(1, "a", "b", "c", "d"))
        pids = _cluster_pids(pg_cluster)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)  # as a hung host: connections open, nothing answers
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnwritable, match="^state database unreachable: "):
                await store.append_audit(AuditRecord(2, "a", "b", "c", "d"))
            assert time.monotonic() - started < 5
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        await store.append_audit(AuditRecord(3, "a", "b", "c", "d"))
        assert store.health.problem is None
        assert [r.at_ms for r in await store.recent_audit()] == [1, 3]
