"""llmgw.server.core.tenantsplit: a key's budget split between gateways."""

from __future__ import annotations

import random

import pytest

from llmgw.api.llmgw.v1 import KeyWindow, TenantKey
from llmgw.server.core.tenantsplit import FleetSplit, split_budget


def test_split_budget_never_exceeds_the_limit_and_keeps_what_was_used() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        n = rng.randrange(1, 6)
        limit = rng.randrange(1, 500)
        used = [rng.randrange(0, limit // n + 2) for _ in range(n)]
        demand = [rng.choice([0.0, rng.random() * 10]) for _ in range(n)]
        parts = split_budget(limit, used, demand)
        assert all(p >= u for p, u in zip(parts, used, strict=True))
        if sum(used) <= limit:
            assert sum(parts) == limit
        else:
            assert parts == used


def test_the_room_goes_by_demand_with_a_reserve_for_the_idle() -> None:
    assert split_budget(100, [0, 0], [0.0, 0.0]) == [50, 50]
    busy, idle = split_budget(100, [0, 0], [9.0, 0.0])
    assert busy == 90 and idle == 10  # reserve 0.2 → 10 each, 80 by demand
    a, b = split_budget(30, [15, 0], [1.0, 1.0])
    assert a + b == 30 and a >= 15


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="same gateways"):
        split_budget(10, [1], [])


class Clock:
    now = 0.0


KEY = TenantKey(key_id="k", rpm=60, tpm=6000)


def window(requests: int = 0, asked: int = 0, tokens: int = 0) -> KeyWindow:
    return KeyWindow(key_id="k", requests=requests, asked_requests=asked, tokens=tokens)


def test_two_gateways_split_and_the_busy_one_gets_more() -> None:
    clock = Clock()
    split = FleetSplit(clock=lambda: clock.now)
    [a0] = split.take("a", [window()], 2.0, [KEY])
    assert a0.rpm == 60 and a0.whole  # alone
    [b0] = split.take("b", [window()], 2.0, [KEY])
    assert b0.rpm == 0 and not b0.whole  # "a" may still use all 60 until its next report
    clock.now = 1.0
    [a0] = split.take("a", [window()], 2.0, [KEY])
    [b0] = split.take("b", [window()], 2.0, [KEY])
    assert (a0.rpm, b0.rpm) == (30, 30)  # each its share once both reported
    clock.now = 2.0
    [a1] = split.take("a", [window(requests=20, asked=40)], 2.0, [KEY])
    assert a1.rpm == 30  # its share is more, but "b" may still use its 30
    [b1] = split.take("b", [window()], 2.0, [KEY])
    assert 1 <= b1.rpm < 10  # "b" gives its room back to the busy one...
    clock.now = 3.0
    [a2] = split.take("a", [window(requests=20, asked=41)], 2.0, [KEY])
    assert a2.rpm > 40 and a2.rpm + b1.rpm <= 60  # ...which takes it at its next report


def test_a_silent_gateway_keeps_its_part_for_a_minute_then_it_is_forgotten() -> None:
    clock = Clock()
    split = FleetSplit(clock=lambda: clock.now)
    split.take("a", [window(requests=40, asked=40)], 1.0, [KEY])
    clock.now = 10.0  # "a" silent for 10 intervals
    [b] = split.take("b", [window()], 1.0, [KEY])
    assert b.rpm == 0 and not b.whole  # cut off, "a" may still admit its whole 60
    clock.now = 80.0  # a minute on: its requests left the window
    [b] = split.take("b", [window()], 1.0, [KEY])
    assert b.rpm == 60 and b.whole


def test_keys_without_limits_and_foreign_windows_are_left_out() -> None:
    split = FleetSplit(clock=lambda: 0.0)
    free = TenantKey(key_id="free")
    foreign = KeyWindow(key_id="nobody", requests=5)
    out = split.take("a", [foreign], 1.0, [free, KEY])
    assert [x.key_id for x in out] == ["k"] and out[0].whole


def test_gateways_kept_are_bounded() -> None:
    split = FleetSplit(clock=lambda: 0.0, max_gateways=3)
    for i in range(10):
        split.take(f"g{i}", [], 1.0, [KEY])
    assert len(split._gateways) == 3
