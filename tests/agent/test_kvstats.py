"""The KV event subscribers' counters as heartbeats carry them (llmgw.agent.kvstats)."""

from __future__ import annotations

import dataclasses

from llmgw.agent.kvevents import KvEventCounters
from llmgw.agent.kvstats import follow_stats, follow_stats_delta
from llmgw.api.llmgw.v1 import AgentMessage, Heartbeat, KvFollowStats

FIELDS = [f.name for f in dataclasses.fields(KvEventCounters)]


def _distinct(base: int) -> KvEventCounters:
    """Counters whose every field holds a different value (a mixed-up field shows)."""
    return KvEventCounters(*(base + i for i in range(len(FIELDS))))


def test_every_counter_is_carried_under_its_own_name_and_survives_the_wire() -> None:
    counters = {"s2": _distinct(100), "s1": _distinct(1 << 40)}
    stats = follow_stats(counters)
    assert [s.shard_id for s in stats] == ["s1", "s2"]  # in shard id order
    wire = bytes(AgentMessage(heartbeat=Heartbeat(seq=1, kv_follow=stats)))
    beat = AgentMessage.parse(wire).heartbeat
    assert beat is not None
    for sent in beat.kv_follow:
        expected = counters[sent.shard_id]
        assert {name: getattr(sent, name) for name in FIELDS} == dataclasses.asdict(expected)


def test_an_unknown_last_seq_stays_unknown_and_zero_stays_zero() -> None:
    none, zero = KvEventCounters(last_seq=None), KvEventCounters(last_seq=0)
    stats = follow_stats({"a": none, "b": zero})
    parsed = [KvFollowStats.parse(bytes(s)) for s in stats]
    assert [p.last_seq for p in parsed] == [None, 0]
    assert parsed[0] != parsed[1]  # so a first batch (seq 0) is a change worth sending


def test_a_new_baseline_sends_everything_then_only_what_changed() -> None:
    first = follow_stats({"s1": KvEventCounters(batches=3), "s2": KvEventCounters()})
    assert follow_stats_delta({}, first) == first  # a new stream: every engine

    seen = {s.shard_id: s for s in first}
    assert follow_stats_delta(seen, follow_stats({"s1": KvEventCounters(batches=3),
                                                  "s2": KvEventCounters()})) == []  # fmt: skip

    later = follow_stats({"s1": KvEventCounters(batches=3, gaps=1), "s2": KvEventCounters()})
    changed = follow_stats_delta(seen, later)
    assert [(s.shard_id, s.gaps) for s in changed] == [("s1", 1)]


def test_an_engine_followed_again_is_sent_again_even_with_equal_counters() -> None:
    """The baseline is what was seen last: an engine gone from it is new when it returns
    (the server dropped its counters when its shard stopped)."""
    both = follow_stats({"s1": KvEventCounters(), "s2": KvEventCounters(blocks=5)})
    gone = follow_stats({"s2": KvEventCounters(blocks=5)})
    seen = {s.shard_id: s for s in both}
    assert follow_stats_delta(seen, gone) == []
    seen = {s.shard_id: s for s in gone}
    back = follow_stats_delta(seen, both)
    assert [s.shard_id for s in back] == ["s1"]
