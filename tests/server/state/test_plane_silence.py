"""A node that misses heartbeats, a server that did not run, a server that restarted.

All found by bench/chaos.py: a SIGSTOPped agent (or a SIGSTOPped server, which on waking
saw every node silent) lost its replicas' KV blocks for good, as the stream that resumed
carried only changes; and a restarted server's router feed told gateways that replicas
were down until their agents came back, so requests for their model got 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_kvblocks import KEYS, _decoded, _registered

from llmgw.api.llmgw.v1 import Heartbeat, NodeState, ShardState
from llmgw.server.state.inventory import InventoryConfig
from llmgw.server.state.plane import STALL_S, ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.routersvc import route_events


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store, InventoryConfig(grace_s=5.0))
        await plane.load()
        yield plane


def _age(plane: ControlPlane, seconds: float) -> None:
    """Make n1's last heartbeat ``seconds`` older, as if that much time had passed."""
    record = plane.inventory.nodes["n1"]
    assert record.last_heartbeat_mono is not None
    record.last_heartbeat_mono -= seconds


def _state(plane: ControlPlane) -> NodeState:
    return plane.inventory.state(plane.inventory.nodes["n1"], time.monotonic())


async def test_blocks_survive_missed_heartbeats_and_the_stream_carries_on(
    plane: ControlPlane,
) -> None:
    connection = await _registered(plane)
    plane.kv_delta("n1", connection, _decoded(KEYS[:5], reset=True))
    await plane.tick()
    _age(plane, 10)  # the agent was hung: no heartbeat for longer than the grace
    await plane.tick()
    assert _state(plane) is NodeState.NOT_READY
    assert sorted(plane.kv_blocks.keys("chat-1")) == sorted(KEYS[:5])  # kept
    # it wakes up: a heartbeat, then the changes of the silence on the same stream
    assert plane.heartbeat("n1", connection, Heartbeat())
    plane.kv_delta("n1", connection, _decoded(KEYS[5:7], removed=KEYS[:1]))
    assert _state(plane) is NodeState.READY
    assert sorted(plane.kv_blocks.keys("chat-1")) == sorted(KEYS[1:7])


async def test_time_the_server_did_not_run_is_not_node_silence(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    connection = await _registered(plane)
    plane.kv_delta("n1", connection, _decoded(KEYS[:5], reset=True))
    clock = [1000.0]
    monkeypatch.setattr("llmgw.server.state.plane.time.monotonic", lambda: clock[0])
    plane.inventory.nodes["n1"].last_heartbeat_mono = clock[0] - 0.9
    for _ in range(3):  # the usual: a tick every 0.5 s
        await plane.tick()
        clock[0] += 0.5
    clock[0] += 4.6  # stopped: the heartbeats of those seconds wait unread in the socket
    await plane.tick()
    record = plane.inventory.nodes["n1"]
    assert record.last_heartbeat_mono is not None
    assert clock[0] - record.last_heartbeat_mono < 5.0  # not silent beyond the grace
    assert plane.inventory.state(record, clock[0]) is NodeState.READY
    assert len(plane.kv_blocks.keys("chat-1")) == 5
    for _ in range(12):  # then truly silent while the server ticks as usual: NOT_READY
        clock[0] += 0.5
        await plane.tick()
    assert plane.inventory.state(record, clock[0]) is NodeState.NOT_READY
    assert len(plane.kv_blocks.keys("chat-1")) == 5  # kept until the stream ends
    assert STALL_S < 4.6


async def test_a_node_whose_stream_ends_loses_its_blocks(plane: ControlPlane) -> None:
    connection = await _registered(plane)
    plane.kv_delta("n1", connection, _decoded(KEYS[:5], reset=True))
    plane.disconnect("n1", connection, "stream closed")
    assert plane.kv_blocks.replica_ids() == []


async def test_a_restarted_servers_feed_waits_for_the_agents_it_remembers(tmp_path: Path) -> None:
    async with Store(tmp_path / "s.db") as store:
        before = ControlPlane(store, InventoryConfig(grace_s=5.0))
        await before.load()
        await _registered(before)  # n1 and its replica chat-1, READY, in the store
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store, InventoryConfig(grace_s=5.0))
        await plane.load()  # the server restarted: n1 is remembered, not back yet
        feed = route_events(plane)
        first = asyncio.ensure_future(anext(feed))
        try:
            await asyncio.sleep(0.3)
            assert not first.done()  # no snapshot that would call chat-1 down
            await _registered(plane)
            event = await asyncio.wait_for(first, 5)
        finally:
            first.cancel()
            await feed.aclose()
        assert event.snapshot is not None
        assert [(t.replica_id, t.state) for t in event.snapshot.targets] == [
            ("chat-1", ShardState.READY)
        ]
        started = time.monotonic()
        plane.disconnect("n1", plane.inventory.nodes["n1"].connection, "gone")
        await plane.agents_back(timeout_s=5.0)  # back once: later losses hold nobody
        assert time.monotonic() - started < 1.0  # no wait for the 5 s


async def test_a_node_that_never_comes_back_holds_the_feed_only_so_long(tmp_path: Path) -> None:
    async with Store(tmp_path / "s.db") as store:
        before = ControlPlane(store, InventoryConfig(grace_s=5.0))
        await before.load()
        await _registered(before)
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store, InventoryConfig(grace_s=5.0))
        await plane.load()
        started = time.monotonic()
        await plane.agents_back(timeout_s=0.3)
        assert 0.25 < time.monotonic() - started < 2.0
