"""llmgw.gateway.flow: bands strictly, tenants of a band by virtual token counters, bounds."""

from __future__ import annotations

import random

import pytest

from llmgw.gateway.flow import FlowItem, FlowScheduler

INTERACTIVE, BATCH = 0, 1


def item(tenant: str, band: int = BATCH, cost: int = 100, at: float = 0.0) -> FlowItem:
    return FlowItem(tenant, band, cost, at)


def test_interactive_always_goes_before_batch_whatever_came_first() -> None:
    s = FlowScheduler(max_queued=100)
    for i in range(5):
        s.push(item("b", BATCH, at=i))
    s.push(item("i", INTERACTIVE, at=9))
    assert s.next_band() == INTERACTIVE
    first = s.pop()
    assert first is not None and first.tenant == "i"
    assert s.next_band() == BATCH and len(s) == 5


def test_a_tenant_is_served_in_its_order_of_arrival() -> None:
    s = FlowScheduler(max_queued=10)
    items = [item("a", at=i) for i in range(3)]
    for x in items:
        s.push(x)
    assert [s.pop() for _ in range(3)] == items
    assert s.pop() is None and s.next_band() is None


def _serve(s: FlowScheduler, rounds: int) -> dict[str, float]:
    """Pop and charge ``rounds`` times, each tenant refilled as in a flood."""
    served: dict[str, float] = {}
    for _ in range(rounds):
        got = s.pop()
        assert got is not None
        s.charge(got.tenant, got.band, got.cost)
        served[got.tenant] = served.get(got.tenant, 0.0) + got.cost
        s.push(item(got.tenant, got.band, got.cost))
    return served


def test_two_flooding_tenants_get_equal_tokens_not_equal_requests() -> None:
    s = FlowScheduler(max_queued=1000)
    for _ in range(50):
        s.push(item("small", cost=100))
        s.push(item("large", cost=400))
    served = _serve(s, 2000)
    total, squares = sum(served.values()), sum(v * v for v in served.values())
    jain = total * total / (len(served) * squares)
    assert jain >= 0.99


def test_idling_earns_no_credit() -> None:
    s = FlowScheduler(max_queued=1000)
    for _ in range(10):
        s.push(item("old"))
    _serve(s, 500)  # "old" alone: its counter grows to 50,000
    for _ in range(10):
        s.push(item("new"))
    assert s.counter("new", BATCH) == s.counter("old", BATCH)  # lifted, not from 0
    served = _serve(s, 200)
    assert abs(served["new"] - served["old"]) <= 200  # shared, not 500 rounds to "new"


def test_a_correction_after_the_answer_moves_the_counter() -> None:
    s = FlowScheduler(max_queued=10)
    s.charge("a", BATCH, 100)
    s.charge("a", BATCH, -60)
    assert s.counter("a", BATCH) == 40


def test_removed_requests_are_skipped_and_not_counted() -> None:
    s = FlowScheduler(max_queued=10)
    a, b, c = item("t"), item("t"), item("u")
    for x in (a, b, c):
        s.push(x)
    s.remove(b)
    s.remove(b)  # idempotent
    s.remove(c)
    assert len(s) == 1 and s.waiting(BATCH) == 1
    assert s.pop() is a and s.pop() is None


def test_the_queue_is_bounded() -> None:
    s = FlowScheduler(max_queued=2)
    assert s.push(item("a")) and s.push(item("b"))
    assert not s.push(item("c"))
    assert len(s) == 2


def test_counters_of_idle_tenants_are_forgotten_past_the_bound() -> None:
    s = FlowScheduler(max_queued=10, max_tenants=4)
    s.push(item("kept"))
    for i in range(20):
        s.charge(f"t{i}", BATCH, 1)
    assert len(s._counters) <= 4
    assert (BATCH, "kept") in s._counters  # backlogged: never forgotten


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="max_queued"):
        FlowScheduler(max_queued=-1)


def test_random_operations_keep_the_counts_true() -> None:
    rng = random.Random(7)
    s = FlowScheduler(max_queued=50)
    live: list[FlowItem] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.5:
            x = item(f"t{rng.randrange(5)}", rng.randrange(2), rng.randrange(1, 500))
            if s.push(x):
                live.append(x)
        elif op < 0.8:
            got = s.pop()
            if got is not None:
                assert got in live and got.band == min(x.band for x in live)
                live.remove(got)
        elif live:
            x = rng.choice(live)
            s.remove(x)
            live.remove(x)
        assert len(s) == len(live)
