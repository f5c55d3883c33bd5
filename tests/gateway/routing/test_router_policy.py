"""Routing policies: round robin, least load, session affinity and the prefix policy."""

from __future__ import annotations

from collections import Counter

import pytest

from llmgw.gateway import (
    POLICIES,
    Decision,
    LoadTracker,
    PrefixConfig,
    PrefixPolicy,
    RouteRequest,
    SessionPolicy,
    Target,
    make_policy,
)
from llmgw.gateway.routing.policy import prefix_decision
from llmgw.gateway.routing.prefix_tree import DEFAULT_MAX_CHARS_PER_REPLICA

SYSTEM = "You are a careful assistant. " * 40  # ~1.1 k characters shared by a group


def fleet(n: int = 3, model: str = "m") -> tuple[Target, ...]:
    return tuple(Target(f"r{i}", model, f"http://127.0.0.1:{8100 + i}") for i in range(1, n + 1))


def loaded(**in_flight: int) -> LoadTracker:
    load = LoadTracker()
    for replica_id, count in in_flight.items():
        for _ in range(count):
            load.acquire(replica_id)
    return load


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def prefix_policy(**config: float) -> PrefixPolicy:
    return PrefixPolicy(PrefixConfig(**config), clock=FakeClock())  # type: ignore[arg-type]


def pick(decision: Decision | None) -> str:
    assert decision is not None
    return decision.target.replica_id


# --- factory ---------------------------------------------------------------------------


def test_make_policy_builds_every_named_policy() -> None:
    assert POLICIES[0] == "prefix"
    for name in POLICIES:
        assert make_policy(name).name == name


def test_make_policy_refuses_unknown_names_listing_the_choices() -> None:
    with pytest.raises(ValueError, match="prefix, round_robin, least_load, session"):
        make_policy("random")


def test_every_policy_skips_excluded_and_returns_none_when_nothing_is_left() -> None:
    targets = fleet(2)
    for name in POLICIES:
        policy = make_policy(name)
        request = RouteRequest("m", "some text", "s1")
        assert (
            pick(policy.choose(request, targets, LoadTracker(), exclude=frozenset({"r1"}))) == "r2"
        )
        assert (
            policy.choose(request, targets, LoadTracker(), exclude=frozenset({"r1", "r2"})) is None
        )
        assert policy.choose(request, (), LoadTracker()) is None


# --- round robin and least load --------------------------------------------------------


def test_round_robin_cycles_per_model_and_skips_excluded() -> None:
    policy = make_policy("round_robin")
    load = LoadTracker()
    request = RouteRequest("m")
    assert [pick(policy.choose(request, fleet(), load)) for _ in range(4)] == [
        "r1",
        "r2",
        "r3",
        "r1",
    ]
    other = fleet(2, "other")
    assert pick(policy.choose(RouteRequest("other"), other, load)) == "r1"
    decision = policy.choose(request, fleet(), load, exclude=frozenset({"r2", "r3"}))
    assert decision is not None
    assert (decision.target.replica_id, decision.tier) == ("r1", "round_robin")


def test_least_load_picks_the_replica_with_fewest_in_flight() -> None:
    policy = make_policy("least_load")
    decision = policy.choose(RouteRequest("m"), fleet(), loaded(r1=3, r2=1, r3=2))
    assert decision is not None
    assert (decision.target.replica_id, decision.tier, decision.outcome) == ("r2", "load", "miss")


def test_least_load_spreads_a_burst_when_the_caller_acquires() -> None:
    policy = make_policy("least_load")
    load = LoadTracker()
    for _ in range(12):
        load.acquire(pick(policy.choose(RouteRequest("m"), fleet(), load)))
    assert load.snapshot() == {"r1": 4, "r2": 4, "r3": 4}


def test_least_load_rotates_ties_so_sequential_requests_spread() -> None:
    policy = make_policy("least_load")
    chosen = Counter(
        pick(policy.choose(RouteRequest("m"), fleet(), LoadTracker())) for _ in range(9)
    )
    assert chosen == {"r1": 3, "r2": 3, "r3": 3}


# --- session ---------------------------------------------------------------------------


def test_session_sticks_to_its_replica_whatever_the_load() -> None:
    policy = make_policy("session")
    first = policy.choose(RouteRequest("m", session="alice"), fleet(), LoadTracker())
    assert first is not None
    assert (first.tier, first.outcome) == ("affinity", "miss")
    busy = loaded(**{first.target.replica_id: 50})
    for _ in range(5):
        again = policy.choose(RouteRequest("m", session="alice"), fleet(), busy)
        assert again is not None
        assert (again.target, again.outcome) == (first.target, "hit")


def test_sessions_spread_and_only_the_departed_replicas_sessions_move() -> None:
    policy = make_policy("session")
    sessions = [f"user-{n}" for n in range(60)]
    before = {
        s: pick(policy.choose(RouteRequest("m", session=s), fleet(), LoadTracker()))
        for s in sessions
    }
    assert set(before.values()) == {"r1", "r2", "r3"}
    policy.forget("r2")
    survivors = tuple(t for t in fleet() if t.replica_id != "r2")
    after = {
        s: pick(policy.choose(RouteRequest("m", session=s), survivors, LoadTracker()))
        for s in sessions
    }
    for session in sessions:
        if before[session] != "r2":
            assert after[session] == before[session]
        else:
            assert after[session] in {"r1", "r3"}


def test_session_fallback_is_consistent_across_gateways() -> None:
    one, two = make_policy("session"), make_policy("session")
    for n in range(20):
        request = RouteRequest("m", session=f"s{n}")
        assert pick(one.choose(request, fleet(), LoadTracker())) == pick(
            two.choose(request, fleet(), loaded(r1=9))
        )


def test_session_moves_when_its_replica_leaves_the_candidates_or_is_excluded() -> None:
    policy = make_policy("session")
    home = pick(policy.choose(RouteRequest("m", session="bob"), fleet(), LoadTracker()))
    retry = policy.choose(
        RouteRequest("m", session="bob"), fleet(), LoadTracker(), exclude=frozenset({home})
    )
    assert retry is not None
    assert retry.target.replica_id != home
    again = policy.choose(RouteRequest("m", session="bob"), fleet(), LoadTracker())
    assert again is not None
    assert (again.target, again.outcome) == (retry.target, "hit")


def test_session_map_is_bounded() -> None:
    policy = SessionPolicy(max_sessions=2)
    for name in ("a", "b", "c"):
        policy.choose(RouteRequest("m", session=name), fleet(), LoadTracker())
    assert list(policy._pins) == ["b", "c"]


def test_no_session_routes_by_load() -> None:
    policy = make_policy("session")
    decision = policy.choose(RouteRequest("m"), fleet(), loaded(r1=2, r3=1))
    assert decision is not None
    assert (decision.target.replica_id, decision.tier) == ("r2", "load")


# --- prefix ----------------------------------------------------------------------------


def test_a_conversation_comes_back_to_the_replica_that_served_its_prefix() -> None:
    policy = prefix_policy()
    load = loaded(r1=1)  # r1 busy: the first turn goes elsewhere
    turn1 = SYSTEM + "user: what is a radix tree?"
    first = policy.choose(RouteRequest("m", turn1), fleet(), load)
    assert first is not None
    assert (first.target.replica_id, first.tier, first.outcome) == ("r2", "load", "miss")
    turn2 = turn1 + " assistant: a compressed trie. user: and its cost?"
    load.acquire("r2")  # r2 now the busiest (1 vs r1 1, r3 0): still wins on the prefix
    second = policy.choose(RouteRequest("m", turn2), fleet(), load)
    assert second is not None
    assert (second.target.replica_id, second.tier, second.outcome) == ("r2", "approximate", "hit")
    assert second.matched == pytest.approx(len(turn1) / len(turn2))


def test_a_small_common_start_is_a_miss_routed_by_load() -> None:
    policy = prefix_policy(min_share=0.1)
    policy.choose(RouteRequest("m", "Hi! " + "x" * 200), fleet(), LoadTracker())
    decision = policy.choose(RouteRequest("m", "Hi! " + "y" * 200), fleet(), loaded(r1=1))
    assert decision is not None
    assert (decision.tier, decision.outcome) == ("load", "miss")
    assert decision.target.replica_id == "r2"
    assert decision.matched == 0.0
    # the miss was recorded: the same prefix now hits r2, though r2 is the busiest
    again = policy.choose(RouteRequest("m", "Hi! " + "y" * 100 + "z"), fleet(), loaded(r2=1))
    assert again is not None
    assert (again.target.replica_id, again.outcome) == ("r2", "hit")


def test_misses_spread_new_prefixes_over_the_fleet_caches() -> None:
    policy = prefix_policy()
    chosen = [
        pick(
            policy.choose(RouteRequest("m", f"{n} " + "unique text " * 20), fleet(), LoadTracker())
        )
        for n in range(3)
    ]
    assert sorted(chosen) == ["r1", "r2", "r3"]


def test_the_guard_diverts_a_request_from_a_hot_replica() -> None:
    policy = prefix_policy(guard_abs=4, guard_rel=2.0)
    policy.choose(RouteRequest("m", SYSTEM + "q0"), fleet(), LoadTracker())  # r1 holds SYSTEM
    decision = policy.choose(RouteRequest("m", SYSTEM + "q1"), fleet(), loaded(r1=5, r3=1))
    assert decision is not None
    assert (decision.target.replica_id, decision.tier, decision.outcome) == (
        "r2",
        "load",
        "guarded",
    )
    # the diverted replica now holds the prefix too, so the next one is a hit there
    follow = policy.choose(RouteRequest("m", SYSTEM + "q2"), fleet(), loaded(r1=5, r2=1))
    assert follow is not None
    assert (follow.target.replica_id, follow.outcome) == ("r2", "hit")


def test_the_guard_is_per_request_not_a_fleet_wide_switch() -> None:
    policy = prefix_policy()
    other = "A different system prompt for another group of users. " * 20
    policy.choose(RouteRequest("m", SYSTEM + "q0"), fleet(), LoadTracker())  # → r1
    policy.choose(RouteRequest("m", other + "q0"), fleet(), loaded(r1=1))  # → r2
    load = loaded(r1=9, r2=2)  # r1 hot; r2 not
    hit = policy.choose(RouteRequest("m", other + "q1"), fleet(), load)
    assert hit is not None
    assert (hit.target.replica_id, hit.outcome) == ("r2", "hit")
    calm = policy.choose(RouteRequest("m", SYSTEM + "q1"), fleet(), loaded(r1=3))
    assert calm is not None
    assert (calm.target.replica_id, calm.outcome) == ("r1", "hit")


def test_the_guard_needs_both_the_absolute_and_the_relative_excess() -> None:
    policy = prefix_policy(guard_abs=4, guard_rel=2.0)
    policy.choose(RouteRequest("m", SYSTEM + "q0"), fleet(), LoadTracker())  # → r1
    # 12 vs 7: five more (> 4) but less than twice as many: r1 keeps the request
    decision = policy.choose(RouteRequest("m", SYSTEM + "q1"), fleet(), loaded(r1=12, r2=7, r3=7))
    assert decision is not None
    assert (decision.target.replica_id, decision.outcome) == ("r1", "hit")
    # 15 vs 7: more than twice as many and > 4 more: refused
    decision = policy.choose(RouteRequest("m", SYSTEM + "q2"), fleet(), loaded(r1=15, r2=7, r3=7))
    assert decision is not None
    assert decision.outcome == "guarded"
    assert decision.target.replica_id != "r1"


def test_a_burst_sharing_one_prefix_spreads_over_the_fleet() -> None:
    policy = prefix_policy()
    load = LoadTracker()
    outcomes: Counter[str] = Counter()
    for n in range(30):
        decision = policy.choose(RouteRequest("m", SYSTEM + f"question {n}"), fleet(), load)
        assert decision is not None
        load.acquire(decision.target.replica_id)
        outcomes[decision.outcome] += 1
    counts = load.snapshot()
    assert set(counts) == {"r1", "r2", "r3"}
    assert max(counts.values()) - min(counts.values()) <= 5
    assert outcomes["hit"] > outcomes["guarded"] > 0


def test_equal_matches_go_to_less_load_then_to_the_smaller_id() -> None:
    policy = prefix_policy()
    tree = policy.tree("m")
    for replica_id in ("r1", "r2", "r3"):
        tree.insert(SYSTEM, replica_id, 0.0)
    assert pick(policy.choose(RouteRequest("m", SYSTEM + "x"), fleet(), loaded(r1=1))) == "r2"
    assert pick(policy.choose(RouteRequest("m", SYSTEM + "y"), fleet(), LoadTracker())) == "r1"


def test_exclude_takes_the_next_best_match() -> None:
    policy = prefix_policy()
    tree = policy.tree("m")
    tree.insert(SYSTEM + "long shared history", "r1", 0.0)
    tree.insert(SYSTEM, "r3", 0.0)
    request = RouteRequest("m", SYSTEM + "long shared history, continued")
    assert pick(policy.choose(request, fleet(), LoadTracker())) == "r1"
    retry = policy.choose(request, fleet(), LoadTracker(), exclude=frozenset({"r1"}))
    assert retry is not None
    assert (retry.target.replica_id, retry.outcome) == ("r3", "hit")


def test_forget_drops_a_replica_from_the_tree() -> None:
    policy = prefix_policy()
    policy.choose(RouteRequest("m", SYSTEM + "q0"), fleet(), LoadTracker())  # → r1
    policy.forget("r1")
    decision = policy.choose(RouteRequest("m", SYSTEM + "q1"), fleet(), loaded(r2=1))
    assert decision is not None
    assert (decision.target.replica_id, decision.outcome) == ("r1", "miss")
    assert policy.tree("m").replica_chars("r1") == len(SYSTEM + "q1")


def test_trees_are_per_model() -> None:
    policy = prefix_policy()
    policy.choose(RouteRequest("a", SYSTEM), fleet(model="a"), LoadTracker())
    decision = policy.choose(RouteRequest("b", SYSTEM), fleet(model="b"), loaded(r1=1))
    assert decision is not None
    assert (decision.target.replica_id, decision.outcome) == ("r2", "miss")


def test_a_request_without_text_routes_by_load_and_records_nothing() -> None:
    policy = prefix_policy()
    decision = policy.choose(RouteRequest("m"), fleet(), loaded(r1=1, r2=1))
    assert decision is not None
    assert (decision.target.replica_id, decision.tier, decision.matched) == ("r3", "load", 0.0)
    assert policy.tree("m").size == 0


def test_prefix_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="min_share"):
        PrefixConfig(min_share=1.5)
    with pytest.raises(ValueError, match="guard_rel"):
        PrefixConfig(guard_rel=0.5)
    with pytest.raises(ValueError, match="max_chars_per_replica"):
        PrefixConfig(max_chars_per_replica=0)


# --- the per-replica capacity ------------------------------------------------------------


def test_replica_capacity_reaches_every_tree_now_and_later() -> None:
    policy = prefix_policy()
    assert policy.config.max_chars_per_replica == DEFAULT_MAX_CHARS_PER_REPLICA
    before = policy.tree("a")
    policy.set_replica_capacity("r1", 5_000)
    assert before.replica_limit("r1") == policy.tree("b").replica_limit("r1") == 5_000
    assert before.replica_limit("r2") == DEFAULT_MAX_CHARS_PER_REPLICA
    policy.forget("r1")
    assert policy.tree("c").replica_limit("r1") == 5_000  # the engine's size, kept
    policy.set_replica_capacity("r1", None)
    assert before.replica_limit("r1") == policy.tree("d").replica_limit("r1")
    assert before.replica_limit("r1") == DEFAULT_MAX_CHARS_PER_REPLICA


def test_a_replica_sized_to_its_cache_stops_claiming_what_it_evicted() -> None:
    other = "A different system prompt for another group of users. " * 20
    claims = {}
    for capacity in (None, len(SYSTEM) + len(other)):
        policy = prefix_policy()
        policy.set_replica_capacity("r1", capacity)
        assert pick(policy.choose(RouteRequest("m", SYSTEM + "q0"), fleet(), LoadTracker())) == "r1"
        busy = loaded(r2=3, r3=3)  # r1 takes the other group too, filling its cache
        assert pick(policy.choose(RouteRequest("m", other + "q0"), fleet(), busy)) == "r1"
        decision = policy.choose(RouteRequest("m", SYSTEM + "q1"), fleet(), loaded(r1=1))
        assert decision is not None
        claims[capacity] = (decision.target.replica_id, decision.outcome)
    assert claims[None] == ("r1", "hit")  # unbounded: still believes r1 holds SYSTEM
    assert claims[len(SYSTEM) + len(other)] == ("r2", "miss")  # r1 dropped its oldest


# --- prefix_decision: the scoring on plain values --------------------------------------


def test_prefix_decision_scores_shares_in_any_unit() -> None:
    in_tokens = prefix_decision(fleet(), {"r2": 600, "r3": 300}, {}, total=1_000)
    assert (in_tokens.target.replica_id, in_tokens.tier, in_tokens.outcome) == (
        "r2",
        "approximate",
        "hit",
    )
    assert in_tokens.matched == pytest.approx(0.6)
    as_shares = prefix_decision(fleet(), {"r2": 0.6, "r3": 0.3}, {})
    assert as_shares == in_tokens
    clamped = prefix_decision(fleet(), {"r1": 1_200}, {}, total=1_000)
    assert clamped.matched == 1.0


def test_prefix_decision_trades_share_for_load_and_guards_a_hot_replica() -> None:
    # 0.6 vs 0.5 share: r2 is 2 requests busier, costing 0.25 * 2 / 4 = 0.125 > 0.1
    decision = prefix_decision(fleet(), {"r1": 0.5, "r2": 0.6}, {"r2": 2})
    assert (decision.target.replica_id, decision.outcome) == ("r1", "hit")
    guarded = prefix_decision(fleet(), {"r1": 0.9}, {"r1": 5, "r3": 1})
    assert (guarded.target.replica_id, guarded.tier, guarded.outcome) == ("r2", "load", "guarded")


def test_prefix_decision_misses_by_load_then_by_what_replicas_hold() -> None:
    held = {"r1": 10, "r2": 500, "r3": 20}
    decision = prefix_decision(fleet(), {"r2": 0.05}, {"r1": 1}, cached=held.__getitem__)
    assert (decision.target.replica_id, decision.tier, decision.outcome) == ("r3", "load", "miss")
    assert prefix_decision(fleet(), {}, {}, cached=held.__getitem__).target.replica_id == "r1"
    assert prefix_decision(fleet(), {}, {}).target.replica_id == "r1"


def test_prefix_decision_reads_what_replicas_hold_only_on_a_miss() -> None:
    def unreadable(replica_id: str) -> int:
        raise AssertionError(f"read {replica_id} on a hit")

    decision = prefix_decision(fleet(), {"r3": 0.8}, {}, cached=unreadable)
    assert decision.target.replica_id == "r3"


def test_prefix_decision_refuses_no_candidates_and_an_empty_total() -> None:
    with pytest.raises(ValueError, match="no candidate"):
        prefix_decision((), {}, {})
    with pytest.raises(ValueError, match="total"):
        prefix_decision(fleet(), {}, {}, total=0)


def test_the_prefix_policy_decides_exactly_as_prefix_decision() -> None:
    policy = prefix_policy()
    load = LoadTracker()
    for n in range(40):
        text = (SYSTEM if n % 3 else "other " * 200) + f"question {n % 7}"
        tree = policy.tree("m")
        loads = load.snapshot()
        expected = prefix_decision(
            fleet(),
            tree.match(text),
            loads,
            policy.config,
            total=len(text),
            cached=tree.replica_chars,
        )
        assert policy.choose(RouteRequest("m", text), fleet(), load) == expected
        load.acquire(expected.target.replica_id)
        if n % 4 == 3:
            load.release(expected.target.replica_id)
