"""The console's deployments view and the overview's shortfall lines, driven by a pushed feed
of deployments carrying the status the server computes (its own pure function)."""

from __future__ import annotations

import asyncio
from typing import Any

from textual.pilot import Pilot

from llmgw.api.llmgw.v1 import Cluster, Deployment, ShardState, WatchEvent
from llmgw.server.core.deployment_status import ReplicaFacts, RoundVerdict, deployment_status
from llmgw.tui.app import ConsoleApp
from llmgw.tui.model import ClusterModel
from llmgw.tui.stream import LinkPhase, LinkStatus
from llmgw.tui.widgets.detail import DetailScreen

T0 = 1_700_000_000_000
NO_ROOM = "no schedulable node has 2 free L4 GPUs: l4-1 has 0 free (4 in use)"


def _deployment(name: str, desired: int, ready: int, why: str = "") -> Deployment:
    deployment = Deployment(name=name, profile=f"{name}-p", replicas=desired)
    facts = [ReplicaFacts(f"{name}-{i}", ShardState.READY, True, True) for i in range(ready)]
    verdict = RoundVerdict(why)
    deployment.status = deployment_status(
        deployment, facts, verdict, previous=None, now_ms=T0 - 90_000
    )
    return deployment


class Feed:
    def __init__(self) -> None:
        self.model = ClusterModel()
        self.sink: Any = None

    async def run(self, sink: Any) -> None:
        self.sink = sink
        await asyncio.Event().wait()

    def push(self, event: WatchEvent) -> None:
        self.model.apply(event, T0)
        self.sink.snapshot_ready(self.model.snapshot(T0))


def _text(app: ConsoleApp) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


async def _started(pilot: Pilot[Any], feed: Feed) -> None:
    for _ in range(100):
        if feed.sink is not None:
            break
        await pilot.pause(0.05)
    feed.sink.status_changed(LinkStatus().to(LinkPhase.LIVE, live_at=100.0))
    deployments = [_deployment("chat", 2, 2), _deployment("wide", 3, 2, NO_ROOM)]
    feed.push(WatchEvent(revision=1, snapshot=Cluster(deployments=deployments)))
    await pilot.pause()


def _rows(app: ConsoleApp) -> dict[str, list[str]]:
    return {w[0]: w for w in map(str.split, _text(app).splitlines()) if w}


async def test_colon_deployments_shows_desired_against_ready_and_follows_deltas() -> None:
    feed = Feed()
    app = ConsoleApp(feed, clock=lambda: 100.0)
    async with app.run_test(size=(160, 50)) as pilot:
        await _started(pilot, feed)
        await pilot.press("colon", *"deployments", "enter")
        assert app.current_view == "deployments"
        rows = _rows(app)
        assert rows["chat"][:6] == ["chat", "chat-p", "✓", "2/2", "2", "2"]
        assert rows["wide"][:6] == ["wide", "wide-p", "✗", "2/3", "2", "2"]
        assert NO_ROOM in _text(app)
        lines = [line.split()[0] for line in _text(app).splitlines()[2:4]]
        assert lines == ["wide", "chat"]  # short ones first

        feed.push(WatchEvent(revision=2, deployment=_deployment("wide", 3, 3)))
        await pilot.pause()
        assert _rows(app)["wide"][:4] == ["wide", "wide-p", "✓", "3/3"]
        assert NO_ROOM not in _text(app)

        feed.push(WatchEvent(revision=3, deployment=_deployment("chat", 2, 1, NO_ROOM)))
        await pilot.pause()
        await pilot.press("G", "enter")  # chat, short again (rows keep their places)
        for _ in range(50):
            if "deployment chat" in _text(app):
                break
            await pilot.pause(0.05)
        assert isinstance(app.screen, DetailScreen)
        detail = _text(app)
        assert "deployment chat" in detail and "2 desired, 1 ready" in detail
        assert "Available" in detail and "MinimumReplicasUnavailable" in detail
        assert "ReplicaFailure" in detail and "Unplaceable" in detail


async def test_jumps_by_alias_and_the_overview_names_the_short_ones() -> None:
    feed = Feed()
    app = ConsoleApp(feed, clock=lambda: 100.0)
    async with app.run_test(size=(80, 24)) as pilot:
        await _started(pilot, feed)
        text = _text(app)
        assert "wide 2/3 ready: no schedulable node has 2 free L4 GPUs" in text
        assert "chat 2/2" not in text
        await pilot.press("colon", *"dp", "enter")
        assert app.current_view == "deployments"
        await pilot.press("colon", *"deploy", "enter")
        assert app.current_view == "deployments"
