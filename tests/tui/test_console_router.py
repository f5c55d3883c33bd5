"""The router view from detailed GetRouterStats: windowed rates and ratios (counter resets
included), per-replica rows, and the view on screen through Textual's Pilot."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from textual.widgets import Sparkline

from llmgw.api.llmgw.v1 import (
    Cluster,
    Replica,
    ReplicaRouterStats,
    RouterStats,
    ShardState,
    WatchEvent,
)
from llmgw.tui.app import ConsoleApp
from llmgw.tui.model import ClusterModel, RouterStatus, RouterView
from llmgw.tui.stream import LinkPhase, LinkStatus
from llmgw.tui.views.table import TableView

T0 = 1_700_000_000_000


def stats(
    decisions: dict[str, int],
    requests: dict[int, int],
    reuse: tuple[int, int, int],
    prompts: tuple[int, int],
    replicas: list[ReplicaRouterStats],
) -> RouterStats:
    """A detailed answer; ``decisions`` is by "TIER/OUTCOME"."""
    by_tier: dict[str, int] = {}
    for key, count in decisions.items():
        tier = key.split("/")[0]
        by_tier[tier] = by_tier.get(tier, 0) + count
    return RouterStats(
        decisions=sum(decisions.values()),
        decisions_by_tier=by_tier,
        decisions_by_tier_outcome=decisions,
        requests_by_status=requests,
        reuse_available_tokens=reuse[0],
        reuse_captured_tokens=reuse[1],
        reuse_delivered_tokens=reuse[2],
        router_prompt_tokens=prompts[0],
        engine_prompt_tokens=prompts[1],
        replicas=replicas,
        at_unix_ms=T0,
    )


def replica(rid: str, requests: int, in_flight: int, ratio: float | None) -> ReplicaRouterStats:
    return ReplicaRouterStats(
        replica_id=rid,
        in_flight=in_flight,
        requests=requests,
        delivered_hit_ratio=ratio,
        kv_capacity_tokens=8192 if ratio is not None else 0,
    )


FIRST = stats(
    {"precise/hit": 4, "precise/guarded": 2, "load/miss": 4},
    {200: 10},
    (500, 400, 100),
    (1000, 800),
    [replica("r1", 6, 1, 0.25), replica("r2", 4, 0, None)],
)
SECOND = stats(  # ten seconds later
    {"precise/hit": 16, "precise/guarded": 4, "load/miss": 10},
    {200: 28, 499: 2},
    (1500, 1000, 500),
    (3000, 2800),
    [replica("r1", 20, 3, 0.3), replica("r2", 10, 0, None)],
)
RESTARTED = stats(  # the gateway restarted: every counter began again; r2 has left
    {"load/miss": 5},
    {200: 5},
    (0, 0, 50),
    (0, 100),
    [replica("r1", 5, 0, 0.5)],
)


def two_polls() -> RouterView:
    model = ClusterModel()
    model.add_router_stats(FIRST, 0.0)
    model.add_router_stats(SECOND, 10.0)
    return model.snapshot(T0).router


def test_two_polls_give_windowed_rates_and_ratios() -> None:
    router = two_polls()
    assert router.status is RouterStatus.AVAILABLE and router.detailed
    assert router.request_rate == pytest.approx(2.0)  # 20 requests answered in 10 s
    assert router.prefix_share == pytest.approx(12 / 20)  # hits among the decisions
    tiers = {t.tier: t for t in router.tiers}
    assert (tiers["precise"].decisions, tiers["precise"].rate) == (20, pytest.approx(1.4))  # type: ignore[comparison-overlap]
    assert tiers["precise"].hit_share == pytest.approx(12 / 14)
    assert tiers["load"].hit_share == 0.0
    assert router.available_share == pytest.approx(1000 / 2000)
    assert router.captured_share == pytest.approx(600 / 2000)
    assert router.captured_of_available == pytest.approx(600 / 1000)
    assert router.delivered_share == pytest.approx(400 / 2000)
    rows = {r.replica_id: r for r in router.replicas}
    assert (rows["r1"].in_flight, rows["r1"].request_rate) == (3, pytest.approx(1.4))  # type: ignore[comparison-overlap]
    assert rows["r1"].delivered_hit_ratio == pytest.approx(0.3)
    assert rows["r2"].delivered_hit_ratio is None and rows["r2"].request_rate == pytest.approx(0.6)


def test_a_gateway_restart_counts_from_zero_never_negative() -> None:
    model = ClusterModel()
    for at, answer in ((0.0, FIRST), (10.0, SECOND), (20.0, RESTARTED)):
        model.add_router_stats(answer, at)
    router = model.snapshot(T0).router
    assert router.request_rate == pytest.approx((20 + 5) / 20)
    assert router.rate_series == pytest.approx((2.0, 0.5))
    assert router.share_series == pytest.approx((0.6, 0.0))
    assert router.prefix_share == pytest.approx(12 / 25)
    assert router.delivered_share == pytest.approx((400 + 50) / (2000 + 100))
    assert router.available_share == pytest.approx(1000 / 2000)  # nothing routed since
    [row] = router.replicas  # r2 left the gateway
    assert (row.replica_id, row.requests, row.request_rate) == ("r1", 5, pytest.approx(19 / 20))  # type: ignore[comparison-overlap]


def test_an_old_server_keeps_the_decisions_only_view() -> None:
    model = ClusterModel()
    model.add_router_stats(RouterStats(decisions=4, decisions_by_tier={"precise": 4}), 0.0)
    model.add_router_stats(RouterStats(decisions=8, decisions_by_tier={"precise": 6}), 2.0)
    router = model.snapshot(T0).router
    assert not router.detailed and router.replicas == ()
    assert router.request_rate == pytest.approx(2.0)  # decisions, as before
    assert router.prefix_share == pytest.approx(2 / 4)  # the prefix tiers' share
    assert router.available_share is None and router.tiers[0].hit_share is None


# --- on screen ---------------------------------------------------------------------------


THIRD = stats(  # ten seconds after SECOND: ten more requests, all to r2 by load
    {"precise/hit": 16, "precise/guarded": 4, "load/miss": 20},
    {200: 38, 499: 2},
    (1500, 1000, 500),
    (3000, 2800),
    [replica("r1", 20, 0, 0.3), replica("r2", 20, 1, None)],
)


class RouterFeed:
    """Pushes a snapshot holding the first two polls, then each poll the test pushes."""

    def __init__(self) -> None:
        self.sink: Any = None
        self.model = ClusterModel()

    async def run(self, sink: Any) -> None:
        self.sink = sink
        self.model.add_router_stats(FIRST, 90.0)
        self.push(SECOND, 100.0)
        sink.status_changed(LinkStatus().to(LinkPhase.LIVE, live_at=100.0))
        await asyncio.Event().wait()

    def push(self, answer: RouterStats, at_s: float) -> None:
        self.model.add_router_stats(answer, at_s)
        self.sink.snapshot_ready(self.model.snapshot(T0 + int(at_s * 1000)))


def screen_text(app: ConsoleApp) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def rows(text: str) -> dict[str, list[str]]:
    """The screen's lines as words, by their first word."""
    return {words[0]: words for words in map(str.split, text.splitlines()) if words}


async def test_the_router_view_shows_tiers_reuse_replicas_and_sparklines() -> None:
    feed = RouterFeed()
    app = ConsoleApp(feed, view="router", clock=lambda: 100.0)
    async with app.run_test(size=(160, 50)) as pilot:
        for _ in range(100):
            if app.displayed.router.detailed:
                break
            await pilot.pause(0.05)
        await pilot.pause()
        text = screen_text(app)
        assert "2.0/s over 10s, 60% prefix hits; 30 decisions" in text
        assert "DELIVERED HIT" in text and "not reported by the server yet" not in text
        lines = rows(text)
        assert lines["precise"][1:4] == ["20", "1.4/s", "86%"]
        assert lines["load"][1:4] == ["10", "0.6/s", "0%"]
        assert lines["r1"][1:4] == ["3", "1.4/s", "30%"] and "8,192" in lines["r1"]
        assert lines["r2"][1:4] == ["0", "0.6/s", "–"]
        assert "50% of routed prompt tokens" in text  # available
        assert "30% of routed prompt tokens (60% of available)" in text  # captured
        assert "20% of engine prompt tokens" in text  # delivered
        assert "prefix-hit rate" in text
        rate = app.query_one("#router-rate", Sparkline)
        assert not rate.display and "requests/s: no samples yet" in text  # one interval
        feed.push(THIRD, 110.0)
        await pilot.pause()
        share = app.query_one("#router-share", Sparkline)
        assert rate.display and list(rate.data or []) == pytest.approx([2.0, 1.0])
        assert share.display and list(share.data or []) == pytest.approx([0.6, 0.0])
        lines = rows(screen_text(app))
        assert lines["r2"][1:3] == ["1", "0.8/s"]  # 16 of 40 decisions over 20 s
        await pilot.press("colon", *"overview", "enter")
        await pilot.pause()
        assert "1.5/s over 20s, 40% prefix hits; 40 decisions" in screen_text(app)


# --- the replicas view's INFL / KV / HIT -------------------------------------------------


def figures(rid: str, in_flight: int, kv: float | None, hit: float | None) -> ReplicaRouterStats:
    return ReplicaRouterStats(
        replica_id=rid, in_flight=in_flight, requests=1, delivered_hit_ratio=hit, kv_usage=kv
    )


def replicas_cluster() -> Cluster:
    replicas = [
        Replica(
            replica_id=rid, deployment="chat", profile="p", model="chat", state=ShardState.READY
        )
        for rid in ("chat-1", "chat-2", "chat-3")
    ]
    return Cluster(replicas=replicas)


def test_the_snapshot_joins_the_gateways_figures_into_replica_rows() -> None:
    model = ClusterModel()
    model.apply(WatchEvent(revision=1, snapshot=replicas_cluster()), T0)
    assert model.snapshot(T0).replicas["chat-1"].in_flight is None  # no router stats yet
    answer = stats({}, {}, (0, 0, 0), (0, 0), [figures("chat-1", 3, 0.42, 0.3)])
    model.add_router_stats(answer, 0.0)
    rows = model.snapshot(T0 + 1).replicas
    chat1 = rows["chat-1"]
    assert (chat1.in_flight, chat1.kv_usage, chat1.prefix_hit) == (3, 0.42, 0.3)
    assert (rows["chat-2"].in_flight, rows["chat-2"].kv_usage) == (None, None)  # no row
    model.router_unavailable("the server runs no gateway")
    assert model.snapshot(T0 + 2).replicas["chat-1"].in_flight is None


class ReplicaFeed:
    """Replicas from a Watch snapshot, then router stats the test pushes."""

    def __init__(self) -> None:
        self.sink: Any = None
        self.model = ClusterModel()
        self.now = T0

    async def run(self, sink: Any) -> None:
        self.sink = sink
        self.model.apply(WatchEvent(revision=1, snapshot=replicas_cluster()), T0)
        sink.snapshot_ready(self.model.snapshot(T0))
        sink.status_changed(LinkStatus().to(LinkPhase.LIVE, live_at=100.0))
        await asyncio.Event().wait()

    def push(self, replicas: list[ReplicaRouterStats]) -> None:
        self.model.add_router_stats(stats({}, {}, (0, 0, 0), (0, 0), replicas), None)
        self.now += 1000
        self.sink.snapshot_ready(self.model.snapshot(self.now))


def replica_cells(app: ConsoleApp) -> dict[str, list[str]]:
    """INFL, KV and HIT of each replica on screen."""
    return {rid: words[-3:] for rid, words in rows(screen_text(app)).items() if "READY" in words}


async def test_the_replicas_view_shows_in_flight_kv_and_hit_by_keyed_updates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    feed = ReplicaFeed()
    app = ConsoleApp(feed, view="replicas", clock=lambda: 100.0)
    async with app.run_test(size=(120, 30)) as pilot:
        for _ in range(100):
            if len(replica_cells(app)) == 3:
                break
            await pilot.pause(0.05)
        assert replica_cells(app) == dict.fromkeys(("chat-1", "chat-2", "chat-3"), ["–"] * 3)
        view = app.view()
        assert isinstance(view, TableView)
        calls: dict[str, list[Any]] = {}
        for name in ("append_rows", "remove_rows", "update_cells", "clear", "update_cell"):
            method = getattr(view.table, name)

            def counted(*args: Any, _name: str = name, _method: Any = method) -> Any:
                batch = list(args[0]) if args else []
                calls.setdefault(_name, []).append(batch)
                return _method(batch, *args[1:]) if args else _method()

            monkeypatch.setattr(view.table, name, counted)
        feed.push([figures("chat-1", 3, 0.42, 0.3), figures("chat-2", 0, None, None)])
        await pilot.pause()
        assert replica_cells(app) == {
            "chat-1": ["3", "42%", "30%"],
            "chat-2": ["0", "–", "–"],  # polled nothing yet: unknown, not 0%
            "chat-3": ["–", "–", "–"],  # the gateway has no row for it
        }
        assert set(calls) == {"append_rows", "remove_rows", "update_cells"}  # no rebuild
        assert calls["append_rows"] == [[]] and calls["remove_rows"] == [[]]
        changed = {(row, column) for row, column, _ in calls["update_cells"][0]}
        assert changed == {("chat-1", "in_flight"), ("chat-1", "kv"), ("chat-1", "hit")} | {
            ("chat-2", "in_flight")
        }
        feed.push([figures("chat-1", 1, 0.875, 0.3)])  # chat-2 left the gateway
        await pilot.pause()
        assert replica_cells(app)["chat-1"] == ["1", "88%", "30%"]
        assert replica_cells(app)["chat-2"] == ["–", "–", "–"]
        changed = {(row, column) for row, column, _ in calls["update_cells"][1]}
        assert changed == {("chat-1", "in_flight"), ("chat-1", "kv"), ("chat-2", "in_flight")}
