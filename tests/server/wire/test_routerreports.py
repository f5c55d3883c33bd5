"""Reported gateway figures (llmgw.server.wire.routerreports): checks, merging by replica, stale
reports, and fleet totals that never go backwards across restarts and departures."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pytest
from grpclib.const import Status

from llmgw.api.llmgw.v1 import (
    ReplicaRouterStats,
    RouteCandidate,
    RouteDecision,
    RouterReport,
    RouterStats,
)
from llmgw.server.wire.routerreports import (
    DEFAULT_LIVE_S,
    ReportLimits,
    ReportRefused,
    RouterReports,
    StatsPart,
    combine,
)

COUNTERS = (
    "decisions",
    "reuse_available_tokens",
    "reuse_captured_tokens",
    "reuse_delivered_tokens",
    "router_prompt_tokens",
    "engine_prompt_tokens",
)


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def row(replica_id: str, **fields: object) -> ReplicaRouterStats:
    return ReplicaRouterStats(replica_id=replica_id, **fields)  # type: ignore[arg-type]


def stats(n: int, *rows: ReplicaRouterStats) -> RouterStats:
    """Figures of a gateway that made ``n`` decisions (every counter derived from ``n``)."""
    return RouterStats(
        decisions=n,
        decisions_by_tier={"approximate": n},
        decisions_by_tier_outcome={"approximate/hit": n},
        requests_by_status={200: n},
        reuse_available_tokens=10 * n,
        reuse_captured_tokens=8 * n,
        reuse_delivered_tokens=5 * n,
        router_prompt_tokens=100 * n,
        engine_prompt_tokens=90 * n,
        replicas=list(rows),
    )


def report(gateway_id: str, n: int, *rows: ReplicaRouterStats, **fields: object) -> RouterReport:
    started = int(fields.pop("started", 1_700_000_000_000))  # type: ignore[call-overload]
    interval = int(fields.pop("interval_ms", 2000))  # type: ignore[call-overload]
    return RouterReport(
        gateway_id=gateway_id,
        started_at_unix_ms=started,
        stats=stats(n, *rows),
        interval_ms=interval,
    )


def totals(store: RouterReports) -> RouterStats:
    return combine(store.parts(), now_ms=1)


def flat(figures: RouterStats) -> dict[str, int]:
    """Every cumulative counter of ``figures``, the per-replica requests included."""
    out = {name: int(getattr(figures, name)) for name in COUNTERS}
    out.update({f"tier:{k}": v for k, v in figures.decisions_by_tier.items()})
    out.update({f"outcome:{k}": v for k, v in figures.decisions_by_tier_outcome.items()})
    out.update({f"status:{k}": v for k, v in figures.requests_by_status.items()})
    return out


# --- combining (pure) --------------------------------------------------------------------


def test_counters_add_up_and_rows_merge_by_replica() -> None:
    server = stats(3, row("r1", in_flight=1, requests=3, kv_capacity_tokens=0))
    fresh = stats(
        5,
        row("r1", in_flight=2, requests=4, delivered_hit_ratio=0.5, kv_usage=0.25),
        row("r2", in_flight=1, requests=1, kv_capacity_tokens=800),
    )
    older = stats(
        7,
        row("r1", in_flight=4, requests=7, kv_capacity_tokens=4096, kv_usage=0.9),
    )
    older.replicas[0].engine_waiting, older.replicas[0].engine_running = 3, 8
    fresh.replicas[0].engine_waiting = 1  # fresher: wins; running only the older says
    parts = [
        StatsPart(older, live=True, fresh_s=1.0),
        StatsPart(server, live=True, fresh_s=math.inf),
        StatsPart(fresh, live=True, fresh_s=2.0),
    ]
    merged = combine(parts, now_ms=42)
    assert merged.at_unix_ms == 42
    assert merged.decisions == 15 and merged.decisions_by_tier == {"approximate": 15}
    assert merged.requests_by_status == {200: 15}
    assert merged.reuse_delivered_tokens == 75 and merged.engine_prompt_tokens == 1350
    r1, r2 = merged.replicas
    assert (r1.replica_id, r1.in_flight, r1.requests) == ("r1", 7, 14)
    # the freshest that says each engine figure: the server's says no capacity (0), the
    # fresh report's ratio and usage win over the older's; the capacity is the older's
    assert (r1.delivered_hit_ratio, r1.kv_usage, r1.kv_capacity_tokens) == (0.5, 0.25, 4096)
    assert (r2.replica_id, r2.in_flight, r2.requests, r2.kv_capacity_tokens) == ("r2", 1, 1, 800)
    assert r2.delivered_hit_ratio is None and r2.kv_usage is None
    assert (r1.engine_waiting, r1.engine_running) == (1, 8)
    assert (r2.engine_waiting, r2.engine_running) == (None, None)


def test_a_stale_part_counts_its_counters_but_not_its_rows_or_gauges() -> None:
    live = stats(2, row("r1", in_flight=1, requests=2, kv_usage=0.1))
    stale = stats(9, row("r1", in_flight=5, requests=9, kv_usage=0.8), row("r9", in_flight=3))
    merged = combine([StatsPart(live, True, 1.0), StatsPart(stale, False, 5.0)], now_ms=0)
    assert merged.decisions == 11
    [r1] = merged.replicas  # r9 is only in the stale figures
    assert (r1.in_flight, r1.requests, r1.kv_usage) == (1, 11, 0.1)


def test_sums_saturate_instead_of_overflowing_the_wire_types() -> None:
    big = RouterStats(decisions=2**64 - 1, replicas=[row("r", in_flight=2**32 - 1)])
    merged = combine([StatsPart(big, True, 1.0), StatsPart(big, True, 2.0)], now_ms=0)
    assert merged.decisions == 2**64 - 1 and merged.replicas[0].in_flight == 2**32 - 1
    bytes(merged)  # still encodes


# --- the store ---------------------------------------------------------------------------


def test_a_report_stays_live_for_three_intervals_then_leaves_only_its_counters() -> None:
    clock = Clock()
    store = RouterReports(clock=clock)
    store.take(report("gw-a", 4, row("r1", in_flight=2, requests=4), interval_ms=1000))
    store.take(report("gw-b", 1, row("r1", in_flight=1, requests=1), interval_ms=0))
    clock.now += 2.9
    assert totals(store).replicas[0].in_flight == 3
    clock.now += 0.2  # gw-a: 3.1 s, over 3 intervals of 1 s; gw-b: the 10 s default
    [r1] = totals(store).replicas
    assert (r1.in_flight, r1.requests) == (1, 5)
    assert totals(store).decisions == 5
    clock.now += DEFAULT_LIVE_S
    assert totals(store).replicas == [] and totals(store).decisions == 5


def test_counters_never_go_backwards_across_restarts_and_departures() -> None:
    """Two gateways count; one restarts twice (with the same id and a new start time, then
    as a new instance id), the other leaves and its slot is taken by newcomers; each sample
    of the fleet totals is at least the one before, field by field (a rate from them is
    never negative), and nothing counted is lost."""
    clock = Clock()
    store = RouterReports(ReportLimits(max_gateways=3), clock=clock)

    def r1(n: int) -> ReplicaRouterStats:
        return row("r1", in_flight=1, requests=n)

    steps = [
        (2, "a", 10, 1),
        (0, "b", 20, 1),
        (2, "a", 15, 1),
        (0, "b", 30, 1),
        (2, "a", 2, 2),  # a restarted: same id, later start, fresh counters
        (0, "b", 31, 1),  # b's last report: it leaves
        (2, "a#2", 1, 3),  # a restarted again, as a new instance (the CLI's random suffix)
        (2, "a#2", 4, 3),
        (7, "a#2", 5, 3),  # b (and a's second run) are stale now: their gauges are gone
        (0, "c", 3, 1),  # the limit is 3: c takes the stalest slot (a's second run)
        (2, "d", 6, 1),  # and d takes b's
    ]
    samples: list[dict[str, int]] = []
    for wait, gateway_id, n, start in steps:
        clock.now += wait
        store.take(report(gateway_id, n, r1(n), started=start))
        now = totals(store)
        samples.append(flat(now) | {"r1": now.replicas[0].requests})
    for before, after in zip(samples, samples[1:], strict=False):
        assert all(after.get(k, 0) >= v for k, v in before.items()), (before, after)
    # everything ever counted is there: a's runs 15 + 2 + 5, b 31, c 3, d 6
    assert samples[-1]["decisions"] == samples[-1]["r1"] == 15 + 2 + 5 + 31 + 3 + 6
    assert samples[-1]["status:200"] == samples[-1]["decisions"]
    assert len(store) == 3  # a#2, c, d; the rest folded into the retired total
    [r1_row] = totals(store).replicas
    assert r1_row.in_flight == 3  # only the live gateways' gauges


def test_counters_lower_under_the_same_id_and_start_count_as_a_restart() -> None:
    store = RouterReports(clock=Clock())
    store.take(report("gw", 10))
    store.take(report("gw", 3))
    assert totals(store).decisions == 13


def test_an_older_process_under_a_live_id_is_refused() -> None:
    store = RouterReports(clock=Clock())
    store.take(report("gw", 10, started=2000))
    with pytest.raises(ReportRefused) as caught:
        store.take(report("gw", 99, started=1000))
    assert caught.value.status is Status.FAILED_PRECONDITION
    assert "'gw'" in caught.value.why and "--gateway-id" in caught.value.why
    assert totals(store).decisions == 10


def test_the_gateway_limit_refuses_a_new_live_gateway_and_reuses_stale_slots() -> None:
    clock = Clock()
    store = RouterReports(ReportLimits(max_gateways=2), clock=clock)
    store.take(report("a", 1))
    store.take(report("b", 2, interval_ms=1000))
    with pytest.raises(ReportRefused) as caught:
        store.take(report("c", 4))
    assert caught.value.status is Status.RESOURCE_EXHAUSTED
    assert "at most 2 gateways" in caught.value.why and "'c'" in caught.value.why
    store.take(report("a", 5))  # a known gateway is always taken
    clock.now += 3.5  # b is stale now (3 × 1 s), a is not
    store.take(report("c", 4))
    assert len(store) == 2
    assert totals(store).decisions == 5 + 2 + 4  # b folded into the retired total


BAD = [
    (RouterReport(started_at_unix_ms=1, stats=RouterStats()), "gateway_id is required"),
    (RouterReport(gateway_id="g\n", started_at_unix_ms=1, stats=RouterStats()), "gateway_id"),
    (RouterReport(gateway_id="g" * 400, started_at_unix_ms=1, stats=RouterStats()), "at most"),
    (RouterReport(gateway_id="g", stats=RouterStats()), "started_at_unix_ms must be positive"),
    (RouterReport(gateway_id="g", started_at_unix_ms=1), "stats is required"),
    (
        RouterReport(gateway_id="g", started_at_unix_ms=1, stats=RouterStats(), interval_ms=10**6),
        "interval_ms 1000000 is over the limit",
    ),
    (
        RouterReport(
            gateway_id="g",
            started_at_unix_ms=1,
            stats=RouterStats(replicas=[row("r", kv_usage=float("nan"))]),
        ),
        "stats.replicas[0].kv_usage nan is not a share",
    ),
    (
        RouterReport(
            gateway_id="g",
            started_at_unix_ms=1,
            stats=RouterStats(replicas=[row("r"), row("r")]),
        ),
        "stats.replicas[1].replica_id 'r' is repeated",
    ),
    (
        RouterReport(gateway_id="g", started_at_unix_ms=1, stats=RouterStats(replicas=[row("")])),
        "stats.replicas[0].replica_id is required",
    ),
    (
        RouterReport(
            gateway_id="g",
            started_at_unix_ms=1,
            stats=RouterStats(decisions_by_tier={f"t{i}": 1 for i in range(65)}),
        ),
        "stats.decisions_by_tier has more than 64 entries",
    ),
    (
        RouterReport(
            gateway_id="g",
            started_at_unix_ms=1,
            stats=RouterStats(replicas=[row(f"r{i}") for i in range(1025)]),
        ),
        "stats.replicas has more than 1024 rows",
    ),
]


@pytest.mark.parametrize(("bad", "why"), BAD)
def test_bad_reports_are_refused_naming_the_field_and_change_nothing(
    bad: RouterReport, why: str
) -> None:
    store = RouterReports(clock=Clock())
    store.take(report("good", 3))
    with pytest.raises(ReportRefused) as caught:
        store.take(bad)
    assert caught.value.status is Status.INVALID_ARGUMENT
    assert why in caught.value.why
    assert len(caught.value.why) < 1024
    assert len(store) == 1 and totals(store).decisions == 3


def test_nothing_reported_yet() -> None:
    store = RouterReports(clock=Clock())
    assert not store.ever_reported
    assert totals(store) == RouterStats(at_unix_ms=1)
    store.take(report("g", 0))
    assert store.ever_reported


# --- recent decisions and the precise tier's check ----------------------------------------


def decision(at_ms: int, replica_id: str = "r1", **fields: object) -> RouteDecision:
    made = RouteDecision(at_unix_ms=at_ms, model="m", tier="precise", replica_id=replica_id)
    for name, value in fields.items():
        setattr(made, name, value)
    return made


def test_recent_decisions_of_every_gateway_merge_by_time_stamped_with_their_gateway() -> None:
    clock = Clock()
    reports = RouterReports(clock=clock)
    for gateway_id, times in (("gw-a", (10, 30)), ("gw-b", (20, 40))):
        message = report(gateway_id, 2)
        assert message.stats is not None
        message.stats.recent_decisions = [decision(t, f"{gateway_id}-r") for t in times]
        reports.take(message)
    own = stats(1)
    own.recent_decisions = [decision(35, "local")]
    parts = [*reports.parts(), StatsPart(own, live=True, fresh_s=math.inf)]
    merged = combine(parts, 0, max_decisions=4).recent_decisions
    assert [(d.at_unix_ms, d.gateway_id, d.replica_id) for d in merged] == [
        (20, "gw-b", "gw-b-r"),
        (30, "gw-a", "gw-a-r"),
        (35, "", "local"),
        (40, "gw-b", "gw-b-r"),
    ]
    again = combine(reports.parts(), 0).recent_decisions  # the kept reports stay unstamped
    assert {d.gateway_id for d in again} == {"gw-a", "gw-b"}
    assert all(not d.gateway_id for p in reports.parts() for d in p.stats.recent_decisions)


def test_the_check_counters_add_up_over_gateways() -> None:
    one, two = stats(1), stats(2)
    for figures, n in ((one, 1), (two, 2)):
        figures.route_predicted_tokens, figures.route_cached_tokens = 100 * n, 90 * n
        figures.route_gap_tokens, figures.route_checked_requests = 10 * n, n
        figures.route_checked_prompt_tokens = 200 * n
    parts = [StatsPart(one, live=True, fresh_s=1.0), StatsPart(two, live=False, fresh_s=0.0)]
    total = combine(parts, 0)
    assert (total.route_predicted_tokens, total.route_cached_tokens) == (300, 270)
    assert (total.route_gap_tokens, total.route_checked_requests) == (30, 3)
    assert total.route_checked_prompt_tokens == 600


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ([decision(1, "")], "recent_decisions[0].replica_id is required"),
        ([decision(1, reason="a\nb")], "recent_decisions[0].reason must be printable"),
        ([decision(i) for i in range(201)], "recent_decisions has more than 200"),
        (
            [decision(1, candidates=[RouteCandidate(replica_id="")])],
            "recent_decisions[0].candidates[0].replica_id is required",
        ),
    ],
)
def test_a_report_with_bad_decisions_is_refused_naming_the_field(
    bad: list[RouteDecision], field: str
) -> None:
    reports = RouterReports()
    message = report("gw", 1)
    assert message.stats is not None
    message.stats.recent_decisions = bad
    with pytest.raises(ReportRefused, match=re.escape(field)) as caught:
        reports.take(message)
    assert caught.value.status is Status.INVALID_ARGUMENT and len(reports) == 0
