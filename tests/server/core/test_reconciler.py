"""The reconciler: one test per rule, and properties over a simulated fleet.

The fleet's agents execute commands at once (Start → READY, Stop/Drain → STOPPED); a node
that fails keeps its engines running but stops reporting (a partition), so fencing is
exercised when it comes back.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import betterproto2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.api.llmgw.v1 import (
    ControlMessage,
    Deployment,
    DrainShard,
    EngineProfile,
    MultiNode,
    Shard,
    ShardState,
    ShardStatus,
    StartShard,
    StopShard,
)
from llmgw.protocol import read_shard_state
from llmgw.server.core.plan import ReplicaPlan, ShardPlan, Unplaceable
from llmgw.server.core.reconcile_state import (
    ALLOWED_LIFECYCLE,
    CommandKind,
    Decision,
    Lifecycle,
    NodeView,
    PendingCommand,
    ReconcileConfig,
    ReconcileInput,
    apply_decision,
)
from llmgw.server.core.reconciler import reconcile, replica_id_for

CONFIG = ReconcileConfig(node_grace_s=5, command_retry_s=3, max_restarts=3, drain_grace_s=7)
GPUS = 8


def fingerprint(profile: EngineProfile) -> str:
    return hashlib.sha256(bytes(profile)).hexdigest()[:12]


@dataclass
class FakePlace:
    """Places on the first nodes (by replicas of the deployment, then id) with GPUs free."""

    node_ids: Sequence[str]
    calls: list[tuple[str, tuple[str, ...], frozenset[str]]] = field(default_factory=list)
    refuse: str = ""

    def __call__(
        self,
        deployment: Deployment,
        profile: EngineProfile,
        replica_ids: Sequence[str],
        *,
        excluding: frozenset[str],
        taken: Sequence[ReplicaPlan],
    ) -> Sequence[ReplicaPlan | Unplaceable]:
        self.calls.append((deployment.name, tuple(replica_ids), excluding))
        if self.refuse:
            return [Unplaceable(self.refuse)] * len(replica_ids)
        plans = list(taken)
        out: list[ReplicaPlan | Unplaceable] = []
        for replica_id in replica_ids:
            plan = self._one(deployment, profile, replica_id, excluding, plans)
            out.append(plan if plan else Unplaceable("no node has the GPUs free"))
            plans.extend([plan] if plan else [])
        return out

    def _one(
        self,
        deployment: Deployment,
        profile: EngineProfile,
        replica_id: str,
        excluding: frozenset[str],
        taken: list[ReplicaPlan],
    ) -> ReplicaPlan | None:
        used = {(s.node_id, g) for p in taken for s in p.shards for g in s.gpu_uuids}
        ports = {(s.node_id, s.port) for p in taken for s in p.shards}
        spread = Counter(n for p in taken if p.deployment == deployment.name for n in p.nodes)
        free = {
            n: [f"{n}-g{i}" for i in range(GPUS) if (n, f"{n}-g{i}") not in used]
            for n in self.node_ids
        }
        fits = [
            n
            for n in sorted(self.node_ids, key=lambda n: (spread[n], n))
            if n not in excluding and len(free[n]) >= profile.tp
        ][: profile.nodes]
        if len(fits) < profile.nodes:
            return None
        port = {n: min(p for p in range(20000, 20100) if (n, p) not in ports) for n in fits}
        hcas = [(f"mlx5_{rank}",) if len(fits) > 1 else () for rank in range(len(fits))]
        gpus = [tuple(free[n][: profile.tp]) for n in fits]
        shards = [
            ShardPlan(f"{replica_id}.{r}", n, r, gpus[r], port[n], hcas[r])
            for r, n in enumerate(fits)
        ]
        master = 29500 if len(shards) > 1 else 0
        fp = fingerprint(profile)
        return ReplicaPlan(replica_id, deployment.name, profile.name, fp, tuple(shards), master)


def profile(name: str = "p", *, tp: int = 1, nodes: int = 1, arg: str = "a") -> EngineProfile:
    return EngineProfile(name=name, engine="sim", gpu_class="H100", tp=tp, nodes=nodes, args=[arg])


def node(node_id: str, *, ready: bool = True, since: float | None = None) -> NodeView:
    return NodeView(node_id, ready, not_ready_since=since, address=f"10.0.0.{node_id[-1]}")


def shard(
    plan: ShardPlan, replica_id: str, state: ShardState = ShardState.READY, **status: Any
) -> Shard:
    reported = ShardStatus(
        shard_id=plan.shard_id, replica_id=replica_id, rank=plan.rank, state=state, **status
    )
    return Shard(plan.shard_id, replica_id, plan.node_id, reported)


def state_of(
    deployments: Mapping[str, Deployment], profiles: Mapping[str, EngineProfile], nodes: list[str]
) -> ReconcileInput:
    views = {n: node(n) for n in nodes}
    place = FakePlace(nodes)
    return ReconcileInput(
        deployments, profiles, fingerprint, place, {}, {}, views, {}, 100.0, "key-{}".format, CONFIG
    )


def one_deployment(count: int = 1, prof: EngineProfile | None = None) -> ReconcileInput:
    prof = prof or profile()
    deployment = Deployment(name="chat", profile=prof.name, replicas=count)
    return state_of({"chat": deployment}, {prof.name: prof}, ["n1", "n2", "n3"])


def kinds(decision: Decision) -> list[tuple[str, str, str]]:
    """(node, kind, shard id) of every command."""
    which = [(n, betterproto2.which_one_of(m, "msg")) for n, m in decision.commands]
    return [(n, name.removesuffix("_shard"), inner.shard_id) for n, (name, inner) in which]  # type: ignore[union-attr]


def settle(state: ReconcileInput) -> tuple[ReconcileInput, dict[str, Shard]]:
    """Place and start everything, with every started shard READY, and adopt them (the
    round that sees them READY only marks each replica ``was_ready``)."""
    decision = reconcile(state)
    state = apply_decision(state, decision)
    shards = dict(state.shards)
    for record in decision.replicas.values():
        fp = record.plan.fingerprint
        for p in record.plan.shards:
            shards[p.shard_id] = shard(p, record.replica_id, profile_fingerprint=fp)
    state = replace(state, shards=shards, pending={})
    adopted = reconcile(state)
    assert (adopted.commands, adopted.events) == ((), ())
    assert all(r == replace(state.replicas[r.replica_id], was_ready=True)
               for r in adopted.replicas.values())  # fmt: skip
    return apply_decision(state, adopted), shards


def test_places_and_starts_then_sends_nothing_new_until_retry_is_due() -> None:
    state = one_deployment(2)
    first = reconcile(state)
    assert sorted(first.replicas) == ["chat-1", "chat-2"]
    assert all(r.lifecycle is Lifecycle.ACTIVE for r in first.replicas.values())
    assert kinds(first) == [("n1", "start", "chat-1.0"), ("n2", "start", "chat-2.0")]
    assert first.pending["chat-1.0"] == PendingCommand(CommandKind.START, "n1", 100.0)
    again = apply_decision(state, first)
    assert reconcile(again).commands == ()
    assert reconcile(replace(again, now=102.9)).commands == ()
    assert kinds(reconcile(replace(again, now=103.0)))[0] == ("n1", "start", "chat-1.0")


def test_adopts_reported_shards_without_commands() -> None:
    state, _ = settle(one_deployment(2))
    decision = reconcile(state)
    assert (decision.commands, decision.events, decision.replicas) == ((), (), {})


def test_start_message_carries_profile_key_and_plan() -> None:
    ((node_id, msg),) = reconcile(one_deployment(1, profile(tp=2))).commands
    assert node_id == "n1" and msg.start_shard == StartShard(
        shard_id="chat-1.0",
        replica_id="chat-1",
        rank=0,
        profile=profile(tp=2),
        profile_fingerprint=fingerprint(profile(tp=2)),
        gpu_uuids=["n1-g0", "n1-g1"],
        port=20000,
        api_key="key-chat-1",
    )


def test_multi_node_replica_starts_every_rank_at_the_leader() -> None:
    decision = reconcile(one_deployment(1, profile(tp=4, nodes=2)))
    starts = [msg.start_shard for _, msg in decision.commands]
    assert [n for n, _ in decision.commands] == ["n1", "n2"]
    prof = profile(tp=4, nodes=2)
    for rank, start in enumerate(starts):
        node_id = f"n{rank + 1}"
        assert start == StartShard(
            shard_id=f"chat-1.{rank}",
            replica_id="chat-1",
            rank=rank,
            profile=prof,
            profile_fingerprint=fingerprint(prof),
            gpu_uuids=[f"{node_id}-g{i}" for i in range(4)],
            port=20000,
            api_key="key-chat-1",
            multinode=MultiNode(
                nnodes=2,
                node_rank=rank,
                master_addr="10.0.0.1",
                master_port=29500,
                hcas=[f"mlx5_{rank}"],
            ),
        )


def test_deployments_with_the_largest_shards_are_placed_first() -> None:
    profiles = {
        "small": profile("small", tp=1),
        "big": profile("big", tp=8),
        "wide": profile("wide", tp=8, nodes=2),  # 4 GPUs per shard
    }
    deployments = {
        name: Deployment(name=name, profile=prof, replicas=1)
        for name, prof in (("a-small", "small"), ("m-wide", "wide"), ("z-big", "big"))
    }
    state = state_of(deployments, profiles, ["n1", "n2"])
    reconcile(state)
    assert [call[0] for call in state.place.calls] == ["z-big", "m-wide", "a-small"]  # type: ignore[attr-defined]


def test_failed_shard_is_left_to_its_agent_until_restarts_run_out() -> None:
    state, shards = settle(one_deployment(1))
    plan = state.replicas["chat-1"].plan.leader
    failing = {**shards, plan.shard_id: shard(plan, "chat-1", ShardState.FAILED, restarts=2)}
    assert reconcile(replace(state, shards=failing)).commands == ()
    done = {**shards, plan.shard_id: shard(plan, "chat-1", ShardState.FAILED, restarts=3)}
    decision = reconcile(replace(state, shards=done))
    assert decision.replicas["chat-1"].lifecycle is Lifecycle.RETIRED
    assert decision.replicas["chat-2"].replaces == "chat-1"
    assert "n1" in state.place.calls[-1][2]  # type: ignore[attr-defined]
    assert kinds(decision) == [("n2", "start", "chat-2.0"), ("n1", "stop", "chat-1.0")]
    assert any("FAILED after 3 restarts" in e.why for e in decision.events)


def test_failed_shard_its_agent_gave_up_on_is_replaced_at_once() -> None:
    state, shards = settle(one_deployment(1))
    plan = state.replicas["chat-1"].plan.leader
    refused = shard(plan, "chat-1", ShardState.FAILED, reason="StartShard refused: tp: 3")
    refused.status.gave_up = True  # type: ignore[union-attr]
    decision = reconcile(replace(state, shards={**shards, plan.shard_id: refused}))
    assert decision.replicas["chat-1"].lifecycle is Lifecycle.RETIRED
    assert decision.replicas["chat-2"].replaces == "chat-1"
    why = "shard chat-1.0 FAILED and its agent gave up: StartShard refused: tp: 3"
    assert [e.why for e in decision.events if e.subject == "chat-1"][0] == why


def test_node_gone_past_grace_is_replaced_and_fenced_when_it_returns() -> None:
    state, shards = settle(one_deployment(1))
    down = {**state.nodes, "n1": node("n1", ready=False, since=100.0)}
    within = reconcile(replace(state, nodes=down, now=104.9))
    assert within.commands == () and within.replicas == {}
    gone = reconcile(replace(state, nodes=down, now=105.0))
    assert gone.replicas["chat-1"].lifecycle is Lifecycle.RETIRED
    assert gone.replicas["chat-2"].plan.nodes == ("n2",)
    assert kinds(gone) == [("n2", "start", "chat-2.0")]  # nothing sent to the dead node
    after = apply_decision(replace(state, nodes=down, now=105.0), gone)
    back = replace(after, nodes={**state.nodes}, now=200.0)  # n1 reports chat-1.0 READY
    fenced = reconcile(back)
    assert ("n1", "stop", "chat-1.0") in kinds(fenced)
    assert not any(k == "start" and s.startswith("chat-1.") for _, k, s in kinds(fenced))


def test_unknown_and_misplaced_shards_are_stopped() -> None:
    state, shards = settle(one_deployment(1))
    plan = state.replicas["chat-1"].plan.leader
    stray = ShardPlan("ghost-1.0", "n2", 0, (), 20001)
    moved = ShardPlan(plan.shard_id, "n3", 0, (), 20000)
    reported = {**shards, "ghost-1.0": shard(stray, "ghost-1"), "chat-1.0": shard(moved, "chat-1")}
    decision = reconcile(replace(state, shards=reported))
    assert kinds(decision) == [("n3", "stop", "chat-1.0"), ("n2", "stop", "ghost-1.0")]
    stop = decision.commands[1][1].stop_shard
    assert stop is not None
    assert stop == StopShard(shard_id="ghost-1.0", grace_seconds=10, reason=stop.reason)
    assert "unknown" in stop.reason


def test_scale_down_retires_not_ready_first_then_newest_and_drains() -> None:
    state, shards = settle(one_deployment(3))
    loading = state.replicas["chat-1"].plan.leader
    shards = {**shards, loading.shard_id: shard(loading, "chat-1", ShardState.LOADING)}
    smaller = {"chat": Deployment(name="chat", profile="p", replicas=1)}
    decision = reconcile(replace(state, shards=shards, deployments=smaller))
    retiring = sorted(k for k, r in decision.replicas.items() if r.lifecycle is Lifecycle.RETIRING)
    assert retiring == ["chat-1", "chat-3"]
    assert kinds(decision) == [("n1", "drain", "chat-1.0"), ("n3", "drain", "chat-3.0")]
    assert decision.commands[0][1] == ControlMessage(
        drain_shard=DrainShard(shard_id="chat-1.0", grace_seconds=7)
    )
    after = apply_decision(replace(state, shards=shards, deployments=smaller), decision)
    stopped = {**shards}
    for rid in retiring:
        p = after.replicas[rid].plan.leader
        stopped[p.shard_id] = shard(p, rid, ShardState.STOPPED)
    final = reconcile(replace(after, shards=stopped))
    assert {k: r.lifecycle.value for k, r in final.replicas.items()} == dict.fromkeys(
        retiring, "retired"
    )
    assert final.commands == ()


def test_retires_not_ready_before_out_of_date_and_stops_failed_retiring_shards() -> None:
    state, shards = settle(one_deployment(3))
    old = state.replicas["chat-2"]
    outdated = replace(old, plan=replace(old.plan, fingerprint="old"))
    p1, p3 = state.replicas["chat-1"].plan.leader, state.replicas["chat-3"].plan.leader
    shards = {**shards, p1.shard_id: shard(p1, "chat-1", ShardState.LOADING)}
    smaller = {"chat": Deployment(name="chat", profile="p", replicas=2)}
    state = replace(state, replicas={**state.replicas, "chat-2": outdated}, shards=shards)
    decision = reconcile(replace(state, deployments=smaller))
    assert [k for k, r in decision.replicas.items() if r.lifecycle is Lifecycle.RETIRING] == [
        "chat-1"
    ]
    retiring = replace(state.replicas["chat-3"], lifecycle=Lifecycle.RETIRING)
    failed = {**shards, p3.shard_id: shard(p3, "chat-3", ShardState.FAILED)}
    state = replace(state, replicas={**state.replicas, "chat-3": retiring}, shards=failed)
    assert ("n3", "stop", "chat-3.0") in kinds(reconcile(state))


def test_deleted_deployment_retires_every_replica() -> None:
    state, _ = settle(one_deployment(2))
    decision = reconcile(replace(state, deployments={}))
    assert {r.lifecycle for r in decision.replicas.values()} == {Lifecycle.RETIRING}
    assert [k for _, k, _ in kinds(decision)] == ["drain", "drain"]
    assert any("deleted" in e.why for e in decision.events)


def test_reprofile_surges_one_then_retires_one_and_surges_the_next() -> None:
    state, shards = settle(one_deployment(2))
    new = profile(arg="b")
    state = replace(state, profiles={"p": new})
    first = reconcile(state)
    (surge,) = first.replicas.values()
    assert (surge.replica_id, surge.replaces) == ("chat-3", "chat-2")
    assert surge.lifecycle is Lifecycle.SURGE
    assert surge.plan.fingerprint == fingerprint(new)
    assert kinds(first) == [("n3", "start", "chat-3.0")]
    state = apply_decision(state, first)
    assert reconcile(state).commands == ()  # not READY yet: nothing retired

    ready = {**shards, "chat-3.0": shard(surge.plan.leader, "chat-3")}
    second = reconcile(replace(state, shards=ready))
    assert second.replicas["chat-3"].lifecycle is Lifecycle.ACTIVE
    assert second.replicas["chat-2"].lifecycle is Lifecycle.RETIRING  # newest out-of-date
    assert second.replicas["chat-4"].lifecycle is Lifecycle.SURGE  # the next one at once
    assert second.replicas["chat-4"].replaces == "chat-1"
    assert "chat-1" not in second.replicas  # still ACTIVE: READY stays at two
    assert kinds(second) == [("n2", "drain", "chat-2.0"), ("n1", "start", "chat-4.0")]


def test_unplaceable_and_undefined_profile_are_reported() -> None:
    state = replace(one_deployment(1), place=FakePlace(("n1",), refuse="no H100 free"))
    decision = reconcile(state)
    assert decision.unplaceable == {"chat": "no H100 free"}
    assert decision.commands == ()
    missing = replace(state, profiles={})
    assert reconcile(missing).unplaceable == {"chat": "profile 'p' is not defined"}


def test_a_refused_profile_places_starts_and_stops_nothing_and_says_why() -> None:
    hostile = replace(profile(), env={"LD_PRELOAD": "/tmp/x.so"})
    decision = reconcile(one_deployment(2, hostile))
    assert (decision.replicas, decision.commands) == ({}, ())
    assert decision.unplaceable["chat"].startswith("profile 'p' is refused: env.LD_PRELOAD: ")
    # a replica an older server placed with it: running, it is left alone; stopped, it is
    # not started again
    state, shards = settle(one_deployment(1))
    record = replace(state.replicas["chat-1"], profile=hostile)
    state = replace(state, replicas={"chat-1": record}, profiles={"p": hostile})
    assert reconcile(state).commands == ()
    stopped = {"chat-1.0": shard(record.plan.leader, "chat-1", ShardState.STOPPED)}
    decision = reconcile(replace(state, shards=stopped))
    assert decision.commands == () and "env.LD_PRELOAD" in decision.unplaceable["chat"]


def test_replica_ids_continue_past_retired_ones() -> None:
    assert replica_id_for("chat", 7) == "chat-7"
    state, _ = settle(one_deployment(1))
    retired = replace(state.replicas["chat-1"], lifecycle=Lifecycle.RETIRED)
    decision = reconcile(replace(state, replicas={"chat-1": retired}, shards={}))
    assert sorted(decision.replicas) == ["chat-2"]


def test_out_of_date_replica_restarts_with_the_profile_it_was_placed_with() -> None:
    state, shards = settle(one_deployment(1))
    old = state.replicas["chat-1"]
    stopped = {"chat-1.0": shard(old.plan.leader, "chat-1", ShardState.STOPPED)}
    state = replace(state, profiles={"p": profile(arg="b")}, shards=stopped)
    starts = [m.start_shard for _, m in reconcile(state).commands if m.start_shard]
    assert [(s.shard_id, s.profile) for s in starts] == [
        ("chat-1.0", profile()),  # its own profile, matching its fingerprint
        ("chat-2.0", profile(arg="b")),  # the surge
    ]


def test_multi_node_ranks_wait_for_their_leader_node() -> None:
    state = one_deployment(1, profile(tp=4, nodes=2))
    state = apply_decision(state, reconcile(state))
    down = {**state.nodes, "n1": node("n1", ready=False, since=200.0)}
    assert reconcile(replace(state, nodes=down, now=201.0, pending={})).commands == ()


# --- a simulated fleet --------------------------------------------------------------------

RUNNING = (ShardState.LOADING, ShardState.READY, ShardState.FAILED)  # alive, in the fleet


def _st(engine: Shard) -> ShardState:
    return read_shard_state(engine.status.state if engine.status else 0)


@dataclass
class Fleet:
    """Agents that execute commands at once; a failed node is partitioned, not wiped.

    A slow fleet's engines start LOADING, and the next round sees them so.
    """

    state: ReconcileInput
    engines: dict[str, dict[str, Shard]]  # node → shard id → the engine as it really is
    slow: bool = False
    stale: dict[str, Shard] = field(default_factory=dict)  # last reports of partitioned nodes

    def reported(self) -> dict[str, Shard]:
        view = dict(self.stale)
        for node_id, engines in sorted(self.engines.items()):
            if self.state.nodes[node_id].ready:
                view.update(engines)
        return view

    def round(self) -> Decision:
        state = replace(self.state, shards=self.reported())
        decision = reconcile(state)
        for rid, record in decision.replicas.items():
            old = state.replicas.get(rid)
            marked = old is not None and record == replace(old, was_ready=True)
            assert old is None or marked or record.lifecycle in ALLOWED_LIFECYCLE[old.lifecycle]
        self.state = replace(apply_decision(state, decision), now=state.now + 1)
        for _, _, e in self.states():  # what was LOADING when the round looked is READY now
            if e.status and e.status.state is ShardState.LOADING:
                e.status.state = ShardState.READY
        for node_id, msg in decision.commands:
            assert self.state.nodes[node_id].ready, f"command sent to NOT_READY {node_id}"
            self.execute(node_id, msg)
        running = [sid for _, sid, e in self.states() if _st(e) in RUNNING]
        assert len(running) == len(set(running)), running  # one copy of a shard at most
        return decision

    def execute(self, node_id: str, msg: ControlMessage) -> None:
        engines = self.engines[node_id]
        if msg.start_shard:
            s = msg.start_shard
            plan = ShardPlan(s.shard_id, node_id, s.rank, (), s.port)
            state = ShardState.LOADING if self.slow else ShardState.READY
            fp = s.profile_fingerprint
            engines[s.shard_id] = shard(plan, s.replica_id, state, profile_fingerprint=fp)
            return
        inner = msg.stop_shard or msg.drain_shard
        assert inner is not None and inner.shard_id in engines
        engines[inner.shard_id].status.state = ShardState.STOPPED  # type: ignore[union-attr]

    def states(self) -> list[tuple[str, str, Shard]]:
        """(node, shard id, engine) of every engine, as it really is."""
        return [
            (n, sid, e)
            for n, engines in sorted(self.engines.items())
            for sid, e in sorted(engines.items())
        ]

    def fail(self, node_id: str) -> None:
        if self.state.nodes[node_id].ready:
            self.stale.update({k: Shard.parse(bytes(v)) for k, v in self.engines[node_id].items()})
            nodes = {**self.state.nodes, node_id: node(node_id, ready=False, since=self.state.now)}
            self.state = replace(self.state, nodes=nodes)

    def recover(self, node_id: str) -> None:
        self.stale = {k: v for k, v in self.stale.items() if v.node_id != node_id}
        self.state = replace(self.state, nodes={**self.state.nodes, node_id: node(node_id)})

    def crash(self, index: int) -> None:
        """One READY engine on a connected node fails for good (its restarts are spent)."""
        ready = ShardState.READY
        live = [
            (n, i) for n, i, e in self.states() if _st(e) is ready and self.state.nodes[n].ready
        ]
        if live:
            node_id, shard_id = live[index % len(live)]
            self.engines[node_id][shard_id] = shard(
                ShardPlan(shard_id, node_id, 0, (), 0),
                self.engines[node_id][shard_id].replica_id,
                ShardState.FAILED,
                restarts=CONFIG.max_restarts,
            )

    def ready_replicas(self, deployment: str) -> int:
        ready = {(n, sid) for n, sid, e in self.states() if _st(e) is ShardState.READY}
        return sum(
            all((p.node_id, p.shard_id) in ready for p in r.plan.shards)
            for r in self.state.replicas.values()
            if r.plan.deployment == deployment
        )

    def converged(self) -> bool:
        """Every deployment at its count, up to date, every shard READY, nothing else runs."""
        for name, dep in self.state.deployments.items():
            records = [r for r in self.state.replicas.values() if r.plan.deployment == name]
            live = [r for r in records if r.lifecycle in _UNSETTLED]
            fp = fingerprint(self.state.profiles[dep.profile])
            active = [r for r in records if r.lifecycle is Lifecycle.ACTIVE]
            if live or len(active) != dep.replicas or any(r.plan.fingerprint != fp for r in active):
                return False
        wanted = {
            (p.node_id, p.shard_id)
            for r in self.state.replicas.values()
            if r.lifecycle is Lifecycle.ACTIVE
            for p in r.plan.shards
        }
        running = {(n, sid) for n, sid, e in self.states() if _st(e) in RUNNING}
        ready = {(n, sid) for n, sid, e in self.states() if _st(e) is ShardState.READY}
        return wanted == running == ready


_UNSETTLED = (Lifecycle.SURGE, Lifecycle.RETIRING)


deployment_specs = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 2), st.integers(1, 2)),  # replicas, tp, nodes
    min_size=1,
    max_size=3,
)
KINDS = ("fail", "recover", "wait", "crash", "reprofile", "scale", "delete")
operation = st.tuples(st.sampled_from(KINDS), st.integers(0, 50), st.integers(0, 3))
operations = st.lists(operation, max_size=8)


def fleet_of(specs: Sequence[tuple[int, int, int]], slow: bool) -> Fleet:
    profiles = {f"p{i}": profile(f"p{i}", tp=tp, nodes=n) for i, (_, tp, n) in enumerate(specs)}
    deployments = {
        f"d{i}": Deployment(name=f"d{i}", profile=f"p{i}", replicas=count)
        for i, (count, _, _) in enumerate(specs)
    }
    ids = [f"n{i}" for i in range(1, 9)]
    return Fleet(state_of(deployments, profiles, ids), {n: {} for n in ids}, slow)


def perform(fleet: Fleet, op: tuple[str, int, int]) -> None:
    kind, arg, count = op
    state, deps, names = fleet.state, sorted(fleet.state.deployments), sorted(fleet.state.profiles)
    if kind in ("fail", "recover"):
        (fleet.fail if kind == "fail" else fleet.recover)(f"n{arg % 6 + 1}")
    elif kind == "wait":
        fleet.state = replace(state, now=state.now + arg % 8)
    elif kind == "crash":
        fleet.crash(arg)
    elif kind == "reprofile":
        name = names[arg % len(names)]
        fleet.state = replace(state, profiles={**state.profiles, name: reprofiled(state, name)})
    elif deps and kind == "scale":
        dep = state.deployments[deps[arg % len(deps)]]
        changed = Deployment(name=dep.name, profile=dep.profile, replicas=count)
        fleet.state = replace(state, deployments={**state.deployments, dep.name: changed})
    elif deps:
        rest = {k: v for k, v in state.deployments.items() if k != deps[arg % len(deps)]}
        fleet.state = replace(state, deployments=rest)


def reprofiled(state: ReconcileInput, name: str) -> EngineProfile:
    new = EngineProfile.parse(bytes(state.profiles[name]))
    new.args = [*new.args, "x"]
    return new


PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(deployment_specs, operations, st.booleans())
def test_fleet_converges_and_every_round_is_idempotent(
    specs: list[tuple[int, int, int]], ops: list[tuple[str, int, int]], slow: bool
) -> None:
    fleet = fleet_of(specs, slow)
    for op in ops:
        perform(fleet, op)
        for _ in range(2):
            assert_idempotent(fleet)
            fleet.round()
    for node_id in sorted(fleet.engines):
        fleet.recover(node_id)
    for _ in range(20):
        assert_idempotent(fleet)
        fleet.round()
        fleet.state = replace(fleet.state, now=fleet.state.now + CONFIG.command_retry_s)
        if fleet.converged():
            break
    assert fleet.converged(), fleet.state.replicas
    assert fleet.round().commands == ()


def assert_idempotent(fleet: Fleet) -> None:
    state = replace(fleet.state, shards=fleet.reported())
    decision = reconcile(state)
    again = reconcile(apply_decision(state, decision))
    assert (again.commands, again.replicas) == ((), {}), again.events


@PROPERTY
@given(deployment_specs, st.lists(st.integers(0, 2), min_size=1, max_size=3), st.booleans())
def test_reprofile_never_drops_ready_below_desired(
    specs: list[tuple[int, int, int]], changes: list[int], slow: bool
) -> None:
    fleet = fleet_of(specs, slow)
    for _ in range(4):
        fleet.round()
    assert fleet.converged()
    for change in changes:
        name = f"p{change % len(specs)}"
        profiles = {**fleet.state.profiles, name: reprofiled(fleet.state, name)}
        fleet.state = replace(fleet.state, profiles=profiles)
        for _ in range(12):  # one surge per deployment at a time, in parallel
            fleet.round()
            for dep in fleet.state.deployments.values():
                assert fleet.ready_replicas(dep.name) >= dep.replicas, dep.name
            if fleet.converged():
                break
        assert fleet.converged()


def test_operator_drain_retires_that_replica_not_the_reconcilers_choice() -> None:
    state, _ = settle(one_deployment(3))
    lowered = {"chat": Deployment(name="chat", profile="p", replicas=2)}
    # Without the request the newest (chat-3) would go; the operator names chat-1.
    drained = replace(state, deployments=lowered, retire=frozenset({"chat-1"}))
    decision = reconcile(drained)
    assert {k: r.lifecycle for k, r in decision.replicas.items()} == {"chat-1": Lifecycle.RETIRING}
    assert kinds(decision) == [("n1", "drain", "chat-1.0")]
    again = apply_decision(drained, decision)
    assert reconcile(again).replicas == {}  # level-based: nothing new, nothing placed


def test_replace_request_surges_a_replacement_before_retiring_the_named_replica() -> None:
    state, shards = settle(one_deployment(2))
    moving = replace(state, replace=frozenset({"chat-1"}))
    first = reconcile(moving)
    (surge,) = first.replicas.values()
    assert (surge.lifecycle, surge.replaces) == (Lifecycle.SURGE, "chat-1")
    moving = apply_decision(moving, first)
    ready = {**shards, surge.plan.leader.shard_id: shard(surge.plan.leader, surge.replica_id)}
    second = reconcile(replace(moving, shards=ready))
    assert second.replicas[surge.replica_id].lifecycle is Lifecycle.ACTIVE
    assert second.replicas["chat-1"].lifecycle is Lifecycle.RETIRING
    assert "chat-2" not in second.replicas  # the other replica is left alone
