"""Physical GPUs and MIG slices counted apart, on the simulated A100 MIG box (4 GPUs: three
in MIG mode carved into 7 + 4 + 1 slices, one whole) and a DGX H100 beside it."""

from __future__ import annotations

from llmgw.agent.discovery.simulated import simulated_node
from llmgw.api.llmgw.v1 import (
    Cluster,
    Node,
    NodeInfo,
    NodeState,
    Replica,
    Shard,
    ShardState,
    ShardStatus,
    WatchEvent,
)
from llmgw.tui.actions import plan_cordon, plan_drain
from llmgw.tui.model import ClusterModel, ConsoleSnapshot
from llmgw.tui.report import snapshot_tables
from llmgw.tui.summary import GpuCounts, gpu_counts, summarize

T0 = 1_700_000_000_000


def _info(fixture: str, node_id: str) -> NodeInfo:
    return simulated_node(fixture, node_id=node_id, hostname=node_id)


def _holding(replica: str, info: NodeInfo, uuids: list[str]) -> Shard:
    status = ShardStatus(
        shard_id=f"{replica}.0", replica_id=replica, state=ShardState.READY, gpu_uuids=uuids
    )
    return Shard(shard_id=f"{replica}.0", replica_id=replica, node_id=info.node_id, status=status)


def _shards() -> list[Shard]:
    """Shards on two 1g slices of GPU 0, the 3g slice of GPU 1, the whole GPU 3 and two
    H100s; GPU 2 (one 7g slice) and six H100s free."""
    mig, dgx = _info("a100-mig", "mig-1"), _info("dgx-h100", "dgx-1")
    slices = {g.mig.gpu_instance_id: g for g in mig.gpus if g.mig and g.index == 0}
    three_g = next(g for g in mig.gpus if g.mig and g.mig.profile == "3g.40gb")
    whole = next(g for g in mig.gpus if g.index == 3)
    shards = [
        _holding("a-1", mig, [slices[7].uuid]),
        _holding("a-2", mig, [slices[8].uuid]),
        _holding("b-1", mig, [three_g.uuid]),
        _holding("c-1", mig, [whole.uuid]),
        _holding("d-1", dgx, [dgx.gpus[0].uuid, dgx.gpus[1].uuid]),
    ]
    return shards


def _snapshot() -> ConsoleSnapshot:
    mig, dgx = _info("a100-mig", "mig-1"), _info("dgx-h100", "dgx-1")
    shards = _shards()
    nodes = [Node(info=i, state=NodeState.READY, connected=True) for i in (mig, dgx)]
    model = ClusterModel()
    model.apply(WatchEvent(revision=1, snapshot=Cluster(nodes=nodes, shards=shards)), T0)
    return model.snapshot(T0)


def test_the_mig_box_is_four_gpus_with_twelve_slices_not_thirteen_gpus() -> None:
    row = _snapshot().nodes["mig-1"]
    assert (row.gpus, row.mig_slices) == (4, 12)
    assert row.gpu_words == "4×A100 (12 MIG slices)"
    assert _snapshot().nodes["dgx-1"].gpu_words == "8×H100"


def test_a_gpu_is_used_when_it_or_any_of_its_slices_is_held() -> None:
    snapshot = _snapshot()
    mig = [g for g in snapshot.gpus.values() if g.node_id == "mig-1"]
    assert gpu_counts(mig) == GpuCounts(gpus=4, gpus_used=3, slices=12, slices_used=3)
    overview = summarize(snapshot)
    assert overview.gpus == GpuCounts(gpus=12, gpus_used=5, slices=12, slices_used=3)
    assert overview.gpus.words == "GPUs 5/12 used · MIG slices 3/12 used"


def test_no_slices_no_slice_words() -> None:
    dgx = [g for g in _snapshot().gpus.values() if g.node_id == "dgx-1"]
    assert gpu_counts(dgx).words == "GPUs 2/8 used"
    assert gpu_counts([]) == GpuCounts(0, 0, 0, 0)


def test_tables_and_dialogs_count_the_same_way() -> None:
    snapshot = _snapshot()
    nodes = dict(snapshot_tables(snapshot))["NODES"]
    assert nodes[0][:5] == ["NODE", "STATE", "GPUS", "USED", "SLICES"]
    by_id = {row[0]: row for row in nodes[1:]}
    assert by_id["mig-1"][2:5] == ["4", "3", "3/12"]
    assert by_id["dgx-1"][2:5] == ["8", "2", "-"]
    assert plan_cordon(snapshot, "mig-1").targets == ("node mig-1: READY, 4×A100 (12 MIG slices)",)


def test_draining_a_slice_replica_frees_a_slice_not_a_gpu() -> None:
    replicas = [
        Replica(replica_id=r, deployment=r[0], profile="p", model="m", state=ShardState.READY,
                shard_ids=[f"{r}.0"])
        for r in ("b-1", "d-1")
    ]  # fmt: skip
    model = ClusterModel()
    cluster = Cluster(
        nodes=[Node(info=i, state=NodeState.READY, connected=True)
               for i in (_info("a100-mig", "mig-1"), _info("dgx-h100", "dgx-1"))],
        shards=_shards(),
        replicas=replicas,
    )  # fmt: skip
    model.apply(WatchEvent(revision=1, snapshot=cluster), T0)
    snapshot = model.snapshot(T0)
    assert plan_drain(snapshot, "b-1").impact[-1] == "Frees 1 MIG slice on mig-1."
    assert plan_drain(snapshot, "d-1").impact[-1] == "Frees 2 GPUs on dgx-1."
