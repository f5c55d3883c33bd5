"""Placement on the simulated topology fixtures, and its invariants over random fleets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    Deployment,
    EngineProfile,
    GpuTelemetry,
    Health,
    Node,
    NodeState,
    NodeTelemetry,
)
from llmgw.server.core.capacity import NodeCapacity, node_capacity
from llmgw.server.core.placement import (
    FleetPlacer,
    Taken,
    place_deployment,
    place_replica,
    requirement,
)
from llmgw.server.core.plan import ReplicaPlan, Unplaceable

FP = "fp-1"


def _cap(
    fixture: str,
    node_id: str,
    *,
    state: NodeState = NodeState.READY,
    labels: dict[str, str] | None = None,
    ib: str | None = None,
    unhealthy: Sequence[int] = (),
) -> NodeCapacity:
    info = simulated_node(fixture, node_id=node_id, hostname=node_id, labels=labels)
    if ib is not None:
        for att in info.fabrics:
            att.fabric = ib
    live = [
        GpuTelemetry(uuid=g.uuid, health=Health.UNHEALTHY)
        for g in info.gpus
        if g.index in unhealthy and not g.mig_enabled
    ]
    return node_capacity(
        Node(
            info=info,
            state=state,
            cordoned=state is NodeState.CORDONED,
            telemetry=NodeTelemetry(node_id=node_id, gpus=live),
        )
    )


def _profile(gpu_class: str = "H100", tp: int = 1, **kw: Any) -> EngineProfile:
    return EngineProfile(name="p", engine="sim", gpu_class=gpu_class, tp=tp, **kw)


def _place(
    nodes: Sequence[NodeCapacity],
    profile: EngineProfile,
    count: int = 1,
    deployment: Deployment | None = None,
    **taken: Any,
) -> list[ReplicaPlan | Unplaceable]:
    return place_deployment(
        nodes,
        profile,
        deployment or Deployment(name="chat", profile="p", replicas=count),
        replica_ids=[f"chat-{i}" for i in range(count)],
        fingerprint=FP,
        taken=Taken(**taken),
    )


def _plans(results: Sequence[ReplicaPlan | Unplaceable]) -> list[ReplicaPlan]:
    assert all(isinstance(r, ReplicaPlan) for r in results), results
    return [r for r in results if isinstance(r, ReplicaPlan)]


def _indices(node: NodeCapacity, uuids: Sequence[str]) -> list[int]:
    by_uuid = {d.uuid: d for d in node.devices}
    return sorted(by_uuid[u].index for u in uuids)


def _numa(node: NodeCapacity, uuids: Sequence[str]) -> set[int]:
    by_uuid = {d.uuid: d for d in node.devices}
    return {by_uuid[u].numa_node for u in uuids}


# --- the fixtures ------------------------------------------------------------------------


def test_tp4_on_dgx_takes_four_nvlinked_gpus_of_one_numa_node() -> None:
    dgx = _cap("dgx-h100", "dgx-1")
    [plan] = _plans(_place([dgx], _profile(tp=4)))
    shard = plan.leader
    assert plan.fingerprint == FP and plan.deployment == "chat" and plan.replica_id == "chat-0"
    assert shard.node_id == "dgx-1" and shard.shard_id == "chat-0.0" and shard.rank == 0
    assert len(shard.gpu_uuids) == 4 and len(_numa(dgx, shard.gpu_uuids)) == 1
    by_uuid = {d.uuid: d for d in dgx.devices}
    chosen = [by_uuid[u] for u in shard.gpu_uuids]
    assert all(b.index in a.nvlink_peers for a in chosen for b in chosen if a is not b)
    assert shard.port == 20000 and plan.master_port == 0


def test_two_tp4_replicas_fill_both_numa_halves() -> None:
    dgx = _cap("dgx-h100", "dgx-1")
    first, second = _plans(_place([dgx], _profile(tp=4), 2))
    assert _numa(dgx, first.leader.gpu_uuids) == {0}
    assert _numa(dgx, second.leader.gpu_uuids) == {1}
    assert {first.leader.port, second.leader.port} == {20000, 20001}
    [third] = _place(
        [dgx],
        _profile(tp=4),
        1,
        devices={"dgx-1": frozenset(first.leader.gpu_uuids + second.leader.gpu_uuids)},
    )
    assert third == Unplaceable(
        "no schedulable node has 4 free H100 GPUs: dgx-1 has 0 free (8 in use)"
    )


def test_a_single_gpu_packs_into_the_fuller_numa_half() -> None:
    dgx = _cap("dgx-h100", "dgx-1")
    used = {"dgx-1": frozenset(d.uuid for d in dgx.devices if d.index in (0, 1, 2))}
    [plan] = _plans(_place([dgx], _profile(tp=1), devices=used))
    assert _indices(dgx, plan.leader.gpu_uuids) == [3]  # NUMA 0 has one left: best fit


def test_replicas_spread_across_nodes() -> None:
    nodes = [_cap("dgx-h100", f"dgx-{i}") for i in (1, 2, 3)]
    plans = _plans(_place(nodes, _profile(tp=2), 3))
    assert sorted(p.leader.node_id for p in plans) == ["dgx-1", "dgx-2", "dgx-3"]
    # existing replicas of the deployment count too
    [plan] = _plans(_place(nodes, _profile(tp=2), replicas={"dgx-1": 1, "dgx-2": 1}))
    assert plan.leader.node_id == "dgx-3"


def test_tp8_two_nodes_only_across_a_shared_infiniband_fabric() -> None:
    nodes = [
        _cap("dgx-h100", "dgx-1", ib="ib-a"),
        _cap("dgx-h100", "dgx-2", ib="ib-b"),
        _cap("dgx-h100", "dgx-3", ib="ib-a"),
    ]
    profile = _profile(tp=8, pp=2, nodes=2)  # world size tp × pp = 16: 8 GPUs per node
    [plan] = _plans(_place(nodes, profile))
    assert plan.nodes == ("dgx-1", "dgx-3")
    assert [s.rank for s in plan.shards] == [0, 1]
    assert [s.shard_id for s in plan.shards] == ["chat-0.0", "chat-0.1"]
    assert all(len(s.gpu_uuids) == 8 for s in plan.shards)
    assert plan.shards[0].hcas == tuple(f"mlx5_{i}" for i in range(8))  # each GPU's PIX HCA
    assert plan.master_port == 20001 and plan.leader.port == 20000
    # a second replica has dgx-2 alone on its fabric
    [again] = _place(
        nodes,
        profile,
        devices={
            n: frozenset(s.gpu_uuids[0] for s in plan.shards if s.node_id == n) for n in plan.nodes
        },
    )
    assert isinstance(again, Unplaceable)
    assert again.reason.startswith(
        "TP=8 × PP=2 × 2 nodes needs two nodes on one InfiniBand fabric or NVLink domain "
        "with 8 free H100 each: only dgx-2 qualifies"
    )


def test_multi_node_names_nodes_that_share_no_fabric() -> None:
    nodes = [_cap("dgx-h100", "dgx-1", ib="ib-a"), _cap("dgx-h100", "dgx-2", ib="ib-b")]
    [miss] = _place(nodes, _profile(tp=8, pp=2, nodes=2))
    assert isinstance(miss, Unplaceable)
    assert "the nodes that qualify share no fabric" in miss.reason
    assert miss.reason.endswith(
        "the nodes that qualify share no fabric (dgx-1: InfiniBand ib-a; dgx-2: InfiniBand ib-b)"
    )
    ethernet = [_cap("l4-pcie", f"l4-{i}") for i in (1, 2)]
    [miss] = _place(ethernet, _profile("L4", tp=2, nodes=2))
    assert isinstance(miss, Unplaceable)
    assert "(l4-1: no InfiniBand fabric or NVLink domain; l4-2: no InfiniBand" in miss.reason


def test_multi_node_with_no_qualifying_node_names_the_misses() -> None:
    nodes = [_cap("dgx-h100", "dgx-1"), _cap("dgx-h100", "dgx-2", state=NodeState.NOT_READY)]
    used = {"dgx-1": frozenset(d.uuid for d in nodes[0].devices[:5])}
    [miss] = _place(nodes, _profile(tp=4, pp=2, nodes=2), devices=used)
    assert miss == Unplaceable(
        "TP=4 × PP=2 × 2 nodes needs two nodes on one InfiniBand fabric or NVLink domain "
        "with 4 free H100 each: no node qualifies (dgx-1 has 3 free (5 in use), "
        "dgx-2 is NOT_READY)"
    )


def test_multi_node_hcas_come_from_the_shared_fabric_only() -> None:
    nodes = []
    for node_id in ("dgx-1", "dgx-2"):
        info = simulated_node("dgx-h100", node_id=node_id, hostname=node_id)
        for att in info.fabrics[4:]:  # NUMA 1's HCAs on another fabric than NUMA 0's
            att.fabric = "ib-z"
        nodes.append(node_capacity(Node(info=info, state=NodeState.READY)))
    [plan] = _plans(_place(nodes, _profile(tp=4, pp=2, nodes=2)))
    for shard in plan.shards:  # GPUs 0-3 and their own PIX HCAs, all on ib-compute
        assert _indices(nodes[shard.rank], shard.gpu_uuids) == [0, 1, 2, 3]
        assert shard.hcas == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")
    # GPUs of NUMA 1 have no near HCA on ib-compute: every HCA on that fabric is given
    taken = {n.node_id: frozenset(d.uuid for d in n.devices[:4]) for n in nodes}
    [plan] = _plans(_place(nodes, _profile(tp=4, nodes=2), devices=taken))
    assert plan.leader.hcas == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")


def test_gb200_multi_node_uses_the_nvlink_domain() -> None:
    nodes = [_cap("gb200-nvl4", f"tray-{i}", ib=f"ib-{i}") for i in (1, 2)]  # no shared IB
    [plan] = _plans(_place(nodes, _profile("gb200", tp=4, nodes=2)))
    assert plan.nodes == ("tray-1", "tray-2")
    assert all(s.hcas == () for s in plan.shards)  # NVLink, not InfiniBand
    no_imex = [_cap("gb200-nvl4", "tray-3", ib="ib-3"), nodes[0]]
    object.__setattr__(no_imex[0], "nvlink_domain", None)
    [miss] = _place(no_imex, _profile("GB200", tp=4, nodes=2))
    assert isinstance(miss, Unplaceable) and "share no fabric" in miss.reason


def test_mig_profiles_place_on_slices() -> None:
    a100 = _cap("a100-mig", "a100-1")
    slices = {d.uuid: d for d in a100.devices}
    plans = _plans(_place([a100], _profile("A100:3g.40gb")))
    assert slices[plans[0].leader.gpu_uuids[0]].mig_profile == "3g.40gb"
    ones = _plans(_place([a100], _profile("a100:1G.10GB"), 9))
    assert len({p.leader.gpu_uuids[0] for p in ones}) == 9
    assert all(slices[p.leader.gpu_uuids[0]].mig_profile == "1g.10gb" for p in ones)
    [tenth] = _place([a100], _profile("A100:1g.10gb"), 10)[9:]
    assert tenth == Unplaceable(
        "no schedulable node has 1 free A100 1g.10gb MIG slices: a100-1 has 0 free (9 in use)"
    )
    # a plain class never takes a slice: only GPU 3 is whole
    [whole] = _plans(_place([a100], _profile("A100")))
    assert slices[whole.leader.gpu_uuids[0]].mig_profile is None
    assert slices[whole.leader.gpu_uuids[0]].index == 3


def test_mig_profile_refuses_tensor_parallel() -> None:
    need = requirement(_profile("A100:1g.10gb", tp=2))
    assert isinstance(need, Unplaceable) and "a MIG slice cannot be combined" in need.reason


def test_l4_pcie_places_tp2_on_one_numa_node() -> None:
    l4 = _cap("l4-pcie", "l4-1")
    first, second = _plans(_place([l4], _profile("L4", tp=2), 2))
    assert len(_numa(l4, first.leader.gpu_uuids)) == 1
    assert _numa(l4, first.leader.gpu_uuids) != _numa(l4, second.leader.gpu_uuids)


def test_cpu_profiles_need_threads() -> None:
    nodes = [_cap("cpu-only", "cpu-1"), _cap("l4-pcie", "l4-1")]
    profile = _profile("cpu", cpu_threads=100)
    [plan] = _plans(_place(nodes, profile, threads={"cpu-1": 150}))
    assert plan.leader.node_id == "l4-1" and plan.leader.gpu_uuids == ()
    assert plan.leader.cpu_threads == 100
    results = _place(nodes, profile, 3)
    assert [r.leader.node_id for r in _plans(results[:2])] == ["cpu-1", "l4-1"]
    assert results[2] == Unplaceable(
        "no schedulable node has 100 CPU threads free: cpu-1 has 92 free of 192 (100 in use), "
        "l4-1 has 28 free of 128 (100 in use)"
    )


def test_pools_and_labels() -> None:
    nodes = [
        _cap("dgx-h100", "dgx-1", labels={"pool": "batch"}),
        _cap("dgx-h100", "dgx-2", labels={"pool": "chat", "zone": "b"}),
        _cap("dgx-h100", "dgx-3", labels={"pool": "chat", "zone": "a"}),
    ]
    deployment = Deployment(name="chat", profile="p", pool="chat", labels={"zone": "a"})
    plans = _plans(_place(nodes, _profile(tp=8), 1, deployment))
    assert plans[0].leader.node_id == "dgx-3"
    [miss] = _place(nodes, _profile(tp=8), 2, deployment)[1:]
    assert miss == Unplaceable(
        "no schedulable node has 8 free H100 GPUs: dgx-3 has 0 free (8 in use), "
        "dgx-1 is in pool 'batch', dgx-2 lacks label zone=a"
    )


def test_reason_names_the_closest_misses() -> None:
    nodes = [
        _cap("dgx-h100", "dgx-1"),
        _cap("dgx-h100", "dgx-2", state=NodeState.CORDONED),
        _cap("dgx-h100", "dgx-3", state=NodeState.NOT_READY),
        _cap("l4-pcie", "l4-1"),
    ]
    used = {"dgx-1": frozenset(d.uuid for d in nodes[0].devices[:6])}
    [miss] = _place(nodes, _profile(tp=4), devices=used)
    assert miss == Unplaceable(
        "no schedulable node has 4 free H100 GPUs: dgx-1 has 2 free (6 in use), "
        "dgx-2 is CORDONED, dgx-3 is NOT_READY, l4-1 has no H100 GPUs"
    )


def test_unhealthy_gpus_and_low_memory_are_named() -> None:
    dgx = _cap("dgx-h100", "dgx-1", unhealthy=(0, 1, 2, 3, 4))
    [miss] = _place([dgx], _profile(tp=4))
    assert miss == Unplaceable(
        "no schedulable node has 4 free H100 GPUs: dgx-1 has 3 free (0 in use, 5 unhealthy)"
    )
    [miss] = _place([_cap("dgx-h100", "dgx-2")], _profile(tp=1, min_gpu_memory_bytes=90 << 30))
    assert miss == Unplaceable(
        "no schedulable node has 1 free H100 GPUs with 90 GiB free each: "
        "dgx-2 has 0 free (0 in use, 8 with less than 90 GiB free)"
    )


def test_ports_skip_used_ones_and_run_out() -> None:
    dgx = _cap("dgx-h100", "dgx-1")
    plans = _plans(_place([dgx], _profile(tp=1), 2, ports={"dgx-1": frozenset({20000})}))
    assert [p.leader.port for p in plans] == [20001, 20002]
    results = place_deployment(
        [dgx],
        _profile(tp=1),
        Deployment(name="chat"),
        replica_ids=["a", "b", "c"],
        fingerprint=FP,
        port_range=(30000, 30001),
    )
    assert [r.leader.port for r in _plans(results[:2])] == [30000, 30001]
    assert results[2] == Unplaceable(
        "no schedulable node has 1 free H100 GPUs: dgx-1 has no free engine port in 30000-30001"
    )


def test_place_replica_matches_place_deployment() -> None:
    dgx = _cap("dgx-h100", "dgx-1")
    plan = place_replica(
        [dgx],
        _profile(tp=2),
        Deployment(name="chat"),
        replica_id="r1",
        fingerprint=FP,
        taken=Taken(),
    )
    assert plan == _place([dgx], _profile(tp=2))[0].__class__(  # type: ignore[call-arg]
        "r1",
        "chat",
        "p",
        FP,
        (plan.leader,),  # type: ignore[union-attr]
    )


def test_profiles_that_can_never_place() -> None:
    assert isinstance(requirement(_profile(tp=3, nodes=2)), Unplaceable)
    assert isinstance(requirement(_profile("cpu", nodes=2)), Unplaceable)
    assert _place([], _profile()) == [Unplaceable("no nodes are registered")]


def test_fleet_placer_derives_usage_from_taken_plans() -> None:
    nodes = [_cap("dgx-h100", "dgx-1"), _cap("dgx-h100", "dgx-2"), _cap("dgx-h100", "dgx-3")]
    placer = FleetPlacer(nodes, lambda p: f"fp-of-{p.name}")
    deployment = Deployment(name="chat", profile="p")
    first = _plans(placer(deployment, _profile(tp=4), ["c-1"], excluding=frozenset(), taken=()))
    assert first[0].fingerprint == "fp-of-p" and first[0].leader.node_id == "dgx-1"
    # dgx-2 excluded; dgx-1 holds a replica of chat already: the next goes to dgx-3
    [second] = _plans(
        placer(deployment, _profile(tp=4), ["c-2"], excluding=frozenset({"dgx-2"}), taken=first)
    )
    assert second.leader.node_id == "dgx-3"
    # with dgx-3 and dgx-2 out, the other NUMA half of dgx-1, on another port
    [third] = _plans(
        placer(
            deployment,
            _profile(tp=4),
            ["c-3"],
            excluding=frozenset({"dgx-2", "dgx-3"}),
            taken=first,
        )
    )
    assert not set(third.leader.gpu_uuids) & set(first[0].leader.gpu_uuids)
    assert third.leader.port == first[0].leader.port + 1


# --- invariants over random fleets -------------------------------------------------------

_FIXTURES = ["dgx-h100", "a100-mig", "gb200-nvl4", "l4-pcie", "cpu-only"]


@st.composite
def _fleets(draw: st.DrawFn, fixtures: Sequence[str] = tuple(_FIXTURES)) -> list[NodeCapacity]:
    count = draw(st.integers(1, 7))
    kinds = draw(st.lists(st.sampled_from(fixtures), min_size=1, max_size=2))  # few kinds
    fleet = []
    for i in range(count):
        info = simulated_node(draw(st.sampled_from(kinds)), node_id=f"n{i}", hostname=f"n{i}")
        for att in info.fabrics:
            att.fabric = draw(st.sampled_from(["ib-a", "ib-b"]))
        sick = draw(st.sets(st.integers(0, 7), max_size=3))
        live = [
            GpuTelemetry(uuid=g.uuid, health=Health.UNHEALTHY) for g in info.gpus if g.index in sick
        ]
        state = draw(
            st.sampled_from([NodeState.READY] * 4 + [NodeState.CORDONED, NodeState.NOT_READY])
        )
        fleet.append(
            node_capacity(Node(info=info, state=state, telemetry=NodeTelemetry(gpus=live)))
        )
    return fleet


def _classes(fleet: Sequence[NodeCapacity]) -> list[str]:
    """The classes the fleet offers (MIG ones as CLASS:PROFILE), plus cpu and one it lacks."""
    found = {
        f"{d.gpu_class}:{d.mig_profile}" if d.mig_profile else d.gpu_class
        for n in fleet
        for d in n.devices
    }
    return sorted(found) + ["cpu", "B200"]


def _profiles(
    classes: list[str], nodes: Sequence[int] = (1, 1, 2)
) -> st.SearchStrategy[EngineProfile]:
    return st.builds(
        lambda klass, tp, pp, nodes, threads: _profile(
            klass, tp=tp, pp=pp, nodes=nodes, cpu_threads=threads
        ),
        st.sampled_from(classes),
        st.sampled_from([1, 1, 2, 4, 8]),
        st.sampled_from([1, 1, 1, 2]),
        st.sampled_from(nodes),
        st.integers(0, 64),
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=_fleets(), data=st.data())
def test_placement_invariants(fleet: list[NodeCapacity], data: st.DataObject) -> None:
    profiles = _profiles(_classes(fleet))
    rounds = data.draw(st.lists(st.tuples(profiles, st.integers(1, 6)), min_size=1, max_size=4))
    _check_rounds(fleet, rounds)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=_fleets(("dgx-h100", "gb200-nvl4")), data=st.data())
def test_multi_node_invariants(fleet: list[NodeCapacity], data: st.DataObject) -> None:
    profiles = _profiles(_classes(fleet), nodes=(2, 2, 3))
    rounds = data.draw(st.lists(st.tuples(profiles, st.integers(1, 4)), min_size=1, max_size=4))
    _check_rounds(fleet, rounds)


def _check_rounds(fleet: list[NodeCapacity], rounds: list[tuple[EngineProfile, int]]) -> None:
    """Place every round in turn, each seeing what the earlier ones took, and check that no
    GPU or port is given twice and only schedulable nodes and healthy GPUs are used."""
    by_id = {n.node_id: n for n in fleet}
    used: dict[str, set[str]] = {}
    ports: dict[str, set[int]] = {}
    threads: dict[str, int] = {}
    for profile, count in rounds:
        results = _place(
            fleet,
            profile,
            count,
            devices={k: frozenset(v) for k, v in used.items()},
            ports={k: frozenset(v) for k, v in ports.items()},
            threads=dict(threads),
        )
        need = requirement(profile)
        for plan in (r for r in results if isinstance(r, ReplicaPlan)):
            assert not isinstance(need, Unplaceable)
            assert sum(len(s.gpu_uuids) for s in plan.shards) == (
                0 if need.cpu else need.tp * need.pp
            )
            assert len(plan.shards) == need.nodes
            for shard in plan.shards:
                node = by_id[shard.node_id]
                assert node.schedulable
                devices = {d.uuid: d for d in node.devices}
                for uuid in shard.gpu_uuids:
                    assert devices[uuid].healthy
                    assert uuid not in used.setdefault(shard.node_id, set()), "GPU given twice"
                    used[shard.node_id].add(uuid)
                assert shard.port not in ports.setdefault(shard.node_id, set()), "port given twice"
                ports[shard.node_id].add(shard.port)
                threads[shard.node_id] = threads.get(shard.node_id, 0) + shard.cpu_threads
                assert threads[shard.node_id] <= node.cpu_count or not need.cpu
            if plan.master_port:
                assert plan.master_port not in ports[plan.leader.node_id]
                ports[plan.leader.node_id].add(plan.master_port)
