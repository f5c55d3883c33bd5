"""RouterService and the gateway's feed follower against a real ControlPlane (temp store):
the snapshot, changes and removals a gateway sees, a resync after falling behind, and a
RoutingTable kept in step over grpclib on loopback, kept while the server is away."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import grpclib.server
import httpx
import pytest

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    EngineProfile,
    KvDelta,
    NodeTelemetry,
    Register,
    Replica,
    RouterFeedEvent,
    RouteTarget,
    ShardState,
    ShardStatus,
    WatchEvent,
)
from llmgw.gateway.app import GatewayConfig
from llmgw.gateway.feed import (
    FollowConfig,
    apply_feed_event,
    feed_channel,
    follow,
    target_from_route,
)
from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.kvcache.keys import pack_keys, unpack_keys
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server.core.plan import ReplicaPlan, ShardPlan
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord
from llmgw.server.state.kvblocks import decode_kv_delta
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.state.storeschema import StoredTenantKey
from llmgw.server.state.watch import DEFAULT_QUEUE
from llmgw.server.wire import routersvc
from llmgw.server.wire.codec import CheckedProtoCodec, install_message_limit
from llmgw.server.wire.routersvc import RouterService, route_events, serve_gateway

PROFILE = EngineProfile(
    name="chat-p", engine="sim", gpu_class="H100", tp=1, model_path="/m/chat",
    served_model_name="chat", kv_events=True,
)  # fmt: skip
KEY = "k" * 40
FAST = FollowConfig(base_s=0.02, cap_s=0.1, keepalive_s=5, keepalive_timeout_s=5)


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        yield plane


async def _register(plane: ControlPlane, node_id: str, peer_host: str) -> None:
    node = simulated_node("dgx-h100", node_id=node_id, hostname=node_id)
    message = Register(protocol_version=PROTOCOL_VERSION, node=node)
    await plane.register(node, message, peer=f"{peer_host}:5000")


def _record(replica_id: str, port: int, lifecycle: Lifecycle = Lifecycle.ACTIVE) -> ReplicaRecord:
    shard = ShardPlan(f"{replica_id}.0", "a1", 0, ("gpu-0",), port)
    plan = ReplicaPlan(replica_id, "chat", "chat-p", "fp", (shard,))
    return ReplicaRecord(plan, PROFILE, lifecycle, serial=1, api_key=f"{KEY}-{replica_id}")


def _shard(plane: ControlPlane, replica_id: str, state: ShardState) -> None:
    status = ShardStatus(shard_id=f"{replica_id}.0", replica_id=replica_id, state=state)
    plane.shard_status("a1", status)


async def _save(plane: ControlPlane, *records: ReplicaRecord) -> None:
    await plane.save_replicas({r.replica_id: r for r in records})


async def _next(events: AsyncIterator[RouterFeedEvent]) -> RouterFeedEvent:
    return await asyncio.wait_for(anext(events), 5)


async def _snapshot(events: AsyncIterator[RouterFeedEvent]) -> RouterFeedEvent:
    """The snapshot, and the scalable models and tenant keys that always follow it (none
    here)."""
    snapshot = await _next(events)
    assert snapshot.snapshot is not None, snapshot
    scalable = await _next(events)
    assert scalable.scalable is not None and scalable.scalable.models == [], scalable
    keys = await _next(events)
    assert keys.tenant_keys is not None and keys.tenant_keys.keys == [], keys
    return snapshot


def _state(event: RouterFeedEvent) -> tuple[str, ShardState]:
    assert event.target is not None, event
    return event.target.replica_id, event.target.state


async def test_snapshot_carries_keys_endpoints_states_and_kv_events(plane: ControlPlane) -> None:
    await _register(plane, "a1", "10.0.0.7")
    await _save(plane, _record("chat-1", 9001), _record("chat-2", 9002))
    retired = replace(_record("chat-0", 9000), lifecycle=Lifecycle.RETIRED)
    await _save(plane, retired)
    events = route_events(plane)
    try:
        first = await _next(events)
    finally:
        await events.aclose()
    assert first.snapshot is not None and first.snapshot.revision == first.revision > 0
    by_id = {t.replica_id: t for t in first.snapshot.targets}
    assert sorted(by_id) == ["chat-1", "chat-2"]  # the RETIRED one is not routable at all
    one = by_id["chat-1"]
    assert one == RouteTarget(
        replica_id="chat-1", deployment="chat", model="chat", endpoint="http://10.0.0.7:9001",
        api_key=f"{KEY}-chat-1", state=ShardState.PENDING, kv_events=True,
    )  # fmt: skip


async def test_changes_only_what_a_gateway_routes_on(plane: ControlPlane) -> None:
    await _register(plane, "a1", "10.0.0.7")
    await _save(plane, _record("chat-1", 9001))
    events = route_events(plane)
    try:
        assert (await _snapshot(events)).snapshot is not None
        _shard(plane, "chat-1", ShardState.STARTING)
        assert _state(await _next(events)) == ("chat-1", ShardState.STARTING)
        _shard(plane, "chat-1", ShardState.READY)
        assert _state(await _next(events)) == ("chat-1", ShardState.READY)
        _shard(plane, "chat-1", ShardState.READY)  # reported again: nothing changes
        plane.hub.publish(WatchEvent(node_telemetry=NodeTelemetry(node_id="a1")))
        await _save(plane, _record("chat-2", 9002))  # the next thing the feed says
        added = await _next(events)
        assert _state(added) == ("chat-2", ShardState.PENDING)
        assert added.target is not None and added.target.api_key == f"{KEY}-chat-2"

        await _register(plane, "a1", "10.0.0.8")  # the node moved: every endpoint on it
        moved = [await _next(events), await _next(events)]
        assert [(e.target.replica_id, e.target.endpoint) for e in moved if e.target] == [
            ("chat-1", "http://10.0.0.8:9001"),
            ("chat-2", "http://10.0.0.8:9002"),
        ]

        await _save(plane, replace(_record("chat-1", 9001), lifecycle=Lifecycle.RETIRING))
        # a1 re-registered without shards: retiring with none running reads STOPPED
        assert _state(await _next(events)) == ("chat-1", ShardState.STOPPED)
        await _save(plane, replace(_record("chat-1", 9001), lifecycle=Lifecycle.RETIRED))
        assert (await _next(events)).target_removed == "chat-1"
    finally:
        await events.aclose()


async def test_a_draining_replica_is_not_routable(plane: ControlPlane) -> None:
    await _register(plane, "a1", "10.0.0.7")
    await _save(plane, _record("chat-1", 9001))
    _shard(plane, "chat-1", ShardState.READY)
    table = RoutingTable()
    events = route_events(plane)
    try:
        apply_feed_event(table, await _snapshot(events))
        assert [t.replica_id for t in table.candidates("chat")] == ["chat-1"]
        await _save(plane, replace(_record("chat-1", 9001), lifecycle=Lifecycle.RETIRING))
        event = await _next(events)
        assert _state(event) == ("chat-1", ShardState.DRAINING)
        apply_feed_event(table, event)
    finally:
        await events.aclose()
    assert table.candidates("chat") == ()
    target = table.get("chat-1")
    assert target is not None and not target.ready


async def test_a_watcher_that_falls_behind_gets_a_fresh_snapshot(plane: ControlPlane) -> None:
    await _register(plane, "a1", "10.0.0.7")
    events = route_events(plane)
    try:
        assert (await _snapshot(events)).snapshot is not None
        await _save(plane, _record("chat-1", 9001))
        for _ in range(DEFAULT_QUEUE + 1):  # the feed's subscriber does not read meanwhile
            plane.hub.publish(WatchEvent(node_telemetry=NodeTelemetry(node_id="a1")))
        resync = await _next(events)
    finally:
        await events.aclose()
    assert resync.snapshot is not None
    assert [t.replica_id for t in resync.snapshot.targets] == ["chat-1"]
    assert plane.hub.resyncs == 1 and plane.hub.watchers == 0


def test_target_from_route_reads_unknown_states_as_not_ready() -> None:
    route = RouteTarget(
        replica_id="r", model="m", endpoint="http://h:1/", api_key="s", deployment="d",
        state=ShardState.READY, kv_events=True,
    )  # fmt: skip
    assert target_from_route(route) == Target("r", "m", "http://h:1", "s", True, "d", True)
    for state in (ShardState.DRAINING, ShardState.UNSPECIFIED, 99):
        route.state = state  # type: ignore[assignment]
        assert not target_from_route(route).ready


# --- over grpclib ----------------------------------------------------------------------


async def _serve(plane: ControlPlane, port: int = 0) -> tuple[grpclib.server.Server, RouterService]:
    install_message_limit()
    service = RouterService(plane)
    server = grpclib.server.Server([service], codec=CheckedProtoCodec())
    await server.start("127.0.0.1", port)
    return server, service


async def _until(check: Callable[[], object], what: str) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_follow_keeps_the_table_through_an_outage_and_resyncs(
    plane: ControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    await _register(plane, "a1", "127.0.0.1")
    await _save(plane, _record("chat-1", 9001), _record("chat-2", 9002))
    _shard(plane, "chat-1", ShardState.READY)
    server, service = await _serve(plane)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    table, stop = RoutingTable(), asyncio.Event()
    task = asyncio.create_task(
        follow(lambda: feed_channel("127.0.0.1", port, FAST), table, stop=stop, config=FAST)
    )
    try:
        await _until(lambda: table.candidates("chat"), "the snapshot")
        (one,) = table.candidates("chat")
        assert one == Target(
            "chat-1", "chat", "http://127.0.0.1:9001", f"{KEY}-chat-1", True, "chat", True
        )
        _shard(plane, "chat-2", ShardState.READY)
        await _until(lambda: len(table.candidates("chat")) == 2, "chat-2 READY")

        caplog.set_level(logging.DEBUG, logger="llmgw.gateway.feed")
        service.shutdown()  # as the server does when it stops: the feed ends UNAVAILABLE
        server.close()
        await server.wait_closed()
        await _save(plane, replace(_record("chat-1", 9001), lifecycle=Lifecycle.RETIRED))
        await asyncio.sleep(0.5)  # several reconnect attempts fail meanwhile
        assert [t.replica_id for t in table.candidates("chat")] == ["chat-1", "chat-2"]
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "last table (2 targets)" in warnings[0].getMessage()

        server, service = await _serve(plane, port)  # back: the snapshot replaces the table whole
        await _until(lambda: table.get("chat-1") is None, "the snapshot after the outage")
        assert [t.replica_id for t in table.candidates("chat")] == ["chat-2"]
        assert any("router feed back" in r.getMessage() for r in caplog.records)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        server.close()
        await server.wait_closed()
    assert task.result() is None


# --- the in-server gateway ---------------------------------------------------------------


async def _models(client: httpx.AsyncClient) -> list[str]:
    return [m["id"] for m in (await client.get("/v1/models")).json()["data"]]


async def test_serve_gateway_routes_what_the_plane_says_from_the_first_request(
    plane: ControlPlane,
) -> None:
    await _register(plane, "a1", "127.0.0.1")
    await _save(plane, _record("chat-1", 9001))
    _shard(plane, "chat-1", ShardState.READY)
    async with serve_gateway(plane, GatewayConfig(port=0)) as served:
        async with httpx.AsyncClient(base_url=f"http://{served.host}:{served.port}") as client:
            assert await _models(client) == ["chat"]  # no wait: the table was filled first
            target = served.gateway.table.get("chat-1")
            assert target is not None and target.api_key == f"{KEY}-chat-1"
            await _save(plane, replace(_record("chat-1", 9001), lifecycle=Lifecycle.RETIRING))
            for _ in range(100):
                if not await _models(client):
                    break
            assert await _models(client) == []  # draining: no longer offered


async def test_the_in_server_feed_survives_its_own_failure(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    await _register(plane, "a1", "127.0.0.1")
    await _save(plane, _record("chat-1", 9001))
    _shard(plane, "chat-1", ShardState.READY)
    real, calls = plane.replica_view, []

    def flaky(record: ReplicaRecord) -> Replica:
        calls.append(record.replica_id)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return real(record)

    monkeypatch.setattr(plane, "replica_view", flaky)
    monkeypatch.setattr(routersvc, "RESUBSCRIBE_S", 0.01)
    table = RoutingTable()
    task = asyncio.create_task(routersvc.feed_table(plane, table))
    try:
        await _until(lambda: table.candidates("chat"), "the feed after its failure")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert "feed failed; subscribing again" in caplog.text and plane.hub.watchers == 0


# --- KV blocks (issue #6) ------------------------------------------------------------------

BLOCK_KEYS = [(i * 0x9E3779B97F4A7C15) % 2**64 | 1 for i in range(1, 400)]


def _kv(plane: ControlPlane, replica_id: str, stored: list[int], *, reset: bool = False,
        removed: list[int] | None = None) -> None:  # fmt: skip
    """A checked KvDelta from the leader of ``replica_id`` on a1, as agentsvc hands it on."""
    removed = removed or []
    delta = KvDelta(
        shard_id=f"{replica_id}.0", reset=reset, block_size=16,
        stored=pack_keys(stored), stored_keys=pack_keys(stored),
        removed=pack_keys(removed), removed_keys=pack_keys(removed),
    )  # fmt: skip
    plane.kv_delta("a1", plane.inventory.nodes["a1"].connection, decode_kv_delta(delta))


def _kv_keys(event: RouterFeedEvent) -> tuple[str, bool, list[int], list[int]]:
    blocks = event.kv_blocks
    assert blocks is not None, event
    stored, removed = unpack_keys(blocks.stored_keys), unpack_keys(blocks.removed_keys)
    return blocks.replica_id, blocks.reset, list(stored), list(removed)


async def test_snapshot_then_full_copies_then_deltas_and_a_full_copy_after_falling_behind(
    plane: ControlPlane,
) -> None:
    await _register(plane, "a1", "10.0.0.7")
    await _save(plane, _record("chat-1", 9001), _record("chat-2", 9002))
    _shard(plane, "chat-1", ShardState.READY)
    _shard(plane, "chat-2", ShardState.READY)
    _kv(plane, "chat-1", BLOCK_KEYS[:5], reset=True)
    plane.kv_blocks.chunk = 3
    events = route_events(plane)
    try:
        first = await _snapshot(events)
        assert first.snapshot is not None and first.snapshot.kv_replicas == ["chat-1"]
        copy = [_kv_keys(await _next(events)) for _ in range(2)]
        assert copy == [
            ("chat-1", True, sorted(BLOCK_KEYS[:5])[:3], []),
            ("chat-1", False, sorted(BLOCK_KEYS[:5])[3:], []),
        ]
        _kv(plane, "chat-2", BLOCK_KEYS[10:12])
        _kv(plane, "chat-1", BLOCK_KEYS[5:6], removed=BLOCK_KEYS[:1])
        _shard(plane, "chat-2", ShardState.DRAINING)  # a target change goes first
        assert _state(await _next(events)) == ("chat-2", ShardState.DRAINING)
        assert _kv_keys(await _next(events)) == ("chat-1", False, [], [BLOCK_KEYS[0]])
        assert _kv_keys(await _next(events)) == ("chat-1", False, [BLOCK_KEYS[5]], [])
        assert _kv_keys(await _next(events)) == ("chat-2", False, sorted(BLOCK_KEYS[10:12]), [])

        plane.kv_blocks.touched_limit = 10  # this subscriber does not read meanwhile
        for i in range(20, 40):
            _kv(plane, "chat-1", BLOCK_KEYS[i : i + 1])
        replica_id, reset, stored, _ = _kv_keys(await _next(events))
        held = list(plane.kv_blocks.keys("chat-1"))
        assert (replica_id, reset, stored) == ("chat-1", True, held[:3]) and len(held) == 25
    finally:
        await events.aclose()
    assert plane.kv_blocks.stats().watchers == 0 and plane.hub.watchers == 0


async def test_follow_fills_the_kv_index_then_applies_deltas_and_resyncs_after_an_outage(
    plane: ControlPlane,
) -> None:
    await _register(plane, "a1", "127.0.0.1")
    await _save(plane, _record("chat-1", 9001), _record("chat-2", 9002))
    _shard(plane, "chat-1", ShardState.READY)
    _shard(plane, "chat-2", ShardState.READY)
    _kv(plane, "chat-1", BLOCK_KEYS[:300], reset=True)
    _kv(plane, "chat-2", BLOCK_KEYS[:10], reset=True)
    plane.kv_blocks.chunk = 64
    server, service = await _serve(plane)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    table, index, stop = RoutingTable(), KvIndex(), asyncio.Event()
    task = asyncio.create_task(
        follow(lambda: feed_channel("127.0.0.1", port, FAST), table, stop=stop, config=FAST,
               index=index)
    )  # fmt: skip
    try:
        await _until(lambda: index.blocks_of("chat-1") == 300, "the full copy")
        request = BLOCK_KEYS[:20]
        assert index.match(request, ["chat-1", "chat-2"]) == {"chat-1": 20, "chat-2": 10}
        assert index.block_size("chat-1") == 16
        _kv(plane, "chat-1", [], removed=BLOCK_KEYS[5:6])  # a delta
        await _until(lambda: index.match(request, ["chat-1"]) == {"chat-1": 5}, "the delta")

        service.shutdown()
        server.close()
        await server.wait_closed()
        _shard(plane, "chat-2", ShardState.FAILED)  # dropped while the gateway is away
        await asyncio.sleep(0.2)
        assert index.blocks_of("chat-2") == 10  # kept while the server is away

        server, service = await _serve(plane, port)
        await _until(lambda: not index.blocks_of("chat-2"), "the snapshot after the outage")
        assert index.blocks_of("chat-1") == 299 and index.replicas() == ["chat-1"]
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        server.close()
        await server.wait_closed()


async def test_the_in_server_gateways_kv_index_fills(plane: ControlPlane) -> None:
    await _register(plane, "a1", "127.0.0.1")
    await _save(plane, _record("chat-1", 9001))
    _shard(plane, "chat-1", ShardState.READY)
    _kv(plane, "chat-1", BLOCK_KEYS[:50], reset=True)
    async with serve_gateway(plane, GatewayConfig(port=0)) as served:
        index = served.gateway.kv_index
        await _until(lambda: index.blocks_of("chat-1") == 50, "the full copy")
        _kv(plane, "chat-1", BLOCK_KEYS[50:60])
        await _until(lambda: index.blocks_of("chat-1") == 60, "a delta")
        assert index.match(BLOCK_KEYS[:70], ["chat-1"]) == {"chat-1": 60}
        _shard(plane, "chat-1", ShardState.STOPPED)
        await _until(lambda: not index.blocks_of("chat-1"), "the drop")
    assert plane.kv_blocks.stats().watchers == 0


class _StaleWakeup:
    """A KV watcher whose wakeup is set with nothing owed; counts how often it is asked."""

    def __init__(self) -> None:
        self.wakeup = asyncio.Event()
        self.wakeup.set()
        self.asked = 0

    @property
    def pending(self) -> bool:
        self.asked += 1
        return False


async def test_a_stale_kv_wakeup_does_not_spin_the_feed() -> None:
    """A set wakeup with nothing owed once kept the feed in a busy loop (the server at
    100 % CPU, found with real vLLM: its engines slowed to a crawl)."""
    from llmgw.server.wire.routersvc import _Sources

    async def no_events() -> AsyncIterator[WatchEvent]:
        await asyncio.Event().wait()
        yield WatchEvent()  # never reached

    kv = _StaleWakeup()
    sources = _Sources(no_events(), kv)  # type: ignore[arg-type]
    sources.synced = True
    waiting = asyncio.ensure_future(sources.next())
    await asyncio.sleep(0.2)
    assert not waiting.done()
    assert kv.asked <= 3, f"the feed asked {kv.asked} times in 0.2 s: it spins"
    kv.wakeup.set()  # something owed after all: it looks again, and goes on waiting
    await asyncio.sleep(0.05)
    assert not waiting.done() and kv.asked <= 5
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await sources.aclose()


async def test_serve_gateway_knows_the_tenants_keys_from_the_first_request(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def feed_not_yet(*_: object) -> None:  # the feed's first events not arrived yet
        await asyncio.Event().wait()

    monkeypatch.setattr(routersvc, "feed_table", feed_not_yet)
    await _register(plane, "a1", "127.0.0.1")
    await _save(plane, _record("chat-1", 9001))
    _shard(plane, "chat-1", ShardState.READY)
    digest = hashlib.sha256(b"llmgw_k_secret").digest()
    await plane.tenant_keys.add(StoredTenantKey("k_1", "team-a", digest, created_ms=1))
    async with serve_gateway(plane, GatewayConfig(port=0)) as served:
        async with httpx.AsyncClient(base_url=f"http://{served.host}:{served.port}") as client:
            # no wait for the feed: a table with targets and no keys would let this in
            assert (await client.get("/v1/models")).status_code == 401
            keyed = {"authorization": "Bearer llmgw_k_secret"}
            assert (await client.get("/v1/models", headers=keyed)).status_code == 200
