"""The dry run's diff: plan_apply against fleets the real reconciler brought up.

Placement is the real one (``FleetPlacer`` over simulated H100 nodes), so ids, GPUs and
ports are what the reconciler chooses; the test checks that by running the reconciler
after planning and comparing.
"""

from __future__ import annotations

from dataclasses import replace

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    Deployment,
    EngineProfile,
    Node,
    NodeState,
    Shard,
    ShardState,
    ShardStatus,
)
from llmgw.server.core.applyplan import Action, ApplyPlan, plan_apply, undone_live_change
from llmgw.server.core.capacity import node_capacity
from llmgw.server.core.fingerprint import profile_fingerprint
from llmgw.server.core.placement import FleetPlacer
from llmgw.server.core.reconcile_state import (
    Lifecycle,
    NodeView,
    ReconcileInput,
    apply_decision,
)
from llmgw.server.core.reconciler import reconcile

PORTS = (31000, 31099)


def _profile(name: str, tp: int = 1, model: str = "m") -> EngineProfile:
    return EngineProfile(
        name=name, engine="sim", gpu_class="H100", tp=tp, pp=1, nodes=1, gpus_per_node=tp,
        model_path=f"/models/{model}", served_model_name=model,
    )  # fmt: skip


def _fleet(*node_ids: str) -> ReconcileInput:
    caps = [
        node_capacity(
            Node(
                info=simulated_node("dgx-h100", node_id=n, hostname=n),
                state=NodeState.READY,
            )
        )
        for n in node_ids
    ]
    placer = FleetPlacer(caps, profile_fingerprint, port_range=PORTS)
    return ReconcileInput(
        deployments={}, profiles={}, fingerprint=profile_fingerprint, place=placer,
        replicas={}, shards={}, nodes={n: NodeView(n, True) for n in node_ids},
        pending={}, now=100.0, api_key_for="key-{}".format,
    )  # fmt: skip


def _want(
    state: ReconcileInput, *deployments: Deployment, **profiles: EngineProfile
) -> ReconcileInput:
    return replace(
        state,
        deployments={**state.deployments, **{d.name: d for d in deployments}},
        profiles={**state.profiles, **profiles},
    )


def _settle(state: ReconcileInput) -> ReconcileInput:
    """Reconcile until nothing changes, every started shard READY at once, stopped ones gone."""
    for _ in range(20):
        decision = reconcile(state)
        state = apply_decision(state, decision)
        shards = dict(state.shards)
        for node_id, message in decision.commands:
            if message.start_shard is not None:
                start = message.start_shard
                status = ShardStatus(shard_id=start.shard_id, replica_id=start.replica_id,
                                     state=ShardState.READY)  # fmt: skip
                shards[start.shard_id] = Shard(start.shard_id, start.replica_id, node_id, status)
            for stop in (message.stop_shard, message.drain_shard):
                if stop is not None:
                    shards.pop(stop.shard_id, None)
        state = replace(state, shards=shards, now=state.now + 1)
        if not decision.replicas and not decision.commands:
            return state
    raise AssertionError("the fleet never settled")


def _actions(plan: ApplyPlan) -> list[tuple[str, str]]:
    return [(c.action.value, c.replica) for c in plan.changes]


def _running(state: ReconcileInput) -> dict[str, tuple[str, tuple[str, ...], int]]:
    return {
        r.replica_id: (r.plan.leader.node_id, r.plan.leader.gpu_uuids, r.plan.leader.port)
        for r in state.replicas.values()
        if r.lifecycle is Lifecycle.ACTIVE
    }


def test_the_applied_state_plans_only_keeps() -> None:
    chat = Deployment(name="chat", profile="small", replicas=3)
    state = _settle(_want(_fleet("n1", "n2"), chat, small=_profile("small")))
    plan = plan_apply(state, ["chat"])
    assert _actions(plan) == [("keep", "chat-1"), ("keep", "chat-2"), ("keep", "chat-3")]
    assert plan.placeable and plan.placed == 3 and plan.desired == {"chat": 3}


def test_a_new_deployment_gets_the_ids_gpus_and_ports_the_reconciler_gives() -> None:
    chat = Deployment(name="chat", profile="small", replicas=2)
    state = _settle(_want(_fleet("n1"), chat, small=_profile("small")))
    big = Deployment(name="big", profile="tp4", replicas=1)
    wanted = _want(state, big, tp4=_profile("tp4", tp=4))
    plan = plan_apply(wanted, ["big"])
    (add,) = plan.changes
    assert (add.action, add.replica) == (Action.ADD, "big-1")
    assert add.plan is not None and PORTS[0] <= add.plan.leader.port <= PORTS[1]
    used = {g for r in state.replicas.values() for g in r.plan.leader.gpu_uuids}
    assert not used & set(add.plan.leader.gpu_uuids)  # the running replicas' GPUs are taken
    after = _settle(wanted)
    placed = _running(after)["big-1"]
    assert placed == (add.plan.leader.node_id, add.plan.leader.gpu_uuids, add.plan.leader.port)


def test_a_profile_change_rolls_each_replica_old_to_new() -> None:
    chat = Deployment(name="chat", profile="a", replicas=2)
    state = _settle(_want(_fleet("n1", "n2"), chat, a=_profile("a"), b=_profile("b")))
    plan = plan_apply(_want(state, replace(chat, profile="b")), ["chat"])
    assert [(c.action, c.from_profile, c.profile, c.reason) for c in plan.changes] == [
        (Action.ROLL, "a", "b", "replaces chat-2"),  # the reconciler retires the newest first
        (Action.ROLL, "a", "b", "replaces chat-1"),
    ]
    assert [c.replica for c in plan.changes] == ["chat-3", "chat-4"]


def test_more_than_fits_is_unplaceable_with_the_placement_reason() -> None:
    huge = Deployment(name="huge", profile="tp16", replicas=1)
    plan = plan_apply(_want(_fleet("n1", "n2"), huge, tp16=_profile("tp16", tp=16)), ["huge"])
    (change,) = plan.changes
    assert change.action is Action.UNPLACEABLE and change.replica == "huge-1"
    assert "16 free H100 GPUs" in change.reason and not plan.placeable
    assert plan.placed == 0 and plan.reasons() == [f"deployment huge: {change.reason}"]


def test_scaling_adds_and_removes_and_frees_what_it_removes() -> None:
    a = Deployment(name="a", profile="tp8", replicas=2)
    state = _settle(_want(_fleet("n1", "n2"), a, tp8=_profile("tp8", tp=8)))
    shrink = replace(a, replicas=1)
    b = Deployment(name="b", profile="tp8", replicas=1)
    plan = plan_apply(_want(state, shrink, b), ["a", "b"])
    assert sorted(_actions(plan)) == [("add", "b-1"), ("keep", "a-1"), ("remove", "a-2")]
    assert plan.placeable  # b takes the node a gives back


def test_a_refused_profile_is_unplaceable_naming_the_arg() -> None:
    bad = replace(_profile("bad"), args=["--tensor-parallel-size", "2"])
    d = Deployment(name="d", profile="bad", replicas=1)
    (change,) = plan_apply(_want(_fleet("n1"), d, bad=bad), ["d"]).changes
    assert change.action is Action.UNPLACEABLE and "--tensor-parallel-size" in change.reason


def test_undoing_a_live_change_is_said() -> None:
    applied = Deployment(name="chat", profile="a", replicas=2)
    live = replace(applied, replicas=3)  # llmgw start since the apply
    assert "undoes a live scale to 3" in undone_live_change(applied, live, applied)
    assert undone_live_change(live, live, applied) == ""
    moved = replace(applied, profile="b")
    assert "undoes a live reprofile to b" in undone_live_change(applied, moved, applied)
    state = _settle(_want(_fleet("n1"), live, a=_profile("a")))
    plan = plan_apply(
        _want(state, applied), ["chat"], live={"chat": live}, applied={"chat": applied}
    )
    (removed,) = [c for c in plan.changes if c.action is Action.REMOVE]
    assert "undoes a live scale to 3" in removed.reason


def test_rolls_name_the_gpus_and_ports_the_rolling_replacement_takes() -> None:
    chat = Deployment(name="chat", profile="a", replicas=3)
    state = _settle(_want(_fleet("n1"), chat, a=_profile("a", tp=2), b=_profile("b", tp=2)))
    wanted = _want(state, replace(chat, profile="b"))
    plan = plan_apply(wanted, ["chat"])
    assert [c.action for c in plan.changes] == [Action.ROLL] * 3
    predicted = {
        c.replica: (c.plan.leader.node_id, c.plan.leader.gpu_uuids, c.plan.leader.port)
        for c in plan.changes
        if c.plan is not None
    }
    after = _running(_settle(wanted))
    assert {k: after[k] for k in predicted} == predicted


def test_an_edited_profile_of_the_same_name_rolls_saying_so() -> None:
    chat = Deployment(name="chat", profile="a", replicas=1)
    state = _settle(_want(_fleet("n1"), chat, a=_profile("a")))
    edited = replace(_profile("a"), args=["--max-model-len", "4096"])
    (roll,) = plan_apply(_want(state, chat, a=edited), ["chat"]).changes
    assert (roll.action, roll.from_profile, roll.profile) == (Action.ROLL, "a", "a")
    assert roll.reason.startswith("replaces chat-1 (profile edited: ")
