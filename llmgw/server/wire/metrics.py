"""The control server's own Prometheus metrics: ``GET /metrics`` on its gRPC-web port.

Text format 0.0.4, written with ``llmgw.promtext`` as the gateway's is (``llmgw.gateway.metrics``;
the gateway's own families, ``llmgw_kv_index_*`` among them, are on the gateway's port).
It carries no secrets (node, replica and shard ids, counts), so it is served without a
token, like ``/healthz``. Families::

    llmgw_agents_connected                              agent streams open now
    llmgw_agent_sessions_total                          agent streams registered (a flapping
                                                        node shows here)
    llmgw_agent_registrations_refused_total{reason}     Connects refused: duplicate (another
                                                        agent holds the node), rate (limits)
    llmgw_kv_events_batches_total{node,replica,shard}   KV event batches the node's agent
                                                        applied from the engine
    llmgw_kv_events_applied_total{…}                    events in them
    llmgw_kv_events_gaps_total{…}                       seq gaps on the live stream
    llmgw_kv_events_replays_total{…}                    replays requested (start, restart, gap)
    llmgw_kv_events_replay_failures_total{…}            holes no replay could fill
    llmgw_kv_events_resets_total{…}                     the engine's blocks reset upstream
                                                        (hole, engine restart, AllBlocksCleared)
    llmgw_kv_events_restarts_total{…}                   engine restarts noticed
    llmgw_kv_events_decode_errors_total{…}              malformed messages skipped
    llmgw_kv_mirror_blocks{…}                           blocks the agent mirrors now
    llmgw_kv_events_last_seq{…}                         the last batch applied (when known)
    llmgw_kv_follow_refused_total                       heartbeat counters refused (bad shard id,
                                                        too many engines on a node)
    llmgw_kv_store_{replicas,blocks,feeds}              the server's KV block store: replicas
                                                        holding blocks, (replica, rank, block)
                                                        entries, gateway feeds following it
    llmgw_kv_store_{deltas,stored,removed,resets,malformed,ignored,drops}_total
                                                        what the store has seen (kvblocks.py)
    llmgw_deployment_replicas_desired{deployment}       a deployment's replica count
    llmgw_deployment_replicas_ready{deployment}         its live replicas ready now (every shard
                                                        READY on a READY node; DeploymentStatus)
    llmgw_autoscale_desired{deployment}                 the autoscaler's count for a deployment
                                                        with a policy (its last round; in mode
                                                        advise what it would set)
    llmgw_autoscale_decisions_total{deployment,reason}  the autoscaler's rounds by the reason
                                                        the planner gave (scale_up, hold, …)
    llmgw_nodes{state}                                  nodes by state (ready, not_ready,
                                                        cordoned; every state, 0 included)
    llmgw_replicas{state}                               replicas not retired, by state (pending,
                                                        starting, loading, ready, draining,
                                                        stopped, failed)
    llmgw_shards{state}                                 shards agents report, by the same states
    llmgw_build_info{version,python}                    1, labelled with this build

The ``llmgw_kv_events_*`` counters come from the agents (``llmgw.server.state.kvfollow``), as of
their last heartbeat; ``replica`` is the shard's replica ("" while the server knows no such
shard on that node). They start again at 0 when an agent follows an engine afresh (a
restarted agent, a shard started again), which ``rate()`` reads as a counter reset; an
engine's series goes when its shard stops or fails or its node's stream ends.
"""

from __future__ import annotations

import platform
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from llmgw import __version__
from llmgw.api.llmgw.v1 import Leadership, NodeState, ShardState
from llmgw.promtext import family, label_set
from llmgw.protocol import read_shard_state
from llmgw.server.core.reconcile_state import Lifecycle
from llmgw.server.state.kvblocks import KvBlocksStats
from llmgw.server.state.kvfollow import EngineFollowStats
from llmgw.server.state.plane import ControlPlane

__all__ = [
    "CONTENT_TYPE",
    "AgentStreamStats",
    "FleetFigures",
    "fleet_figures",
    "leader_metrics",
    "render_server_metrics",
    "server_metrics",
]

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

_FOLLOW_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("llmgw_kv_events_batches_total", "batches", "KV event batches the agent applied."),
    ("llmgw_kv_events_applied_total", "events", "KV events in the batches the agent applied."),
    ("llmgw_kv_events_gaps_total", "gaps", "Seq gaps on an engine's live KV event stream."),
    ("llmgw_kv_events_replays_total", "replays", "KV event replays requested by the agent."),
    (
        "llmgw_kv_events_replay_failures_total",
        "replay_failures",
        "KV event holes no replay could fill.",
    ),
    ("llmgw_kv_events_resets_total", "resets", "Times an engine's KV blocks were reset."),
    ("llmgw_kv_events_restarts_total", "restarts", "Engine restarts the KV subscriber noticed."),
    (
        "llmgw_kv_events_decode_errors_total",
        "decode_errors",
        "Malformed KV event messages skipped.",
    ),
)
_STORE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("llmgw_kv_store_replicas", "replicas", "Replicas holding at least one KV block."),
    ("llmgw_kv_store_blocks", "blocks", "(replica, rank, block) entries held."),
    ("llmgw_kv_store_feeds", "watchers", "Gateway feeds following the KV block store."),
)
_STORE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("llmgw_kv_store_deltas_total", "deltas", "KV deltas applied."),
    ("llmgw_kv_store_stored_total", "stored", "Block keys added."),
    ("llmgw_kv_store_removed_total", "removed", "Block keys removed."),
    ("llmgw_kv_store_resets_total", "resets", "KV deltas with reset applied."),
    ("llmgw_kv_store_malformed_total", "malformed", "KV deltas refused as malformed."),
    ("llmgw_kv_store_ignored_total", "ignored", "KV deltas not applied (not a live leader's)."),
    ("llmgw_kv_store_drops_total", "drops", "Replicas whose KV blocks were dropped."),
)


@dataclass(frozen=True, slots=True)
class AgentStreamStats:
    """What the agent service has seen of agent streams since the start."""

    sessions: int = 0
    refused_duplicate: int = 0
    refused_rate: int = 0


@dataclass(frozen=True, slots=True)
class FleetFigures:
    """The fleet's state now: deployments' desired and ready counts, things by state."""

    deployments: tuple[tuple[str, int, int], ...] = ()  # (name, desired, ready), by name
    # by state, as labelled: "ready", "not_ready", …; a state absent counts 0
    nodes: Mapping[str, int] = field(default_factory=dict)
    replicas: Mapping[str, int] = field(default_factory=dict)
    shards: Mapping[str, int] = field(default_factory=dict)
    autoscaled: tuple[tuple[str, int], ...] = ()  # (deployment, the autoscaler's count)
    decisions: tuple[tuple[str, str, int], ...] = ()  # (deployment, reason, rounds)


def fleet_figures(plane: ControlPlane) -> FleetFigures:
    """The plane's deployments, nodes, replicas and shards, counted."""
    deployments = []
    for name, deployment in sorted(plane.desired.deployments.items()):
        status = plane.statuses.status(deployment, remember=False)
        deployments.append((name, status.desired, status.ready))
    now = time.monotonic()
    inventory = plane.inventory
    nodes = Counter(_state_label(inventory.state(r, now)) for r in inventory.nodes.values())
    replicas = Counter(
        _state_label(plane.replica_view(record).state)
        for record in plane.replicas.values()
        if record.lifecycle is not Lifecycle.RETIRED
    )
    shards = Counter(
        _state_label(read_shard_state(shard.status.state if shard.status else 0))
        for shard in inventory.shards.values()
    )
    autoscaled = tuple(sorted((n, s.desired) for n, s in plane.statuses.autoscaled().items()))
    decisions = tuple(sorted((n, r, c) for (n, r), c in plane.statuses.decisions.items()))
    return FleetFigures(tuple(deployments), nodes, replicas, shards, autoscaled, decisions)


def _state_label(state: NodeState | ShardState) -> str:
    return str(state.name).lower()


def server_metrics(
    plane: ControlPlane, agents_connected: int, streams: AgentStreamStats | None = None
) -> bytes:
    """The server's metrics now, from its plane and its number of agent streams."""
    shards = plane.inventory.shards

    def replica_of(node_id: str, shard_id: str) -> str:
        shard = shards.get(shard_id)
        return shard.replica_id if shard is not None and shard.node_id == node_id else ""

    return render_server_metrics(
        agents_connected=agents_connected,
        engines=plane.kv_follow.engines(),
        replica_of=replica_of,
        follow_refused=plane.kv_follow.refused,
        store=plane.kv_blocks.stats(),
        streams=streams or AgentStreamStats(),
        fleet=fleet_figures(plane),
    )


def leader_metrics(leadership: Leadership) -> bytes:
    """``llmgw_leader{server}`` (1 on the leader, 0 on a follower) and
    ``llmgw_leader_epoch`` (the epoch of the lease as this server knows it): a leader and
    its followers answer these alike, the followers nothing else."""
    out: list[str] = []
    family(out, "llmgw_leader", "gauge", "1 while this server leads the control plane, else 0.")
    server = label_set([("server", leadership.server_id)])
    _sample(out, "llmgw_leader", server, int(leadership.leading))
    family(out, "llmgw_leader_epoch", "gauge", "The leader lease's epoch as this server knows it.")
    _sample(out, "llmgw_leader_epoch", "", leadership.epoch)
    return ("\n".join(out) + "\n").encode()


def render_server_metrics(
    *,
    agents_connected: int,
    engines: Sequence[EngineFollowStats],
    replica_of: Callable[[str, str], str],
    follow_refused: int,
    store: KvBlocksStats,
    streams: AgentStreamStats | None = None,
    fleet: FleetFigures | None = None,
) -> bytes:
    """The exposition text of these figures (``replica_of(node, shard)`` names replicas)."""
    out: list[str] = []
    family(out, "llmgw_agents_connected", "gauge", "Agent streams open now.")
    _sample(out, "llmgw_agents_connected", "", agents_connected)
    streams = streams or AgentStreamStats()
    family(out, "llmgw_agent_sessions_total", "counter", "Agent streams registered.")
    _sample(out, "llmgw_agent_sessions_total", "", streams.sessions)
    refused = "llmgw_agent_registrations_refused_total"
    family(out, refused, "counter", "Agent Connects refused, by reason.")
    _sample(out, refused, '{reason="duplicate"}', streams.refused_duplicate)
    _sample(out, refused, '{reason="rate"}', streams.refused_rate)
    labels = [_engine_labels(e, replica_of(e.node_id, e.shard_id)) for e in engines]
    for name, attr, help_ in _FOLLOW_COUNTERS:
        family(out, name, "counter", help_)
        for engine, label in zip(engines, labels, strict=True):
            _sample(out, name, label, getattr(engine, attr))
    family(out, "llmgw_kv_mirror_blocks", "gauge", "KV blocks the agent mirrors per engine.")
    for engine, label in zip(engines, labels, strict=True):
        _sample(out, "llmgw_kv_mirror_blocks", label, engine.blocks)
    family(out, "llmgw_kv_events_last_seq", "gauge", "The last KV event batch applied.")
    for engine, label in zip(engines, labels, strict=True):
        if engine.last_seq is not None:
            _sample(out, "llmgw_kv_events_last_seq", label, engine.last_seq)
    family(out, "llmgw_kv_follow_refused_total", "counter", "Heartbeat KV counters refused.")
    _sample(out, "llmgw_kv_follow_refused_total", "", follow_refused)
    _store_lines(out, store)
    _fleet_lines(out, fleet or FleetFigures())
    return ("\n".join(out) + "\n").encode("utf-8")


def _store_lines(out: list[str], store: KvBlocksStats) -> None:
    for families, kind in ((_STORE_GAUGES, "gauge"), (_STORE_COUNTERS, "counter")):
        for name, attr, help_ in families:
            family(out, name, kind, help_)
            _sample(out, name, "", getattr(store, attr))


_NODE_STATES = tuple(_state_label(s) for s in NodeState if s is not NodeState.UNSPECIFIED)
_SHARD_STATES = tuple(_state_label(s) for s in ShardState if s is not ShardState.UNSPECIFIED)


def _fleet_lines(out: list[str], fleet: FleetFigures) -> None:
    desired, ready = "llmgw_deployment_replicas_desired", "llmgw_deployment_replicas_ready"
    family(out, desired, "gauge", "A deployment's desired replica count.")
    for name, count, _ in fleet.deployments:
        _sample(out, desired, label_set([("deployment", name)]), count)
    family(out, ready, "gauge", "A deployment's live replicas ready now.")
    for name, _, count in fleet.deployments:
        _sample(out, ready, label_set([("deployment", name)]), count)
    _autoscale_lines(out, fleet)
    _by_state(out, "llmgw_nodes", "Nodes by state.", _NODE_STATES, fleet.nodes)
    _by_state(
        out, "llmgw_replicas", "Replicas not retired, by state.", _SHARD_STATES, fleet.replicas
    )
    _by_state(out, "llmgw_shards", "Shards agents report, by state.", _SHARD_STATES, fleet.shards)
    family(out, "llmgw_build_info", "gauge", "This build: always 1, labelled.")
    build = label_set([("version", __version__), ("python", platform.python_version())])
    _sample(out, "llmgw_build_info", build, 1)


def _autoscale_lines(out: list[str], fleet: FleetFigures) -> None:
    desired, decisions = "llmgw_autoscale_desired", "llmgw_autoscale_decisions_total"
    family(out, desired, "gauge", "The autoscaler's replica count for a deployment.")
    for name, count in fleet.autoscaled:
        _sample(out, desired, label_set([("deployment", name)]), count)
    family(out, decisions, "counter", "The autoscaler's decisions, by the planner's reason.")
    for name, reason, count in fleet.decisions:
        _sample(out, decisions, label_set([("deployment", name), ("reason", reason)]), count)


def _by_state(
    out: list[str], name: str, help_: str, states: Sequence[str], counts: Mapping[str, int]
) -> None:
    """One sample per state, 0 included."""
    family(out, name, "gauge", help_)
    for state in states:
        _sample(out, name, label_set([("state", state)]), counts.get(state, 0))


def _engine_labels(engine: EngineFollowStats, replica: str) -> str:
    pairs = (("node", engine.node_id), ("replica", replica), ("shard", engine.shard_id))
    return label_set(pairs)


def _sample(out: list[str], name: str, labels: str, value: int) -> None:
    out.append(f"{name}{labels} {int(value)}")
