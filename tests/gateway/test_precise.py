"""The precise tier: block keys reused across turns, scoring on the KV index, fallbacks."""

from __future__ import annotations

import json
import random
import re
from array import array
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import routing as bench_routing
from bench import routing_fleet as fleet
from bench import routing_sim as sim
from llmgw.gateway.metrics import GatewayMetrics, kv_index_lines
from llmgw.gateway.precise import (
    TIER_PRECISE,
    BlockKeyCache,
    Fallback,
    PreciseConfig,
    PreciseRequest,
    PreciseTier,
)
from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.gateway.routing.load import LoadTracker
from llmgw.gateway.routing.policy import PrefixPolicy, RouteRequest
from llmgw.gateway.routing.table import Target
from llmgw.kvcache import BlockStored, EventBatch
from llmgw.kvcache.mirror import BlockMirror, block_keys

MODEL = "m"


class CountingKeys:
    """``block_keys`` that counts the blocks it hashes."""

    def __init__(self) -> None:
        self.blocks = 0

    def __call__(self, tokens: Sequence[int], block_size: int, **kw: Any) -> list[int]:
        keys = block_keys(tokens, block_size, **kw)
        self.blocks += len(keys)
        return keys


def tokens_of(values: Sequence[int]) -> array[int]:
    return array("I", values)


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(49_152) for _ in range(count)]


def salted(salt: str) -> Callable[[int, int], tuple[object, ...] | None]:
    return lambda start, end: (salt,) if start == 0 else None


# -- BlockKeyCache ---------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 7, 16, 128, 200])
def test_keys_equal_block_keys_over_the_whole_sequence(block_size: int) -> None:
    rng = random.Random(block_size)
    cache = BlockKeyCache(block_size)
    system = random_tokens(rng, 3000)
    for _ in range(6):  # conversations sharing a system prompt, each continued
        convo = system + random_tokens(rng, rng.randrange(0, 900))
        for _ in range(3):
            convo += random_tokens(rng, rng.randrange(1, 700))
            assert cache.keys(tokens_of(convo)) == block_keys(convo, block_size)


def test_a_continued_chat_hashes_only_its_new_blocks() -> None:
    rng = random.Random(7)
    counting = CountingKeys()
    cache = BlockKeyCache(16, hasher=counting)
    turn1 = random_tokens(rng, 6000 + 5)  # ends in a partial chunk and a partial block
    assert cache.keys(tokens_of(turn1)) == block_keys(turn1, 16)
    assert counting.blocks == 6005 // 16 == cache.hashed
    turn2 = turn1 + random_tokens(rng, 1000)
    keys2 = cache.keys(tokens_of(turn2))
    assert keys2 == block_keys(turn2, 16)
    assert counting.blocks - 6005 // 16 == 7005 // 16 - 6005 // 16  # the new blocks only
    before = counting.blocks
    assert cache.keys(tokens_of(turn2)) == keys2  # a repeat hashes nothing
    assert counting.blocks == before


def test_another_conversation_reuses_the_shared_system_prompt() -> None:
    rng = random.Random(8)
    counting = CountingKeys()
    cache = BlockKeyCache(16, hasher=counting)
    system = random_tokens(rng, 4000)
    cache.keys(tokens_of(system + random_tokens(rng, 500)))
    before = counting.blocks
    other = system + random_tokens(rng, 2000)
    assert cache.keys(tokens_of(other)) == block_keys(other, 16)
    new_blocks = len(other) // 16 - len(system) // 16
    per_chunk = 128 // 16  # the chunk holding the fork is hashed again, at most
    assert new_blocks <= counting.blocks - before < new_blocks + per_chunk


def test_the_memo_is_bounded_and_still_right_when_evicted() -> None:
    rng = random.Random(9)
    cache = BlockKeyCache(16, max_groups=10)
    for _ in range(5):
        convo = random_tokens(rng, 2000)
        assert cache.keys(tokens_of(convo)) == block_keys(convo, 16)
        assert len(cache) <= 10
    nothing = BlockKeyCache(16, max_groups=0)
    convo = random_tokens(rng, 300)
    assert nothing.keys(tokens_of(convo)) == block_keys(convo, 16) and len(nothing) == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 300), st.sampled_from([None, "s1", "s2"])),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([3, 16, 64]),
)
def test_any_order_of_prefixes_and_salts_gives_block_keys(
    steps: list[tuple[int, int, str | None]], block_size: int
) -> None:
    rng = random.Random(0)
    bases = [random_tokens(rng, 600) for _ in range(3)]
    cache = BlockKeyCache(block_size, max_groups=40)
    for base_index, cut, salt in steps:
        tokens = bases[base_index % 3][: cut + base_index * 50]
        extra = salted(salt) if salt is not None else None
        want = block_keys(tokens, block_size, extra_keys_fn=extra)
        assert cache.keys(tokens_of(tokens), salt) == want


def test_salted_keys_are_the_keys_the_agents_mirror_computes() -> None:
    # vLLM 0.17+ publishes the salt as block 0's extra keys; the agent's mirror keys blocks
    # from the event, and the gateway must reach the same keys from the tokens alone.
    rng = random.Random(3)
    tokens = random_tokens(rng, 64)
    stored = BlockStored(
        block_hashes=(11, 12, 13, 14),
        parent_block_hash=None,
        token_ids=tuple(tokens),
        block_size=16,
        extra_keys=(("tenant-a",), None, None, None),
    )
    mirror = BlockMirror()
    mirror.apply(EventBatch(ts=1.0, events=(stored,)))
    published = [mirror.key_of(h) for h in (11, 12, 13, 14)]
    assert BlockKeyCache(16).keys(tokens_of(tokens), "tenant-a") == published
    assert BlockKeyCache(16).keys(tokens_of(tokens)) != published


# -- scoring ---------------------------------------------------------------------------------


def targets(*ids: str, kv_events: bool = True) -> tuple[Target, ...]:
    return tuple(
        Target(rid, MODEL, f"http://127.0.0.1:{9000 + i}", kv_events=kv_events)
        for i, rid in enumerate(ids)
    )


def tier(
    index: KvIndex, *, metrics: GatewayMetrics | None = None, claim_ttl_s: float = 0.5
) -> tuple[PreciseTier, PrefixPolicy]:
    policy = PrefixPolicy()
    config = PreciseConfig(claim_ttl_s=claim_ttl_s)
    return PreciseTier(index, policy, None, config, metrics=metrics), policy


def hold(index: KvIndex, replica_id: str, tokens: Sequence[int], block_size: int = 16) -> None:
    index.apply(replica_id, False, block_keys(tokens, block_size), block_size=block_size)


def test_precise_beats_a_cold_tree() -> None:
    rng = random.Random(1)
    prompt = random_tokens(rng, 2000)
    index = KvIndex()
    hold(index, "c", prompt[:1600])  # c holds the first 100 of 125 blocks
    hold(index, "a", prompt[:320])
    hold(index, "b", random_tokens(rng, 800))
    candidates = targets("a", "b", "c")
    precise, policy = tier(index)
    route = RouteRequest(MODEL, "x" * 8000)
    cold = PrefixPolicy().choose(route, candidates, LoadTracker())  # approximate: no idea
    assert cold is not None and (cold.tier, cold.outcome) == ("load", "miss")
    decision = precise.choose(PreciseRequest(tokens_of(prompt)), route, candidates, LoadTracker())
    assert decision is not None
    assert decision.target.replica_id == "c"
    assert (decision.tier, decision.outcome) == (TIER_PRECISE, "hit")
    assert decision.matched == pytest.approx(1600 / 2000)
    # the approximate tree learned the choice: it is warm for the next fallback
    assert policy.tree(MODEL).match("x" * 8000) == {"c": 8000}


def test_the_hot_replica_guard_applies_to_precise_decisions() -> None:
    rng = random.Random(2)
    prompt = random_tokens(rng, 1024)
    index = KvIndex()
    hold(index, "a", prompt)  # scores 1.0 - 0.25 * 9 / 4 = 0.44 at 9 in flight, but hot
    hold(index, "b", prompt[:128])  # scores 0.125
    load = LoadTracker()
    for _ in range(9):
        load.acquire("a")  # 9 in flight against 0: far past guard_abs 4 and guard_rel 2
    precise, _ = tier(index, claim_ttl_s=0)  # b's claim would hold the prompt after
    request = PreciseRequest(tokens_of(prompt))
    decision = precise.choose(request, RouteRequest(MODEL), targets("a", "b"), load)
    assert decision is not None
    assert decision.target.replica_id == "b"
    assert (decision.tier, decision.outcome) == (TIER_PRECISE, "guarded")
    for _ in range(6):
        load.release("a")  # 3 in flight: a wins again, load weighed against its share
    again = precise.choose(request, RouteRequest(MODEL), targets("a", "b"), load)
    assert again is not None and again.target.replica_id == "a" and again.outcome == "hit"


def test_a_precise_miss_goes_to_the_least_loaded_and_then_least_holding() -> None:
    rng = random.Random(3)
    index = KvIndex()
    hold(index, "a", random_tokens(rng, 3200))
    hold(index, "b", random_tokens(rng, 320))
    hold(index, "c", random_tokens(rng, 1600))
    load = LoadTracker()
    load.acquire("c")
    precise, _ = tier(index)
    request = PreciseRequest(tokens_of(random_tokens(rng, 800)))
    decision = precise.choose(request, RouteRequest(MODEL), targets("a", "b", "c"), load)
    assert decision is not None
    assert (decision.target.replica_id, decision.tier, decision.outcome) == (
        "b",
        TIER_PRECISE,
        "miss",
    )


def test_excluded_replicas_are_not_chosen_and_none_left_is_none() -> None:
    prompt = list(range(64))
    index = KvIndex()
    hold(index, "a", prompt)
    precise, _ = tier(index)
    request = PreciseRequest(tokens_of(prompt))
    decision = precise.choose(
        request, RouteRequest(MODEL), targets("a", "b"), LoadTracker(), exclude=frozenset({"a"})
    )
    assert decision is not None and decision.target.replica_id == "b"
    nothing = precise.choose(
        request, RouteRequest(MODEL), targets("a"), LoadTracker(), exclude=frozenset({"a"})
    )
    assert nothing is None


def test_replicas_of_different_block_sizes_are_matched_with_their_own_keys() -> None:
    rng = random.Random(4)
    prompt = random_tokens(rng, 1000)
    index = KvIndex()
    hold(index, "a", prompt[:900], block_size=128)  # 7 blocks of 128 = 896 tokens
    hold(index, "b", prompt[:480], block_size=16)  # 30 blocks of 16 = 480 tokens
    precise, _ = tier(index)
    request = PreciseRequest(tokens_of(prompt))
    matched, sizes = precise.matched_tokens(request, targets("a", "b"))
    assert matched == {"a": 896, "b": 480}
    assert sizes == {"a": 128, "b": 16}
    assert set(request.keys_by_size) == {16, 128}


def test_salted_requests_match_only_salted_blocks() -> None:
    rng = random.Random(5)
    prompt = random_tokens(rng, 640)
    index = KvIndex()
    salted_keys = block_keys(prompt, 16, extra_keys_fn=salted("t1"))
    index.apply("a", False, salted_keys, block_size=16)
    hold(index, "b", prompt)
    precise, _ = tier(index)
    with_salt = PreciseRequest(tokens_of(prompt), salt="t1")
    assert precise.matched_tokens(with_salt, targets("a", "b"))[0] == {"a": 640, "b": 0}
    without = PreciseRequest(tokens_of(prompt))
    assert precise.matched_tokens(without, targets("a", "b"))[0] == {"a": 0, "b": 640}


def test_reuse_available_and_captured_are_counted_once_per_request() -> None:
    rng = random.Random(6)
    prompt = random_tokens(rng, 1000)
    index = KvIndex()
    hold(index, "a", prompt[:800])
    hold(index, "b", prompt[:160])
    metrics = GatewayMetrics()
    precise, _ = tier(index, metrics=metrics)
    load = LoadTracker()
    for _ in range(9):
        load.acquire("a")
    request = PreciseRequest(tokens_of(prompt))
    decision = precise.choose(request, RouteRequest(MODEL), targets("a", "b"), load)
    assert decision is not None and decision.target.replica_id == "b"  # guarded
    precise.choose(request, RouteRequest(MODEL), targets("a", "b"), load)  # a retry
    assert metrics.reuse == {"available": 800, "captured": 160, "delivered": 0}
    assert metrics.reuse_prompt["router"] == 1000
    assert metrics.precise_seconds.count == 1


# -- when the precise tier steps aside -------------------------------------------------------


def body(document: dict[str, Any]) -> bytes:
    return json.dumps(document).encode()


async def test_fallback_reasons_are_counted_and_token_prompts_need_no_tokenizer() -> None:
    index = KvIndex()
    metrics = GatewayMetrics()
    precise, _ = tier(index, metrics=metrics)
    load = LoadTracker()
    ids = list(range(100, 164))
    completion = body({"model": MODEL, "prompt": ids})

    async def prepare(candidates: tuple[Target, ...], data: bytes = completion) -> object:
        return await precise.prepare("/v1/completions", data, MODEL, 10, candidates, load)

    assert await prepare(targets("a", kv_events=False)) == Fallback("no_events")
    assert await prepare(targets("a")) == Fallback("no_blocks")
    index.apply("a", False, [5, 6, 7])  # blocks, but no block size known anywhere
    assert await prepare(targets("a")) == Fallback("no_block_size")
    index.apply("a", False, [8], block_size=16)
    prepared = await prepare(targets("a"))
    assert isinstance(prepared, PreciseRequest) and list(prepared.tokens) == ids
    chat = body({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert await prepare(targets("a"), chat) == Fallback("malformed_request")  # wrong path
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    media = body({"model": MODEL, "messages": [{"role": "user", "content": [image]}]})
    assert await precise.prepare(
        "/v1/chat/completions", media, MODEL, 10, targets("a"), load
    ) == Fallback("multimodal")
    text = body({"model": MODEL, "prompt": "hello"})
    assert await prepare(targets("a"), text) == Fallback("no_tokenizer")
    assert metrics.precise_fallbacks == {
        "no_events": 1,
        "no_blocks": 1,
        "no_block_size": 1,
        "malformed_request": 1,
        "multimodal": 1,
        "no_tokenizer": 1,
    }


async def test_the_block_size_may_come_from_the_engine_poller() -> None:
    index = KvIndex()
    index.apply("a", False, [5, 6, 7])
    sizes = {"a": 16}
    precise = PreciseTier(index, PrefixPolicy(), None, block_size_of=lambda r: sizes.get(r, 0))
    assert precise.applicable(targets("a")) == ""
    assert precise.block_size("a") == 16
    index.apply("a", False, [9], block_size=32)
    assert precise.block_size("a") == 32  # the feed's word wins


# -- claims: blocks sent to a replica before its events can show them -----------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def burst(precise: PreciseTier, prompt: Sequence[int], count: int, load: LoadTracker) -> list[str]:
    """``count`` requests with the same prompt decided in a row, each acquired at once."""
    chosen = []
    for _ in range(count):
        decision = precise.choose(
            PreciseRequest(tokens_of(prompt)), RouteRequest(MODEL), targets("a", "b", "c"), load
        )
        assert decision is not None
        load.acquire(decision.target.replica_id)
        chosen.append(decision.target.replica_id)
    return chosen


def test_a_burst_sharing_a_new_prefix_goes_where_the_first_went() -> None:
    rng = random.Random(10)
    prompt = random_tokens(rng, 1024)
    index = KvIndex()
    for replica_id in "abc":
        hold(index, replica_id, random_tokens(rng, 64))  # some blocks, none of this prompt
    clock = Clock()
    claiming = PreciseTier(index, PrefixPolicy(), None, clock=clock)
    assert burst(claiming, prompt, 5, LoadTracker()) == ["a"] * 5  # then the guard spreads
    forgetful = PreciseTier(index, PrefixPolicy(), None, PreciseConfig(claim_ttl_s=0))
    assert burst(forgetful, prompt, 3, LoadTracker()) == ["a", "b", "c"]  # 3 prefills


def test_a_claim_covers_what_the_index_does_not_show_until_its_time_is_up() -> None:
    rng = random.Random(11)
    prompt = random_tokens(rng, 512)
    index = KvIndex()
    hold(index, "c", random_tokens(rng, 64))
    clock = Clock()
    precise = PreciseTier(index, PrefixPolicy(), None, clock=clock)
    request = PreciseRequest(tokens_of(prompt))
    keys = precise.keys(request, 16)

    def claimed(replica_id: str) -> int:
        return precise.claims.held(keys, {replica_id}, clock.now, 8).get(replica_id, 0)

    assert burst(precise, prompt, 1, LoadTracker()) == ["a"]  # a new replica: size 16 too
    assert precise.matched_tokens(request, targets("a", "b", "c"))[0]["a"] == 0
    assert claimed("a") == 32  # every block of the prompt, none of it indexed yet
    assert burst(precise, prompt, 1, LoadTracker()) == ["a"]  # by its claim
    clock.now += 0.5  # claim_ttl_s: a's events never came (its requests failed, say)
    assert claimed("a") == 0
    hold(index, "a", prompt[:256])  # they came, for half the prompt
    load = LoadTracker()
    load.acquire("b")
    assert burst(precise, prompt, 1, load) == ["a"]
    claims = len(precise.claims)
    assert claimed("a") == 32 and claims == 2  # blocks 23 and 31: those not indexed yet
    hold(index, "a", prompt)
    assert burst(precise, prompt, 1, LoadTracker()) == ["a"]
    assert len(precise.claims) == claims  # all indexed: nothing more to claim


# -- the routing benchmark's precise tier (bench/routing_sim.py, routing_fleet.py) ---------------


def test_the_bench_feeds_the_precise_tier_from_the_engines_events() -> None:
    # Two conversations of one group, far apart: the first finds nothing indexed (the
    # approximate tier decides, by load); by the second, engine-00's events have reached
    # the index, and the precise tier finds the shared system prompt there, as the oracle.
    fields: dict[str, Any] = {"engines": 2, "groups": 1, "users": 2, "turns": 2}
    fields |= {"system_tokens": 200, "question_tokens": 40, "rate": 0.02, "think_s": 1.0}
    fields |= {"kv_blocks": 256}
    config = replace(fleet.BenchConfig(), **fields)
    workload = sim.build_workload(config)
    precise = bench_routing.replay(config, workload, "precise")
    oracle = bench_routing.replay(config, workload, "oracle")
    assert precise.decisions == {"load/miss": 1, "precise/hit": 3}
    assert precise.per_engine == oracle.per_engine == (4, 0)
    assert precise.hit_rate == oracle.hit_rate > 0
    assert precise.exact_chosen_share == precise.exact_best_share > 0
    assert precise.precise_cost_us["decisions"] == 3


def test_the_micro_benchmark_times_continued_chats() -> None:
    costs = fleet.precise_micro(16, conversations=4, replicas=3)
    assert len(costs) == 4 and all(0 < cost < 0.1 for cost in costs)


# -- what /metrics says about the precise tier ------------------------------------------------

_FAMILY = re.compile(r"^# (HELP|TYPE) ([a-zA-Z_:][\w:]*) (.+)$")
_LINE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{(\w+="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def test_the_precise_families_are_valid_exposition() -> None:
    index = KvIndex()
    hold(index, "a", list(range(64)))
    index.note_event_lag(0.02)
    metrics = GatewayMetrics()
    metrics.add_collector(lambda: kv_index_lines(index.stats()))
    metrics.precise_fallback("timeout")
    metrics.tokenized(0.004, "timeout")
    metrics.precise_decided(1000, 800, 640, 0.0002)
    metrics.delivered(1000, 700)
    text = metrics.render({"a": 0}).decode()
    declared: set[str] = set()
    for line in text.splitlines():
        family = _FAMILY.match(line)
        if family:
            declared.add(family.group(2))
            continue
        sample = _LINE.match(line)
        assert sample is not None, line
        name = sample.group(1)
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in declared or base in declared, line
    for want in (
        'llmgw_reuse_tokens_total{stage="available"} 800',
        'llmgw_reuse_tokens_total{stage="captured"} 640',
        'llmgw_reuse_tokens_total{stage="delivered"} 700',
        'llmgw_reuse_prompt_tokens_total{source="router"} 1000',
        'llmgw_precise_fallbacks_total{reason="timeout"} 1',
        'llmgw_tokenize_failures_total{reason="timeout"} 1',
        "llmgw_precise_seconds_count 1",
        "llmgw_kv_index_blocks 4",
        'llmgw_kv_index_event_lag_seconds_bucket{le="0.01"} 0',
        'llmgw_kv_index_event_lag_seconds_bucket{le="0.025"} 1',
        'llmgw_kv_index_event_lag_seconds_bucket{le="+Inf"} 1',
        "llmgw_kv_index_event_lag_seconds_sum 0.02",
        "llmgw_kv_index_event_lag_seconds_count 1",
        "llmgw_kv_index_event_lag_max_seconds 0.02",
    ):
        assert want in text.splitlines(), want
