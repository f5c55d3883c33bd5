"""Operator actions (start, drain, reprofile, drain a node) on an in-process ControlService
and control plane, with rounds of the reconcile loop against a fake agent sender."""

from __future__ import annotations

import asyncio
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
    EngineProfile,
    NodeRequest,
    Register,
    ReplicaRequest,
    ReprofileReplicaRequest,
    ShardState,
    ShardStatus,
)
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server.core.fingerprint import profile_fingerprint
from llmgw.server.core.reconcile_state import Lifecycle
from llmgw.server.reconcile_loop import ReconcileLoop
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.state.storeschema import AuditRecord
from llmgw.server.wire.controlsvc import ControlService

OLD = EngineProfile(
    name="chat-a", engine="sim", gpu_class="H100", tp=1, model_path="/m/chat",
    served_model_name="chat",
)  # fmt: skip
NEW = EngineProfile(
    name="chat-b", engine="sim", gpu_class="H100", tp=1, model_path="/m/chat",
    served_model_name="chat", args=["--max-model-len", "4096"],
)  # fmt: skip


class Agents:
    """Every command sent; started shards are reported READY, drained ones STOPPED."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.sent: list[tuple[str, ControlMessage]] = []

    async def send(self, node_id: str, message: ControlMessage) -> bool:
        self.sent.append((node_id, message))
        if (start := message.start_shard) is not None:
            self._report(node_id, start.shard_id, start.replica_id, ShardState.READY, start)
        for stop in (message.drain_shard, message.stop_shard):
            if stop is not None:
                shard = self.plane.inventory.shards[stop.shard_id]
                self._report(node_id, stop.shard_id, shard.replica_id, ShardState.STOPPED)
        return True

    def _report(
        self, node_id: str, shard_id: str, replica_id: str, state: ShardState, start: object = None
    ) -> None:
        fingerprint = getattr(start, "profile_fingerprint", "")
        status = ShardStatus(
            shard_id=shard_id, replica_id=replica_id, state=state,
            profile_fingerprint=fingerprint,
        )  # fmt: skip
        self.plane.shard_status(node_id, status)

    def drained(self) -> list[str]:
        return [m.drain_shard.shard_id for _, m in self.sent if m.drain_shard is not None]


class Fleet:
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.agents = Agents(plane)
        self.loop = ReconcileLoop(plane, self.agents.send)
        self.svc = ControlService(plane)

    async def settle(self, rounds: int = 8) -> None:
        for _ in range(rounds):
            await self.loop.round()

    def lifecycles(self) -> dict[str, Lifecycle]:
        return {k: r.lifecycle for k, r in sorted(self.plane.replicas.items())}

    def live(self) -> list[str]:
        live = (Lifecycle.ACTIVE, Lifecycle.SURGE)
        return [k for k, life in self.lifecycles().items() if life in live]

    def count(self) -> int:
        return self.plane.desired.deployments["chat"].replicas

    async def operator_audit(self) -> list[AuditRecord]:
        records = await self.plane.store.recent_audit(1000)
        ours = (r for r in records if r.actor == "operator" and r.action != "apply")
        return sorted(ours, key=lambda r: r.at_ms)


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        for i, name in enumerate(("n1", "n2")):
            node = simulated_node("dgx-h100", node_id=name, hostname=name)
            register = Register(protocol_version=PROTOCOL_VERSION, node=node)
            await plane.register(node, register, peer=f"10.0.0.{i + 1}:5000")
        deployment = Deployment(name="chat", profile="chat-a", replicas=2)
        request = ApplyDeploymentRequest(deployment=deployment, profiles=[OLD, NEW])
        await ControlService(plane).apply_deployment(request)
        fleet = Fleet(plane)
        await fleet.settle()
        assert fleet.live() == ["chat-1", "chat-2"]
        yield fleet


async def test_drain_retires_that_replica_and_lowers_the_count(fleet: Fleet) -> None:
    result = await fleet.svc.drain_replica(ReplicaRequest(replica_id="chat-1"))
    assert result.ok and "chat-1 draining" in result.message
    assert fleet.count() == 1
    stored = {d.name: d for d in await fleet.plane.store.load_deployments()}
    assert Deployment.parse(stored["chat"].deployment).replicas == 1  # durably
    await fleet.settle()
    assert fleet.agents.drained() == ["chat-1.0"]
    assert fleet.lifecycles() == {"chat-1": Lifecycle.RETIRED, "chat-2": Lifecycle.ACTIVE}
    assert fleet.plane.desired.retire == set()  # the request is forgotten once done
    (audit,) = await fleet.operator_audit()
    assert (audit.action, audit.target) == ("drain", "replica/chat-1")
    assert audit.result.startswith("ok: replica chat-1 draining")


async def restarted(fleet: Fleet) -> Fleet:
    """A new plane over the same store, as a server killed and started again sees it."""
    plane = ControlPlane(fleet.plane.store)
    await plane.load()
    for node_id, record in fleet.plane.inventory.nodes.items():
        shards = [s.status for s in fleet.plane.inventory.shards_of(node_id) if s.status]
        register = Register(protocol_version=PROTOCOL_VERSION, node=record.info, shards=shards)
        await plane.register(record.info, register, peer="10.0.0.9:5000")
    return Fleet(plane)


async def test_a_drain_stored_before_a_kill_retires_that_replica_after_restart(
    fleet: Fleet,
) -> None:
    await fleet.svc.drain_replica(ReplicaRequest(replica_id="chat-2"))  # no round runs
    again = await restarted(fleet)
    assert again.plane.desired.retire == {"chat-2"}
    await again.settle()
    assert again.lifecycles() == {"chat-1": Lifecycle.ACTIVE, "chat-2": Lifecycle.RETIRED}
    assert await again.plane.store.load_requests() == []  # forgotten once carried out


async def test_a_node_drain_stored_before_a_kill_still_moves_its_replicas(fleet: Fleet) -> None:
    on_n1 = {k for k in fleet.live() if "n1" in fleet.plane.replicas[k].plan.nodes}
    await fleet.svc.drain_node(NodeRequest(node_id="n1"))  # no round runs
    again = await restarted(fleet)
    assert again.plane.desired.replace == on_n1
    await again.settle(12)
    assert all(again.plane.replicas[k].plan.nodes == ("n2",) for k in again.live())
    assert all(again.lifecycles()[k] is Lifecycle.RETIRED for k in on_n1)


async def test_two_drains_at_once_each_lower_the_count(fleet: Fleet) -> None:
    await asyncio.gather(
        fleet.svc.drain_replica(ReplicaRequest(replica_id="chat-1")),
        fleet.svc.drain_replica(ReplicaRequest(replica_id="chat-2")),
    )
    assert fleet.count() == 0
    await fleet.settle()
    assert fleet.live() == []


async def test_start_scales_up_by_one_and_refuses_a_running_replica(fleet: Fleet) -> None:
    with pytest.raises(GRPCError) as running:
        await fleet.svc.start_replica(ReplicaRequest(replica_id="chat-2"))
    assert running.value.status is Status.FAILED_PRECONDITION
    assert running.value.message == "replica chat-2 already running"
    assert fleet.count() == 2
    result = await fleet.svc.start_replica(ReplicaRequest(deployment="chat"))
    assert result.message == "deployment chat scaled up to 3 replicas"
    await fleet.settle()
    assert fleet.live() == ["chat-1", "chat-2", "chat-3"]
    refused, started = await fleet.operator_audit()
    assert refused.result == "refused: replica chat-2 already running"
    assert (started.action, started.target, started.result[:3]) == (
        "start",
        "deployment/chat",
        "ok:",
    )


async def test_start_names_a_retired_replica_to_bring_its_deployment_back_up(fleet: Fleet) -> None:
    await fleet.svc.drain_replica(ReplicaRequest(replica_id="chat-2"))
    await fleet.settle()
    await fleet.svc.start_replica(ReplicaRequest(replica_id="chat-2"))
    await fleet.settle()
    assert fleet.count() == 2
    assert fleet.live() == ["chat-1", "chat-3"]


async def test_reprofile_replaces_every_replica_one_surge_at_a_time(fleet: Fleet) -> None:
    request = ReprofileReplicaRequest(replica_id="chat-1", profile="chat-b")
    result = await fleet.svc.reprofile_replica(request)
    assert result.message.startswith("deployment chat reprofiled to chat-b")
    assert fleet.plane.desired.deployments["chat"].profile == "chat-b"
    active, live = [], []
    for _ in range(10):
        await fleet.loop.round()
        active.append(sum(life is Lifecycle.ACTIVE for life in fleet.lifecycles().values()))
        live.append(len(fleet.live()))
    assert min(active) >= 2 and max(live) == 3  # never below the count; a surge of one
    fingerprints = {fleet.plane.replicas[k].plan.fingerprint for k in fleet.live()}
    assert fingerprints == {profile_fingerprint(fleet.plane.desired.profiles["chat-b"])}
    assert len(fleet.live()) == 2


async def test_drain_node_cordons_and_moves_its_replicas_before_retiring_them(
    fleet: Fleet,
) -> None:
    on_n1 = [k for k in fleet.live() if "n1" in fleet.plane.replicas[k].plan.nodes]
    assert on_n1
    result = await fleet.svc.drain_node(NodeRequest(node_id="n1"))
    assert result.message.startswith("node n1 cordoned; replacing")
    assert fleet.plane.inventory.nodes["n1"].cordoned
    await fleet.settle(12)
    assert len(fleet.live()) == 2
    assert all(fleet.plane.replicas[k].plan.nodes == ("n2",) for k in fleet.live())
    assert all(fleet.lifecycles()[k] is Lifecycle.RETIRED for k in on_n1)
    actions = [(r.action, r.target) for r in await fleet.operator_audit()]
    assert actions == [("cordon", "n1"), ("drain-node", "node/n1")]


@pytest.mark.parametrize(
    ("call", "status"),
    [
        ("drain-unknown", Status.NOT_FOUND),
        ("drain-twice", Status.FAILED_PRECONDITION),
        ("start-unknown-deployment", Status.NOT_FOUND),
        ("reprofile-unknown-profile", Status.NOT_FOUND),
        ("drain-node-unknown", Status.NOT_FOUND),
    ],
)
async def test_refusals_change_nothing_and_are_audited(
    fleet: Fleet, call: str, status: Status
) -> None:
    svc = fleet.svc
    if call == "drain-twice":
        await svc.drain_replica(ReplicaRequest(replica_id="chat-1"))
    before = (dict(fleet.plane.desired.deployments), fleet.lifecycles())
    calls = {
        "drain-unknown": lambda: svc.drain_replica(ReplicaRequest(replica_id="chat-9")),
        "drain-twice": lambda: svc.drain_replica(ReplicaRequest(replica_id="chat-1")),
        "start-unknown-deployment": lambda: svc.start_replica(ReplicaRequest(deployment="x")),
        "reprofile-unknown-profile": lambda: svc.reprofile_replica(
            ReprofileReplicaRequest(deployment="chat", profile="nope")
        ),
        "drain-node-unknown": lambda: svc.drain_node(NodeRequest(node_id="n9")),
    }
    with pytest.raises(GRPCError) as refused:
        await calls[call]()
    assert refused.value.status is status
    assert (dict(fleet.plane.desired.deployments), fleet.lifecycles()) == before
    last = (await fleet.operator_audit())[-1]
    assert last.result == f"refused: {refused.value.message}"
