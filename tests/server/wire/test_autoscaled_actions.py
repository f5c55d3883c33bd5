"""Operator actions on a deployment the autoscaler owns (mode act), on an in-process
ControlService and reconcile loop (``test_operator_actions``' fleet): a drain replaces the
replica and keeps the count; scale and start are refused and change nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from test_operator_actions import OLD, Fleet

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    ApplyDeploymentRequest,
    AutoscalePolicy,
    Deployment,
    Register,
    ReplicaRequest,
    ScaleRequest,
)
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server.core.reconcile_state import Lifecycle
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.controlsvc import ControlService

POLICY = AutoscalePolicy(min=2, max=4, ttft_p90_ms=800, scale_down_after_s=300, mode="act")


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        node = simulated_node("dgx-h100", node_id="n1", hostname="n1")
        await plane.register(
            node, Register(protocol_version=PROTOCOL_VERSION, node=node), peer="10.0.0.1:5000"
        )
        deployment = Deployment(name="chat", profile="chat-a", autoscale=POLICY)
        request = ApplyDeploymentRequest(deployment=deployment, profiles=[OLD])
        await ControlService(plane).apply_deployment(request)
        fleet = Fleet(plane)
        await fleet.settle()
        assert fleet.live() == ["chat-1", "chat-2"]  # a new deployment starts at min
        yield fleet


async def test_a_drain_replaces_the_replica_and_keeps_the_autoscalers_count(
    fleet: Fleet,
) -> None:
    result = await fleet.svc.drain_replica(ReplicaRequest(replica_id="chat-1"))
    assert "chat-1 draining; deployment chat is autoscaled and keeps 2 replicas" in (result.message)
    assert fleet.count() == 2
    await fleet.settle()
    assert fleet.agents.drained() == ["chat-1.0"]
    assert fleet.lifecycles()["chat-1"] is Lifecycle.RETIRED
    assert len(fleet.live()) == 2 and "chat-1" not in fleet.live()


async def test_scale_and_start_are_refused_and_change_nothing(fleet: Fleet) -> None:
    for call in (
        fleet.svc.scale_deployment(ScaleRequest(deployment="chat", replicas=3)),
        fleet.svc.start_replica(ReplicaRequest(deployment="chat")),
    ):
        with pytest.raises(GRPCError) as caught:
            await call
        assert caught.value.status is Status.FAILED_PRECONDITION
    await fleet.settle()
    assert fleet.count() == 2 and fleet.live() == ["chat-1", "chat-2"]
