"""The agents' KV event subscriber counters, as their heartbeats last reported them.

Each agent follows the KV events of its engines (``llmgw.agent.kvevents``) and counts what
it saw: batches, gaps, replays, replay failures, resets, engine restarts, decode errors,
blocks mirrored. Heartbeats carry those counters (``Heartbeat.kv_follow``) for the engines
whose counters changed, and for every engine on a stream's first heartbeat.
:class:`KvFollowBoard` keeps the last value per (node, shard) so that ``/metrics`` on the
server's gRPC-web port (``llmgw.server.wire.metrics``) can show them.

**When an entry goes.** An engine's counters are dropped when its node registers again (the
new stream's first heartbeat reports every engine the agent follows), when its node's
stream ends, and when its shard is reported in a state whose engine the agent does not
follow (`FOLLOWED_STATES`: the agent's subscriber is gone, and a new one counts from 0).

**Bad input.** A ``KvFollowStats`` without a shard id, or with one longer than
`MAX_SHARD_ID`, is refused and counted; so is a new engine beyond `MAX_ENGINES_PER_NODE` on
one node, so an agent cannot make the server hold an unbounded number of entries. The rest
of the heartbeat is applied.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from llmgw.api.llmgw.v1 import KvFollowStats, ShardState

log = logging.getLogger(__name__)

__all__ = [
    "FOLLOWED_STATES",
    "MAX_ENGINES_PER_NODE",
    "MAX_SHARD_ID",
    "EngineFollowStats",
    "KvFollowBoard",
]

FOLLOWED_STATES = frozenset({ShardState.LOADING, ShardState.READY, ShardState.DRAINING})
"""Shard states in which the agent follows the engine's KV events (as the agent's
supervisor decides, ``llmgw.agent.supervisor._KV_FOLLOWED``)."""
MAX_ENGINES_PER_NODE = 1024
"""Engines kept per node; more are refused (a node runs one engine per shard)."""
MAX_SHARD_ID = 256
"""The longest shard id kept (characters)."""


@dataclass(frozen=True, slots=True)
class EngineFollowStats:
    """One engine's counters as its agent last reported them (a snapshot)."""

    node_id: str
    shard_id: str
    batches: int  # event batches applied
    events: int  # events in them
    gaps: int  # seq gaps seen on the live stream
    replays: int  # replays requested (start, engine restart, gap)
    replay_failures: int  # holes no replay could fill
    resets: int  # the engine's blocks reset (hole, restart, AllBlocksCleared)
    restarts: int  # engine restarts noticed
    decode_errors: int  # malformed messages skipped
    blocks: int  # blocks mirrored now (a gauge)
    last_seq: int | None  # the last batch applied; None: none since the last sync

    @classmethod
    def of(cls, node_id: str, stats: KvFollowStats) -> EngineFollowStats:
        """The snapshot of a heartbeat's ``KvFollowStats`` from ``node_id``."""
        return cls(
            node_id=node_id,
            shard_id=stats.shard_id,
            batches=stats.batches,
            events=stats.events,
            gaps=stats.gaps,
            replays=stats.replays,
            replay_failures=stats.replay_failures,
            resets=stats.resets,
            restarts=stats.restarts,
            decode_errors=stats.decode_errors,
            blocks=stats.blocks,
            last_seq=stats.last_seq,
        )


class KvFollowBoard:
    """The latest KV event subscriber counters of every engine, by (node, shard)."""

    def __init__(self, *, max_engines_per_node: int = MAX_ENGINES_PER_NODE) -> None:
        self._max_per_node = max_engines_per_node
        self._nodes: dict[str, dict[str, EngineFollowStats]] = {}
        self.refused = 0  # KvFollowStats refused (no shard id, too long, too many engines)

    def update(self, node_id: str, reports: Iterable[KvFollowStats]) -> None:
        """Keep the counters a heartbeat from ``node_id`` carries (each replaces the last)."""
        engines = self._nodes.get(node_id)
        for stats in reports:
            why = self._refusal(stats, engines)
            if why:
                self.refused += 1
                log.debug("node %s: KV follow stats refused: %s", node_id, why)
                continue
            if engines is None:
                engines = self._nodes[node_id] = {}
            engines[stats.shard_id] = EngineFollowStats.of(node_id, stats)

    def _refusal(self, stats: KvFollowStats, engines: dict[str, EngineFollowStats] | None) -> str:
        """Why ``stats`` cannot be kept ("" when it can)."""
        if not stats.shard_id:
            return "no shard_id"
        if len(stats.shard_id) > MAX_SHARD_ID:
            return f"shard_id longer than {MAX_SHARD_ID} characters"
        known = engines or {}
        if len(known) >= self._max_per_node and stats.shard_id not in known:
            return f"more than {self._max_per_node} engines on one node"
        return ""

    def drop_node(self, node_id: str) -> None:
        """Forget every engine of ``node_id``."""
        self._nodes.pop(node_id, None)

    def shard_state(self, node_id: str, shard_id: str, state: ShardState) -> None:
        """A shard's reported state: outside `FOLLOWED_STATES` its counters go."""
        if state in FOLLOWED_STATES:
            return
        engines = self._nodes.get(node_id)
        if engines is not None and engines.pop(shard_id, None) is not None and not engines:
            del self._nodes[node_id]

    def get(self, node_id: str, shard_id: str) -> EngineFollowStats | None:
        return self._nodes.get(node_id, {}).get(shard_id)

    def engines(self) -> list[EngineFollowStats]:
        """Every engine's counters, by node then shard."""
        return [
            stats
            for _, engines in sorted(self._nodes.items())
            for _, stats in sorted(engines.items())
        ]
