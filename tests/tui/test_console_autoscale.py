"""The autoscaler in the console's ``:deployments`` view: current→desired with the
planner's reason and the signal in the table, the policy and the decision in words on
Enter. The frozen cluster of ``test_console_snapshots`` (its chat deployment scales itself,
small is advised); the table's SVG snapshots are that file's ``test_live[deployments-…]``."""

from __future__ import annotations

from typing import Any

import pytest
import test_console_snapshots as frozen
from textual.pilot import Pilot

from llmgw.api.llmgw.v1 import AutoscalePolicy, Cluster, Deployment, Replica, ShardState, WatchEvent
from llmgw.tui.actions import ActionUnavailable, plan_drain, plan_start
from llmgw.tui.app import ConsoleApp
from llmgw.tui.autoscale import autoscale_row
from llmgw.tui.model import ClusterModel
from llmgw.tui.widgets.detail import DetailScreen


def _text(app: ConsoleApp) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def _rows(app: ConsoleApp) -> dict[str, list[str]]:
    return {w[0]: w for w in map(str.split, _text(app).splitlines()) if w}


async def _detail(pilot: Pilot[Any], app: ConsoleApp) -> str:
    """Enter on the selected row; the detail screen's text."""
    await pilot.press("enter")
    for _ in range(50):
        if isinstance(app.screen, DetailScreen):
            break
        await pilot.pause(0.05)
    await pilot.pause()
    return _text(app)


async def test_the_table_and_the_detail_show_current_desired_reason_and_signal() -> None:
    app = frozen._app("deployments")
    async with app.run_test(size=(160, 50)) as pilot:
        await frozen._shown(pilot)
        rows = _rows(app)
        assert rows["chat"][6:9] == ["3→4", "scale_up", "ttft_p90_ms=1240"]
        assert rows["small"][6:10] == ["advise", "2→2", "hold", "itl_p90_ms=22"]
        assert rows["big"][6:8] == ["-", "-"]
        detail = await _detail(pilot, app)  # chat: the first row, short
        assert "chat, profile chat-h100-v2" in detail
        assert "act, 1 to 6 replicas, ttft p90 <= 800 ms, down after 300 s" in detail
        assert "3 → 4 (scale_up), decided 12s ago" in detail
        assert "ttft p90 1240 ms > target 800 ms on 3 replicas" in detail
        assert "ttft p90 1240 ms, itl p90 31 ms, 6.40 req/s, 14 in flight, 0 waiting, kv 62%" in (
            detail
        )
        assert "16 GPUs in the pool" in detail


def test_a_policy_before_its_first_decision_and_a_fixed_count() -> None:
    policy = AutoscalePolicy(min=0, max=2, itl_p90_ms=40, scale_down_after_s=60, mode="act")
    row = autoscale_row(Deployment(name="d", autoscale=policy))
    assert row is not None and not row.decided and row.cell == "waiting" and not row.moving
    assert row.policy == "act, 0 to 2 replicas, itl p90 <= 40 ms, down after 60 s"
    assert autoscale_row(Deployment(name="d", replicas=3)) is None


def test_the_drain_dialog_says_an_autoscaled_deployment_keeps_its_count() -> None:
    policy = AutoscalePolicy(min=2, max=4, ttft_p90_ms=800, scale_down_after_s=300, mode="act")
    replicas = [
        Replica(replica_id=f"chat-{i}", deployment="chat", profile="p", model="chat",
                state=ShardState.READY)
        for i in (1, 2)
    ]  # fmt: skip
    cluster = Cluster(
        replicas=replicas,
        deployments=[Deployment(name="chat", profile="p", replicas=2, autoscale=policy)],
    )
    model = ClusterModel()
    model.apply(WatchEvent(revision=1, snapshot=cluster), frozen.T0)
    impact = plan_drain(model.snapshot(frozen.T0), "chat-1").impact
    assert (
        "Deployment chat is autoscaled and keeps 2 replicas: a replacement for chat-1 is placed."
        in impact
    )


def test_start_is_unavailable_for_an_autoscaled_deployment() -> None:
    policy = AutoscalePolicy(min=1, max=3, ttft_p90_ms=800, scale_down_after_s=300, mode="act")
    cluster = Cluster(
        deployments=[Deployment(name="chat", profile="p", replicas=1, autoscale=policy)]
    )
    model = ClusterModel()
    model.apply(WatchEvent(revision=1, snapshot=cluster), frozen.T0)
    with pytest.raises(ActionUnavailable, match=r"chat is autoscaled \(1 to 3 replicas\)"):
        plan_start(model.snapshot(frozen.T0), "chat")
