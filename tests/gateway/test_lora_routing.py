"""LoRA adapters in the routing table: a request naming an adapter reaches the replicas that
serve it (``RouteTarget.adapters``, from the profile), as vLLM answers such a request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from simserve import NO_TIME, sim_engine

from llmgw.api.llmgw.v1 import EngineProfile, LoraAdapter, RouteTarget, ShardState
from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.feed import target_from_route
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.server.core.plan import ReplicaPlan, ShardPlan
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.routersvc import route_target

ADAPTER = "sql-lora"


def target(
    replica_id: str, *, adapters: tuple[str, ...] = (ADAPTER,), ready: bool = True
) -> Target:
    return Target(replica_id, "chat", "http://127.0.0.1:1", ready=ready, adapters=adapters)


def test_an_adapters_requests_go_to_the_replicas_serving_it() -> None:
    table = RoutingTable([target("r1"), target("r2", adapters=()), target("r3", ready=False)])
    assert [t.replica_id for t in table.candidates(ADAPTER)] == ["r1"]
    assert [t.replica_id for t in table.candidates("chat")] == ["r1", "r2"]
    assert table.models() == ("chat", ADAPTER)
    assert target("r3").serves(ADAPTER) and not target("r2", adapters=()).serves(ADAPTER)


def test_a_replica_whose_adapters_change_is_forgotten_by_the_policies() -> None:
    table = RoutingTable([target("r1")])
    removed: list[str] = []
    table.on_removed(removed.append)
    table.upsert(target("r1", adapters=("other",)))
    assert removed == ["r1"] and table.candidates(ADAPTER) == ()


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        yield plane


async def test_the_feed_carries_the_profiles_adapters(plane: ControlPlane) -> None:
    profile = EngineProfile(
        name="p", engine="sim", gpu_class="H100", tp=1, model_path="/m", served_model_name="chat",
        adapters=[LoraAdapter(name=ADAPTER, path="/a/sql"), LoraAdapter(name="b", path="/a/b")],
    )  # fmt: skip
    plan = ReplicaPlan("r1", "chat", "p", "fp", (ShardPlan("r1.0", "a1", 0, ("gpu-0",), 9001),))
    record = ReplicaRecord(plan, profile, Lifecycle.ACTIVE, serial=1, api_key="k")
    route = route_target(plane, record)
    assert route.adapters == [ADAPTER, "b"]
    assert target_from_route(route).adapters == (ADAPTER, "b")
    old = RouteTarget(replica_id="r1", model="chat", state=ShardState.READY)  # older server
    assert target_from_route(old).adapters == ()


async def test_the_gateway_proxies_an_adapters_request_to_its_replica() -> None:
    flags = ("--served-model-name", "chat", "--enable-lora", "--lora-modules")
    async with sim_engine("/models/chat", *flags, f"{ADAPTER}=/a/sql", *NO_TIME) as url:
        table = RoutingTable([Target("r1", "chat", url, adapters=(ADAPTER,))])
        gateway = Gateway(table, GatewayConfig(port=0, engine_poll_s=0))
        host, port = await gateway.start()
        try:
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=10) as client:
                body = {"model": ADAPTER, "prompt": "SELECT", "max_tokens": 2}
                reply = await client.post("/v1/completions", json=body)
                assert reply.status_code == 200, reply.text
                assert reply.json()["model"] == ADAPTER
                listed = (await client.get("/v1/models")).json()["data"]
                assert [m["id"] for m in listed] == ["chat", ADAPTER]
                table.replace_all([Target("r1", "chat", url, ready=False, adapters=(ADAPTER,))])
                reply = await client.post("/v1/completions", json=body)
                assert reply.status_code == 503, reply.text  # known, not ready: not a 404
        finally:
            await gateway.stop()
