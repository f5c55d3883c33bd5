"""A state database that cannot be written: sqlite's errors mapped, what the plane keeps and
writes later, what it refuses, and UNAVAILABLE on both ports.

``_Disk`` makes a real store's writes fail with sqlite's own SQLITE_FULL error (taken from
a real database over its page limit), while reads go through: what a full disk does.
tests/integration/test_disk_full_e2e.py does it with a real full file system.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from pathlib import Path
from typing import Any

import grpclib.client
import grpclib.server
import httpx
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from test_kvblocks import _register_message

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
from llmgw.server.state.storeschema import AuditRecord
from llmgw.server.state.storesqlite import SqliteBackend
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
    """A store's connection whose writes fail as on a full disk while ``full``."""

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


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        yield plane


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
    plane: ControlPlane, tmp_path: Path
) -> None:
    disk = _Disk(plane.store)
    disk.full = True
    message = _register_message()
    assert message.node is not None
    connection = await plane.register(message.node, message, peer="127.0.0.1:1")  # served
    assert plane.heartbeat("n1", connection, Heartbeat())
    await plane.audit("operator", "test", "node/n1", "ok")  # its change is done: kept
    await plane.tick()  # neither raises nor loses anything
    await plane.flush(now=True)
    assert plane.store.health.problem == "state database full/read-only: database or disk is full"
    assert [e.action for e in plane.snapshot().events] == ["test"]
    refused = disk.refused
    await plane.flush()  # within the backoff: not tried
    assert disk.refused == refused

    disk.full = False
    await plane.flush(now=True)
    assert plane.store.health.problem is None
    async with Store(tmp_path / "s.db") as again:
        (node,) = await again.load_nodes()
        audit = await again.recent_audit()
    assert node.node_id == "n1" and node.last_seen_ms >= node.first_seen_ms
    assert [(r.actor, r.action, r.target) for r in audit] == [("operator", "test", "node/n1")]


async def test_a_cordon_of_a_node_whose_registration_waits_stores_both(
    plane: ControlPlane, tmp_path: Path
) -> None:
    disk = _Disk(plane.store)
    disk.full = True
    message = _register_message()
    assert message.node is not None
    await plane.register(message.node, message, peer="127.0.0.1:1")
    disk.full = False
    await plane.set_cordoned("n1", True, actor="operator")  # before any flush
    async with Store(tmp_path / "s.db") as again:
        (node,) = await again.load_nodes()
    assert node.node_id == "n1" and node.cordoned


async def test_a_probe_write_turns_healthy_with_nothing_to_write(plane: ControlPlane) -> None:
    disk = _Disk(plane.store)
    disk.full = True
    with pytest.raises(StoreUnwritable):
        await plane.store.append_audit(AuditRecord(1, "a", "b", "c", "d"))
    assert plane.store.health.problem is not None
    await plane.flush(now=True)  # nothing pending: the probe fails too
    assert plane.store.health.problem is not None
    disk.full = False
    await plane.flush(now=True)
    assert plane.store.health.problem is None


async def test_after_an_io_error_every_write_is_refused_until_a_restart(
    plane: ControlPlane,
) -> None:
    disk = _Disk(plane.store, _sqlite_io_error)
    disk.full = True
    with pytest.raises(StoreUnwritable) as caught:
        await plane.store.append_audit(AuditRecord(1, "a", "b", "c", "d"))
    assert str(caught.value).startswith("state database full/read-only: disk I/O error; ")
    assert "until the server restarts" in str(caught.value)
    disk.full = False  # the next write might seem to commit: it is not even tried
    tried = disk.refused
    with pytest.raises(StoreUnwritable):
        await plane.store.append_audit(AuditRecord(2, "a", "b", "c", "d"))
    await plane.flush(now=True)
    assert disk.refused == tried
    assert "until the server restarts" in (plane.store.health.problem or "")


async def test_a_write_that_fails_changes_nothing_in_memory(plane: ControlPlane) -> None:
    message = _register_message()
    assert message.node is not None
    await plane.register(message.node, message, peer="127.0.0.1:1")
    disk = _Disk(plane.store)
    disk.full = True
    with pytest.raises(StoreUnwritable):
        await plane.set_cordoned("n1", True, actor="operator")
    assert not plane.inventory.nodes["n1"].cordoned
    control = ControlService(plane)
    with pytest.raises(StoreUnwritable):
        await control.apply_deployment(_apply_request())
    assert plane.desired.deployments == {} and plane.desired.profiles == {}
    disk.full = False
    await plane.set_cordoned("n1", True, actor="operator")
    assert plane.inventory.nodes["n1"].cordoned


# --- both ports -------------------------------------------------------------------------


async def test_both_ports_answer_unavailable_and_keep_reading(plane: ControlPlane) -> None:
    message = _register_message()
    assert message.node is not None
    await plane.register(message.node, message, peer="127.0.0.1:1")
    _Disk(plane.store).full = True
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
        assert caught.value.message == "state database full/read-only: database or disk is full"
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
        assert "state database full/read-only: database or disk is full" in str(refused.value)
        assert (await client.get_cluster()).deployments == []
    assert plane.desired.deployments == {}
