"""The console's state, pure: Watch events in, frozen snapshots out, keyed diffs between them.

``ClusterModel`` belongs to the one worker that follows Watch (never shared between tasks):
it applies each ``WatchEvent`` by replacing the rows the event touches, and hands out a
``ConsoleSnapshot`` (frozen, read-only maps of frozen rows) when asked. A fresh snapshot
from the server (first connection, reconnection, or a watcher that fell behind) replaces
everything; rows it no longer lists disappear. ``diff_rows`` says which keys two snapshots'
maps added, changed or removed, comparing rows by identity first, so a view updates only
what changed.

Besides the server's records, the model keeps an event log: the audit records (a snapshot
repeats the recent ones, kept once) and the state changes it saw (node, shard, replica),
newest last, bounded. State changes are not invented for the first snapshot; after a
reconnection the new snapshot's differences from the old one are logged as changes.

Router statistics are sampled counters (``RouterStats``); rates, the prefix-routed share,
each tier's hit share, the reuse ratios and per-replica request rates are windowed
(``llmgw.tui.rates``), so a gateway restart does not make them negative. A server that sets
``at_unix_ms`` gives the detailed figures (outcomes, statuses, reuse, replicas); an older
one gives decisions by tier only, and the view says the rest is not reported.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, TypeVar

import betterproto2

from llmgw.api.llmgw.v1 import (
    AuditEvent,
    Cluster,
    Deployment,
    Node,
    NodeState,
    NodeTelemetry,
    Replica,
    ReplicaRouterStats,
    RouterStats,
    Shard,
    WatchEvent,
)
from llmgw.tui.leader import leader_words
from llmgw.tui.rates import CounterWindow
from llmgw.tui.routes import RoutesView, check_counters, routes_view
from llmgw.tui.rows import (
    AuditIdentity,
    DeploymentRow,
    EventRow,
    GpuRow,
    NodeRow,
    ReplicaRow,
    ShardRow,
    audit_identity,
    deployment_row,
    event_identity,
    gpu_infos,
    gpu_key,
    gpu_row,
    node_row,
    replica_row,
    shard_row,
    with_router_figures,
    with_shards,
)

__all__ = [
    "PREFIX_TIERS",
    "ClusterModel",
    "ConsoleSnapshot",
    "ReplicaLoad",
    "RouterStatus",
    "RouterView",
    "TierFigures",
    "RowDiff",
    "diff_rows",
]

R = TypeVar("R")

PREFIX_TIERS: Final = ("precise", "approximate")
"""Router tiers whose decision used a cached prefix (``llmgw.gateway.precise``, ``prefix_tree``)."""
DECISIONS: Final = "decisions"
_TIER = "tier:"
_HIT = "hit:"  # decisions of a tier whose outcome was "hit"
_REQUESTS = "requests"  # requests answered, any status
_ROUTED = "routed:"  # decisions that chose a replica
_REUSE = ("available", "captured", "delivered")
_PROMPT = ("router", "engine")


class RouterStatus(enum.Enum):
    """Whether the server gives router statistics."""

    UNKNOWN = "unknown"  # not asked yet
    AVAILABLE = "available"  # the last GetRouterStats answered
    UNAVAILABLE = "unavailable"  # the server does not give them (``reason`` says why)


@dataclass(frozen=True, slots=True)
class TierFigures:
    """One routing tier: its decisions (total), their rate and the share that hit."""

    tier: str
    decisions: int
    rate: float  # per second over the window
    hit_share: float | None  # Δhits / Δdecisions of this tier; None: none in the window


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica as the gateway sees it, as of the latest sample."""

    replica_id: str
    in_flight: int
    requests: int  # decisions that chose it (total)
    request_rate: float | None  # per second over the window
    delivered_hit_ratio: float | None  # its engine's own prefix-cache hit ratio
    kv_capacity_tokens: int  # 0: unknown
    kv_usage: float | None = None  # share (0..1) of its engine's KV cache in use


@dataclass(frozen=True, slots=True)
class RouterView:
    """Router statistics as of the latest sample, with windowed rates."""

    status: RouterStatus = RouterStatus.UNKNOWN
    reason: str = ""
    decisions: int = 0
    by_tier: tuple[tuple[str, int], ...] = ()  # latest totals
    tier_rates: tuple[tuple[str, float], ...] = ()  # per second over the window
    request_rate: float | None = None  # decisions per second over the window
    prefix_share: float | None = None  # Δ(prefix-tier decisions) / Δ(decisions)
    rate_series: tuple[float, ...] = ()
    share_series: tuple[float, ...] = ()
    window_s: float = 0.0
    detailed: bool = False  # the server reports outcomes, statuses, reuse and replicas
    tiers: tuple[TierFigures, ...] = ()
    available_share: float | None = None  # Δavailable / Δrouter prompt tokens
    captured_share: float | None = None  # Δcaptured / Δrouter prompt tokens
    captured_of_available: float | None = None  # Δcaptured / Δavailable
    delivered_share: float | None = None  # Δdelivered / Δengine prompt tokens
    replicas: tuple[ReplicaLoad, ...] = ()
    routes: RoutesView = RoutesView()  # the last decisions and the check's drift (routes.py)


@dataclass(frozen=True, slots=True)
class ConsoleSnapshot:
    """Everything the console shows, at one revision; safe to hand to any task."""

    revision: int
    taken_ms: int  # wall clock when it was taken (ages are computed against it)
    nodes: Mapping[str, NodeRow]
    gpus: Mapping[str, GpuRow]
    shards: Mapping[str, ShardRow]
    replicas: Mapping[str, ReplicaRow]
    deployments: Mapping[str, DeploymentRow]
    events: Mapping[str, EventRow]
    router: RouterView
    leader: str = ""  # which server leads, in words (leader_words); "" before a snapshot

    @classmethod
    def empty(cls) -> ConsoleSnapshot:
        none: Mapping[str, Any] = MappingProxyType({})
        return cls(0, 0, none, none, none, none, none, none, RouterView())


@dataclass(frozen=True, slots=True)
class RowDiff:
    """Keys added, changed and removed between two maps of rows."""

    added: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.changed or self.removed)


def diff_rows(old: Mapping[str, R], new: Mapping[str, R]) -> RowDiff:
    """What changed from ``old`` to ``new``: rows compare by identity, then by value."""
    if old is new:
        return RowDiff((), (), ())
    added, changed = [], []
    for key, row in new.items():
        before = old.get(key)
        if before is None:
            added.append(key)
        elif before is not row and before != row:
            changed.append(key)
    removed = tuple(key for key in old if key not in new)
    return RowDiff(tuple(added), tuple(changed), removed)


class ClusterModel:
    """Rows of the whole cluster, updated by Watch events; not shared between tasks."""

    def __init__(self, *, max_events: int = 1000, router_window_s: float = 60.0) -> None:
        self.revision = 0
        self.leader = ""  # leader_words of the last snapshot
        self.dirty = False  # changed since the last snapshot
        self._max_events = max_events
        self._nodes: dict[str, NodeRow] = {}
        self._node_gpus: dict[str, list[str]] = {}  # node id → its GPU rows' keys
        self._gpus: dict[str, GpuRow] = {}
        self._holders: dict[str, str] = {}  # GPU key → shard id
        self._shards: dict[str, ShardRow] = {}
        self._replica_shards: dict[str, set[str]] = {}  # replica id → shard ids seen
        self._replicas: dict[str, ReplicaRow] = {}
        self._deployments: dict[str, DeploymentRow] = {}
        self._events: deque[EventRow] = deque()
        self._audits: set[AuditIdentity] = set()  # the audit records in the log
        self._seq = 0
        self._primed = False  # a snapshot arrived: later changes are logged
        self._router = CounterWindow(router_window_s)
        self._router_status = RouterStatus.UNKNOWN
        self._router_reason = ""
        self._router_latest = RouterStats()
        self._cache: ConsoleSnapshot | None = None

    # --- events ------------------------------------------------------------------------

    def apply(self, event: WatchEvent, now_ms: int) -> None:
        """Apply one Watch event; ``now_ms`` stamps the state changes it causes."""
        field, value = betterproto2.which_one_of(event, "event")
        if self._dispatch(field, value, now_ms):
            self._changed()
        if event.revision:  # a restarted server counts from 0 again
            self.revision = event.revision

    def _dispatch(self, field: str, value: object, now_ms: int) -> bool:
        """Apply one oneof member; False for none (an event kind from a newer server)."""
        if isinstance(value, Cluster):
            self.reset(value, now_ms)
        elif isinstance(value, Node):
            self._upsert_node(value, now_ms)
        elif isinstance(value, NodeTelemetry):
            self._telemetry(value)
        elif isinstance(value, Shard):
            self._upsert_shard(value, now_ms)
        elif isinstance(value, Replica):
            self._upsert_replica(value, now_ms)
        elif isinstance(value, Deployment):
            self._deployments[value.name] = deployment_row(value)
        elif isinstance(value, AuditEvent):
            self._add_audit(value)
        elif isinstance(value, str) and field in _REMOVALS:
            _REMOVALS[field](self, value, now_ms)
        else:
            return False
        return True

    def reset(self, cluster: Cluster, now_ms: int) -> None:
        """Replace everything with a snapshot from the server."""
        for node in cluster.nodes:
            self._upsert_node(node, now_ms)
        for shard in cluster.shards:
            self._upsert_shard(shard, now_ms)
        for replica in cluster.replicas:
            self._upsert_replica(replica, now_ms)
        self._drop_absent(cluster, now_ms)
        self._deployments = {d.name: deployment_row(d) for d in cluster.deployments}
        for audit in cluster.events:
            self._add_audit(audit)
        if cluster.router_stats is not None:
            self.add_router_stats(cluster.router_stats, None)
        self._primed = True
        self.revision = cluster.revision
        self.leader = leader_words(cluster.leadership)
        self._changed()

    def _drop_absent(self, cluster: Cluster, now_ms: int) -> None:
        nodes = {n.info.node_id for n in cluster.nodes if n.info is not None}
        shards = {s.shard_id for s in cluster.shards}
        replicas = {r.replica_id for r in cluster.replicas}
        for node_id in [n for n in self._nodes if n not in nodes]:
            self._remove_node(node_id, now_ms)
        for shard_id in [s for s in self._shards if s not in shards]:
            self._remove_shard(shard_id, now_ms)
        for replica_id in [r for r in self._replicas if r not in replicas]:
            self._remove_replica(replica_id, now_ms)

    # --- nodes and GPUs ----------------------------------------------------------------

    def _upsert_node(self, node: Node, now_ms: int) -> None:
        if node.info is None or not node.info.node_id:
            return
        node_id = node.info.node_id
        before = self._nodes.get(node_id)
        row = node_row(node)
        self._nodes[node_id] = row
        self._replace_gpus(node_id, node)
        if before is not None and _node_word(before) != _node_word(row):
            reason = f": {row.reason}" if row.reason else ""
            text = f"{_node_word(before)} → {_node_word(row)}{reason}"
            self._log(now_ms, "node", "state", node_id, text)
        elif before is None and self._primed:
            self._log(now_ms, "node", "joined", node_id, _node_word(row))

    def _replace_gpus(self, node_id: str, node: Node) -> None:
        info = node.info
        assert info is not None
        for key in self._node_gpus.pop(node_id, ()):
            self._gpus.pop(key, None)
        live = {t.uuid: t for t in node.telemetry.gpus} if node.telemetry else {}
        keys = self._node_gpus[node_id] = []
        for gpu, static in zip(info.gpus, gpu_infos(info), strict=True):
            key = gpu_key(node_id, gpu.uuid)
            self._gpus[key] = gpu_row(node_id, static, gpu, live.get(gpu.uuid), self._holder(key))
            keys.append(key)

    def _telemetry(self, delta: NodeTelemetry) -> None:
        node = self._nodes.get(delta.node_id)
        if node is None:
            return
        self._nodes[delta.node_id] = dataclasses.replace(
            node,
            last_heartbeat_ms=delta.last_heartbeat_unix_ms,
            memory_available_bytes=delta.memory.available_bytes
            if delta.memory
            else node.memory_available_bytes,
        )
        gpus, holders = self._gpus, self._holders
        for live in delta.gpus:
            key = gpu_key(delta.node_id, live.uuid)
            old = gpus.get(key)
            if old is not None:
                gpus[key] = gpu_row(delta.node_id, old.info, None, live, holders.get(key, ""))

    def _remove_node(self, node_id: str, now_ms: int) -> None:
        if self._nodes.pop(node_id, None) is None:
            return
        for key in self._node_gpus.pop(node_id, ()):
            self._gpus.pop(key, None)
        if self._primed:
            self._log(now_ms, "node", "removed", node_id, "")

    def _holder(self, key: str) -> str:
        return self._holders.get(key, "")

    def _held(self, row: GpuRow) -> GpuRow:
        """``row`` naming the shard that holds its GPU now (the same row if it does)."""
        holder = self._holders.get(row.key, "")
        return row if row.shard_id == holder else dataclasses.replace(row, shard_id=holder)

    # --- shards and replicas -----------------------------------------------------------

    def _upsert_shard(self, shard: Shard, now_ms: int) -> None:
        row = shard_row(shard)
        before = self._shards.get(row.shard_id)
        self._shards[row.shard_id] = row
        self._replica_shards.setdefault(row.replica_id, set()).add(row.shard_id)
        if before is None or _claim_of(before) != _claim_of(row):
            self._release(before)
            self._claim(row)
        if before is not None and before.state is not row.state:
            text = f"{before.state.name} → {row.state.name}"
            self._log(now_ms, "shard", "state", row.shard_id, _with_reason(text, row.reason))
        self._rederive_replica(row.replica_id)

    def _remove_shard(self, shard_id: str, now_ms: int) -> None:
        row = self._shards.pop(shard_id, None)
        if row is None:
            return
        self._release(row)
        self._replica_shards.get(row.replica_id, set()).discard(shard_id)
        self._rederive_replica(row.replica_id)

    def _claim(self, row: ShardRow) -> None:
        if not row.holds_gpus:
            return
        for uuid in row.gpu_uuids:
            key = gpu_key(row.node_id, uuid)
            self._holders[key] = row.shard_id
            self._refresh_gpu(key)

    def _release(self, row: ShardRow | None) -> None:
        if row is None:
            return
        for uuid in row.gpu_uuids:
            key = gpu_key(row.node_id, uuid)
            if self._holders.get(key) == row.shard_id:
                del self._holders[key]
                self._refresh_gpu(key)

    def _refresh_gpu(self, key: str) -> None:
        row = self._gpus.get(key)
        if row is not None:
            self._gpus[key] = self._held(row)

    def _upsert_replica(self, replica: Replica, now_ms: int) -> None:
        before = self._replicas.get(replica.replica_id)
        row = replica_row(replica, self._shards_of(replica.replica_id))
        self._replicas[row.replica_id] = row
        if before is None and self._primed:
            self._log(now_ms, "replica", "created", row.replica_id, row.state.name)
        elif before is not None and before.state is not row.state:
            text = f"{before.state.name} → {row.state.name}"
            self._log(now_ms, "replica", "state", row.replica_id, text)

    def _remove_replica(self, replica_id: str, now_ms: int) -> None:
        if self._replicas.pop(replica_id, None) is not None and self._primed:
            self._log(now_ms, "replica", "removed", replica_id, "")

    def _rederive_replica(self, replica_id: str) -> None:
        row = self._replicas.get(replica_id)
        if row is None:
            return
        self._replicas[replica_id] = with_shards(row, self._shards_of(replica_id))

    def _shards_of(self, replica_id: str) -> list[ShardRow]:
        ids = self._replica_shards.get(replica_id, ())
        return [self._shards[s] for s in ids if s in self._shards]

    def _remove_deployment(self, name: str, now_ms: int) -> None:
        self._deployments.pop(name, None)

    # --- the event log -----------------------------------------------------------------

    def _add_audit(self, audit: AuditEvent) -> None:
        identity = audit_identity(audit)
        if identity in self._audits:
            return
        self._audits.add(identity)
        at, actor, action, target, result = identity
        self._log(at, "audit", action, target, result, actor=actor)

    def _log(
        self, at_ms: int, kind: str, action: str, target: str, result: str, *, actor: str = ""
    ) -> None:
        self._seq += 1
        self._events.append(EventRow(self._seq, at_ms, kind, actor, action, target, result))
        while len(self._events) > self._max_events:
            gone = self._events.popleft()
            if gone.kind == "audit":
                self._audits.discard(event_identity(gone))

    # --- router ------------------------------------------------------------------------

    def add_router_stats(self, stats: RouterStats, at_s: float | None) -> None:
        """A GetRouterStats answer read at monotonic ``at_s`` (None: not a timed sample)."""
        self._router_status = RouterStatus.AVAILABLE
        self._router_reason = ""
        self._router_latest = stats
        if at_s is not None:
            self._router.add(at_s, _router_counters(stats))
        self._changed()

    def router_unavailable(self, reason: str) -> None:
        """The server does not give router statistics; say why instead of showing zeros."""
        if self._router_status is RouterStatus.UNAVAILABLE and self._router_reason == reason:
            return
        self._router_status = RouterStatus.UNAVAILABLE
        self._router_reason = reason
        self._router.clear()
        self._changed()

    def _router_view(self) -> RouterView:
        if self._router_status is not RouterStatus.AVAILABLE:
            return RouterView(self._router_status, self._router_reason)
        window, stats = self._router, self._router_latest
        latest = window.latest()
        tiers = [n.removeprefix(_TIER) for n in window.names() if n.startswith(_TIER)]
        detailed = stats.at_unix_ms != 0
        hits = [_HIT + t for t in tiers] if detailed else [_TIER + t for t in PREFIX_TIERS]
        requests = [_REQUESTS] if detailed and stats.requests_by_status else [DECISIONS]
        return RouterView(
            status=RouterStatus.AVAILABLE,
            decisions=latest.get(DECISIONS) if latest else 0,
            by_tier=tuple((t, latest.get(_TIER + t) if latest else 0) for t in tiers),
            tier_rates=tuple((t, window.rate([_TIER + t]) or 0.0) for t in tiers),
            request_rate=window.rate(requests),
            prefix_share=window.ratio(hits, [DECISIONS]),
            rate_series=window.rate_series(requests),
            share_series=window.ratio_series(hits, [DECISIONS]),
            window_s=window.span_s(),
            detailed=detailed,
            tiers=tuple(_tier_figures(window, t, detailed) for t in tiers),
            available_share=window.ratio(["reuse:available"], ["prompt:router"]),
            captured_share=window.ratio(["reuse:captured"], ["prompt:router"]),
            captured_of_available=window.ratio(["reuse:captured"], ["reuse:available"]),
            delivered_share=window.ratio(["reuse:delivered"], ["prompt:engine"]),
            replicas=tuple(_replica_load(window, r) for r in stats.replicas),
            routes=routes_view(stats, window),
        )

    # --- snapshots ---------------------------------------------------------------------

    def _changed(self) -> None:
        self.dirty = True
        self._cache = None

    def snapshot(self, now_ms: int) -> ConsoleSnapshot:
        """A frozen copy of the current rows (cheap: the rows themselves are shared)."""
        self.dirty = False
        if self._cache is not None and self._cache.taken_ms == now_ms:
            return self._cache
        router = self._router_view()
        self._cache = ConsoleSnapshot(
            revision=self.revision,
            taken_ms=now_ms,
            nodes=MappingProxyType(dict(self._nodes)),
            gpus=MappingProxyType(dict(self._gpus)),
            shards=MappingProxyType(dict(self._shards)),
            replicas=MappingProxyType(_with_loads(self._replicas, router.replicas)),
            deployments=MappingProxyType(dict(self._deployments)),
            events=MappingProxyType({e.key: e for e in self._events}),
            router=router,
            leader=self.leader,
        )
        return self._cache


def _router_counters(stats: RouterStats) -> dict[str, int]:
    """A RouterStats answer as the named counters the router window keeps."""
    values = {DECISIONS: stats.decisions}
    values.update((_TIER + t, n) for t, n in stats.decisions_by_tier.items())
    for key, count in stats.decisions_by_tier_outcome.items():
        tier, _, outcome = key.partition("/")
        if outcome == "hit":
            values[_HIT + tier] = count
    if stats.requests_by_status:
        values[_REQUESTS] = sum(stats.requests_by_status.values())
    reuse = (
        stats.reuse_available_tokens,
        stats.reuse_captured_tokens,
        stats.reuse_delivered_tokens,
    )
    values.update(("reuse:" + stage, n) for stage, n in zip(_REUSE, reuse, strict=True))
    prompt = (stats.router_prompt_tokens, stats.engine_prompt_tokens)
    values.update(("prompt:" + source, n) for source, n in zip(_PROMPT, prompt, strict=True))
    values.update((_ROUTED + r.replica_id, r.requests) for r in stats.replicas)
    values.update(check_counters(stats))
    return values


def _tier_figures(window: CounterWindow, tier: str, detailed: bool) -> TierFigures:
    latest = window.latest()
    return TierFigures(
        tier=tier,
        decisions=latest.get(_TIER + tier) if latest else 0,
        rate=window.rate([_TIER + tier]) or 0.0,
        hit_share=window.ratio([_HIT + tier], [_TIER + tier]) if detailed else None,
    )


def _replica_load(window: CounterWindow, row: ReplicaRouterStats) -> ReplicaLoad:
    return ReplicaLoad(
        replica_id=row.replica_id,
        in_flight=row.in_flight,
        requests=row.requests,
        request_rate=window.rate([_ROUTED + row.replica_id]),
        delivered_hit_ratio=row.delivered_hit_ratio,
        kv_capacity_tokens=row.kv_capacity_tokens,
        kv_usage=row.kv_usage,
    )


def _with_loads(
    replicas: Mapping[str, ReplicaRow], loads: tuple[ReplicaLoad, ...]
) -> dict[str, ReplicaRow]:
    """``replicas`` with the gateway's figures joined by id (a replica without: not reported)."""
    joined = dict(replicas)
    for load in loads:
        if (row := joined.get(load.replica_id)) is not None:
            figures = (load.in_flight, load.kv_usage, load.delivered_hit_ratio)
            joined[load.replica_id] = with_router_figures(row, *figures)
    return joined


def _claim_of(row: ShardRow) -> tuple[str, tuple[str, ...], bool]:
    """What decides which GPUs a shard holds."""
    return (row.node_id, row.gpu_uuids, row.holds_gpus)


def _node_word(row: NodeRow) -> str:
    return row.state.name + (
        " (cordoned)" if row.cordoned and row.state is not NodeState.CORDONED else ""
    )


def _with_reason(text: str, reason: str) -> str:
    return f"{text}: {reason}" if reason else text


_REMOVALS: Final[Mapping[str, Callable[[ClusterModel, str, int], None]]] = {
    "node_removed": ClusterModel._remove_node,
    "shard_removed": ClusterModel._remove_shard,
    "replica_removed": ClusterModel._remove_replica,
    "deployment_removed": ClusterModel._remove_deployment,
}
