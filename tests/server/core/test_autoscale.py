"""The autoscaler's planner (``plan``) and the GPU budget (``share_budget``), as values."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.api.llmgw.v1 import AutoscalePolicy
from llmgw.server.core.autoscale import (
    ADVISE,
    Claim,
    Current,
    Decision,
    Memory,
    Policy,
    Signals,
    Tuning,
    plan,
)
from llmgw.server.core.autoscale_budget import share_budget

POLICY = Policy(min=1, max=8, ttft_p90_ms=800.0, scale_down_after_s=300.0)
ON_TARGET = Signals(ttft_p90_ms=500.0, samples=100, arrival_rps=4.0, in_flight=4)
LOW = Signals(ttft_p90_ms=200.0, samples=100, arrival_rps=1.0, in_flight=1)
IDLE = Signals()


def _steady(count: int) -> Current:
    return Current(count=count, ready=count, coming=0, gpus_per_replica=1)


def _run(policy: Policy, signals: Signals, current: Current, start: float, end: float,
         step: float = 5.0, memory: Memory | None = None) -> list[Decision]:  # fmt: skip
    """Rounds every ``step`` s from ``start`` to ``end`` under the same window, the count
    following each decision at once (every replica READY at once)."""
    out: list[Decision] = []
    memory = memory or Memory()
    now = start
    while now <= end:
        decision = plan(policy, signals, current, memory, now)
        out.append(decision)
        memory = decision.memory
        current = replace(current, count=decision.desired, ready=decision.desired)
        now += step
    return out


def test_from_proto_reads_every_field_and_defaults_the_mode() -> None:
    proto = AutoscalePolicy(min=0, max=4, ttft_p90_ms=800, itl_p90_ms=50, scale_down_after_s=60)
    assert Policy.from_proto(proto) == Policy(0, 4, 800.0, 50.0, 60.0, "act")
    assert Policy.from_proto(AutoscalePolicy(max=1, mode=ADVISE)).mode == ADVISE


def test_over_target_scales_up_at_once_in_proportion_bounded_by_the_step() -> None:
    hot = Signals(ttft_p90_ms=1240.0, samples=50, arrival_rps=5.0, in_flight=9)
    decision = plan(POLICY, hot, _steady(2), Memory(), now=10.0)
    assert (decision.desired, decision.reason) == (4, "scale_up")  # ceil(2 × 1240/800)
    assert decision.signal == "ttft_p90_ms=1240"
    assert "ttft p90 1240 ms over target 800 ms on 2" in decision.message
    very_hot = replace(hot, ttft_p90_ms=8000.0)
    assert plan(POLICY, very_hot, _steady(2), Memory(), now=10.0).desired == 4  # at most × 2
    unbounded = Tuning(max_ratio=100.0)
    assert plan(POLICY, very_hot, _steady(2), Memory(), 10.0, unbounded).desired == 2 + 4
    assert plan(POLICY, very_hot, _steady(7), Memory(), now=10.0).desired == 8  # max


def test_at_max_over_target_holds_and_says_so() -> None:
    hot = Signals(ttft_p90_ms=1240.0, samples=50, arrival_rps=5.0)
    decision = plan(POLICY, hot, _steady(8), Memory(), now=10.0)
    assert (decision.desired, decision.reason) == (8, "hold")
    assert "at max 8" in decision.message


def test_itl_target_alone_drives_the_count() -> None:
    policy = Policy(min=1, max=8, itl_p90_ms=50.0)
    slow = Signals(ttft_p90_ms=9000.0, itl_p90_ms=80.0, samples=50, arrival_rps=2.0)
    decision = plan(policy, slow, _steady(2), Memory(), now=1.0)
    assert (decision.desired, decision.signal) == (4, "itl_p90_ms=80")


def test_engines_queueing_scales_up_before_the_percentiles_show_it() -> None:
    queued = replace(ON_TARGET, engine_waiting=3, engine_running=6)
    decision = plan(POLICY, queued, _steady(2), Memory(), now=1.0)
    assert decision.memory.extra["slots"] == 3.0  # 6 running on 2 while they queue
    assert (decision.desired, decision.reason) == (4, "scale_up")  # 9 on hand / (0.85 × 3)
    assert decision.signal == "in_flight=9"
    no_slots = Tuning(busy_util=100.0)
    decision = plan(POLICY, queued, _steady(2), Memory(), 1.0, no_slots)
    assert (decision.desired, decision.signal) == (3, "engine_waiting=3")


def test_learned_slots_size_the_count_for_what_is_on_hand() -> None:
    memory = Memory(extra={"slots": 8.0})
    busy = replace(ON_TARGET, in_flight=30, engine_running=14, engine_waiting=0)
    decision = plan(POLICY, busy, _steady(4), memory, now=1.0)
    assert (decision.desired, decision.reason) == (5, "scale_up")  # 30 / (0.75 × 8) → 5
    assert "30 on hand > 75% of 4 × 8 slots" in decision.message
    calm = replace(busy, in_flight=20)
    assert plan(POLICY, calm, _steady(4), memory, now=1.0).reason == "hold"


def test_growing_anyway_it_can_size_for_the_arrivals_trend_over_the_start_up() -> None:
    memory = Memory(extra={"slots": 8.0, "busy": 30.0, "rps": 10.0, "rps_at": 0.0})
    rising = replace(ON_TARGET, arrival_rps=12.0, in_flight=30)  # +0.4 req/s per s
    plain = plan(POLICY, rising, _steady(4), memory, now=5.0)
    assert plain.desired == 5  # 30 / (0.85 × 8)
    assert plain.memory.extra["trend"] == pytest.approx(0.4 * Tuning().trend_smoothing)
    ahead = Tuning(max_growth=2.0, trend_smoothing=1.0)
    decision = plan(POLICY, rising, _steady(4), memory, 5.0, ahead)
    assert decision.desired == 8  # 30 × (1 + 0.4 × 60 / 12) capped at × 2 → 60 / 6.8 → 9, step


def test_never_acts_while_a_change_is_still_coming() -> None:
    hot = Signals(ttft_p90_ms=5000.0, samples=50, arrival_rps=5.0, engine_waiting=30)
    coming = Current(count=4, ready=2, coming=2, gpus_per_replica=1)
    decision = plan(POLICY, hot, coming, Memory(), now=1.0)
    assert (decision.desired, decision.reason) == (4, "pending")
    idle = plan(POLICY, IDLE, coming, Memory(low_since=0.0, idle_since=0.0), now=1000.0)
    assert (idle.desired, idle.reason) == (4, "pending")


def test_while_coming_only_load_past_the_count_with_them_scales_up_and_never_twice() -> None:
    memory = Memory(extra={"slots": 4.0, "busy": 30.0})
    wide = replace(POLICY, max=16)
    burst = Signals(ttft_p90_ms=5000.0, samples=50, arrival_rps=5.0, in_flight=30,
                    engine_waiting=14, engine_running=8)  # fmt: skip
    coming = Current(count=4, ready=2, coming=2, gpus_per_replica=1)
    decision = plan(wide, burst, coming, memory, now=1.0)
    assert (decision.desired, decision.reason) == (8, "scale_up")  # 30 / (0.75 × 4) → 10, step
    assert "2 of them not READY yet" in decision.message
    more = Current(count=8, ready=2, coming=6, gpus_per_replica=1)
    decision = plan(wide, burst, more, decision.memory, now=6.0)
    assert decision.desired == 10
    asked = Current(count=10, ready=2, coming=8, gpus_per_replica=1)
    again = plan(wide, burst, asked, decision.memory, now=11.0)
    assert (again.desired, again.reason) == (10, "pending")  # what is on its way is not re-asked
    light = replace(burst, in_flight=10, engine_waiting=2)  # p90 and queue stale: they wait
    fresh = Memory(extra={"slots": 4.0})
    assert plan(POLICY, light, coming, fresh, now=1.0).reason == "pending"


def test_unplaced_replicas_hold_a_scale_up_but_not_a_scale_down() -> None:
    hot = Signals(ttft_p90_ms=5000.0, samples=50, arrival_rps=5.0)
    unplaced = Current(count=3, ready=2, coming=0, gpus_per_replica=1)
    assert plan(POLICY, hot, unplaced, Memory(), now=1.0).reason == "pending"
    down = plan(POLICY, LOW, unplaced, Memory(low_since=0.0), now=400.0)
    assert (down.desired, down.reason) == (2, "scale_down")


def test_stale_window_after_a_change_came_ready_does_not_scale_up_again() -> None:
    hot = Signals(ttft_p90_ms=1600.0, samples=50, arrival_rps=5.0)
    coming = Current(count=4, ready=2, coming=2, gpus_per_replica=1)
    memory = plan(POLICY, hot, coming, Memory(), now=0.0).memory
    settled = plan(POLICY, hot, _steady(4), memory, now=5.0)  # READY now: the window is old
    assert (settled.desired, settled.reason) == (4, "hold")
    later = plan(POLICY, hot, _steady(4), settled.memory, now=5.0 + Tuning().settle_s)
    assert (later.desired, later.reason) == (8, "scale_up")


def test_scales_down_only_after_the_window_stayed_low_that_long_one_step_a_window() -> None:
    decisions = _run(POLICY, LOW, _steady(4), start=0.0, end=400.0)
    counts = [d.desired for d in decisions]
    first_down = next(i for i, d in enumerate(decisions) if d.reason == "scale_down")
    assert first_down * 5.0 == 300.0
    assert set(counts[:first_down]) == {4}
    assert counts[first_down] == 3
    assert counts[first_down + 5] == 3  # the next one a window (30 s) later
    assert counts[first_down + 6] == 2
    assert min(counts) >= POLICY.min


def test_a_round_above_down_ratio_restarts_the_low_window() -> None:
    memory = plan(POLICY, LOW, _steady(4), Memory(), now=0.0).memory
    memory = plan(POLICY, ON_TARGET, _steady(4), memory, now=200.0).memory
    assert memory.low_since is None
    decision = plan(POLICY, LOW, _steady(4), memory, now=310.0)
    assert (decision.desired, decision.reason) == (4, "hold")
    assert "below target for 0 s" in decision.message


def test_scale_down_waits_until_what_is_on_hand_fits_on_fewer_replicas() -> None:
    memory = Memory(low_since=0.0, extra={"slots": 2.0})
    fast_but_full = Signals(ttft_p90_ms=100.0, samples=500, arrival_rps=3.0, in_flight=12)
    decision = plan(POLICY, fast_but_full, _steady(8), memory, now=1000.0)
    assert (decision.desired, decision.reason) == (8, "hold")  # 12 > 70 % of 7 × 2 slots
    emptier = replace(fast_but_full, in_flight=9)
    assert plan(POLICY, emptier, _steady(8), memory, now=1000.0).desired == 7


def test_itl_below_target_is_projected_onto_one_replica_fewer() -> None:
    policy = Policy(min=1, max=8, itl_p90_ms=40.0)
    memory = Memory(low_since=0.0)
    near = Signals(itl_p90_ms=34.0, samples=100, arrival_rps=1.0, in_flight=2)
    assert plan(policy, near, _steady(4), memory, now=1000.0).desired == 4  # 34 × 4/3 > 40
    room = replace(near, itl_p90_ms=29.0)
    assert plan(policy, room, _steady(4), memory, now=1000.0).desired == 3  # 29 × 4/3 ≤ 40


def test_to_zero_only_when_min_is_zero_and_idle_that_long() -> None:
    scale_to_zero = replace(POLICY, min=0)
    decisions = _run(scale_to_zero, IDLE, _steady(1), start=0.0, end=300.0)
    assert [d.desired for d in decisions[:-1]] == [1] * (len(decisions) - 1)
    assert (decisions[-1].desired, decisions[-1].reason) == (0, "to_zero")
    kept = _run(POLICY, IDLE, _steady(1), start=0.0, end=1000.0)
    assert {d.desired for d in kept} == {1}


def test_light_traffic_is_not_idle_and_never_goes_to_zero() -> None:
    trickle = Signals(samples=2, arrival_rps=0.05, in_flight=0)
    decisions = _run(replace(POLICY, min=0), trickle, _steady(2), start=0.0, end=2000.0)
    assert decisions[-1].desired == 1
    assert "to_zero" not in {d.reason for d in decisions}


def test_from_zero_at_once_when_a_request_waits() -> None:
    zero = Current(count=0, ready=0, coming=0, gpus_per_replica=1)
    policy = replace(POLICY, min=0)
    decision = plan(policy, Signals(waiting=1), zero, Memory(), now=1.0)
    assert (decision.desired, decision.reason, decision.signal) == (1, "from_zero", "waiting=1")
    assert plan(policy, IDLE, zero, Memory(), now=1.0).reason == "hold"
    learned = Memory(capacity_rps=1.0)
    burst = Signals(waiting=20, arrival_rps=4.0)
    assert plan(policy, burst, zero, learned, now=1.0).desired == 4  # 4 / 0.8 → 5, step 4


def test_a_count_outside_min_max_is_brought_inside_even_while_pending() -> None:
    coming = Current(count=10, ready=8, coming=2, gpus_per_replica=1)
    assert plan(POLICY, IDLE, coming, Memory(), now=1.0).desired == 8
    low = plan(replace(POLICY, min=3), IDLE, _steady(1), Memory(), now=1.0)
    assert (low.desired, low.reason) == (3, "scale_up")


def test_capacity_is_learned_where_the_target_broke_and_raised_where_it_held() -> None:
    assert plan(POLICY, ON_TARGET, _steady(2), Memory(), now=1.0).memory.capacity_rps is None
    over = Signals(ttft_p90_ms=900.0, samples=50, arrival_rps=6.0)
    memory = plan(POLICY, over, _steady(2), Memory(), now=1.0).memory
    assert memory.capacity_rps == 3.0  # over target at 3 req/s per replica
    lower = replace(over, arrival_rps=5.0)
    assert plan(POLICY, lower, _steady(2), memory, now=2.0).memory.capacity_rps == 2.5
    held = replace(ON_TARGET, arrival_rps=8.0)
    assert plan(POLICY, held, _steady(2), memory, now=2.0).memory.capacity_rps == 4.0
    coming = Current(count=2, ready=1, coming=1, gpus_per_replica=1)
    assert plan(POLICY, lower, coming, memory, now=2.0).memory.capacity_rps == 3.0


def test_capacity_is_not_learned_down_from_a_burst_s_slow_answers_after_it_ended() -> None:
    # the loop's case: learned 20 req/s per replica in a burst; after it the window still
    # holds its slow answers while the arrivals fell to 1.45 req/s and nothing queues
    after = Signals(ttft_p90_ms=2400.0, samples=60, arrival_rps=1.45, in_flight=1,
                    engine_waiting=0, engine_running=1)  # fmt: skip
    memory = Memory(capacity_rps=20.0)
    assert plan(POLICY, after, _steady(2), memory, now=1.0).memory.capacity_rps == 20.0
    full = replace(after, engine_waiting=6, engine_running=16)  # full now: it says at most
    assert plan(POLICY, full, _steady(2), memory, now=1.0).memory.capacity_rps == 0.725


def test_scale_down_steps_to_what_the_most_on_hand_of_the_last_minutes_needs() -> None:
    memory = Memory(low_since=0.0, extra={"slots": 8.0, "busy": 10.0})
    light = Signals(ttft_p90_ms=100.0, samples=500, arrival_rps=3.0, in_flight=10)
    decision = plan(POLICY, light, _steady(8), memory, now=400.0)
    assert (decision.desired, decision.reason) == (4, "scale_down")  # 8 − step 4; 10 needs 2
    # 30 on hand in the 150 s bucket before this one (150-300 s): kept for the next bucket
    peaked = Memory(low_since=0.0, extra={"slots": 8.0, "busy": 10.0, "peak_now": 30.0,
                                          "peak_bucket": 1.0})  # fmt: skip
    assert plan(POLICY, light, _steady(8), peaked, now=400.0).desired == 6  # 30 / 5.2 → 6
    gone = plan(POLICY, light, _steady(8), peaked, now=460.0)  # two buckets on: forgotten
    assert gone.desired == 4
    itl_policy = replace(POLICY, itl_p90_ms=40.0)
    slow_tokens = replace(light, itl_p90_ms=34.0)  # 8 × 34 / 40 → 7 keep the ITL in target
    assert plan(itl_policy, slow_tokens, _steady(8), memory, now=400.0).desired == 7


def test_learned_capacity_scales_up_when_the_percentiles_say_nothing_yet() -> None:
    long_answers = Signals(samples=2, arrival_rps=9.0, in_flight=10)
    decision = plan(POLICY, long_answers, _steady(4), Memory(capacity_rps=2.0), now=1.0)
    assert (decision.desired, decision.reason) == (5, "scale_up")  # 9 / 2.0 → 5
    assert decision.signal == "arrival_rps=9.00"


_CASES = st.tuples(
    st.integers(0, 4),  # min
    st.integers(0, 6),  # max − min
    st.integers(0, 14),  # count
    st.integers(0, 3),  # coming
    st.one_of(st.none(), st.floats(0.0, 1e5)),  # ttft p90
    st.integers(0, 500),  # samples
    st.floats(0.0, 1e3),  # arrivals/s
    st.integers(0, 50),  # waiting
    st.one_of(st.none(), st.integers(0, 100)),  # engines' queue
    st.one_of(st.none(), st.floats(0.01, 100.0)),  # learned capacity
    st.floats(0.0, 1e6),  # now
)


@settings(max_examples=300, deadline=None)
@given(case=_CASES)
def test_any_window_gives_a_count_within_min_max_in_bounded_steps(
    case: tuple[int, int, int, int, float | None, int, float, int, int | None, float | None, float],
) -> None:
    lo, span, count, coming, ttft, samples, rps, waiting, queued, capacity, now = case
    policy = Policy(min=lo, max=max(lo + span, 1), ttft_p90_ms=800.0)
    signals = Signals(ttft_p90_ms=ttft, samples=samples, arrival_rps=rps, waiting=waiting,
                      engine_waiting=queued)  # fmt: skip
    current = Current(count=count, ready=max(count - coming, 0), coming=min(coming, count),
                      gpus_per_replica=1)  # fmt: skip
    memory = Memory(low_since=0.0, idle_since=0.0, capacity_rps=capacity)
    decision = plan(policy, signals, current, memory, now)
    tuning = Tuning()
    assert policy.min <= decision.desired <= policy.max
    inside = policy.min <= count <= policy.max
    if inside and count > 0:
        assert count - tuning.max_step_down <= decision.desired <= count + tuning.max_step_up
    if inside and current.coming > 0:  # never down while coming; a change never asked twice
        assert decision.desired >= count
        grown = decision.desired - count
        again = replace(current, count=decision.desired, coming=current.coming + grown)
        if grown < tuning.max_step_up:  # what it asked for, not a step toward it
            assert plan(policy, signals, again, decision.memory, now + 5.0).desired == again.count
    if decision.desired == 0 and count > 0:
        assert decision.reason == "to_zero" and rps == 0.0 and waiting == 0
    assert decision.reason in {
        "scale_up", "scale_down", "hold", "from_zero", "to_zero", "budget", "pending", "no_signal",
    }  # fmt: skip


def _claim(desired: int, count: int, priority: int = 0, gpus: int = 1, lo: int = 0,
           pool: str = "h100") -> Claim:  # fmt: skip
    policy = Policy(min=lo, max=16, ttft_p90_ms=800.0)
    current = Current(count=count, ready=count, coming=0, gpus_per_replica=gpus, pool=pool,
                      priority=priority)  # fmt: skip
    decision = Decision(desired, "scale_up" if desired > count else "hold", "m", "s", Memory())
    return Claim(decision, current, policy)


def test_budget_lets_a_higher_priority_take_gpus_from_a_lower_one_down_to_its_min() -> None:
    claims = {"chat": _claim(6, 2, priority=10), "batch": _claim(4, 4, priority=0, lo=1)}
    out = share_budget(claims, {"h100": 6})
    assert (out["chat"].desired, out["chat"].reason) == (5, "budget")  # 6 − batch's min 1
    assert (out["batch"].desired, out["batch"].reason) == (1, "budget")
    assert "pool h100 budget 6 GPUs" in out["batch"].message


def test_budget_within_one_priority_keeps_what_runs_before_anyone_grows() -> None:
    claims = {"a": _claim(6, 2), "b": _claim(3, 3)}
    out = share_budget(claims, {"h100": 5})
    assert out["b"].desired == 3 and out["b"].reason == "hold"
    assert (out["a"].desired, out["a"].reason) == (2, "budget")


def test_budget_counts_gpus_per_replica_and_fixed_deployments() -> None:
    fixed = Claim(
        Decision(2, "hold", "fixed", "", Memory()),
        Current(count=2, ready=2, coming=0, gpus_per_replica=4, pool="h100"),
        Policy(min=2, max=2, mode=ADVISE),
    )
    claims = {"fixed": fixed, "chat": _claim(4, 1, gpus=2, priority=5)}
    out = share_budget(claims, {"h100": 14})
    assert out["fixed"].desired == 2  # its min: never cut
    assert out["chat"].desired == 3  # (14 − 8) // 2


def test_pools_without_a_budget_and_cpu_profiles_pass_as_they_are() -> None:
    claims = {"a": _claim(9, 2, pool="l4"), "cpu": _claim(7, 1, gpus=0), "b": _claim(3, 1)}
    out = share_budget(claims, {"h100": 3})
    assert out == {name: claim.decision for name, claim in claims.items()}


@settings(max_examples=300, deadline=None)
@given(
    budget=st.integers(0, 40),
    wants=st.lists(
        st.tuples(
            st.integers(0, 10),
            st.integers(0, 10),
            st.integers(-2, 2),
            st.integers(0, 4),
            st.integers(0, 3),
        ),  # fmt: skip
        min_size=1,
        max_size=6,
    ),
)
def test_budget_is_never_exceeded_beyond_the_floors(
    budget: int, wants: list[tuple[int, int, int, int, int]]
) -> None:
    claims = {
        f"d{i}": _claim(max(d, lo), c, priority=p, gpus=g, lo=lo)
        for i, (d, c, p, g, lo) in enumerate(wants)
    }
    out = share_budget(claims, {"h100": budget})
    used = sum(out[n].desired * c.current.gpus_per_replica for n, c in claims.items())
    floors = sum(c.policy.min * c.current.gpus_per_replica for c in claims.values())
    assert used <= max(budget, floors)
    for name, claim in claims.items():
        assert claim.policy.min <= out[name].desired <= claim.decision.desired
        if out[name].desired < claim.decision.desired:
            assert out[name].reason == "budget"
    free = budget - used
    for name, claim in claims.items():  # a cut one could not take one more from lower ones
        gpus = claim.current.gpus_per_replica
        if out[name].desired < claim.decision.desired and gpus and floors <= budget:
            lower = sum(
                (out[o].desired - c.policy.min) * c.current.gpus_per_replica
                for o, c in claims.items()
                if c.current.priority < claim.current.priority
            )
            assert free + lower < gpus
