"""Explaining routing decisions: tier, replica, matched blocks, reason, candidates."""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence

from llmgw.gateway.precise import PreciseConfig, PreciseRequest, PreciseTier
from llmgw.gateway.routing.explain import (
    CandidateFacts,
    explain,
    header_value,
    predicted_reuse,
    reason_of,
)
from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.gateway.routing.load import LoadTracker
from llmgw.gateway.routing.policy import (
    LeastLoadPolicy,
    PrefixPolicy,
    RoundRobinPolicy,
    RouteRequest,
    SessionPolicy,
)
from llmgw.gateway.routing.table import Target
from llmgw.kvcache.mirror import block_keys

MODEL = "m"


def targets(*ids: str) -> tuple[Target, ...]:
    return tuple(
        Target(rid, MODEL, f"http://127.0.0.1:{9000 + i}", kv_events=True)
        for i, rid in enumerate(ids)
    )


def hold(index: KvIndex, replica_id: str, tokens: Sequence[int], block_size: int = 16) -> None:
    index.apply(replica_id, False, block_keys(tokens, block_size), block_size=block_size)


def precise_tier(index: KvIndex) -> PreciseTier:
    return PreciseTier(index, PrefixPolicy(), None, PreciseConfig(claim_ttl_s=0))


def test_a_precise_hit_names_the_replica_its_blocks_and_every_candidates_load() -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(50_000) for _ in range(1000)]  # 62 full blocks of 16
    index = KvIndex()
    hold(index, "a", prompt[:320])  # 20 blocks
    hold(index, "b", prompt[:800])  # 50 blocks
    load = LoadTracker()
    load.acquire("a")
    request = PreciseRequest(array("I", prompt))
    decision = precise_tier(index).choose(request, RouteRequest(MODEL), targets("a", "b"), load)
    assert decision is not None
    explained = explain(decision)
    assert (explained.tier, explained.replica_id, explained.reason) == (
        "precise",
        "b",
        "precise-hit",
    )
    assert (explained.matched, explained.total, explained.unit) == (50, 62, "blocks")
    assert explained.candidates == (CandidateFacts("a", 20, 1), CandidateFacts("b", 50, 0))
    assert header_value(explained) == "tier=precise; replica=b; matched=50/62; reason=precise-hit"
    assert predicted_reuse(decision) == 800


def test_predicted_reuse_leaves_out_the_last_token_as_engines_do() -> None:
    prompt = list(range(64))  # exactly 4 blocks: the engine recomputes the last one
    index = KvIndex()
    hold(index, "a", prompt)
    request = PreciseRequest(array("I", prompt))
    decision = precise_tier(index).choose(request, RouteRequest(MODEL), targets("a"), LoadTracker())
    assert decision is not None
    assert explain(decision).matched == 4
    assert predicted_reuse(decision) == 48


def test_a_precise_miss_says_so_and_predicts_nothing() -> None:
    index = KvIndex()
    hold(index, "a", list(range(5000, 5320)))
    request = PreciseRequest(array("I", range(400)))
    decision = precise_tier(index).choose(request, RouteRequest(MODEL), targets("a"), LoadTracker())
    assert decision is not None
    assert explain(decision).reason == "precise-miss"
    assert predicted_reuse(decision) == 0


def test_the_approximate_tier_counts_characters_and_names_the_precise_fallback() -> None:
    policy = PrefixPolicy()
    text = "You are a helpful assistant. " * 10
    first = policy.choose(RouteRequest(MODEL, text), targets("a", "b"), LoadTracker())
    assert first is not None
    assert explain(first).reason == "approximate-miss"  # nothing seen yet: by load
    again = policy.choose(RouteRequest(MODEL, text), targets("a", "b"), LoadTracker())
    assert again is not None and again.target == first.target
    explained = explain(again, fallback="no_blocks")
    assert explained.reason == "fallback-approximate-hit because no_blocks"
    assert (explained.matched, explained.total, explained.unit) == (len(text), len(text), "chars")
    assert header_value(explained).endswith(
        f"matched={len(text)}/{len(text)} chars; reason=fallback-approximate-hit because no_blocks"
    )
    assert predicted_reuse(again) is None


def test_a_fallback_is_not_claimed_for_a_precise_decision() -> None:
    index = KvIndex()
    hold(index, "a", list(range(64)))
    request = PreciseRequest(array("I", range(64)))
    decision = precise_tier(index).choose(request, RouteRequest(MODEL), targets("a"), LoadTracker())
    assert decision is not None
    assert reason_of(decision, "timeout") == "precise-hit"


def test_the_other_policies_have_their_own_reasons() -> None:
    load, route = LoadTracker(), RouteRequest(MODEL, "hi", session="s1")
    candidates = targets("a", "b")
    rr = RoundRobinPolicy().choose(route, candidates, load)
    least = LeastLoadPolicy().choose(route, candidates, load)
    session = SessionPolicy()
    new, pinned = (session.choose(route, candidates, load) for _ in range(2))
    reasons = [explain(d).reason for d in (rr, least, new, pinned) if d is not None]
    assert reasons == ["round-robin", "least-load", "session-new", "session-pinned"]
    assert pinned is not None and explain(pinned).candidates == ()  # no scores to show


def test_a_hit_on_a_claim_says_so_and_predicts_what_was_claimed() -> None:
    clock = [100.0]
    index = KvIndex()
    hold(index, "b", list(range(9000, 9016)))  # b has events and a block size
    precise = PreciseTier(
        index, PrefixPolicy(), None, PreciseConfig(claim_ttl_s=5), clock=lambda: clock[0]
    )
    prompt = PreciseRequest(array("I", range(160)))  # 10 blocks nobody holds yet
    first = precise.choose(prompt, RouteRequest(MODEL), targets("a", "b"), LoadTracker())
    assert first is not None and explain(first).reason == "precise-miss"
    clock[0] += 1  # within the claim: the chosen replica's events have not arrived
    again = PreciseRequest(array("I", range(160)))
    second = precise.choose(again, RouteRequest(MODEL), targets("a", "b"), LoadTracker())
    assert second is not None and second.target == first.target
    explained = explain(second)
    assert (explained.reason, explained.matched) == ("precise-claimed", 0)
    assert predicted_reuse(second) == 144  # 9 claimed blocks (the last token's excluded)
