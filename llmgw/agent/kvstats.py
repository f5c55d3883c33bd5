"""The KV event subscribers' counters as heartbeats carry them (``Heartbeat.kv_follow``).

Each engine the agent follows has a `~llmgw.agent.kvevents.KvEventCounters` (batches,
gaps, replays, resets, ...). A heartbeat carries them as ``KvFollowStats`` messages, but
only those that changed since the last heartbeat of the same stream: a fleet of idle
engines costs nothing, and the server keeps the last value it received per engine. A new
stream starts from an empty baseline, so its first heartbeat carries every engine.

The baseline is simply the engines' stats as last seen (`follow_stats_delta` sends every
one that differs from it), so an engine no longer followed leaves the baseline, and one
followed again later (its counters start again at 0) is sent again even when its counters
equal what was sent for it before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from llmgw.api.llmgw.v1 import KvFollowStats

if TYPE_CHECKING:
    from llmgw.agent.kvevents import KvEventCounters

__all__ = ["follow_stats", "follow_stats_delta"]


def follow_stats(counters: Mapping[str, KvEventCounters]) -> list[KvFollowStats]:
    """Each engine's counters (by shard id) as wire messages, in shard id order."""
    return [_stats(shard_id, c) for shard_id, c in sorted(counters.items())]


def follow_stats_delta(
    previous: Mapping[str, KvFollowStats], current: Sequence[KvFollowStats]
) -> list[KvFollowStats]:
    """The stats of ``current`` worth sending, given what was last seen (``previous``, by
    shard id): every engine that is new or whose stats differ, in the order of ``current``."""
    return [stats for stats in current if previous.get(stats.shard_id) != stats]


def _stats(shard_id: str, c: KvEventCounters) -> KvFollowStats:
    return KvFollowStats(
        shard_id=shard_id,
        batches=c.batches,
        events=c.events,
        gaps=c.gaps,
        replays=c.replays,
        replay_failures=c.replay_failures,
        resets=c.resets,
        restarts=c.restarts,
        decode_errors=c.decode_errors,
        blocks=c.blocks,
        last_seq=c.last_seq,
    )
