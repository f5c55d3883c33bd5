"""SVG snapshots of the console (pytest-textual-snapshot, pinned) with data and clock frozen.

One fixed synthetic cluster, built from the protos and the simulated topology fixtures
(a DGX H100, an A100 with MIG slices, a GB200 NVL4 and an L4 box; seeded telemetry),
with replicas in every state, a multi-node replica, an out-of-date one, operator actions
from the audit log, state changes seen after the snapshot, and router statistics sampled
at fixed instants. It is shown at 80×24 and 160×50: every view while LIVE, the topology
and the replicas while STALE (dimmed, with the reason and the age on the badge), and the
replicas read-only (no verb that changes the cluster in the footer).

Nothing depends on the machine: the snapshot clock (``taken_ms``) and the badge clock are
fixed, event times are shown in UTC, the theme is chosen (not read from $TERM), NO_COLOR is
unset. Regenerate after a deliberate change with
``.venv/bin/pytest tests/tui/test_console_snapshots.py --snapshot-update`` and look at the
SVGs (or the HTML report a failing run writes) before committing them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from textual.pilot import Pilot

from llmgw.agent.discovery.simulated import SimulatedTelemetry, simulated_node
from llmgw.api.llmgw.v1 import (
    AuditEvent,
    AutoscalePolicy,
    AutoscaleStatus,
    Cluster,
    Deployment,
    DeploymentStatus,
    Node,
    NodeInfo,
    NodeState,
    NodeTelemetry,
    Replica,
    RouterStats,
    Shard,
    ShardState,
    ShardStatus,
    WatchEvent,
)
from llmgw.server.core.deployment_status import ReplicaFacts, RoundVerdict, deployment_status
from llmgw.tui.app import ConsoleApp
from llmgw.tui.model import ClusterModel
from llmgw.tui.stream import LinkPhase, LinkStatus

T0 = 1_700_000_000_000  # 2023-11-14 22:13:20 UTC: when the snapshot was taken
NOW_S = 500.0  # the app's monotonic clock, frozen
SERVER = "http://127.0.0.1:8080"
SIZES = {"80x24": (80, 24), "160x50": (160, 50)}

SnapCompare = Callable[..., bool]


# --- the frozen cluster ------------------------------------------------------------------


def _node_info(fixture: str, node_id: str) -> NodeInfo:
    return simulated_node(fixture, node_id=node_id, hostname=f"{node_id}.lab")


BUSY_GPUS = {"dgx-1": (0, 1, 2, 3, 6, 7), "gb-1": (0, 1, 2, 3), "mig-1": (9,)}
"""GPUs whose engine has loaded its weights and serves: their memory is mostly taken."""


def _telemetry(info: NodeInfo, samples: int = 30) -> NodeTelemetry:
    """Seeded simulated readings after ``samples`` steps (the same on every run), with the
    memory of the GPUs that serve a replica taken by its weights and KV cache."""
    sim = SimulatedTelemetry(info, seed=7)
    gpus = sim.sample()
    for _ in range(samples - 1):
        gpus = sim.sample()
    for i in BUSY_GPUS.get(info.node_id, ()):
        total = info.gpus[i].memory_total_bytes
        gpus[i].memory_used_bytes = total * (78 + 4 * (i % 4)) // 100
        gpus[i].utilization_pct = min(100, gpus[i].utilization_pct + 35 + 5 * i)
    return NodeTelemetry(node_id=info.node_id, last_heartbeat_unix_ms=T0 - 1_000, gpus=gpus)


def _node(fixture: str, node_id: str, state: NodeState, reason: str = "") -> Node:
    info = _node_info(fixture, node_id)
    connected = state is not NodeState.NOT_READY
    return Node(
        info=info,
        state=state,
        cordoned=state is NodeState.CORDONED,
        connected=connected,
        first_seen_unix_ms=T0 - 3_600_000,
        registered_unix_ms=T0 - 1_800_000,
        last_heartbeat_unix_ms=T0 - (45_000 if not connected else 1_000),
        peer="127.0.0.1:40000",
        protocol_version=1,
        state_reason=reason,
        telemetry=_telemetry(info) if connected else None,
    )


def _uuids(info: NodeInfo, *indexes: int) -> list[str]:
    return [info.gpus[i].uuid for i in indexes]


def _shard(
    replica: str, node: NodeInfo, gpus: list[str], state: ShardState, age_s: int, **status: Any
) -> Shard:
    rank = status.pop("rank", 0)
    shard_id = f"{replica}.{rank}"
    return Shard(
        shard_id=shard_id,
        replica_id=replica,
        node_id=node.node_id,
        updated_unix_ms=T0 - age_s * 1000,
        status=ShardStatus(
            shard_id=shard_id,
            replica_id=replica,
            rank=rank,
            state=state,
            gpu_uuids=gpus,
            since_unix_ms=T0 - age_s * 1000,
            endpoint=f"http://127.0.0.1:{8100 + len(shard_id)}" if gpus else "",
            pid=4000 + len(shard_id),
            engine="sim",
            profile_fingerprint="f1e2d3c4",
            **status,
        ),
    )


def _replica(replica_id: str, deployment: str, state: ShardState, shards: list[Shard],
             **extra: Any) -> Replica:  # fmt: skip
    profiles = {"chat": "chat-h100", "small": "small-mig", "embed": "embed-l4", "big": "big-nvl4"}
    return Replica(
        replica_id=replica_id,
        deployment=deployment,
        profile=extra.pop("profile", profiles[deployment]),
        model=deployment,
        state=state,
        shard_ids=[s.shard_id for s in shards],
        endpoint=shards[0].status.endpoint if shards and shards[0].status else "",
        **extra,
    )


def _workload(dgx: NodeInfo, mig: NodeInfo, gb: NodeInfo, l4: NodeInfo) -> tuple[
    list[Shard], list[Replica]
]:  # fmt: skip
    s = ShardState
    three_g = next(i for i, g in enumerate(mig.gpus) if g.mig and g.mig.profile == "3g.40gb")
    shards = {
        "chat-1": [_shard("chat-1", dgx, _uuids(dgx, 0, 1), s.READY, 5_400)],
        "chat-2": [_shard("chat-2", dgx, _uuids(dgx, 2, 3), s.READY, 7_300)],
        "chat-3": [_shard("chat-3", dgx, _uuids(dgx, 4, 5), s.STARTING, 12)],
        "chat-4": [_shard("chat-4", dgx, _uuids(dgx, 6, 7), s.DRAINING, 40,
                          reason="drained by operator:alice; 3 requests in flight")],
        "small-1": [_shard("small-1", mig, _uuids(mig, three_g), s.READY, 900)],
        "big-1": [_shard("big-1", gb, _uuids(gb, 0, 1), s.READY, 2_000),
                  _shard("big-1", gb, _uuids(gb, 2, 3), s.READY, 1_990, rank=1)],
        "embed-1": [_shard("embed-1", l4, _uuids(l4, 0), s.FAILED, 75, exited=True,
                           exit_code=1, restarts=3,
                           reason="engine exited with code 1: CUDA out of memory")],
    }  # fmt: skip
    replicas = [
        _replica("chat-1", "chat", s.READY, shards["chat-1"]),
        _replica("chat-2", "chat", s.READY, shards["chat-2"], out_of_date=True),
        _replica("chat-3", "chat", s.STARTING, shards["chat-3"], profile="chat-h100-v2"),
        _replica("chat-4", "chat", s.DRAINING, shards["chat-4"]),
        _replica("small-1", "small", s.READY, shards["small-1"]),
        _replica("small-2", "small", s.PENDING, []),
        _replica("big-1", "big", s.READY, shards["big-1"]),
        _replica("embed-1", "embed", s.FAILED, shards["embed-1"]),
    ]
    return [shard for group in shards.values() for shard in group], replicas


def _audit() -> list[AuditEvent]:
    records = [
        (3_600, "operator:alice", "apply", "deployment chat", "ok: 4 replicas, profile chat-h100"),
        (3_500, "operator:alice", "apply", "deployment big", "ok: 1 replica, profile big-nvl4"),
        (900, "operator:bob", "cordon", "mig-1", "ok"),
        (300, "operator:alice", "reprofile", "chat", "ok: chat-h100 → chat-h100-v2, rolling"),
        (60, "viewer:carol", "drain", "chat-1", "refused: role viewer may not drain"),
        (40, "operator:alice", "drain", "chat-4", "ok: 3 requests in flight, grace 120s"),
    ]
    return [
        AuditEvent(at_unix_ms=T0 - ago * 1000, actor=actor, action=action, target=t, result=r)
        for ago, actor, action, t, r in records
    ]


WIDE_REASON = "no schedulable node has 2 free L4 GPUs: l4-1 is NOT_READY"


def _status(deployment: Deployment, replicas: list[Replica]) -> DeploymentStatus:
    """The status the server would send for ``deployment`` over these replicas (its pure
    computation; the draining one is retiring, not counted), each condition since 10 min."""
    facts = [
        ReplicaFacts(
            r.replica_id,
            r.state,
            r.state is ShardState.READY,
            r.profile == deployment.profile,
            "FAILED: engine exited with code 1: CUDA out of memory"
            if r.state is ShardState.FAILED
            else "",
        )
        for r in replicas
        if r.deployment == deployment.name and r.state is not ShardState.DRAINING
    ]
    verdict = RoundVerdict(WIDE_REASON if deployment.name == "wide" else "")
    return deployment_status(deployment, facts, verdict, previous=None, now_ms=T0 - 600_000)


def frozen_cluster() -> Cluster:
    dgx = _node("dgx-h100", "dgx-1", NodeState.READY)
    mig = _node("a100-mig", "mig-1", NodeState.CORDONED)
    gb = _node("gb200-nvl4", "gb-1", NodeState.READY)
    l4 = _node("l4-pcie", "l4-1", NodeState.NOT_READY, "no heartbeat for 45s")
    infos = [n.info for n in (dgx, mig, gb, l4)]
    assert all(infos)
    shards, replicas = _workload(*infos)  # type: ignore[arg-type]
    deployments = [
        Deployment(name="big", profile="big-nvl4", replicas=1, updated_unix_ms=T0 - 3_500_000),
        Deployment(name="chat", profile="chat-h100-v2", replicas=3, updated_unix_ms=T0 - 300_000),
        Deployment(name="embed", profile="embed-l4", replicas=1, updated_unix_ms=T0 - 3_600_000),
        Deployment(name="small", profile="small-mig", replicas=2, updated_unix_ms=T0 - 900_000),
        Deployment(name="wide", profile="wide-l4", replicas=2, updated_unix_ms=T0 - 120_000),
    ]
    for deployment in deployments:
        deployment.status = _status(deployment, replicas)
    _autoscaled(deployments[1], deployments[3])
    return Cluster(
        nodes=[dgx, mig, gb, l4],
        replicas=replicas,
        shards=shards,
        deployments=deployments,
        revision=412,
        server_time_unix_ms=T0,
        events=_audit(),
    )


def _autoscaled(chat: Deployment, small: Deployment) -> None:
    """chat scales itself (mode act), and the planner wants one more; small is advised."""
    chat.autoscale = AutoscalePolicy(min=1, max=6, ttft_p90_ms=800, scale_down_after_s=300,
                                     mode="act")  # fmt: skip
    small.autoscale = AutoscalePolicy(min=1, max=4, itl_p90_ms=50, scale_down_after_s=300,
                                      mode="advise")  # fmt: skip
    assert chat.status is not None and small.status is not None
    chat.status.autoscale = AutoscaleStatus(
        mode="act", current=3, desired=4, reason="scale_up",
        message="ttft p90 1240 ms > target 800 ms on 3 replicas", signal="ttft_p90_ms=1240",
        decided_unix_ms=T0 - 12_000, changed_unix_ms=T0 - 12_000, ttft_p90_ms=1240.0,
        itl_p90_ms=31.0, arrival_rps=6.4, in_flight=14, waiting=0, kv_usage=0.62, gpu_budget=16,
    )  # fmt: skip
    small.status.autoscale = AutoscaleStatus(
        mode="advise", current=2, desired=2, reason="hold",
        message="itl p90 22 ms within target 50 ms", signal="itl_p90_ms=22",
        decided_unix_ms=T0 - 40_000, ttft_p90_ms=-1.0, itl_p90_ms=22.0, arrival_rps=0.8,
        in_flight=1, waiting=0, kv_usage=-1.0,
    )  # fmt: skip


def _later_changes() -> list[WatchEvent]:
    """State changes after the first snapshot: the events view logs them."""
    cluster = frozen_cluster()
    shard = next(s for s in cluster.shards if s.shard_id == "chat-3.0")
    assert shard.status is not None
    shard.status.state = ShardState.LOADING
    shard.status.since_unix_ms = T0 - 5_000
    replica = next(r for r in cluster.replicas if r.replica_id == "chat-3")
    replica.state = ShardState.LOADING
    return [WatchEvent(revision=413, shard=shard), WatchEvent(revision=414, replica=replica)]


def _router_samples() -> list[RouterStats]:
    """A minute of GetRouterStats every 4 s: traffic ramping up, prefix share growing."""
    samples = []
    precise = approximate = load = 0
    for i in range(16):
        rate = 3 + (i % 5) + i // 3  # decisions per second over the last 4 s
        hits = min(rate - 1, 1 + i // 2)
        precise += 4 * (hits // 2)
        approximate += 4 * (hits - hits // 2)
        load += 4 * (rate - hits)
        tiers = {"precise": precise, "approximate": approximate, "load": load}
        samples.append(RouterStats(decisions=sum(tiers.values()), decisions_by_tier=tiers))
    return samples


class FrozenFeed:
    """Feeds the app the frozen cluster once, then the status a test asks for."""

    def __init__(self, status: LinkStatus) -> None:
        self.status = status
        self.sink: Any = None

    async def run(self, sink: Any) -> None:
        self.sink = sink
        model = ClusterModel()
        model.apply(WatchEvent(revision=412, snapshot=frozen_cluster()), T0)
        for i, event in enumerate(_later_changes()):
            model.apply(event, T0 - 5_000 + i * 1_000)
        for i, stats in enumerate(_router_samples()):
            model.add_router_stats(stats, NOW_S - 60 + 4 * i)
        sink.status_changed(LinkStatus().to(LinkPhase.LIVE, live_at=NOW_S - 20))
        sink.snapshot_ready(model.snapshot(T0))
        if not self.status.live:
            sink.status_changed(self.status)
        await asyncio.Event().wait()


LIVE = LinkStatus().to(LinkPhase.LIVE, live_at=NOW_S - 20)
STALE = LIVE.to(
    LinkPhase.STALE,
    live_at=NOW_S - 12,
    attempt=2,
    error="cannot reach http://127.0.0.1:8080: connection refused",
)


# --- running the app ---------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _frozen_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """UTC for the events' clock times; colours whatever the CI terminal says."""
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        yield
    finally:
        monkeypatch.undo()
        time.tzset()


def _app(view: str, status: LinkStatus = LIVE, *, read_only: bool = False) -> ConsoleApp:
    feed = FrozenFeed(status)
    return ConsoleApp(
        feed,
        server=SERVER,
        read_only=read_only,
        view=view,
        theme="textual-dark",
        clock=lambda: NOW_S,
    )


async def _shown(pilot: Pilot[Any]) -> None:
    """Wait until the frozen snapshot is on screen (and the status after it)."""
    app = pilot.app
    assert isinstance(app, ConsoleApp) and isinstance(app.feed, FrozenFeed)
    for _ in range(100):
        if app.displayed.revision == 414 and app.status.phase is app.feed.status.phase:
            break
        await pilot.pause(0.05)
    else:
        raise AssertionError("the frozen snapshot never reached the screen")
    await pilot.pause()


# --- the snapshots -----------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(
    "view", ["overview", "nodes", "replicas", "shards", "router", "events", "deployments"]
)
def test_live(snap_compare: SnapCompare, view: str, size: str) -> None:
    assert snap_compare(_app(view), terminal_size=SIZES[size], run_before=_shown)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("view", ["nodes", "replicas"])
def test_stale(snap_compare: SnapCompare, view: str, size: str) -> None:
    assert snap_compare(_app(view, STALE), terminal_size=SIZES[size], run_before=_shown)


@pytest.mark.parametrize("size", SIZES)
def test_read_only(snap_compare: SnapCompare, size: str) -> None:
    app = _app("replicas", read_only=True)
    assert snap_compare(app, terminal_size=SIZES[size], run_before=_shown)


def test_the_frozen_cluster_is_what_the_snapshots_claim() -> None:
    """The data behind the pictures: every state, and nothing taken from the clock."""
    model = ClusterModel()
    model.apply(WatchEvent(revision=412, snapshot=frozen_cluster()), T0)
    snap = model.snapshot(T0)
    states = {r.state for r in snap.replicas.values()}
    assert states == {ShardState.READY, ShardState.STARTING, ShardState.DRAINING,
                      ShardState.PENDING, ShardState.FAILED}  # fmt: skip
    assert {n.state for n in snap.nodes.values()} == set(NodeState) - {NodeState.UNSPECIFIED}
    assert any(g.info.is_mig for g in snap.gpus.values())
    assert snap.replicas["big-1"].gpus == 4 and snap.replicas["chat-2"].out_of_date
    assert frozen_cluster() == frozen_cluster()  # no clock, no randomness
    assert _router_samples() == _router_samples()
