"""KvIndex (llmgw/gateway/routing/kvindex.py): matches equal brute force over plain Python
sets, through bucket splits and merges, resets, forgets and sweeps; a dead replica's bit is
never read as a newer replica's."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.gateway.routing.kvindex import EVENT_LAG_BUCKETS, KvIndex
from llmgw.kvcache.mirror import block_keys

_RNG = random.Random(6)
POOL = [_RNG.getrandbits(64) | 1 for _ in range(4000)]  # blake2b-like: spread over 64 bits
REPLICAS = ("r0", "r1", "r2", "r3", "r4")


def _leading(keys: list[int], held: set[int]) -> int:
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n


# --- KvIndex -------------------------------------------------------------------------------


def test_match_counts_leading_blocks_and_stops_at_the_first_miss() -> None:
    request = block_keys(list(range(640)), 16)  # 40 blocks, keys as a gateway computes them
    index = KvIndex()
    index.apply("a", False, request[:30])
    index.apply("b", False, request[:10] + request[11:40])  # a hole at block 10
    index.apply("c", False, request[1:])  # misses the first block
    index.apply("d", False, request[:40], block_size=16)
    index.apply("d", False, (), request[35:36])
    found = index.match(request, ["a", "b", "c", "d", "e"])
    assert found == {"a": 30, "b": 10, "c": 0, "d": 35, "e": 0}
    assert index.match(request, ["a"]) == {"a": 30}  # only the candidates asked for
    assert index.match([], ["a"]) == {"a": 0}
    assert index.match([0, *request], ["a"]) == {"a": 0}  # 0 (unknown) is never held
    assert index.match([2**64, -1], ["a"]) == {"a": 0}
    assert index.holds("a", request[29]) and not index.holds("a", request[30])
    assert index.blocks_of("d") == 39 and len(index) == 40
    assert index.replicas() == ["a", "b", "c", "d"]
    assert index.block_size("d") == 16 and index.block_size("a") == 0
    index.retain(["a"])
    assert index.block_size("d") == 0


def test_reset_forget_and_retain_drop_blocks_and_count() -> None:
    index = KvIndex()
    index.apply("a", False, POOL[:100])
    index.apply("b", False, POOL[50:150])
    index.apply("a", True, POOL[200:210])  # reset: only the new blocks remain
    assert index.keys_of("a") == sorted(POOL[200:210])
    assert index.match(POOL[50:60], ["a", "b"]) == {"a": 0, "b": 10}
    index.forget("b")
    assert index.blocks_of("b") == 0 and index.keys_of("b") == []
    index.apply("c", False, POOL[300:305])
    index.retain(["c"])
    assert index.replicas() == ["c"]
    index.sweep(10**6)
    stats = index.stats()
    assert (stats.keys, stats.blocks, stats.replicas) == (5, 5, 1)
    assert (stats.resets, stats.forgets, stats.sweeping) == (1, 2, False)
    assert stats.stored == 215 and stats.masks == 1
    index.apply("c", True)  # a reset of a replica holding nothing else: nothing to count
    index.apply("c", True)
    assert index.stats().resets == 2


def test_a_dead_bit_is_not_reused_before_the_sweep_has_passed_every_bucket() -> None:
    index = KvIndex()
    index.apply("old", False, POOL)  # enough keys for several buckets
    index.apply("other", False, POOL[:2])
    last = max(POOL)  # in the last bucket: swept last
    assert index._bits >= 3
    old_bit = index._bit["old"]
    index.forget("old")  # its bit dies; the sweep starts
    index.apply("other", False, POOL[1:2])  # pays for a little of the sweep
    stats = index.stats()
    assert stats.sweeping and stats.keys > len(POOL) // 2  # entries of the dead bit linger
    assert index.match([*POOL[:2], last], ["other"]) == {"other": 2}  # `last` looked up
    index.apply("new", False, POOL[2:3])
    assert index._bit["new"] != old_bit  # not free yet: some buckets still carry it
    assert index.match(POOL[:5], ["new", "old"]) == {"new": 0, "old": 0}
    while index.stats().sweeping:
        index.apply("other", False, POOL[1:2])
    assert len(index) == 3  # only the entries that live replicas hold remain
    index.apply("newer", False, POOL[3:4])
    assert index._bit["newer"] == old_bit  # swept everywhere: reused
    assert index.keys_of("newer") == [POOL[3]]
    assert index.match(POOL[3:10], ["newer"]) == {"newer": 1}
    assert index.match([last], ["newer"]) == {"newer": 0}  # nothing remembered of "old"


def test_a_key_the_sweep_dropped_and_stored_again_is_found() -> None:
    index = KvIndex()
    index.apply("r0", False, POOL[:553])  # two buckets
    request = sorted(POOL[:2])
    assert index.match(request, ["r0"]) == {"r0": 2}  # remembered as found
    index.apply("r0", True)  # the sweep drops the first bucket's entries, then pauses
    assert index.stats().sweeping
    index.apply("r0", False, request)  # stored again, under r0's new bit
    assert index.match(request, ["r0"]) == {"r0": 2}


def test_note_counters() -> None:
    index = KvIndex()
    index.note_event_lag(0.25)
    index.note_event_lag(0.5)
    index.note_refused()
    stats = index.stats()
    assert (stats.event_lags, stats.event_lag_sum_s, stats.event_lag_max_s) == (2, 0.75, 0.5)
    at = {bound: i for i, bound in enumerate(EVENT_LAG_BUCKETS)}
    counts = [0] * (len(EVENT_LAG_BUCKETS) + 1)
    counts[at[0.25]] = counts[at[0.5]] = 1  # a bound is its bucket's upper edge, inclusive
    assert list(stats.event_lag_counts) == counts
    assert stats.refused == 1


# a batch is a run of the pool (cheap to draw, big enough to split buckets) plus a few picks
_batch = st.tuples(
    st.integers(0, len(POOL) - 1),
    st.integers(0, 1500),
    st.lists(st.integers(0, len(POOL) - 1), max_size=20),
)
_ops = st.lists(
    st.tuples(
        st.sampled_from(REPLICAS),
        st.sampled_from(("apply", "apply", "apply", "reset", "forget", "retain")),
        _batch,  # stored
        _batch,  # removed
    ),
    max_size=25,
)

Batch = tuple[int, int, list[int]]


def _keys(batch: Batch) -> list[int]:
    start, length, picks = batch
    return POOL[start : start + length] + [POOL[i] for i in picks]


@settings(max_examples=120, deadline=None)
@given(_ops, st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=60))
def test_index_equals_brute_force_over_per_replica_sets(
    ops: list[tuple[str, str, Batch, Batch]], request_picks: list[int]
) -> None:
    index, truth = KvIndex(), {r: set[int]() for r in REPLICAS}
    for replica, op, stored_batch, removed_batch in ops:
        stored, removed = _keys(stored_batch), _keys(removed_batch)
        if op == "forget":
            index.forget(replica)
            truth[replica].clear()
        elif op == "retain":
            index.retain(REPLICAS[:3])
            for other in REPLICAS[3:]:
                truth[other].clear()
        else:
            index.apply(replica, op == "reset", stored, removed)
            if op == "reset":
                truth[replica].clear()
            truth[replica].difference_update(removed)
            truth[replica].update(stored)
        _check(index, truth, request_picks)
    index.sweep(10**9)
    assert len(index) == len(set().union(*truth.values()))
    _check(index, truth, request_picks)


def _check(index: KvIndex, truth: dict[str, set[int]], request_picks: list[int]) -> None:
    for replica, held in truth.items():
        assert index.blocks_of(replica) == len(held)
        assert index.keys_of(replica) == sorted(held)
    # requests that follow one replica's blocks (long shared runs), and a random one
    requests = [sorted(held)[:60] for held in truth.values() if held]
    requests.append([POOL[i] for i in request_picks])
    for request in requests:
        expected = {r: _leading(request, held) for r, held in truth.items()}
        assert index.match(request, REPLICAS) == expected
