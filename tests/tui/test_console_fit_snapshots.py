"""SVG snapshots of the console where ids are long: the columns size to their content and,
at 80×24, the widest name column gives way with an ellipsis while the state columns stay
whole; the footer drops whole hints, never cuts one. The frozen cluster of
``test_console_snapshots`` (a DGX H100, the A100 with MIG slices, a GB200, an L4 box), its
nodes renamed as a large site names them. Regenerate with ``--snapshot-update``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import test_console_snapshots as frozen
from test_console_snapshots import LIVE, NOW_S, SERVER, SIZES, SnapCompare
from textual.pilot import Pilot

from llmgw.api.llmgw.v1 import Cluster, WatchEvent
from llmgw.tui.app import ConsoleApp
from llmgw.tui.model import ClusterModel

LONG_IDS = {
    "dgx-1": "dgx-h100-pod2-rack14-node001",
    "mig-1": "a100-mig-pod1-rack03-node017",
    "gb-1": "gb200-nvl4-pod3-rack01-node004",
    "l4-1": "l4-pcie-edge-rack22-node009",
}


def long_id_cluster() -> Cluster:
    cluster = frozen.frozen_cluster()
    for node in cluster.nodes:
        assert node.info is not None
        node.info.node_id = LONG_IDS[node.info.node_id]
        if node.telemetry is not None:
            node.telemetry.node_id = node.info.node_id
    for shard in cluster.shards:
        shard.node_id = LONG_IDS[shard.node_id]
    return cluster


class LongIdFeed:
    """The frozen cluster with long node ids, once, LIVE (as ``FrozenFeed``)."""

    async def run(self, sink: Any) -> None:
        model = ClusterModel()
        model.apply(WatchEvent(revision=414, snapshot=long_id_cluster()), frozen.T0)
        for i, stats in enumerate(frozen._router_samples()):
            model.add_router_stats(stats, NOW_S - 60 + 4 * i)
        sink.status_changed(LIVE)
        sink.snapshot_ready(model.snapshot(frozen.T0))
        await asyncio.Event().wait()


async def _shown(pilot: Pilot[Any]) -> None:
    app = pilot.app
    assert isinstance(app, ConsoleApp)
    for _ in range(100):
        if app.displayed.revision == 414 and app.status.live:
            break
        await pilot.pause(0.05)
    else:
        raise AssertionError("the long-id snapshot never reached the screen")
    await pilot.pause()


def _app(view: str) -> ConsoleApp:
    return ConsoleApp(
        LongIdFeed(), server=SERVER, view=view, theme="textual-dark", clock=lambda: NOW_S
    )


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("view", ["nodes", "replicas", "shards"])
def test_long_ids(snap_compare: SnapCompare, view: str, size: str) -> None:
    assert snap_compare(_app(view), terminal_size=SIZES[size], run_before=_shown)
