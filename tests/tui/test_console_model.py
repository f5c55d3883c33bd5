"""The console's pure core: Watch deltas → frozen snapshots, keyed diffs, windowed rates with
counter resets, the link's lifecycle and backoff, the view registry, --once JSON; and the
watch worker against a scripted client (reconnects, idle watchdog, router stats)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from grpclib.const import Status

from llmgw.api.llmgw.v1 import (
    AuditEvent,
    Cluster,
    Deployment,
    Gpu,
    GpuHealth,
    GpuTelemetry,
    Health,
    MigDevice,
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
from llmgw.cli.console import VIEW_NAMES
from llmgw.client import RpcError, ServerUnreachable
from llmgw.tui.model import ClusterModel, ConsoleSnapshot, RouterStatus, diff_rows
from llmgw.tui.rates import CounterWindow, counter_increase
from llmgw.tui.registry import VIEWS, bindings, resolve_view
from llmgw.tui.report import snapshot_json
from llmgw.tui.rows import read_health, read_node_state, read_shard_state
from llmgw.tui.stream import (
    ALLOWED_TRANSITIONS,
    Backoff,
    LinkPhase,
    LinkStatus,
    WatchConfig,
    WatchSession,
)
from llmgw.tui.summary import summarize

T0 = 1_700_000_000_000
GiB = 1 << 30


# --- builders ------------------------------------------------------------------------------


def gpu(node: str, index: int, **kw: Any) -> Gpu:
    return Gpu(
        index=index,
        uuid=f"GPU-{node}-{index}",
        name="NVIDIA H100 80GB HBM3",
        gpu_class="H100",
        memory_total_bytes=80 * GiB,
        numa_node=index // 4,
        nvlink_peers=[i for i in range(4) if i != index],
        health=GpuHealth(health=Health.HEALTHY, temperature_c=40),
        **kw,
    )


def node(node_id: str, gpus: int = 4, state: NodeState = NodeState.READY, **kw: Any) -> Node:
    info = NodeInfo(node_id=node_id, hostname=node_id, gpus=[gpu(node_id, i) for i in range(gpus)])
    return Node(info=info, state=state, connected=state is not NodeState.NOT_READY, **kw)


def shard(shard_id: str, node_id: str, gpus: list[int], state: ShardState, **kw: Any) -> Shard:
    replica_id = shard_id.rpartition(".")[0]
    status = ShardStatus(
        shard_id=shard_id,
        replica_id=replica_id,
        state=state,
        gpu_uuids=[f"GPU-{node_id}-{i}" for i in gpus],
        since_unix_ms=T0 - 60_000,
        **kw,
    )
    return Shard(shard_id=shard_id, replica_id=replica_id, node_id=node_id, status=status)


def replica(replica_id: str, state: ShardState, shards: int = 1, **kw: Any) -> Replica:
    return Replica(
        replica_id=replica_id,
        deployment="chat",
        profile="chat-a",
        model="chat",
        state=state,
        shard_ids=[f"{replica_id}.{i}" for i in range(shards)],
        **kw,
    )


def audit(at: int, action: str = "cordon", target: str = "a1") -> AuditEvent:
    return AuditEvent(at_unix_ms=at, actor="operator", action=action, target=target, result="ok")


def cluster(**kw: Any) -> Cluster:
    base: dict[str, Any] = {
        "nodes": [node("a1"), node("a2")],
        "shards": [shard("chat-1.0", "a1", [0, 1], ShardState.READY)],
        "replicas": [replica("chat-1", ShardState.READY)],
        "deployments": [Deployment(name="chat", profile="chat-a", replicas=1)],
        "events": [audit(T0 - 5000, "apply", "deployment/chat")],
        "revision": 10,
    }
    base.update(kw)
    return Cluster(**base)


def primed(**kw: Any) -> ClusterModel:
    model = ClusterModel()
    model.apply(WatchEvent(revision=10, snapshot=cluster(**kw)), T0)
    return model


# --- deltas → snapshots ------------------------------------------------------------------


def test_a_snapshot_gives_one_row_per_node_gpu_shard_replica() -> None:
    snap = primed().snapshot(T0)
    assert set(snap.nodes) == {"a1", "a2"}
    assert len(snap.gpus) == 8 and "a1/GPU-a1-0" in snap.gpus
    assert snap.gpus["a1/GPU-a1-0"].shard_id == "chat-1.0"
    assert snap.gpus["a1/GPU-a1-2"].shard_id == ""
    assert snap.replicas["chat-1"].nodes == ("a1",) and snap.replicas["chat-1"].gpus == 2
    assert snap.revision == 10 and snap.taken_ms == T0
    # the first snapshot logs its audit records, but no invented state changes
    assert [(e.kind, e.action) for e in snap.events.values()] == [("audit", "apply")]


def test_telemetry_replaces_only_the_gpus_it_names() -> None:
    model = primed()
    before = model.snapshot(T0)
    beat = NodeTelemetry(
        node_id="a1",
        last_heartbeat_unix_ms=T0 + 1000,
        gpus=[GpuTelemetry(uuid="GPU-a1-3", utilization_pct=97, memory_used_bytes=70 * GiB,
                           temperature_c=81, health=Health.HEALTHY)],
    )  # fmt: skip
    model.apply(WatchEvent(revision=11, node_telemetry=beat), T0 + 1000)
    after = model.snapshot(T0 + 1000)
    diff = diff_rows(before.gpus, after.gpus)
    assert diff.changed == ("a1/GPU-a1-3",) and not diff.added and not diff.removed
    row = after.gpus["a1/GPU-a1-3"]
    assert (row.utilization_pct, row.memory_used_bytes, row.temperature_c) == (97, 70 * GiB, 81)
    assert row.info is before.gpus["a1/GPU-a1-3"].info  # static facts shared, not rebuilt
    assert after.nodes["a1"].last_heartbeat_ms == T0 + 1000
    assert after.revision == 11


def test_telemetry_for_an_unknown_node_or_gpu_changes_nothing() -> None:
    model = primed()
    before = model.snapshot(T0)
    model.apply(WatchEvent(node_telemetry=NodeTelemetry(node_id="ghost")), T0)
    beat = NodeTelemetry(node_id="a1", gpus=[GpuTelemetry(uuid="GPU-nope", utilization_pct=5)])
    model.apply(WatchEvent(node_telemetry=beat), T0)
    after = model.snapshot(T0 + 1)
    assert not diff_rows(before.gpus, after.gpus)


def test_a_shard_claims_and_releases_its_gpus_and_its_replica_follows() -> None:
    model = primed()
    model.apply(WatchEvent(shard=shard("chat-2.0", "a2", [2, 3], ShardState.LOADING)), T0)
    model.apply(WatchEvent(replica=replica("chat-2", ShardState.LOADING)), T0)
    snap = model.snapshot(T0)
    assert snap.gpus["a2/GPU-a2-3"].shard_id == "chat-2.0"
    assert snap.replicas["chat-2"].gpus == 2
    model.apply(WatchEvent(shard=shard("chat-2.0", "a2", [2, 3], ShardState.STOPPED)), T0)
    snap = model.snapshot(T0 + 1)
    assert snap.gpus["a2/GPU-a2-3"].shard_id == ""  # a STOPPED shard holds nothing
    assert snap.replicas["chat-2"].gpus == 0 and snap.replicas["chat-2"].nodes == ()
    model.apply(WatchEvent(shard_removed="chat-1.0"), T0)
    snap = model.snapshot(T0 + 2)
    assert "chat-1.0" not in snap.shards and snap.gpus["a1/GPU-a1-0"].shard_id == ""


def test_state_changes_after_the_first_snapshot_are_logged() -> None:
    model = primed()
    model.apply(WatchEvent(node=node("a2", state=NodeState.NOT_READY, state_reason="gone")), T0)
    model.apply(WatchEvent(shard=shard("chat-1.0", "a1", [0, 1], ShardState.FAILED,
                                       reason="exited 1")), T0)  # fmt: skip
    model.apply(WatchEvent(replica=replica("chat-1", ShardState.FAILED)), T0)
    model.apply(WatchEvent(audit=audit(T0, "drain", "chat-1")), T0)
    events = list(model.snapshot(T0).events.values())[1:]
    assert [(e.kind, e.target, e.result) for e in events] == [
        ("node", "a2", "READY → NOT_READY: gone"),
        ("shard", "chat-1.0", "READY → FAILED: exited 1"),
        ("replica", "chat-1", "READY → FAILED"),
        ("audit", "chat-1", "ok"),
    ]
    assert [e.seq for e in events] == sorted(e.seq for e in events)


def test_a_fresh_snapshot_replaces_everything_and_repeats_no_audit() -> None:
    model = primed()
    fresh = cluster(
        nodes=[node("a1")],
        shards=[],
        replicas=[replica("chat-3", ShardState.PENDING)],
        events=[audit(T0 - 5000, "apply", "deployment/chat"), audit(T0 + 1)],
        revision=3,  # a restarted server counts again from 0
    )
    model.apply(WatchEvent(revision=3, snapshot=fresh), T0 + 10)
    snap = model.snapshot(T0 + 10)
    assert set(snap.nodes) == {"a1"} and not any(k.startswith("a2/") for k in snap.gpus)
    assert set(snap.replicas) == {"chat-3"} and not snap.shards
    assert all(not g.shard_id for g in snap.gpus.values())
    audits = [e for e in snap.events.values() if e.kind == "audit"]
    assert [(e.action, e.at_ms) for e in audits] == [("apply", T0 - 5000), ("cordon", T0 + 1)]
    logged = {(e.kind, e.action, e.target) for e in snap.events.values() if e.kind != "audit"}
    assert {("node", "removed", "a2"), ("replica", "removed", "chat-1"),
            ("replica", "created", "chat-3")} <= logged  # fmt: skip
    assert snap.revision == 3


def test_removals_and_deployments() -> None:
    model = primed()
    model.apply(WatchEvent(node_removed="a2"), T0)
    model.apply(WatchEvent(replica_removed="chat-1"), T0)
    model.apply(WatchEvent(deployment=Deployment(name="code", profile="p", replicas=2)), T0)
    model.apply(WatchEvent(deployment_removed="chat"), T0)
    snap = model.snapshot(T0)
    assert set(snap.nodes) == {"a1"} and len(snap.gpus) == 4
    assert not snap.replicas and list(snap.deployments) == ["code"]


def test_an_event_kind_this_build_does_not_know_changes_nothing() -> None:
    model = primed()
    model.snapshot(T0)
    model.apply(WatchEvent(revision=12), T0)
    assert not model.dirty and model.revision == 12


def test_the_event_log_is_bounded_and_forgets_evicted_audits() -> None:
    model = ClusterModel(max_events=3)
    model.apply(WatchEvent(snapshot=cluster(events=[])), T0)
    for i in range(5):
        model.apply(WatchEvent(audit=audit(T0 + i)), T0)
    snap = model.snapshot(T0)
    assert [e.at_ms for e in snap.events.values()] == [T0 + 2, T0 + 3, T0 + 4]
    model.apply(WatchEvent(audit=audit(T0)), T0)  # evicted: a repeat is new again
    assert len(model.snapshot(T0 + 1).events) == 3


def test_unknown_enum_values_read_as_the_safe_value() -> None:
    assert read_shard_state(99) is ShardState.FAILED
    assert read_shard_state(ShardState.UNSPECIFIED) is ShardState.FAILED
    assert read_shard_state(ShardState.READY) is ShardState.READY
    assert read_node_state(42) is NodeState.NOT_READY
    assert read_health(7) is Health.UNKNOWN and read_health(Health.UNHEALTHY) is Health.UNHEALTHY
    wire = bytes(WatchEvent(shard=Shard(shard_id="s", status=ShardStatus(state=4))))  # type: ignore[arg-type]
    newer = WatchEvent.parse(wire.replace(b"\x20\x04", b"\x20\x09"))  # state 9: from the future
    model = primed()
    model.apply(newer, T0)
    assert model.snapshot(T0).shards["s"].state is ShardState.FAILED


def test_snapshots_are_frozen_and_unchanged_rows_are_shared() -> None:
    model = primed()
    first = model.snapshot(T0)
    model.apply(WatchEvent(replica=replica("chat-1", ShardState.DRAINING)), T0)
    second = model.snapshot(T0 + 1)
    assert first.replicas["chat-1"].state is ShardState.READY  # the old snapshot is untouched
    assert second.nodes["a1"] is first.nodes["a1"]
    with pytest.raises(TypeError):
        first.replicas["x"] = first.replicas["chat-1"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.replicas["chat-1"].state = ShardState.FAILED  # type: ignore[misc]


def test_mig_slices_sort_under_their_parent() -> None:
    parent = gpu("m1", 0, mig_enabled=True)
    slices = [
        Gpu(index=0, uuid=f"MIG-{i}", gpu_class="A100", memory_total_bytes=10 * GiB,
            mig=MigDevice(parent_uuid=parent.uuid, profile="1g.10gb", gpu_instance_id=i))
        for i in (2, 1)
    ]  # fmt: skip
    info = NodeInfo(node_id="m1", gpus=[*slices, parent, gpu("m1", 1)])
    model = ClusterModel()
    model.apply(WatchEvent(snapshot=Cluster(nodes=[Node(info=info)])), T0)
    rows = sorted(model.snapshot(T0).gpus.values(), key=lambda g: g.order)
    assert [g.info.label for g in rows] == ["0", "0/mig1:1g.10gb", "0/mig2:1g.10gb", "1"]
    overview = summarize(model.snapshot(T0))
    assert (overview.gpus.gpus, overview.gpus.slices) == (2, 2)  # slices apart from GPUs


def test_summary_counts() -> None:
    model = primed(nodes=[node("a1"), node("a2", state=NodeState.CORDONED, cordoned=True)])
    model.apply(WatchEvent(replica=replica("chat-2", ShardState.FAILED, out_of_date=True)), T0)
    o = summarize(model.snapshot(T0))
    assert (o.nodes_total, o.nodes_ready, o.nodes_cordoned) == (2, 1, 1)
    assert (o.gpus.gpus, o.gpus.gpus_used, o.replicas_total, o.replicas_out_of_date) == (8, 2, 2, 1)
    assert dict(o.replicas_by_state)[ShardState.FAILED] == 1


# --- keyed diffs ------------------------------------------------------------------------


def test_diff_rows_by_identity_then_value() -> None:
    a, b = ("x", 1), ("y", 2)
    old = {"a": a, "b": b, "gone": a}
    new = {"a": a, "b": ("y", 2), "c": b}  # b equal by value: not a change
    assert diff_rows(old, new) == diff_rows(old, dict(new))
    diff = diff_rows(old, new)
    assert (diff.added, diff.changed, diff.removed) == (("c",), (), ("gone",))
    assert diff_rows(new, {**new, "a": ("x", 3)}).changed == ("a",)
    assert not diff_rows(new, new)


# --- rates -------------------------------------------------------------------------------


def test_counter_increase_counts_a_reset_as_growth_from_zero() -> None:
    assert counter_increase(10, 15) == 5
    assert counter_increase(100, 7) == 7  # restarted, then counted 7
    assert counter_increase(5, 5) == 0


def test_window_rates_and_ratios_survive_a_counter_reset() -> None:
    window = CounterWindow(window_s=60)
    assert window.rate(["q"]) is None and window.ratio(["h"], ["q"]) is None
    window.add(0.0, {"q": 1000, "h": 900})
    window.add(10.0, {"q": 1100, "h": 950})  # +100 queries, +50 hits
    window.add(20.0, {"q": 40, "h": 30})  # the gateway restarted: +40, +30
    assert window.increase(["q"]) == 140 and window.increase(["h"]) == 80
    assert window.rate(["q"]) == pytest.approx(7.0)
    assert window.ratio(["h"], ["q"]) == pytest.approx(80 / 140)
    assert window.rate_series(["q"]) == pytest.approx((10.0, 4.0))
    assert window.ratio_series(["h"], ["q"]) == pytest.approx((0.5, 0.75))


def test_window_forgets_old_samples_but_keeps_a_baseline() -> None:
    window = CounterWindow(window_s=10)
    for t in range(0, 31, 5):
        window.add(float(t), {"q": t})
    assert window.span_s() == pytest.approx(10.0)  # 20 → 30, the baseline at the edge
    assert window.rate(["q"]) == pytest.approx(1.0)
    window.add(29.0, {"q": 0})  # older than the newest: ignored
    assert window.latest() is not None and window.latest().get("q") == 30  # type: ignore[union-attr]


def test_an_idle_interval_keeps_the_last_ratio_and_no_queries_is_no_ratio() -> None:
    window = CounterWindow()
    window.add(0, {"q": 0, "h": 0})
    window.add(1, {"q": 10, "h": 5})
    window.add(2, {"q": 10, "h": 5})
    assert window.ratio_series(["h"], ["q"]) == pytest.approx((0.5, 0.5))
    idle = CounterWindow()
    idle.add(0, {"q": 3})
    idle.add(1, {"q": 3})
    assert idle.ratio(["h"], ["q"]) is None and idle.rate(["q"]) == 0.0


def test_router_view_from_stats_with_a_gateway_restart() -> None:
    model = ClusterModel()
    stats = [
        (0.0, 0, {}),
        (2.0, 100, {"precise": 60, "approximate": 20, "load": 20}),
        (4.0, 10, {"precise": 5, "load": 5}),  # the gateway restarted
    ]
    for at, total, tiers in stats:
        model.add_router_stats(RouterStats(decisions=total, decisions_by_tier=tiers), at)
    router = model.snapshot(T0).router
    assert router.status is RouterStatus.AVAILABLE
    assert router.request_rate == pytest.approx(110 / 4)
    assert router.prefix_share == pytest.approx(85 / 110)
    assert router.share_series == pytest.approx((0.8, 0.5))
    assert dict(router.by_tier) == {"approximate": 0, "load": 5, "precise": 5}
    model.router_unavailable("no router stats yet: UNIMPLEMENTED")
    router = model.snapshot(T0 + 1).router
    assert router.status is RouterStatus.UNAVAILABLE and router.request_rate is None
    assert router.reason == "no router stats yet: UNIMPLEMENTED"


# --- the link ----------------------------------------------------------------------------


def test_link_transitions_walk_the_whole_table() -> None:
    for start in LinkPhase:
        for target in LinkPhase:
            status = LinkStatus(phase=start)
            if target in ALLOWED_TRANSITIONS[start]:
                assert status.to(target).phase is target
            else:
                with pytest.raises(ValueError, match="cannot go from"):
                    status.to(target)
    reachable = {LinkPhase.CONNECTING}
    for _ in LinkPhase:
        reachable |= {t for p in reachable for t in ALLOWED_TRANSITIONS[p]}
    assert reachable == set(LinkPhase)


def test_badges() -> None:
    live = LinkStatus().to(LinkPhase.LIVE, live_at=100.0)
    assert live.badge(500.0) == "LIVE" and live.stale_for(500.0) is None
    stale = live.to(LinkPhase.STALE)
    assert stale.badge(112.4) == "STALE 12s" and stale.stale_for(112.4) == pytest.approx(12.4)
    retrying = stale.to(LinkPhase.RECONNECTING, attempt=3)
    assert retrying.badge(120.0) == "RECONNECTING #3"
    assert retrying.to(LinkPhase.STALE).badge(121.0) == "STALE 21s · 3 retries"
    assert stale.to(LinkPhase.RECONNECTING, attempt=1).to(LinkPhase.STALE).badge(100) == (
        "STALE 0s · 1 retry"
    )
    assert LinkStatus().badge(0.0) == "CONNECTING"
    assert LinkStatus().to(LinkPhase.STALE).badge(9.0) == "STALE"  # never had data


def test_backoff_grows_is_capped_and_jittered() -> None:
    backoff = Backoff(first_s=0.5, factor=2, max_s=4, jitter=0.2)
    assert [backoff.delay(n, 0.5) for n in (1, 2, 3, 4, 5, 9)] == [0.5, 1, 2, 4, 4, 4]
    assert backoff.delay(2, 0.0) == pytest.approx(0.8)
    assert backoff.delay(2, 0.999) == pytest.approx(1.2, abs=1e-3)
    assert backoff.delay(30, 0.999) <= 4


# --- registry and --once -----------------------------------------------------------------


def test_views_resolve_by_name_alias_and_unique_prefix() -> None:
    assert resolve_view(":nodes") == "nodes" and resolve_view("topology") == "nodes"
    assert resolve_view("  Replicas ") == "replicas" and resolve_view("ev") == "events"
    assert resolve_view("ro") == "router" and resolve_view("o") == "overview"
    assert resolve_view("r") is None  # replicas or router
    assert resolve_view("nonsense") is None and resolve_view(":") is None
    assert tuple(v.name for v in VIEWS) == VIEW_NAMES


def test_every_key_is_bound_once() -> None:
    keys = [k for b in bindings() for k in b.key.split(",")]
    assert len(keys) == len(set(keys))
    assert {"colon", "space", "c", "j", "k", "h", "l", "q"} <= set(keys)


def test_once_json_is_plain_json_of_the_console_view() -> None:
    model = primed()
    model.router_unavailable("no router stats yet")
    out = json.loads(json.dumps(snapshot_json(model.snapshot(T0), "http://s:8080")))
    assert out["overview"]["nodesReady"] == 2 and out["overview"]["gpus"]["gpusUsed"] == 2
    assert out["overview"]["replicasByState"]["READY"] == 1
    assert out["router"] == {**out["router"], "status": "UNAVAILABLE", "requestRate": None}
    assert [g["info"]["uuid"] for g in out["gpus"]][:2] == ["GPU-a1-0", "GPU-a1-1"]
    assert out["gpus"][0]["shardId"] == "chat-1.0"
    assert out["replicas"][0]["inFlight"] is None  # not reported: null, not 0
    assert out["nodes"][0]["detail"]["labels"] == {}
    (chat,) = out["deployments"]
    assert (chat["name"], chat["replicas"], chat["ready"], chat["conditions"]) == (
        "chat", 1, 0, []  # the primed deployment carries no status: zeros, no conditions
    )  # fmt: skip


# --- the watch worker, against a scripted client -----------------------------------------


class Sink:
    def __init__(self) -> None:
        self.statuses: list[LinkStatus] = []
        self.snapshots: list[ConsoleSnapshot] = []
        self.changed = asyncio.Event()

    def snapshot_ready(self, snapshot: ConsoleSnapshot) -> None:
        self.snapshots.append(snapshot)
        self.changed.set()

    def status_changed(self, status: LinkStatus) -> None:
        self.statuses.append(status)
        self.changed.set()

    def phases(self) -> list[str]:
        return [s.badge(0).split()[0] for s in self.statuses]

    async def until(self, check: Any, seconds: float = 5.0) -> None:
        async with asyncio.timeout(seconds):
            while not check():
                self.changed.clear()
                await self.changed.wait()


class ScriptedClient:
    """``watch`` plays one script per call: events, then "end", "hang" or an exception."""

    def __init__(self, scripts: list[list[Any]], router: Any = None) -> None:
        self.scripts = scripts
        self.router = router or RpcError(Status.UNIMPLEMENTED, "not yet")
        self.watches = 0

    def watch(self) -> AsyncIterator[WatchEvent]:
        script = self.scripts[min(self.watches, len(self.scripts) - 1)]
        self.watches += 1
        return self._play(script)

    async def _play(self, script: list[Any]) -> AsyncIterator[WatchEvent]:
        for step in script:
            if isinstance(step, Exception):
                raise step
            if step == "hang":
                await asyncio.Event().wait()
            if isinstance(step, WatchEvent):
                yield step

    async def get_router_stats(self) -> RouterStats:
        if isinstance(self.router, Exception):
            raise self.router
        return self.router  # type: ignore[no-any-return]


FAST = WatchConfig(backoff=Backoff(first_s=0.01, max_s=0.05), frame_s=0.01, idle_s=0.2,
                   router_every_s=0.05, router_unavailable_every_s=0.05)  # fmt: skip
DOWN = ServerUnreachable("http://s", "cannot connect (refused)")


async def _run(client: ScriptedClient, sink: Sink, check: Any) -> WatchSession:
    session = WatchSession(client, FAST, rand=lambda: 0.5)  # type: ignore[arg-type]
    task = asyncio.create_task(session.run(sink))
    try:
        await sink.until(check)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return session


async def test_worker_reconnects_until_live_and_after_the_stream_ends() -> None:
    snap = WatchEvent(revision=1, snapshot=cluster())
    gone = WatchEvent(revision=2, node_removed="a2")
    client = ScriptedClient([[DOWN], [DOWN], [snap, gone, "end"], [snap, "hang"]])
    sink = Sink()
    await _run(client, sink, lambda: client.watches == 4 and sink.statuses[-1].live)
    assert sink.phases() == [
        "CONNECTING", "STALE", "RECONNECTING", "STALE", "RECONNECTING", "LIVE",
        "STALE", "RECONNECTING", "LIVE",
    ]  # fmt: skip
    attempts = [s.attempt for s in sink.statuses if s.phase is LinkPhase.RECONNECTING]
    assert attempts == [1, 2, 1]  # the count starts again after being LIVE
    assert "cannot connect" in sink.statuses[1].error
    assert sink.statuses[6].error == "the server closed the stream"
    assert set(sink.snapshots[-1].nodes) == {"a1", "a2"}  # the second stream's snapshot


async def test_worker_breaks_a_silent_stream_when_the_server_does_not_answer() -> None:
    client = ScriptedClient([[WatchEvent(snapshot=cluster()), "hang"]], router=DOWN)
    sink = Sink()
    await _run(client, sink, lambda: any(s.phase is LinkPhase.STALE for s in sink.statuses))
    stale = next(s for s in sink.statuses if s.phase is LinkPhase.STALE)
    assert stale.error == "no event for 0.2s and no answer: http://s: cannot connect (refused)"
    assert stale.live_at is not None  # the data were current until then


async def test_worker_keeps_a_quiet_stream_while_the_server_answers() -> None:
    stats = RouterStats(decisions=5, decisions_by_tier={"precise": 5})
    client = ScriptedClient([[WatchEvent(snapshot=cluster()), "hang"]], router=stats)
    sink = Sink()
    loop = asyncio.get_running_loop()
    until = loop.time() + 0.6  # three idle periods
    await _run(client, sink, lambda: loop.time() > until and len(sink.snapshots) > 2)
    assert sink.phases() == ["CONNECTING", "LIVE"] and client.watches == 1
    assert sink.snapshots[-1].router.decisions == 5


async def test_worker_says_why_there_are_no_router_stats() -> None:
    client = ScriptedClient([[WatchEvent(snapshot=cluster()), "hang"]])
    sink = Sink()
    await _run(
        client,
        sink,
        lambda: (
            bool(sink.snapshots) and sink.snapshots[-1].router.status is RouterStatus.UNAVAILABLE
        ),
    )
    assert sink.snapshots[-1].router.reason == "no router stats yet: not yet"
