"""The router feed's scalable models (routersvc.scalable_models): the models of autoscaled
deployments in mode "act", sent after each snapshot and whenever they change, and kept by
the gateway's routing table; the in-server gateway's table starts with them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw.api.llmgw.v1 import (
    AutoscalePolicy,
    Deployment,
    EngineProfile,
    LoraAdapter,
    RouterFeedEvent,
)
from llmgw.gateway import GatewayConfig, RoutingTable, apply_feed_event
from llmgw.server.state.desired import Change
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.routersvc import route_events, scalable_models, serve_gateway

PROFILES = {
    "chat-p": EngineProfile(
        name="chat-p",
        engine="sim",
        gpu_class="H100",
        model_path="/models/chat-7b",  # served as its last component
        adapters=[LoraAdapter(name="sql", path="/lora/sql")],
    ),
    "code-p": EngineProfile(
        name="code-p", engine="sim", gpu_class="H100", served_model_name="coder"
    ),
}


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        yield plane


async def apply(plane: ControlPlane, name: str, profile: str, mode: str | None) -> None:
    policy = None if mode is None else AutoscalePolicy(min=0, max=2, ttft_p90_ms=800, mode=mode)
    deployment = Deployment(name=name, profile=profile, replicas=1, autoscale=policy)
    chosen = PROFILES[profile]
    await plane.desired.apply(Change((chosen,), deployment, chosen))


async def next_scalable(events: AsyncIterator[RouterFeedEvent]) -> list[str]:
    while True:  # deployments change no targets here: only scalable models come
        event = await asyncio.wait_for(anext(events), 5)
        if event.scalable is not None:
            return list(event.scalable.models)
        assert event.snapshot is not None or event.tenant_keys is not None, event


async def test_scalable_models_follow_the_deployments(plane: ControlPlane) -> None:
    await apply(plane, "fixed", "code-p", None)  # no policy: a fixed count
    await apply(plane, "chat", "chat-p", "act")
    events = route_events(plane)
    try:
        assert await next_scalable(events) == ["chat-7b", "sql"]  # after the snapshot
        await apply(plane, "code", "code-p", "act")
        assert await next_scalable(events) == ["chat-7b", "coder", "sql"]
        await apply(plane, "chat", "chat-p", "advise")  # advise changes nothing: no hold
        assert await next_scalable(events) == ["coder"]
        await apply(plane, "fixed", "code-p", None)  # the same models: nothing sent
        assert await plane.desired.delete("code")
        assert await next_scalable(events) == []
    finally:
        await events.aclose()


async def test_the_gateways_table_keeps_them(plane: ControlPlane) -> None:
    await apply(plane, "chat", "chat-p", "act")
    table = RoutingTable()
    events = route_events(plane)
    try:
        for _ in range(2):  # the snapshot, then the scalable models
            apply_feed_event(table, await asyncio.wait_for(anext(events), 5))
    finally:
        await events.aclose()
    assert table.scalable_models() == frozenset({"chat-7b", "sql"})
    assert table.scalable("sql") and not table.scalable("coder")
    assert scalable_models(plane) == ["chat-7b", "sql"]
    async with serve_gateway(plane, GatewayConfig(port=0)) as served:
        assert served.gateway.table.scalable("chat-7b")  # from its first request on
