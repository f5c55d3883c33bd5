"""A node drain's dry run as a pure function: real placement over simulated nodes."""

from __future__ import annotations

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import Deployment, EngineProfile, Node, NodeState
from llmgw.server.core.capacity import node_capacity
from llmgw.server.core.drainplan import drain_text, moving_replicas, plan_node_drain
from llmgw.server.core.fingerprint import profile_fingerprint
from llmgw.server.core.placement import FleetPlacer
from llmgw.server.core.plan import ReplicaPlan, ShardPlan
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord

CHAT = EngineProfile(name="chat", engine="sim", gpu_class="H100", tp=4, model_path="/m/c")
EMBED = EngineProfile(name="embed", engine="sim", gpu_class="L4", tp=1, model_path="/m/e")
DEPLOYMENTS = {
    "chat": Deployment(name="chat", profile="chat", replicas=3),
    "embed": Deployment(name="embed", profile="embed", replicas=1),
}
PROFILES = {"chat": CHAT, "embed": EMBED}


def _nodes() -> list[Node]:
    fixtures = (("h1", "dgx-h100"), ("h2", "dgx-h100"), ("l4", "l4-pcie"))
    return [
        Node(info=simulated_node(f, node_id=n, hostname=n), state=NodeState.READY)
        for n, f in fixtures
    ]


def _record(replica_id: str, node: Node, gpus: range, serial: int, profile: EngineProfile,
            lifecycle: Lifecycle = Lifecycle.ACTIVE) -> ReplicaRecord:  # fmt: skip
    assert node.info is not None
    uuids = tuple(node.info.gpus[i].uuid for i in gpus)
    shard = ShardPlan(f"{replica_id}.0", node.info.node_id, 0, uuids, 20000 + serial)
    name = replica_id.rpartition("-")[0]
    plan = ReplicaPlan(replica_id, name, profile.name, profile_fingerprint(profile), (shard,))
    return ReplicaRecord(plan, profile, lifecycle, serial)


def _fleet() -> tuple[list[Node], dict[str, ReplicaRecord]]:
    nodes = _nodes()
    h1, h2, l4 = nodes
    records = [
        _record("chat-1", h1, range(0, 4), 1, CHAT),
        _record("chat-2", h1, range(4, 8), 2, CHAT),
        _record("chat-3", h2, range(0, 4), 3, CHAT),
        _record("chat-4", h1, range(0, 4), 4, CHAT, Lifecycle.RETIRED),  # gone: not moved
        _record("embed-1", l4, range(0, 1), 1, EMBED),
    ]
    return nodes, {r.replica_id: r for r in records}


def _plan(node_id: str) -> list[str]:
    nodes, records = _fleet()
    capacity = [node_capacity(n) for n in nodes]
    moves = plan_node_drain(
        node_id, records, DEPLOYMENTS, PROFILES, FleetPlacer(capacity, profile_fingerprint),
        unusable=frozenset(), taken=[r.plan for r in records.values()],
    )  # fmt: skip
    return drain_text(node_id, moves, capacity).splitlines()


def test_only_live_replicas_on_the_node_move() -> None:
    _, records = _fleet()
    assert [r.replica_id for r in moving_replicas(records, "h1")] == ["chat-1", "chat-2"]


def test_each_replacement_sees_what_the_one_before_took_and_takes_the_next_free_id() -> None:
    lines = _plan("h1")
    assert (
        lines[0]
        == "dry run: drain node h1: 2 replicas to move, 1 can move now; nothing was changed"
    )
    # h2 has four H100s left: chat-1's replacement takes them, chat-2's finds none.
    assert lines[1] == "chat-1: → chat-5 on h2 GPUs 4,5,6,7 (H100)"  # chat-4 is taken (retired)
    assert lines[2].startswith("chat-2: cannot move (")
    assert "H100" in lines[2] and "l4" in lines[2]  # the L4 box is no room for H100 work


def test_a_replica_of_another_class_has_no_room_on_free_h100s() -> None:
    (line,) = _plan("l4")[1:]
    assert line.startswith("embed-1: cannot move (") and "L4" in line


def test_a_node_with_nothing_on_it() -> None:
    nodes, records = _fleet()
    capacity = [node_capacity(n) for n in nodes]
    assert drain_text("x", [], capacity) == (
        "dry run: drain node x: no replica runs there; nothing was changed"
    )
