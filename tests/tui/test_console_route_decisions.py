"""The router view's last decisions and the reuse drift warning (llmgw.tui.routes, the
router panel): the pure view from GetRouterStats answers, the text on screen through
Textual's Pilot, and SVG snapshots at 80×24 (scrolled to the decisions) and 160×50."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from textual.containers import VerticalScroll
from textual.pilot import Pilot

from llmgw.api.llmgw.v1 import ReplicaRouterStats, RouteCandidate, RouteDecision, RouterStats
from llmgw.tui.app import ConsoleApp
from llmgw.tui.model import ClusterModel
from llmgw.tui.routes import DRIFT_MIN_REQUESTS, decision_row
from llmgw.tui.stream import LinkPhase, LinkStatus

T0 = 1_700_000_000_000
SnapCompare = Callable[..., bool]


def decision(at_s: int, replica: str, reason: str, **fields: Any) -> RouteDecision:
    made = RouteDecision(
        at_unix_ms=T0 - at_s * 1000,
        model="chat",
        tier="precise",
        outcome="hit",
        replica_id=replica,
        reason=reason,
        matched=58,
        total=62,
        unit="blocks",
        candidates=[
            RouteCandidate(replica_id="chat-1", matched=58 if replica == "chat-1" else 3),
            RouteCandidate(
                replica_id="chat-2", matched=58 if replica == "chat-2" else 0, in_flight=2
            ),
        ],
        predicted_tokens=928,
        cached_tokens=928,
    )
    for name, value in fields.items():
        setattr(made, name, value)
    return made


DECISIONS = [
    decision(40, "chat-1", "fallback-approximate-miss because no_blocks", tier="load",
             outcome="miss", unit="chars", matched=0, total=3012, cached_tokens=0),
    decision(30, "chat-1", "precise-hit"),
    decision(20, "chat-2", "precise-claimed", gateway_id="gw-east-1f3a", cached_tokens=None),
    decision(10, "chat-2", "precise-miss", outcome="miss", matched=0, cached_tokens=0,
             candidates=[RouteCandidate(replica_id="chat-1", matched=1, in_flight=3),
                         RouteCandidate(replica_id="chat-2", matched=0, in_flight=0)]),
]  # fmt: skip


def stats(checked: int, gap: int, prompt: int, decisions: list[RouteDecision]) -> RouterStats:
    return RouterStats(
        decisions=40 + checked,
        decisions_by_tier={"precise": 30 + checked, "load": 10},
        decisions_by_tier_outcome={"precise/hit": 25 + checked, "precise/miss": 5, "load/miss": 10},
        requests_by_status={200: 40 + checked},
        replicas=[
            ReplicaRouterStats(replica_id="chat-1", requests=20 + checked, in_flight=0),
            ReplicaRouterStats(replica_id="chat-2", requests=20, in_flight=2),
        ],
        at_unix_ms=T0,
        recent_decisions=decisions,
        route_gap_tokens=gap,
        route_checked_requests=checked,
        route_checked_prompt_tokens=prompt,
    )


def routes_after(*answers: RouterStats) -> Any:
    model = ClusterModel()
    for i, answer in enumerate(answers):
        model.add_router_stats(answer, 10.0 * i)
    return model.snapshot(T0).router.routes


def test_the_last_decisions_come_newest_first_with_their_match_and_candidates() -> None:
    routes = routes_after(stats(0, 0, 0, []), stats(4, 0, 4000, DECISIONS))
    assert [row.reason for row in routes.recent] == [
        "precise-miss",
        "precise-claimed",
        "precise-hit",
        "fallback-approximate-miss because no_blocks",
    ]
    claimed = routes.recent[1]
    assert (claimed.gateway, claimed.replica_id, claimed.matched) == (
        "gw-east-1f3a",
        "chat-2",
        "58/62b",
    )
    assert claimed.cached_tokens is None and claimed.candidates == "chat-1:3/0 chat-2:58/2"
    assert routes.recent[3].matched == "0/3012c"
    assert decision_row(RouteDecision(replica_id="r", tier="round_robin")).matched == ""


def test_drift_warns_only_over_the_threshold_with_enough_checked_requests() -> None:
    start = stats(100, 500, 100_000, [])
    calm = routes_after(start, stats(140, 900, 140_000, []))  # 400 / 40 000: 1 %
    assert calm.drift == pytest.approx(0.01) and calm.checked == 40 and not calm.warning
    few = routes_after(start, stats(100 + DRIFT_MIN_REQUESTS - 1, 19_500, 119_000, []))
    assert few.drift > 0.5 and not few.warning  # too few requests to judge
    drifting = routes_after(start, stats(140, 30_500, 140_000, []))  # 30 000 / 40 000
    assert drifting.drift == pytest.approx(0.75)
    assert drifting.warning.startswith("reuse drift 75%: ") and "40 requests" in drifting.warning
    assert routes_after(start, stats(140, 500, 140_000, [])).drift == 0.0


def reuse(captured: int, router: int, delivered: int, engine: int) -> RouterStats:
    """An answer whose engines report no cached tokens: only the reuse counters move."""
    answer = stats(0, 0, 0, [])
    answer.reuse_captured_tokens, answer.router_prompt_tokens = captured, router
    answer.reuse_delivered_tokens, answer.engine_prompt_tokens = delivered, engine
    return answer


def test_without_reported_cached_tokens_the_engines_counters_judge_the_drift() -> None:
    start = reuse(0, 0, 0, 0)
    agreeing = routes_after(start, reuse(27_000, 30_000, 26_000, 30_000))
    assert agreeing.source == "counters" and agreeing.drift == pytest.approx(1 / 30)
    assert not agreeing.warning
    # the tier expects nothing cached while the engines serve 85 % from cache (keys differ)
    apart = routes_after(start, reuse(0, 30_000, 25_500, 30_000))
    assert apart.drift == pytest.approx(0.85) and apart.warning.startswith("reuse drift 85%")
    assert "expected 0% of routed prompt tokens cached, engines served 85%" in apart.warning
    small = routes_after(start, reuse(0, 10_000, 8_500, 10_000))  # too few tokens to judge
    assert small.drift == pytest.approx(0.85) and not small.warning
    assert routes_after(start, start).source == ""  # nothing moved: nothing to judge


# --- on screen ---------------------------------------------------------------------------


class DriftFeed:
    """Two router polls ten seconds apart: the second with decisions and a drifting check."""

    def __init__(self) -> None:
        self.model = ClusterModel()

    async def run(self, sink: Any) -> None:
        self.model.add_router_stats(stats(100, 500, 100_000, []), 90.0)
        self.model.add_router_stats(stats(140, 30_500, 140_000, DECISIONS), 100.0)
        sink.snapshot_ready(self.model.snapshot(T0))
        sink.status_changed(LinkStatus().to(LinkPhase.LIVE, live_at=100.0))
        await asyncio.Event().wait()


def _app() -> ConsoleApp:
    return ConsoleApp(DriftFeed(), view="router", theme="textual-dark", clock=lambda: 100.0)


async def _shown(pilot: Pilot[Any]) -> None:
    app = pilot.app
    assert isinstance(app, ConsoleApp)
    for _ in range(100):
        if app.displayed.router.routes.recent:
            break
        await pilot.pause(0.05)
    else:
        raise AssertionError("the decisions never reached the screen")
    await pilot.pause()


async def _scrolled_to_the_decisions(pilot: Pilot[Any]) -> None:
    await _shown(pilot)
    for scroll in pilot.app.query(VerticalScroll):
        scroll.scroll_end(animate=False)
    await pilot.pause()


def screen_text(app: ConsoleApp) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


async def test_the_router_view_lists_the_decisions_under_the_drift_warning() -> None:
    app = _app()
    async with app.run_test(size=(160, 50)) as pilot:
        await _shown(pilot)
        text = screen_text(app)
        assert "⚠ DRIFT reuse drift 75%" in text
        lines = [words for words in map(str.split, text.splitlines()) if words[1:2] == ["precise"]]
        assert [words[:7] for words in lines] == [
            ["10s", "precise", "chat-2", "0/62b", "0", "chat-1:1/3", "chat-2:0/0"],
            ["20s", "precise", "chat-2", "58/62b", "-", "chat-1:3/0", "chat-2:58/2"],
            ["30s", "precise", "chat-1", "58/62b", "928", "chat-1:58/0", "chat-2:0/2"],
        ]
        assert "precise-claimed" in text and "fallback-approximate-miss because no_blocks" in text
        assert "reuse check: drift 75% (usage)" in text


@pytest.mark.parametrize(
    ("size", "run_before"),
    [((80, 24), _scrolled_to_the_decisions), ((160, 50), _shown)],
    ids=["80x24", "160x50"],
)
def test_snapshot(snap_compare: SnapCompare, size: tuple[int, int], run_before: Any) -> None:
    assert snap_compare(_app(), terminal_size=size, run_before=run_before)


async def test_the_overview_carries_the_drift_warning_too() -> None:
    app = _app()
    async with app.run_test(size=(160, 50)) as pilot:
        await _shown(pilot)
        await pilot.press("colon", *"overview", "enter")
        await pilot.pause()
        lines = [line.split() for line in screen_text(app).splitlines()]
        assert ["routing", "⚠", "DRIFT", "reuse", "drift", "75%:"] in [words[:6] for words in lines]
