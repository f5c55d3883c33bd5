"""The drain-node dialog says where the server's placement would move each replica.

A control plane in process over mixed GPU classes (two DGX H100s, a 4×L4 box, an A100 with
MIG slices) with rounds of its reconcile loop, served over gRPC-web (``GrpcWebApp`` through
``httpx.ASGITransport``) to the console's own ``ControlClient``. ``D`` on a node asks the
server for a dry run of the drain (``DrainNode`` with ``dry_run``) and shows its answer:
an L4 replica cannot move even though sixteen H100 GPUs are free (the console used to
count them as room), an H100 replica goes to the other DGX.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    ApplyDeploymentRequest,
    ControlMessage,
    Deployment,
    EngineProfile,
    Register,
    ShardState,
    ShardStatus,
    WatchEvent,
)
from llmgw.client import ControlClient, GrpcWebChannel
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server.reconcile_loop import ReconcileLoop
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.controlsvc import ControlService
from llmgw.server.wire.grpcweb import GrpcWebApp
from llmgw.tui.app import ConsoleApp
from llmgw.tui.modals import ConfirmScreen
from llmgw.tui.model import ClusterModel
from llmgw.tui.stream import LinkPhase, LinkStatus

pytestmark = pytest.mark.timeout(120)

T0 = 1_700_000_000_000
NODES = (("h1", "dgx-h100"), ("h2", "dgx-h100"), ("l4", "l4-pcie"), ("mig", "a100-mig"))
PROFILES = (
    EngineProfile(name="chat", engine="sim", gpu_class="H100", tp=8, model_path="/m/chat"),
    EngineProfile(name="embed", engine="sim", gpu_class="L4", tp=1, model_path="/m/embed"),
)
COUNTS = {"chat": 1, "embed": 4}


async def _ready_on_start(plane: ControlPlane, node_id: str, message: ControlMessage) -> bool:
    """A fake agent: a started shard reports READY at once."""
    if (start := message.start_shard) is not None:
        status = ShardStatus(
            shard_id=start.shard_id,
            replica_id=start.replica_id,
            state=ShardState.READY,
            gpu_uuids=list(start.gpu_uuids),
            profile_fingerprint=start.profile_fingerprint,
        )
        plane.shard_status(node_id, status)
    return True


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        for i, (name, fixture) in enumerate(NODES):
            node = simulated_node(fixture, node_id=name, hostname=name)
            register = Register(protocol_version=PROTOCOL_VERSION, node=node)
            await plane.register(node, register, peer=f"10.0.0.{i + 1}:5000")
        svc = ControlService(plane)
        for p in PROFILES:
            deployment = Deployment(name=p.name, profile=p.name, replicas=COUNTS[p.name])
            await svc.apply_deployment(ApplyDeploymentRequest(deployment=deployment, profiles=[p]))
        loop = ReconcileLoop(plane, lambda n, m: _ready_on_start(plane, n, m))
        for _ in range(6):
            await loop.round()
        yield plane


class PlaneFeed:
    """Feeds the console the plane's cluster once (Watch is a stream; ASGITransport
    buffers whole responses, so the snapshot comes from the plane itself)."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    async def run(self, sink: Any) -> None:
        model = ClusterModel()
        model.apply(WatchEvent(revision=1, snapshot=self.plane.snapshot()), T0)
        sink.status_changed(LinkStatus().to(LinkPhase.LIVE, live_at=0.0))
        sink.snapshot_ready(model.snapshot(T0))
        await asyncio.Event().wait()


def _dialog_text(app: ConsoleApp) -> str:
    text = "\n".join(strip.text for strip in app.screen._compositor.render_strips())
    for char in "│╭╮╰╯─":
        text = text.replace(char, " ")
    return " ".join(text.split())


async def _drain_dialog(plane: ControlPlane, node_id: str) -> tuple[tuple[str, ...], str]:
    """``D`` on the node's row: the dialog's impact lines and the screen's words."""
    transport = httpx.ASGITransport(app=GrpcWebApp([ControlService(plane)]))
    async with GrpcWebChannel("http://localhost", transport=transport) as channel:
        app = ConsoleApp(PlaneFeed(plane), client=ControlClient(channel), view="nodes")
        async with app.run_test(size=(160, 50)) as pilot:
            for _ in range(100):
                if app.displayed.revision == 1:
                    break
                await pilot.pause(0.05)
            view = app.view()
            view.table.select_key(f"n:{node_id}")  # type: ignore[union-attr]
            await pilot.press("D")
            for _ in range(100):
                if isinstance(app.screen, ConfirmScreen):
                    break
                await pilot.pause(0.05)
            screen = app.screen
            assert isinstance(screen, ConfirmScreen)
            await pilot.pause(0.2)
            text = _dialog_text(app)
            await pilot.press("escape")
            return screen.operation.impact, text


async def test_an_l4_replica_finds_no_room_on_free_gpus_of_another_class(
    plane: ControlPlane,
) -> None:
    impact, text = await _drain_dialog(plane, "l4")
    assert "Drain node l4" in text and "embed-1: cannot move (no schedulable node" in text
    assert impact[2] == (
        "Where the server's placement would put them now (a dry run, nothing changed):"
    )
    assert impact[3:] == tuple(
        f"embed-{i}: cannot move (no schedulable node has 1 free L4 GPUs: h1 has no L4 GPUs, "
        "h2 has no L4 GPUs, mig has no L4 GPUs); it keeps running on l4 until there is room"
        for i in range(1, 5)
    )
    assert "free GPU" not in text  # no count of the H100s and slices as room
    assert not plane.inventory.nodes["l4"].cordoned  # asking changed nothing


async def test_an_h100_replica_moves_to_the_other_dgx(plane: ControlPlane) -> None:
    (busy,) = plane.replicas["chat-1"].plan.nodes
    other = ({"h1", "h2"} - {busy}).pop()
    impact, text = await _drain_dialog(plane, busy)
    assert impact[-1] == f"chat-1: → chat-2 on {other} GPUs 0,1,2,3,4,5,6,7 (H100)"
    assert "chat-1: → chat-2 on" in text
