"""The approximate prefix tree: matching, edge splits, eviction by size and age.

The property tests compare the tree with brute force over the texts it should still hold
and walk its structural invariants after every operation.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.gateway.routing.prefix_tree import PrefixTree, _Node

REPLICAS = ("r0", "r1", "r2")
texts = st.text(alphabet="abc", max_size=14)
inserts = st.lists(st.tuples(texts, st.sampled_from(REPLICAS)), max_size=30)


def lcp(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def brute(probe: str, served: list[tuple[str, str]]) -> dict[str, int]:
    """Per replica, the longest common prefix of `probe` with any text it served."""
    best: dict[str, int] = {}
    for text, replica in served:
        n = lcp(probe, text)
        if n:
            best[replica] = max(best.get(replica, 0), n)
    return best


def check_invariants(tree: PrefixTree) -> None:
    root: _Node = tree._root
    assert root.replicas == {}
    size = 0
    chars: dict[str, int] = {}
    holding: dict[str, set[int]] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            assert child.edge and child.edge[0] == first
            assert child.parent is node
            assert child.replicas, "an empty node must have been unlinked"
            for replica, seen in child.replicas.items():
                if node is not root:
                    assert replica in node.replicas
                    assert node.replicas[replica] >= seen
                chars[replica] = chars.get(replica, 0) + len(child.edge)
                holding.setdefault(replica, set()).add(id(child))
            size += len(child.edge)
            stack.append(child)
    assert tree.size == size
    for replica in REPLICAS:
        assert tree.replica_chars(replica) == chars.get(replica, 0)
        assert tree.replica_chars(replica) <= tree.replica_limit(replica)
        # the per-replica walk visits exactly the replica's nodes, parents first
        walked = list(tree._replica_nodes(replica))
        assert {id(node) for node in walked} == holding.get(replica, set())
        seen_ids = {id(root)}
        for node in walked:
            assert node.parent is not None and id(node.parent) in seen_ids
            seen_ids.add(id(node))
        tails = {
            id(n) for n in walked if not any(replica in c.replicas for c in n.children.values())
        }
        assert {id(node) for node in tree._replica_leaves(replica)} == tails
    assert tree.replicas() == frozenset(chars)


def probes_for(served: list[tuple[str, str]]) -> list[str]:
    found = {"", "a", "abcabc", "cccccccccccccc"}
    for text, _ in served:
        found.update({text, text + "a", text[:-1], text[: len(text) // 2] + "c"})
    return sorted(found)


# --- plain behaviour -------------------------------------------------------------------


def test_match_reports_leading_characters_served_per_replica() -> None:
    tree = PrefixTree()
    tree.insert("hello world", "r1", 1.0)
    tree.insert("hello there", "r2", 2.0)
    assert tree.match("hello world, again") == {"r1": 11, "r2": 6}
    assert tree.match("help") == {"r1": 3, "r2": 3}
    assert tree.match("hello") == {"r1": 5, "r2": 5}
    assert tree.match("goodbye") == {}
    assert tree.match("") == {}
    check_invariants(tree)


def test_divergence_splits_the_edge_and_keeps_both_branches() -> None:
    tree = PrefixTree()
    tree.insert("hello world", "r1", 1.0)
    tree.insert("hello there", "r2", 2.0)
    (shared,) = tree._root.children.values()
    assert shared.edge == "hello "
    assert shared.replicas == {"r1": 1.0, "r2": 2.0}
    assert sorted(child.edge for child in shared.children.values()) == ["there", "world"]
    assert tree.size == len("hello ") + len("world") + len("there")
    check_invariants(tree)


def test_a_text_ending_inside_an_edge_claims_only_its_own_length() -> None:
    tree = PrefixTree()
    tree.insert("abcdef", "r1", 1.0)
    tree.insert("abc", "r2", 2.0)
    assert tree.match("abcdef") == {"r1": 6, "r2": 3}
    assert tree.replica_chars("r2") == 3
    assert tree.size == 6
    check_invariants(tree)


def test_extending_a_conversation_appends_one_edge() -> None:
    tree = PrefixTree()
    turn1 = "system prompt. user: hi"
    turn2 = turn1 + " assistant: hello. user: how are you?"
    tree.insert(turn1, "r1", 1.0)
    tree.insert(turn2, "r1", 2.0)
    assert tree.match(turn2 + " more") == {"r1": len(turn2)}
    assert tree.size == len(turn2)
    check_invariants(tree)


def test_non_ascii_text_is_matched_by_character() -> None:
    tree = PrefixTree()
    tree.insert("système: héllo 🙂 wörld", "r1", 1.0)
    assert tree.match("système: héllo 🙂 x") == {"r1": len("système: héllo 🙂 ")}


def test_remove_replica_drops_its_entries_and_frees_unshared_edges() -> None:
    tree = PrefixTree()
    tree.insert("shared prefix one", "r1", 1.0)
    tree.insert("shared prefix two", "r2", 1.0)
    tree.remove_replica("r1")
    assert tree.match("shared prefix one") == {"r2": len("shared prefix ")}
    assert tree.replica_chars("r1") == 0
    assert tree.size == len("shared prefix two")
    tree.remove_replica("unknown")
    check_invariants(tree)


def test_size_eviction_drops_the_least_recently_used_leaf_first() -> None:
    tree = PrefixTree(max_chars=30, low_watermark=1.0)
    tree.insert("a" * 10, "r1", 1.0)
    tree.insert("b" * 10, "r1", 2.0)
    tree.insert("c" * 10, "r2", 3.0)
    tree.insert("a" * 10, "r1", 4.0)  # touched again: now the newest but one
    tree.insert("d" * 10, "r1", 5.0)  # 40 > 30: the oldest leaf ("b", t=2) goes
    assert tree.match("b" * 10) == {}
    assert tree.match("a" * 10) == {"r1": 10}
    assert tree.match("c" * 10) == {"r2": 10}
    assert tree.match("d" * 10) == {"r1": 10}
    assert tree.size == 30
    check_invariants(tree)


def test_size_eviction_trims_branch_tails_before_the_shared_prefix() -> None:
    system = "S" * 50
    tree = PrefixTree(max_chars=100, low_watermark=0.8)
    questions = [chr(ord("A") + turn) * 20 for turn in range(10)]
    for turn, question in enumerate(questions):
        tree.insert(system + question, "r1", float(turn))
    assert tree.size <= 100
    assert tree.match(system + questions[-1]) == {"r1": len(system) + 20}
    assert tree.match(system + questions[0]) == {"r1": len(system)}
    check_invariants(tree)


def test_size_eviction_lowers_to_the_watermark() -> None:
    tree = PrefixTree(max_chars=100, low_watermark=0.5)
    for index in range(11):
        tree.insert(chr(ord("A") + index) * 10, "r1", float(index))
    assert tree.size <= 50
    assert tree.match("K" * 10) == {"r1": 10}
    check_invariants(tree)


def test_a_replica_over_its_cap_loses_its_own_oldest_leaves_only() -> None:
    tree = PrefixTree(max_chars=1_000, max_chars_per_replica=30, low_watermark=1.0)
    tree.insert("x" * 10, "r2", 0.0)  # older than everything r1 inserts
    for when, letter in enumerate("abc", start=1):
        tree.insert(letter * 10, "r1", float(when))
    tree.insert("a" * 10, "r1", 4.0)  # touched again: "b" (t=2) is now r1's oldest
    tree.insert("d" * 10, "r1", 5.0)  # r1 at 40 > 30: "b" goes, r2's older "x" stays
    assert tree.match("b" * 10) == {}
    assert tree.match("x" * 10) == {"r2": 10}
    assert [tree.match(c * 10) for c in "acd"] == [{"r1": 10}] * 3
    assert (tree.replica_chars("r1"), tree.replica_chars("r2"), tree.size) == (30, 10, 40)
    check_invariants(tree)


def test_a_replicas_cap_trims_its_tails_and_keeps_a_prefix_others_share() -> None:
    system = "S" * 50
    tree = PrefixTree(max_chars_per_replica=100, low_watermark=0.8)
    tree.insert(system + "r2's own question", "r2", 0.0)
    for turn in range(10):
        tree.insert(system + chr(ord("A") + turn) * 20, "r1", float(turn + 1))
        assert tree.replica_chars("r1") <= 100
    assert tree.match(system + "J" * 20) == {"r1": 70, "r2": 50}
    assert tree.match(system + "A" * 20) == {"r1": 50, "r2": 50}  # r1 keeps the prefix
    assert tree.match(system + "r2's own question") == {"r1": 50, "r2": 67}
    check_invariants(tree)


def test_set_replica_limit_trims_at_once_and_none_restores_the_default() -> None:
    tree = PrefixTree(max_chars=200, max_chars_per_replica=100, low_watermark=1.0)
    for when, letter in enumerate("abcde"):
        tree.insert(letter * 20, "r1", float(when))
    tree.insert("z" * 20, "r2", 0.0)
    assert tree.replica_chars("r1") == 100
    tree.set_replica_limit("r1", 50)
    assert tree.replica_limit("r1") == 50
    assert tree.replica_chars("r1") == 40  # whole leaves, oldest first: a, b, c gone
    assert tree.match("c" * 20) == {} and tree.match("d" * 20) == {"r1": 20}
    assert tree.match("z" * 20) == {"r2": 20}
    tree.set_replica_limit("r1", 10_000)
    assert tree.replica_limit("r1") == 200  # never above the whole tree's bound
    tree.remove_replica("r1")
    assert tree.replica_limit("r1") == 200  # a fact about the replica: kept
    tree.set_replica_limit("r1", None)
    assert tree.replica_limit("r1") == 100
    check_invariants(tree)


def test_a_text_longer_than_the_replicas_cap_is_stored_truncated_to_it() -> None:
    tree = PrefixTree(max_chars=100, max_chars_per_replica=50)
    tree.set_replica_limit("r2", 8)
    tree.insert("abcdefghijkl", "r2", 1.0)
    tree.insert("abcdefghijkl" * 10, "r1", 2.0)
    assert tree.match("abcdefghijkl" * 10) == {"r1": 50, "r2": 8}
    assert tree.size == 50
    check_invariants(tree)


def test_a_text_longer_than_the_tree_is_stored_truncated() -> None:
    tree = PrefixTree(max_chars=8)
    tree.insert("x" * 5, "r2", 1.0)
    tree.insert("abcdefghijkl", "r1", 2.0)
    assert tree.size == 8
    assert tree.match("abcdefghijkl") == {"r1": 8}
    assert tree.match("xxxxx") == {}
    check_invariants(tree)


def test_age_eviction_drops_entries_not_touched_for_max_age() -> None:
    tree = PrefixTree(max_age_s=100.0, sweep_interval_s=10.0)
    tree.insert("common old", "r1", 0.0)
    tree.insert("common new", "r1", 50.0)
    tree.insert("common new", "r2", 80.0)
    tree.evict_expired(120.0)  # cutoff 20: "old" tail goes, the shared "common " stays
    assert tree.match("common old") == {"r1": len("common "), "r2": len("common ")}
    tree.evict_expired(170.0)  # cutoff 70: r1's entries all go, r2's stay
    assert tree.match("common new") == {"r2": len("common new")}
    tree.evict_expired(500.0)
    assert tree.size == 0
    assert tree.replicas() == frozenset()
    check_invariants(tree)


def test_insert_sweeps_expired_entries_at_most_every_interval() -> None:
    tree = PrefixTree(max_age_s=100.0, sweep_interval_s=30.0)
    tree.insert("first", "r1", 0.0)  # sweeps (first call), next sweep at 30
    tree.insert("second", "r1", 101.0)  # sweeps: "first" (t=0) is older than 1
    assert tree.match("first") == {}
    tree.insert("third", "r1", 120.0)  # no sweep before 131
    tree.insert("x", "r2", 205.0)  # sweeps: cutoff 105 drops "second" (t=101)
    assert tree.match("second") == {}
    assert tree.match("third") == {"r1": 5}


def test_time_going_backwards_keeps_the_latest_touch() -> None:
    tree = PrefixTree()
    tree.insert("abc", "r1", 10.0)
    tree.insert("abcd", "r1", 5.0)
    (node,) = tree._root.children.values()
    assert node.replicas["r1"] == 10.0
    check_invariants(tree)


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="max_chars"):
        PrefixTree(max_chars=0)
    with pytest.raises(ValueError, match="max_age_s"):
        PrefixTree(max_age_s=0.0)
    with pytest.raises(ValueError, match="limit must be >= 1"):
        PrefixTree(max_chars_per_replica=0)
    with pytest.raises(ValueError, match="limit must be >= 1"):
        PrefixTree().set_replica_limit("r1", 0)


# --- properties against brute force ----------------------------------------------------


@given(inserts)
def test_match_equals_brute_force_without_eviction(ops: list[tuple[str, str]]) -> None:
    tree = PrefixTree()
    for step, (text, replica) in enumerate(ops):
        tree.insert(text, replica, float(step))
        check_invariants(tree)
    for probe in probes_for(ops):
        assert tree.match(probe) == brute(probe, ops)


@given(inserts, st.integers(min_value=1, max_value=8))
def test_age_sweep_keeps_exactly_the_fresh_texts(ops: list[tuple[str, str]], max_age: int) -> None:
    tree = PrefixTree(max_age_s=float(max_age), sweep_interval_s=0.0)
    for step, (text, replica) in enumerate(ops):
        tree.insert(text, replica, float(step))
        check_invariants(tree)
        fresh = [op for when, op in enumerate(ops[: step + 1]) if when >= step - max_age]
        for probe in probes_for(fresh):
            assert tree.match(probe) == brute(probe, fresh)


@settings(max_examples=150)
@given(
    inserts,
    st.integers(min_value=1, max_value=40),
    st.sampled_from([0.0, 0.5, 0.9, 1.0]),
)
def test_size_eviction_keeps_invariants_and_the_newest_text(
    ops: list[tuple[str, str]], max_chars: int, watermark: float
) -> None:
    tree = PrefixTree(max_chars=max_chars, max_chars_per_replica=None, low_watermark=watermark)
    for step, (text, replica) in enumerate(ops):
        tree.insert(text, replica, float(step))
        check_invariants(tree)
        assert tree.size <= max_chars
        kept = text[:max_chars]
        assert tree.match(kept).get(replica, 0) == len(kept)
    # What each replica still holds of each of its texts explains every match: the tree
    # keeps, per replica, a union of prefixes of texts it served, and nothing else.
    retained = [(text[: tree.match(text).get(replica, 0)], replica) for text, replica in ops]
    for probe in probes_for(ops):
        assert tree.match(probe) == brute(probe, [(t, r) for t, r in retained if t])


caps = st.dictionaries(st.sampled_from(REPLICAS), st.integers(min_value=1, max_value=20))


@settings(max_examples=150)
@given(
    st.lists(st.tuples(texts, st.sampled_from(REPLICAS), st.booleans()), max_size=30),
    caps,
    st.sampled_from([None, 6, 12]),
    st.sampled_from([0.0, 0.5, 0.9, 1.0]),
)
def test_per_replica_caps_bound_each_replica_and_touch_no_other(
    ops: list[tuple[str, str, bool]],
    limits: dict[str, int],
    default: int | None,
    watermark: float,
) -> None:
    # max_chars far above the caps' sum: only the per-replica bound evicts here.
    tree = PrefixTree(max_chars=1_000, max_chars_per_replica=default, low_watermark=watermark)
    for replica, chars in limits.items():
        tree.set_replica_limit(replica, chars)
    served: list[tuple[str, str]] = []
    for step, (text, replica, lower_cap_after) in enumerate(ops):
        others = {r for r in REPLICAS if r != replica}
        probes = probes_for(served)
        before = [{r: n for r, n in tree.match(p).items() if r in others} for p in probes]
        tree.insert(text, replica, float(step))
        served.append((text, replica))
        check_invariants(tree)
        after = [{r: n for r, n in tree.match(p).items() if r in others} for p in probes]
        assert after == before, "a replica's cap evicted another replica's entries"
        kept = text[: tree.replica_limit(replica)]
        assert tree.match(kept).get(replica, 0) == len(kept)
        if lower_cap_after:  # a cap lowered at once trims that replica only
            probes = probes_for(served)
            before = [{r: n for r, n in tree.match(p).items() if r in others} for p in probes]
            tree.set_replica_limit(replica, max(1, tree.replica_chars(replica) // 2))
            check_invariants(tree)
            after = [{r: n for r, n in tree.match(p).items() if r in others} for p in probes]
            assert after == before
    retained = [(text[: tree.match(text).get(replica, 0)], replica) for text, replica in served]
    for probe in probes_for(served):
        assert tree.match(probe) == brute(probe, [(t, r) for t, r in retained if t])


# --- cost ------------------------------------------------------------------------------


def test_matching_a_long_shared_prefix_is_cheap() -> None:
    """Loose bound only (shared CI cores); the figure itself comes from the reply/bench."""
    system = "".join(f"rule {n}: be helpful and precise. " for n in range(700))[:24_000]
    tree = PrefixTree()
    for user in range(50):
        conversation = system
        for turn in range(4):
            conversation += f" user {user} turn {turn}: " + "q" * 300 + " answer: " + "a" * 200
            tree.insert(conversation, f"r{user % 4}", float(user * 10 + turn))
    prompt = system + " a new user asks: " + "z" * 6_000
    rounds = 200
    start = time.perf_counter()
    for _ in range(rounds):
        served = tree.match(prompt)
    per_match = (time.perf_counter() - start) / rounds
    assert served == {f"r{n}": len(system) + 1 for n in range(4)}
    assert per_match < 0.002
