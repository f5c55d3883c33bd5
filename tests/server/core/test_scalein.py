"""Cache-aware scale-in and warm placement: which replica a lowered count retires (the
reconciler's rule 2 with ``ReconcileInput.costs``, and the dry run naming the same one),
which nodes are warm for a model (``placing.warm_nodes``) and how placement prefers them."""

from __future__ import annotations

from dataclasses import replace

from test_applyplan import _actions, _fleet, _running, _settle, _want
from test_applyplan import _profile as _dry_profile
from test_placement import FP, _cap, _place, _plans, _profile
from test_reconciler import one_deployment, profile, settle, shard

from llmgw.api.llmgw.v1 import Deployment, EngineProfile, ShardState
from llmgw.server.core.applyplan import plan_apply
from llmgw.server.core.placement import FleetPlacer
from llmgw.server.core.placing import warm_nodes
from llmgw.server.core.plan import ReplicaPlan, ShardPlan
from llmgw.server.core.reconcile_state import (
    Lifecycle,
    ReconcileInput,
    ReplicaRecord,
    ScaleInCost,
    apply_decision,
)
from llmgw.server.core.reconciler import reconcile


def lowered(state: ReconcileInput, count: int, **costs: ScaleInCost) -> ReconcileInput:
    """``state`` with chat's count lowered to ``count`` and these costs (by replica id)."""
    deployment = Deployment(name="chat", profile="p", replicas=count)
    named = {rid.replace("_", "-"): cost for rid, cost in costs.items()}
    return replace(state, deployments={"chat": deployment}, costs=named)


def retired(state: ReconcileInput) -> list[str]:
    decision = reconcile(state)
    return sorted(rid for rid, r in decision.replicas.items() if r.lifecycle is Lifecycle.RETIRING)


def test_scale_in_retires_the_replica_holding_the_fewest_unique_blocks() -> None:
    state, _ = settle(one_deployment(3))
    costs = {
        "chat_1": ScaleInCost(unique_blocks=40),
        "chat_2": ScaleInCost(unique_blocks=3, in_flight=9),
        "chat_3": ScaleInCost(unique_blocks=25),
    }
    # Without costs the newest goes; with them the one whose loss the caches feel least,
    # however busy it is.
    assert retired(lowered(state, 2)) == ["chat-3"]
    assert retired(lowered(state, 2, **costs)) == ["chat-2"]
    assert retired(lowered(state, 1, **costs)) == ["chat-2", "chat-3"]
    (event,) = [e for e in reconcile(lowered(state, 2, **costs)).events if "retiring" in e.what]
    assert event.why == (
        "more replicas than desired; the cheapest to lose: 3 cached blocks no other replica "
        "holds, 9 requests in flight"
    )
    (event,) = [e for e in reconcile(lowered(state, 2)).events if "retiring" in e.what]
    assert event.why == "more replicas than desired; the newest"


def test_equal_unique_blocks_retire_the_replica_with_the_least_in_flight() -> None:
    state, _ = settle(one_deployment(3))
    costs = {
        "chat_1": ScaleInCost(unique_blocks=5, in_flight=1),
        "chat_2": ScaleInCost(unique_blocks=5, in_flight=4),
        "chat_3": ScaleInCost(unique_blocks=5, in_flight=2),
    }
    assert retired(lowered(state, 2, **costs)) == ["chat-1"]
    # A replica with no cost named holds nothing and serves nothing: it goes first.
    del costs["chat_2"]
    assert retired(lowered(state, 2, **costs)) == ["chat-2"]


def test_not_ready_and_out_of_date_replicas_still_go_before_the_cheapest() -> None:
    state, shards = settle(one_deployment(3))
    costs = {"chat_1": ScaleInCost(0), "chat_2": ScaleInCost(50), "chat_3": ScaleInCost(90)}
    plan = state.replicas["chat-3"].plan.leader
    loading = replace(
        state, shards={**shards, plan.shard_id: shard(plan, "chat-3", ShardState.LOADING)}
    )
    assert retired(lowered(loading, 2, **costs)) == ["chat-3"]
    whys = [e.why for e in reconcile(lowered(loading, 2, **costs)).events if "retiring" in e.what]
    assert whys == ["more replicas than desired; it is not READY"]
    old = replace(state.replicas["chat-2"], profile=profile(arg="old"))
    stale_plan = replace(old.plan, fingerprint="0ld")
    outdated = replace(state, replicas={**state.replicas, "chat-2": replace(old, plan=stale_plan)})
    assert retired(lowered(outdated, 2, **costs)) == ["chat-2"]


def test_a_retiring_choice_is_kept_in_later_rounds_whatever_the_costs_say() -> None:
    state, _ = settle(one_deployment(3))
    first = lowered(state, 2, chat_1=ScaleInCost(1), chat_2=ScaleInCost(2), chat_3=ScaleInCost(3))
    decision = reconcile(first)
    again = apply_decision(first, decision)
    turned = replace(again, costs={"chat-2": ScaleInCost(0), "chat-3": ScaleInCost(0)})
    assert retired(turned) == []  # chat-1 drains; the two left are the count


def test_a_replica_ready_on_every_shard_is_marked_once() -> None:
    state = one_deployment(1)
    placed = apply_decision(state, reconcile(state))
    (record,) = placed.replicas.values()
    assert not record.was_ready
    leader = record.plan.leader
    loading = replace(placed, shards={leader.shard_id: shard(leader, "chat-1", ShardState.LOADING)})
    assert reconcile(loading).replicas == {}
    ready = replace(placed, shards={leader.shard_id: shard(leader, "chat-1")})
    decision = reconcile(ready)
    assert decision.replicas == {"chat-1": replace(record, was_ready=True)}
    assert decision.events == ()
    assert reconcile(apply_decision(ready, decision)).replicas == {}


# --- warm nodes and placement ------------------------------------------------------------


def record(
    replica_id: str, nodes: tuple[str, ...], model: str, *, was_ready: bool, life: Lifecycle
) -> ReplicaRecord:
    shards = tuple(ShardPlan(f"{replica_id}.{r}", n, r, (), 20000) for r, n in enumerate(nodes))
    plan = ReplicaPlan(replica_id, replica_id.rsplit("-", 1)[0], "p", "fp", shards)
    prof = EngineProfile(name="p", engine="sim", model_path=model)
    return ReplicaRecord(plan, prof, life, 1, was_ready=was_ready)


def test_warm_nodes_are_where_a_replica_of_the_same_model_path_was_ready() -> None:
    records = [
        record("a-1", ("n1",), "/models/chat", was_ready=True, life=Lifecycle.RETIRED),
        record("b-1", ("n2", "n3"), "/models/chat", was_ready=True, life=Lifecycle.ACTIVE),
        record("a-2", ("n4",), "/models/chat", was_ready=False, life=Lifecycle.RETIRED),
        record("c-1", ("n5",), "/models/other", was_ready=True, life=Lifecycle.ACTIVE),
    ]
    assert warm_nodes(records, "/models/chat") == {"n1", "n2", "n3"}
    assert warm_nodes(records, "/models/other") == {"n5"}
    assert warm_nodes(records, "/models/none") == frozenset()
    assert warm_nodes(records, "") == frozenset()


def test_placement_prefers_a_warm_node_over_one_with_more_free_devices() -> None:
    nodes = [_cap("dgx-h100", f"dgx-{i}") for i in (1, 2, 3)]
    busy = {"dgx-1": frozenset(d.uuid for d in nodes[0].devices[:2])}
    (cold,) = _plans(_place(nodes, _profile(tp=2), devices=busy))
    assert cold.leader.node_id == "dgx-2"  # the most free devices, then the id
    warm = frozenset({"dgx-1", "dgx-3"})
    (plan,) = _plans(_place(nodes, _profile(tp=2), devices=busy, warm=warm))
    assert plan.leader.node_id == "dgx-3"
    (plan,) = _plans(_place(nodes, _profile(tp=2), devices=busy, warm=frozenset({"dgx-1"})))
    assert plan.leader.node_id == "dgx-1"  # fewer free devices, but warm


def test_spread_wins_over_warmth() -> None:
    nodes = [_cap("dgx-h100", f"dgx-{i}") for i in (1, 2)]
    chat = Deployment(name="chat", profile="p", replicas=3)
    asked: list[str] = []

    def warm(profile: EngineProfile) -> frozenset[str]:
        asked.append(profile.model_path)
        return frozenset({"dgx-2"})

    placer = FleetPlacer(nodes, lambda p: FP, warm=warm)
    ids = ["chat-1", "chat-2", "chat-3"]
    plans = _plans(placer(chat, _profile(model_path="/m"), ids, excluding=frozenset(), taken=[]))
    assert [p.leader.node_id for p in plans] == ["dgx-2", "dgx-1", "dgx-2"]
    assert asked == ["/m"]
    # dgx-2 is warm, but it runs a replica of chat already and dgx-1 none
    (one,) = _plans(placer(chat, _profile(), ["chat-4"], excluding=frozenset(), taken=plans[:1]))
    assert one.leader.node_id == "dgx-1"


def test_a_multi_node_replica_prefers_warm_nodes_of_its_fabric() -> None:
    nodes = [_cap("dgx-h100", f"dgx-{i}", ib="ib-a") for i in (1, 2, 3, 4)]
    profile8 = _profile(tp=8, pp=2, nodes=2)
    (cold,) = _plans(_place(nodes, profile8))
    assert [s.node_id for s in cold.shards] == ["dgx-1", "dgx-2"]
    warm = frozenset({"dgx-2", "dgx-4"})
    (plan,) = _plans(_place(nodes, profile8, warm=warm))
    assert [s.node_id for s in plan.shards] == ["dgx-2", "dgx-4"]


# --- the dry run names the replica the reconciler retires --------------------------------


def test_a_dry_run_that_lowers_the_count_removes_what_the_reconciler_retires() -> None:
    chat = Deployment(name="chat", profile="small", replicas=3)
    state = _settle(_want(_fleet("n1", "n2"), chat, small=_dry_profile("small")))
    lowered = _want(state, replace(chat, replicas=1))
    assert _actions(plan_apply(lowered, ["chat"])) == [
        ("keep", "chat-1"), ("remove", "chat-2"), ("remove", "chat-3"),
    ]  # fmt: skip
    costs = {"chat-1": ScaleInCost(2), "chat-2": ScaleInCost(30), "chat-3": ScaleInCost(2, 1)}
    costly = replace(lowered, costs=costs)
    plan = plan_apply(costly, ["chat"])
    assert _actions(plan) == [("keep", "chat-2"), ("remove", "chat-1"), ("remove", "chat-3")]
    assert sorted(_running(_settle(costly))) == ["chat-2"]  # as the reconciler does
