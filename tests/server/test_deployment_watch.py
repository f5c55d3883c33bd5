"""Deployment statuses on Watch: an in-process ControlPlane and ReconcileLoop, one simulated
DGX node, shard reports as its agent would send them; every change of a status is a
``deployment`` delta, and a snapshot shows the same."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    ApplyDeploymentRequest,
    ControlMessage,
    Deployment,
    DeploymentStatus,
    EngineProfile,
    Register,
    ShardState,
    ShardStatus,
    WatchEvent,
)
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server.reconcile_loop import ReconcileLoop
from llmgw.server.state.desired import check_apply
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store

PROFILE = EngineProfile(
    name="chat-tp2", engine="sim", gpu_class="H100", tp=2, model_path="/m/chat",
    served_model_name="chat",
)  # fmt: skip


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        yield plane


def _statuses(events: list[WatchEvent]) -> list[DeploymentStatus]:
    return [e.deployment.status for e in events if e.deployment and e.deployment.status]


async def test_every_status_change_is_a_deployment_delta(plane: ControlPlane) -> None:
    sent: list[ControlMessage] = []

    async def send(node_id: str, message: ControlMessage) -> bool:
        sent.append(message)
        return True

    loop = ReconcileLoop(plane, send)
    events: list[WatchEvent] = []
    publish = plane.hub.publish

    def recorded(event: WatchEvent) -> None:
        events.append(event)
        publish(event)

    plane.hub.publish = recorded  # type: ignore[method-assign]
    node = simulated_node("dgx-h100", node_id="a1", hostname="a1")
    await plane.register(
        node, Register(protocol_version=PROTOCOL_VERSION, node=node), peer="10.0.0.1:5000"
    )
    deployment = Deployment(name="chat", profile="chat-tp2", replicas=5)  # 8 GPUs hold four
    request = ApplyDeploymentRequest(deployment=deployment, profiles=[PROFILE])
    await plane.desired.apply(check_apply(request, plane.desired.profiles))
    (applied,) = _statuses(events)
    assert (applied.desired, applied.replicas, applied.unplaceable) == (5, 0, 0)

    events.clear()
    await loop.round()
    (placed,) = _statuses(events)
    assert (placed.replicas, placed.starting, placed.unplaceable) == (4, 4, 1)
    assert "H100" in placed.unplaceable_reason and placed.reason == placed.unplaceable_reason

    events.clear()
    for message in sent:
        start = message.start_shard
        assert start is not None
        status = ShardStatus(
            shard_id=start.shard_id, replica_id=start.replica_id, state=ShardState.READY
        )
        plane.shard_status("a1", status)
    ready = [s.ready for s in _statuses(events)]
    assert ready == [1, 2, 3, 4]  # one delta per replica that became ready, none besides
    (shown,) = plane.snapshot().deployments
    assert shown.status == _statuses(events)[-1]
    assert plane.desired.deployments["chat"].status is None  # the stored one carries none

    events.clear()
    await loop.round()  # the same shortfall: no change, no delta
    assert _statuses(events) == []

    plane.disconnect("a1", 1, "stream closed")
    (lost,) = _statuses(events)
    assert (lost.ready, lost.available) == (0, 0)
    available = next(c for c in lost.conditions if c.type == "Available")
    assert (available.status, available.message) == (False, "0 of 5 replicas ready")


async def test_a_restarted_server_shows_the_stored_replicas_in_the_status(tmp_path: Path) -> None:
    async def send(node_id: str, message: ControlMessage) -> bool:
        return True

    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        node = simulated_node("dgx-h100", node_id="a1", hostname="a1")
        register = Register(protocol_version=PROTOCOL_VERSION, node=node)
        await plane.register(node, register, peer="10.0.0.1:5000")
        deployment = Deployment(name="chat", profile="chat-tp2", replicas=2)
        request = ApplyDeploymentRequest(deployment=deployment, profiles=[PROFILE])
        await plane.desired.apply(check_apply(request, plane.desired.profiles))
        await ReconcileLoop(plane, send).round()
    async with Store(tmp_path / "s.db") as store:
        again = ControlPlane(store)
        await again.load()  # no agent back yet, no round yet
        (shown,) = again.snapshot().deployments
        assert shown.status is not None
        assert (shown.status.desired, shown.status.replicas, shown.status.ready) == (2, 2, 0)
        assert shown.status.reason == "replica chat-1: node a1 is NOT_READY"
