"""The reconcile loop against an in-process ControlPlane with a fake agent sender."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    ApplyDeploymentRequest,
    ControlMessage,
    Deployment,
    EngineProfile,
    Register,
    ShardState,
    ShardStatus,
)
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server.core.plan import ReplicaPlan, ShardPlan
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord, crash_delay
from llmgw.server.reconcile_loop import ReconcileLoop, api_key_for
from llmgw.server.state.desired import check_apply
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.replicajson import decode_replica, encode_replica
from llmgw.server.state.store import Store
from llmgw.server.state.storeschema import SCHEMA_VERSION

PROFILE = EngineProfile(
    name="chat-tp2", engine="sim", gpu_class="H100", tp=2, model_path="/m/chat",
    served_model_name="chat",
)  # fmt: skip


class FakeAgents:
    """Records every command, and what the store held for its replica when it was sent."""

    def __init__(self, plane: ControlPlane, connected: set[str]) -> None:
        self.plane = plane
        self.connected = connected
        self.sent: list[tuple[str, ControlMessage]] = []
        self.stored_when_sent: list[bool] = []

    async def send(self, node_id: str, message: ControlMessage) -> bool:
        if node_id not in self.connected:
            return False
        start = message.start_shard
        if start is not None:
            stored = {r.replica_id for r in await self.plane.store.load_replicas()}
            self.stored_when_sent.append(start.replica_id in stored)
        self.sent.append((node_id, message))
        return True

    def starts(self) -> dict[str, str]:
        """Shard id → node of every StartShard sent."""
        return {m.start_shard.shard_id: n for n, m in self.sent if m.start_shard is not None}


async def _register(plane: ControlPlane, node_id: str, *shards: ShardStatus) -> None:
    node = simulated_node("dgx-h100", node_id=node_id, hostname=node_id)
    message = Register(protocol_version=PROTOCOL_VERSION, node=node, shards=list(shards))
    await plane.register(node, message, peer=f"10.0.0.{len(plane.inventory.nodes) + 1}:5000")


async def _apply(plane: ControlPlane, replicas: int) -> None:
    deployment = Deployment(name="chat", profile="chat-tp2", replicas=replicas)
    request = ApplyDeploymentRequest(deployment=deployment, profiles=[PROFILE])
    await plane.desired.apply(check_apply(request, plane.desired.profiles))


def _ready(loop_plane: ControlPlane, agents: FakeAgents) -> list[ShardStatus]:
    """Every started shard reported READY by its node (as its agent would)."""
    out = []
    for node_id, message in agents.sent:
        start = message.start_shard
        if start is None:
            continue
        status = ShardStatus(
            shard_id=start.shard_id,
            replica_id=start.replica_id,
            state=ShardState.READY,
            endpoint=f"http://127.0.0.1:{start.port}",
            profile_fingerprint=start.profile_fingerprint,
            gpu_uuids=start.gpu_uuids,
        )
        loop_plane.shard_status(node_id, status)
        out.append(status)
    return out


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        yield plane


async def test_apply_places_persists_before_sending_and_a_second_round_sends_nothing(
    plane: ControlPlane,
) -> None:
    agents = FakeAgents(plane, {"a1", "a2"})
    loop = ReconcileLoop(plane, agents.send)
    pokes: list[int] = []
    plane.reconcile_soon = lambda: pokes.append(1)
    await _register(plane, "a1")
    await _register(plane, "a2")
    assert pokes  # a registration asks for a round
    await _apply(plane, 4)

    decision = await loop.round()
    starts = agents.starts()
    assert len(decision.replicas) == 4 and len(starts) == 4  # one node each: one shard
    assert agents.stored_when_sent == [True] * len(agents.sent)
    assert sorted(set(starts.values())) == ["a1", "a2"]  # spread over both nodes
    for node_id, message in agents.sent:
        start = message.start_shard
        assert start is not None and len(start.gpu_uuids) == 2
        record = plane.replicas[start.replica_id]
        assert record.plan.shards[0].node_id == node_id
        assert start.api_key == record.api_key and len(record.api_key) >= 32

    sent = len(agents.sent)
    await loop.round()
    assert len(agents.sent) == sent  # level-based: in flight, nothing new

    _ready(plane, agents)
    cluster = plane.snapshot()
    assert [r.state for r in cluster.replicas] == [ShardState.READY] * 4
    replica = cluster.replicas[0]
    assert replica.model == "chat" and not replica.out_of_date
    node = plane.replicas[replica.replica_id].plan.leader.node_id
    port = plane.replicas[replica.replica_id].plan.leader.port
    peer = plane.inventory.nodes[node].peer.rpartition(":")[0]
    assert replica.endpoint == f"http://{peer}:{port}"
    await loop.round()
    assert len(agents.sent) == sent
    audit = [e for e in plane.snapshot().events if e.actor == "reconciler"]
    assert sum("placed active replica" in e.result for e in audit) == 4


async def test_restart_from_the_store_adopts_running_shards_without_starting_them_again(
    tmp_path: Path,
) -> None:
    db = tmp_path / "s.db"
    async with Store(db) as store:
        plane = ControlPlane(store)
        await plane.load()
        agents = FakeAgents(plane, {"a1", "a2"})
        loop = ReconcileLoop(plane, agents.send)
        await _register(plane, "a1")
        await _register(plane, "a2")
        await _apply(plane, 4)
        await loop.round()
        running = _ready(plane, agents)
        records = dict(plane.replicas)
    async with Store(db) as store:  # the server again, from its file
        plane = ControlPlane(store)
        await plane.load()
        assert plane.replicas == records
        agents = FakeAgents(plane, {"a1", "a2"})
        loop = ReconcileLoop(plane, agents.send)
        await loop.round()
        assert agents.sent == []  # its nodes are not back: nothing to anyone
        for node_id in ("a1", "a2"):
            mine = [s for s in running if records[s.replica_id].plan.leader.node_id == node_id]
            await _register(plane, node_id, *mine)
        await loop.round()
        assert agents.sent == []  # every shard adopted, none started twice
        assert [r.state for r in plane.snapshot().replicas] == [ShardState.READY] * 4


async def test_scale_down_drains_extras_and_unknown_shards_are_stopped(
    plane: ControlPlane,
) -> None:
    agents = FakeAgents(plane, {"a1"})
    loop = ReconcileLoop(plane, agents.send)
    stray = ShardStatus(shard_id="ghost-1.0", replica_id="ghost-1", state=ShardState.READY)
    await _register(plane, "a1", stray)
    await _apply(plane, 2)
    await loop.round()
    stops = [m.stop_shard.shard_id for _, m in agents.sent if m.stop_shard is not None]
    assert stops == ["ghost-1.0"]
    _ready(plane, agents)
    await _apply(plane, 1)
    await loop.round()
    drains = [m.drain_shard.shard_id for _, m in agents.sent if m.drain_shard is not None]
    assert len(drains) == 1
    retiring = [r for r in plane.replicas.values() if r.lifecycle is Lifecycle.RETIRING]
    assert [r.plan.shards[0].shard_id for r in retiring] == drains
    views = {r.replica_id: r.state for r in plane.snapshot().replicas}
    assert views[retiring[0].replica_id] is ShardState.DRAINING
    plane.shard_status(
        "a1", ShardStatus(shard_id=drains[0], replica_id=retiring[0].replica_id,
                          state=ShardState.STOPPED)
    )  # fmt: skip
    await loop.round()
    assert plane.replicas[retiring[0].replica_id].lifecycle is Lifecycle.RETIRED
    assert retiring[0].replica_id not in {r.replica_id for r in plane.snapshot().replicas}


async def test_unplaceable_is_audited_once_and_an_unsent_command_is_retried(
    plane: ControlPlane,
) -> None:
    agents = FakeAgents(plane, set())  # registered, but sends fail
    loop = ReconcileLoop(plane, agents.send)
    await _register(plane, "a1")
    await _apply(plane, 5)  # 4 fit on one DGX at TP=2
    await loop.round()
    await loop.round()
    unplaceable = [e for e in plane.snapshot().events if e.action == "unplaceable"]
    assert len(unplaceable) == 1 and unplaceable[0].target == "deployment/chat"
    assert "chat" in loop.unplaceable
    assert loop.pending == {}  # nothing reached the agent: nothing in flight
    agents.connected.add("a1")
    await loop.round()
    assert len(agents.starts()) == 4


async def test_a_replica_that_keeps_failing_is_restarted_in_place_with_a_growing_delay(
    plane: ControlPlane,
) -> None:
    now = [100.0]
    agents = FakeAgents(plane, {"a1", "a2"})
    loop = ReconcileLoop(plane, agents.send, clock=lambda: now[0])
    for node_id in ("a1", "a2"):
        await _register(plane, node_id)
    await _apply(plane, 1)
    handled = [0]

    def agent_acts() -> None:  # every start fails at once, as its agent gives up; stop stops
        for node_id, message in agents.sent[handled[0] :]:
            start, stop = message.start_shard, message.stop_shard
            if start is not None:
                status = ShardStatus(
                    shard_id=start.shard_id, replica_id=start.replica_id,
                    state=ShardState.FAILED, reason="engine exited 1", gave_up=True,
                )  # fmt: skip
                plane.shard_status(node_id, status)
            if stop is not None:
                replica = stop.shard_id.rpartition(".")[0]
                status = ShardStatus(shard_id=stop.shard_id, replica_id=replica,
                                     state=ShardState.STOPPED)  # fmt: skip
                plane.shard_status(node_id, status)
        handled[0] = len(agents.sent)

    def starts() -> list[str]:
        return [m.start_shard.shard_id for _, m in agents.sent if m.start_shard is not None]

    async def at(t: float) -> list[str]:
        now[0] = t
        agent_acts()
        await loop.round()
        return starts()

    assert await at(100.0) == ["chat-1.0"]
    assert await at(100.0) == ["chat-1.0", "chat-2.0"]  # the first failure: replaced at once
    assert await at(101.0) == ["chat-1.0", "chat-2.0"]  # chat-2 failed too: crash-looping
    assert agents.sent[-1][1].stop_shard is not None  # stopped at once: no agent restarts
    assert await at(101.5) == ["chat-1.0", "chat-2.0"]
    why = loop.unplaceable["chat"]
    assert why.startswith("replica chat-2 is crash-looping (2 failures in a row)")
    assert "engine exited 1" in why and plane.replicas["chat-2"].lifecycle.value == "active"
    (view,) = plane.snapshot().replicas
    assert (view.replica_id, view.state) == ("chat-2", ShardState.FAILED)
    assert await at(110.9) == ["chat-1.0", "chat-2.0"]  # its delay: 10 s
    assert await at(111.0) == ["chat-1.0", "chat-2.0", "chat-2.0"]  # started again in place
    await at(111.5)  # failed again: 3 in a row, stopped, 20 s
    assert loop.crashloops["chat-2"].failures == 3
    assert await at(131.4) == ["chat-1.0", "chat-2.0", "chat-2.0"]
    assert await at(131.5) == ["chat-1.0", *["chat-2.0"] * 3]  # the same id, never a new one
    events = [e.result for e in plane.snapshot().events if e.target == "chat-2"]
    assert any("crash-looping (3 failures in a row)" in e for e in events)
    assert set(plane.replicas) == {"chat-1", "chat-2"}
    assert [crash_delay(n, loop.config) for n in (0, 1, 2, 3, 20)] == [0, 5, 10, 20, 300]


async def test_a_port_another_process_holds_is_not_placed_again(plane: ControlPlane) -> None:
    agents = FakeAgents(plane, {"a1"})
    loop = ReconcileLoop(plane, agents.send, port_range=(20000, 20009))
    await _register(plane, "a1")
    await _apply(plane, 1)
    await loop.round()
    (start,) = [m.start_shard for _, m in agents.sent if m.start_shard is not None]
    assert start.port == 20000
    refused = ShardStatus(
        shard_id=start.shard_id, replica_id=start.replica_id, state=ShardState.FAILED,
        reason="port 20000 on 127.0.0.1 is in use by another process", gave_up=True,
        port_in_use=20000,
    )  # fmt: skip
    plane.shard_status("a1", refused)
    await loop.round()
    starts = [m.start_shard for _, m in agents.sent if m.start_shard is not None]
    assert [s.replica_id for s in starts] == ["chat-1", "chat-2"]
    assert starts[1].port == 20001 and ("a1", 20000) in loop.busy_ports


def test_api_keys_never_start_with_a_dash() -> None:
    assert not any(api_key_for("r").startswith("-") for _ in range(2000))


def test_a_record_survives_its_encoding() -> None:
    plan = ReplicaPlan(
        "chat-1", "chat", "chat-tp2", "fp-1",
        (ShardPlan("chat-1.0", "a1", 0, ("g0", "g1"), 20000, ("mlx5_0",), 0),
         ShardPlan("chat-1.1", "a2", 1, ("g2",), 20001)),
        master_port=20002,
    )  # fmt: skip
    record = ReplicaRecord(plan, PROFILE, Lifecycle.SURGE, 7, "key", "chat-0")
    assert decode_replica(encode_replica(record)) == record


async def test_a_schema_2_file_gains_the_replicas_and_requests_tables(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "v2.db"
    async with Store(db):
        pass
    with sqlite3.connect(db) as conn:  # back to version 2 as it shipped: no replicas table
        conn.executescript(
            "DROP TABLE replicas; DROP TABLE replica_requests; PRAGMA user_version=2;"
        )
    conn.close()
    plan = ReplicaPlan(
        "chat-1", "chat", "chat-tp2", "fp-1", (ShardPlan("chat-1.0", "a1", 0, ("g0",), 20000),)
    )
    record = ReplicaRecord(plan, PROFILE, Lifecycle.RETIRED, 1, "key")
    async with Store(db) as store:
        await store.save_replicas([record])
    async with Store(db) as store:
        assert await store.load_replicas() == [record]  # RETIRED records are kept
        assert await store.load_requests() == []
    with sqlite3.connect(db) as conn:
        (version,) = conn.execute("PRAGMA user_version").fetchone()
    conn.close()
    assert version == SCHEMA_VERSION == 10
