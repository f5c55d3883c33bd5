"""A node drain's dry run (placement's answer over mixed GPU classes) and an uncordon that
cancels a drain under way, on an in-process ControlService and control plane."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_operator_actions import Agents, Fleet

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    ApplyDeploymentRequest,
    ControlMessage,
    Deployment,
    EngineProfile,
    NodeRequest,
    Register,
)
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server.core.reconcile_state import Lifecycle
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.controlsvc import ControlService

NODES = (("h1", "dgx-h100"), ("h2", "dgx-h100"), ("l4", "l4-pcie"), ("mig", "a100-mig"))
PROFILES = (
    EngineProfile(name="chat", engine="sim", gpu_class="H100", tp=8, model_path="/m/chat"),
    EngineProfile(name="embed", engine="sim", gpu_class="L4", tp=1, model_path="/m/embed"),
    EngineProfile(name="small", engine="sim", gpu_class="A100:3g.40gb", model_path="/m/small"),
)
COUNTS = {"chat": 1, "embed": 4, "small": 1}


class SlowAgents(Agents):
    """As ``Agents``, but the shards of replicas named in ``stalled`` never get READY."""

    def __init__(self, plane: ControlPlane) -> None:
        super().__init__(plane)
        self.stalled: set[str] = set()

    async def send(self, node_id: str, message: ControlMessage) -> bool:
        start = message.start_shard
        if start is not None and start.replica_id in self.stalled:
            self.sent.append((node_id, message))
            return True
        return await super().send(node_id, message)


@pytest.fixture
async def mixed(tmp_path: Path) -> AsyncIterator[Fleet]:
    """Two DGX H100s, a 4×L4 box and an A100 with MIG slices; chat (8×H100) on one DGX,
    four embed replicas (one L4 each) filling the L4 box, one 3g.40gb slice for small."""
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        for i, (name, fixture) in enumerate(NODES):
            node = simulated_node(fixture, node_id=name, hostname=name)
            register = Register(protocol_version=PROTOCOL_VERSION, node=node)
            await plane.register(node, register, peer=f"10.0.0.{i + 1}:5000")
        svc = ControlService(plane)
        for p in PROFILES:
            deployment = Deployment(name=p.name, profile=p.name, replicas=COUNTS[p.name])
            await svc.apply_deployment(ApplyDeploymentRequest(deployment=deployment, profiles=[p]))
        fleet = Fleet(plane)
        fleet.agents = SlowAgents(plane)
        fleet.loop.send = fleet.agents.send
        await fleet.settle()
        assert len(fleet.live()) == 6
        yield fleet


def _node_of(fleet: Fleet, replica_id: str) -> str:
    (node,) = fleet.plane.replicas[replica_id].plan.nodes
    return node


async def _dry_run(fleet: Fleet, node_id: str) -> list[str]:
    result = await fleet.svc.drain_node(NodeRequest(node_id=node_id, dry_run=True))
    lines = result.message.splitlines()
    movable = sum(1 for line in lines[1:] if "cannot move" not in line)
    assert result.ok == (movable == len(lines) - 1)  # ok: every replica can move
    return lines


async def test_dry_run_moves_each_replica_to_a_gpu_of_its_own_class(mixed: Fleet) -> None:
    busy = _node_of(mixed, "chat-1")
    free = ({"h1", "h2"} - {busy}).pop()
    lines = await _dry_run(mixed, busy)
    assert lines == [
        f"dry run: drain node {busy}: 1 replica to move, 1 can move now; nothing was changed",
        f"chat-1: → chat-2 on {free} GPUs 0,1,2,3,4,5,6,7 (H100)",
    ]
    (slice_line,) = (await _dry_run(mixed, "mig"))[1:]
    assert slice_line.startswith("small-1: cannot move (")  # no other A100 with MIG slices
    assert slice_line.endswith("it keeps running on mig until there is room")


async def test_dry_run_counts_no_gpu_of_another_class_as_room(mixed: Fleet) -> None:
    """The L4 box is full; eight H100s and MIG slices are free, and none of them is room
    for an L4 replica (the old console counted them)."""
    lines = await _dry_run(mixed, "l4")
    assert (
        lines[0]
        == "dry run: drain node l4: 4 replicas to move, 0 can move now; nothing was changed"
    )
    assert [line.split(":")[0] for line in lines[1:]] == [f"embed-{i}" for i in range(1, 5)]
    assert all("L4" in line and "cannot move" in line for line in lines[1:])


async def test_dry_run_changes_nothing_and_is_not_audited(mixed: Fleet) -> None:
    before = mixed.lifecycles()
    await _dry_run(mixed, "l4")
    await mixed.settle(2)
    assert not mixed.plane.inventory.nodes["l4"].cordoned
    assert mixed.plane.desired.replace == set()
    assert mixed.lifecycles() == before
    assert await mixed.operator_audit() == []


async def test_dry_run_of_an_unknown_node_is_not_found(mixed: Fleet) -> None:
    from grpclib.exceptions import GRPCError

    with pytest.raises(GRPCError, match="no node named 'nope'"):
        await _dry_run(mixed, "nope")


async def test_uncordon_cancels_a_stalled_drain_and_keeps_the_replicas(mixed: Fleet) -> None:
    await mixed.svc.drain_node(NodeRequest(node_id="l4"))
    await mixed.settle(3)
    assert mixed.plane.desired.replace == {f"embed-{i}" for i in range(1, 5)}
    result = await mixed.svc.uncordon_node(NodeRequest(node_id="l4"))
    assert result.message == (
        "node l4 uncordoned; drain cancelled: embed-1, embed-2, embed-3, embed-4 stay on l4"
    )
    assert mixed.plane.desired.replace == set()
    assert await mixed.plane.store.load_requests() == []  # a restart does not resume it
    await mixed.settle(4)
    assert sorted(k for k in mixed.live() if k.startswith("embed")) == [
        f"embed-{i}" for i in range(1, 5)
    ]
    assert all(_node_of(mixed, f"embed-{i}") == "l4" for i in range(1, 5))


async def test_uncordon_retires_a_replacement_that_is_not_ready_yet(mixed: Fleet) -> None:
    """A drain whose surge was placed elsewhere but never became READY: the uncordon keeps
    the old replica and retires the surge."""
    busy = _node_of(mixed, "chat-1")
    mixed.agents.stalled.add("chat-2")  # type: ignore[attr-defined]
    await mixed.svc.drain_node(NodeRequest(node_id=busy))
    await mixed.settle(3)
    assert mixed.lifecycles()["chat-2"] is Lifecycle.SURGE
    await mixed.svc.uncordon_node(NodeRequest(node_id=busy))
    await mixed.settle(4)
    assert mixed.lifecycles()["chat-1"] is Lifecycle.ACTIVE
    assert mixed.lifecycles()["chat-2"] in (Lifecycle.RETIRING, Lifecycle.RETIRED)
    assert _node_of(mixed, "chat-1") == busy


async def test_uncordon_of_a_node_not_draining_says_only_that(mixed: Fleet) -> None:
    result = await mixed.svc.uncordon_node(NodeRequest(node_id="h1"))
    assert result.message == "node h1 uncordoned"
