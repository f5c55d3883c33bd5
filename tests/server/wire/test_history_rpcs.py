"""Describe, ScaleDeployment, RolloutHistory and RolloutUndo through ControlService over a
plane with two simulated nodes and agents that report every started shard READY."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    ApplyDeploymentRequest,
    ControlMessage,
    Deployment,
    DescribeRequest,
    EngineProfile,
    Register,
    RolloutHistoryRequest,
    RolloutUndoRequest,
    ScaleRequest,
    ShardState,
    ShardStatus,
)
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server.core.fingerprint import profile_fingerprint
from llmgw.server.core.reconcile_state import Lifecycle
from llmgw.server.reconcile_loop import ReconcileLoop
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.controlsvc import ControlService

A = EngineProfile(
    name="chat-a", engine="sim", gpu_class="H100", tp=1, model_path="/m/chat",
    served_model_name="chat", env={"HF_TOKEN": "secret"},
)  # fmt: skip
B = EngineProfile(
    name="chat-b", engine="sim", gpu_class="H100", tp=1, model_path="/m/chat",
    served_model_name="chat", args=["--max-model-len", "4096"],
)  # fmt: skip


class Fleet:
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.svc = ControlService(plane)
        self.loop = ReconcileLoop(plane, self.send)

    async def send(self, node_id: str, message: ControlMessage) -> bool:
        start, stop = message.start_shard, message.drain_shard or message.stop_shard
        if start is not None:
            state, shard_id, replica_id = ShardState.READY, start.shard_id, start.replica_id
        elif stop is not None:
            shard = self.plane.inventory.shards[stop.shard_id]
            state, shard_id, replica_id = ShardState.STOPPED, stop.shard_id, shard.replica_id
        else:
            return True
        status = ShardStatus(shard_id=shard_id, replica_id=replica_id, state=state)
        self.plane.shard_status(node_id, status)
        return True

    async def settle(self, rounds: int = 10) -> None:
        for _ in range(rounds):
            await self.loop.round()

    def live_profiles(self) -> list[str]:
        live = (Lifecycle.ACTIVE, Lifecycle.SURGE)
        return sorted(r.plan.profile for r in self.plane.replicas.values() if r.lifecycle in live)

    async def apply(self, profile: EngineProfile, replicas: int = 2) -> None:
        deployment = Deployment(name="chat", profile=profile.name, replicas=replicas)
        await self.svc.apply_deployment(
            ApplyDeploymentRequest(deployment=deployment, profiles=[profile])
        )
        await self.settle()


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        for i, name in enumerate(("n1", "n2")):
            node = simulated_node("dgx-h100", node_id=name, hostname=name)
            register = Register(protocol_version=PROTOCOL_VERSION, node=node)
            await plane.register(node, register, peer=f"10.0.0.{i + 1}:5000")
        fleet = Fleet(plane)
        await fleet.apply(A)
        yield fleet


async def test_describe_tells_spec_replicas_shards_and_events(fleet: Fleet) -> None:
    await fleet.plane.history.flush(now=True)
    d = await fleet.svc.describe(DescribeRequest(kind="deployment", name="chat"))
    assert d.deployment is not None and d.deployment.replicas == 2
    assert d.profile is not None and d.profile.env == {"HF_TOKEN": "secret"}  # auth off: admin
    assert d.fingerprint == profile_fingerprint(A) and d.revision == 1
    assert sorted(r.replica.replica_id for r in d.replicas if r.replica) == ["chat-1", "chat-2"]
    assert all(r.lifecycle == "active" and r.planned[0].gpu_uuids for r in d.replicas)
    assert {s.shard_id for s in d.shards} == {"chat-1.0", "chat-2.0"}
    reasons = [(e.actor, e.reason) for e in d.events]
    assert ("operator", "apply") in reasons
    assert ("reconciler", "reconcile") in reasons
    assert any(actor.startswith("node/") and reason == "READY" for actor, reason in reasons)
    placed = [e.message for e in d.events if e.actor == "reconciler"]
    (first,) = [m for m in placed if m.startswith("placed active replica chat-1 of chat on n")]
    (shard,) = next(r for r in d.replicas if r.replica and r.replica.replica_id == "chat-1").planned
    assert f"({shard.gpu_uuids[0][:12]}; port {shard.port})" in first  # where, on which GPUs
    node = await fleet.svc.describe(DescribeRequest(kind="node", name="n1"))
    assert node.node is not None and node.node.state == "READY" and node.node.info is not None
    assert node.events[0].reason == "Registered"
    on_n1 = {s.shard_id for s in node.shards}
    assert on_n1 and {e.object for e in node.events[1:]} <= on_n1  # its shards' states
    replica = await fleet.svc.describe(DescribeRequest(kind="replica", name="chat-1"))
    assert [r.replica.replica_id for r in replica.replicas if r.replica] == ["chat-1"]


@pytest.mark.parametrize(
    ("kind", "name", "status", "text"),
    [
        ("deployment", "nope", Status.NOT_FOUND, "no deployment named 'nope'"),
        ("replica", "chat-9", Status.NOT_FOUND, "no replica named 'chat-9'"),
        ("node", "n9", Status.NOT_FOUND, "no node named 'n9'"),
        ("pod", "x", Status.INVALID_ARGUMENT, "cannot describe 'pod'"),
    ],
)
async def test_describe_refuses_what_it_does_not_know(
    fleet: Fleet, kind: str, name: str, status: Status, text: str
) -> None:
    with pytest.raises(GRPCError) as refused:
        await fleet.svc.describe(DescribeRequest(kind=kind, name=name))
    assert refused.value.status is status and text in str(refused.value.message)


async def test_scale_sets_the_count_durably_and_is_audited(fleet: Fleet) -> None:
    result = await fleet.svc.scale_deployment(ScaleRequest(deployment="chat", replicas=3))
    assert result.message == "deployment chat scaled from 2 to 3 replicas"
    await fleet.settle()
    assert fleet.live_profiles() == ["chat-a"] * 3
    (stored,) = await fleet.plane.store.load_deployments()
    assert Deployment.parse(stored.deployment).replicas == 3
    await fleet.svc.scale_deployment(ScaleRequest(deployment="chat", replicas=1))
    await fleet.settle()
    assert fleet.live_profiles() == ["chat-a"]
    audit = [r for r in await fleet.plane.store.recent_audit() if r.action == "scale"]
    assert [(r.target, r.result) for r in audit] == [
        ("deployment/chat", "ok: deployment chat scaled from 2 to 3 replicas"),
        ("deployment/chat", "ok: deployment chat scaled from 3 to 1 replica"),
    ]
    with pytest.raises(GRPCError) as refused:
        await fleet.svc.scale_deployment(ScaleRequest(deployment="nope", replicas=1))
    assert refused.value.status is Status.NOT_FOUND


async def test_rollout_history_and_undo(fleet: Fleet) -> None:
    await fleet.apply(B)
    assert fleet.live_profiles() == ["chat-b", "chat-b"]
    history = await fleet.svc.rollout_history(RolloutHistoryRequest(deployment="chat"))
    assert [(r.revision, r.profile, r.cause) for r in history.revisions] == [
        (1, "chat-a", "apply"),
        (2, "chat-b", "apply"),
    ]
    assert history.current == 2
    result = await fleet.svc.rollout_undo(RolloutUndoRequest(deployment="chat"))
    assert result.message.startswith("deployment chat rolled back to revision 1: profile chat-a")
    await fleet.settle()
    assert fleet.live_profiles() == ["chat-a", "chat-a"]
    history = await fleet.svc.rollout_history(RolloutHistoryRequest(deployment="chat"))
    assert history.revisions[-1].cause == "rollout undo to revision 1" and history.current == 3
    with pytest.raises(GRPCError) as refused:
        await fleet.svc.rollout_undo(RolloutUndoRequest(deployment="chat", to_revision=7))
    assert refused.value.status is Status.NOT_FOUND
    assert "has no revision 7 (kept: 1, 2, 3)" in str(refused.value.message)
    with pytest.raises(GRPCError) as refused:
        await fleet.svc.rollout_undo(RolloutUndoRequest(deployment="chat", to_revision=3))
    assert refused.value.status is Status.FAILED_PRECONDITION


async def test_undo_restores_changed_content_or_refuses_when_shared(fleet: Fleet) -> None:
    changed = EngineProfile.parse(bytes(A))
    changed.args = ["--max-model-len", "2048"]
    await fleet.apply(changed)  # same name, new content: revision 2
    await fleet.svc.rollout_undo(RolloutUndoRequest(deployment="chat"))
    assert profile_fingerprint(fleet.plane.desired.profiles["chat-a"]) == profile_fingerprint(A)
    other = Deployment(name="other", profile="chat-a", replicas=0)
    await fleet.svc.apply_deployment(ApplyDeploymentRequest(deployment=other))
    with pytest.raises(GRPCError) as refused:
        await fleet.svc.rollout_undo(RolloutUndoRequest(deployment="chat", to_revision=2))
    assert refused.value.status is Status.FAILED_PRECONDITION
    assert "deployments other use it" in str(refused.value.message)
