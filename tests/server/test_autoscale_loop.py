"""The autoscale loop against an in-process ControlPlane: the gateways' figures it is given,
the planner's decisions, the counts it stores (mode act) or only shows (mode advise)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    AutoscalePolicy,
    ControlMessage,
    Deployment,
    EngineProfile,
    ModelSignals,
    Register,
    ReplicaRouterStats,
    ShardState,
    ShardStatus,
)
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server import autoscale_loop
from llmgw.server.autoscale_loop import AutoscaleConfig, AutoscaleLoop
from llmgw.server.core import autoscale
from llmgw.server.core.autoscale import Decision, Policy
from llmgw.server.core.autoscale_window import GatewayReport
from llmgw.server.reconcile_loop import ReconcileLoop
from llmgw.server.state.desired import Change
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.metrics import server_metrics

PROFILE = EngineProfile(
    name="chat-1", engine="sim", gpu_class="H100", tp=1, pp=1, gpus_per_node=1, nodes=1,
    model_path="/m/chat", served_model_name="chat",
)  # fmt: skip
BOUNDS = (50.0, 100.0, 200.0, 400.0, 800.0, 1600.0, 3200.0)
WINDOW_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Gateways:
    """One gateway's cumulative figures for model "chat", reported as a round asks."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.arrivals = 0
        self.ttft = [0] * (len(BOUNDS) + 1)
        self.in_flight = 0
        self.present = True

    def serve(self, n: int, ttft_ms: float) -> None:
        """``n`` requests answered with this time to first token."""
        self.arrivals += n
        for i, bound in enumerate((*BOUNDS, float("inf"))):
            if ttft_ms <= bound:
                self.ttft[i] += n

    def __call__(self) -> list[GatewayReport]:
        if not self.present:
            return []
        signals = ModelSignals(
            model="chat",
            arrivals=self.arrivals,
            answered=self.ttft[-1],
            ttft_counts=list(self.ttft),
            itl_counts=[0] * (len(BOUNDS) + 1),
            in_flight=self.in_flight,
        )
        return [GatewayReport("gw-1@1", self.clock(), BOUNDS, {"chat": signals})]


class Agents:
    """Takes every command; reports each started shard READY when asked."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.sent: list[tuple[str, ControlMessage]] = []

    async def send(self, node_id: str, message: ControlMessage) -> bool:
        self.sent.append((node_id, message))
        return True

    def ready(self) -> None:
        for node_id, message in self.sent:
            start = message.start_shard
            if start is None:
                continue
            self.plane.shard_status(
                node_id,
                ShardStatus(
                    shard_id=start.shard_id,
                    replica_id=start.replica_id,
                    state=ShardState.READY,
                    endpoint=f"http://127.0.0.1:{start.port}",
                    profile_fingerprint=start.profile_fingerprint,
                    gpu_uuids=start.gpu_uuids,
                ),
            )


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        node = simulated_node("dgx-h100", node_id="n1", hostname="n1")
        register = Register(protocol_version=PROTOCOL_VERSION, node=node)
        await plane.register(node, register, peer="10.0.0.1:5000")
        yield plane


async def _apply(
    plane: ControlPlane,
    replicas: int,
    *,
    mode: str = "act",
    profile: EngineProfile = PROFILE,
    **policy: int,
) -> None:
    autoscale = AutoscalePolicy(
        min=policy.get("min", 1), max=policy.get("max", 4), ttft_p90_ms=800,
        scale_down_after_s=policy.get("down_s", 20), mode=mode,
    )  # fmt: skip
    deployment = Deployment(name="chat", profile=profile.name, replicas=replicas)
    deployment.autoscale = autoscale
    await plane.desired.apply(Change((profile,), deployment, profile))


class Fleet:
    """The plane, its reconciler with agents that start every shard, and the autoscaler."""

    def __init__(self, plane: ControlPlane, budgets: dict[str, int] | None = None) -> None:
        self.plane = plane
        self.clock = Clock()
        self.gateways = Gateways(self.clock)
        self.agents = Agents(plane)
        self.rows: list[ReplicaRouterStats] = []
        self.reconciler = ReconcileLoop(plane, self.agents.send, clock=self.clock)
        config = AutoscaleConfig(interval_s=1.0, window_s=WINDOW_S, budgets=budgets or {})
        self.scaler = AutoscaleLoop(
            plane, self.gateways, lambda: self.rows, config, clock=self.clock
        )

    async def settle(self) -> None:
        """A reconciliation round, its shards READY, and one more round."""
        await self.reconciler.round()
        self.agents.ready()
        await self.reconciler.round()

    async def rounds(self, seconds: float, *, rps: int = 0, ttft_ms: float = 0.0) -> None:
        """An autoscaler round each second for ``seconds``, under ``rps`` requests a second."""
        for _ in range(int(seconds)):
            self.clock.now += 1.0
            if rps:
                self.gateways.serve(rps, ttft_ms)
            await self.scaler.round()
            await self.settle()

    def count(self) -> int:
        return self.plane.desired.deployments["chat"].replicas

    def audit(self) -> list[tuple[str, str, str]]:
        events = self.plane.snapshot().events
        return [(e.action, e.target, e.result) for e in events if e.actor == "autoscaler"]


async def test_slow_answers_scale_up_stored_audited_and_shown(plane: ControlPlane) -> None:
    await _apply(plane, 1)
    fleet = Fleet(plane)
    await fleet.settle()
    await fleet.rounds(3, rps=20, ttft_ms=3000.0)  # p90 far above the 800 ms target
    assert fleet.count() > 1
    stored = {d.name: d for d in await plane.store.load_deployments()}
    assert Deployment.parse(stored["chat"].deployment).replicas == fleet.count()
    audit = fleet.audit()
    assert audit and audit[0][:2] == ("autoscale", "deployment/chat")
    assert audit[0][2].startswith("scale_up: 1 → ")
    shown = plane.snapshot().deployments[0].status
    assert shown is not None and shown.autoscale is not None
    assert shown.autoscale.mode == "act" and shown.autoscale.current == fleet.count()
    assert shown.autoscale.ttft_p90_ms > 800.0 and shown.autoscale.arrival_rps > 0
    assert shown.autoscale.changed_unix_ms > 0 and shown.autoscale.decided_unix_ms > 0
    metrics = server_metrics(plane, 1).decode()
    assert f'llmgw_autoscale_desired{{deployment="chat"}} {fleet.count()}' in metrics
    assert 'llmgw_autoscale_decisions_total{deployment="chat",reason="scale_up"}' in metrics


async def test_it_scales_back_down_once_the_load_is_gone(plane: ControlPlane) -> None:
    await _apply(plane, 1, down_s=5)
    fleet = Fleet(plane)
    await fleet.settle()
    await fleet.rounds(6, rps=20, ttft_ms=3000.0)
    peak = fleet.count()
    assert peak > 1
    await fleet.rounds(90)  # the load is gone
    assert fleet.count() == 1
    assert any(a[2].startswith("scale_down: ") for a in fleet.audit())


async def test_advise_changes_nothing_and_says_what_it_would_do_once(plane: ControlPlane) -> None:
    await _apply(plane, 1, mode="advise")
    fleet = Fleet(plane)
    await fleet.settle()
    await fleet.rounds(4, rps=20, ttft_ms=3000.0)
    assert fleet.count() == 1
    shown = plane.snapshot().deployments[0].status
    assert shown is not None and shown.autoscale is not None
    assert shown.autoscale.mode == "advise" and shown.autoscale.current == 1
    assert shown.autoscale.desired > 1 and shown.autoscale.changed_unix_ms == 0
    advice = [a for a in fleet.audit() if a[0] == "autoscale-advise"]
    assert advice and all(" would scale 1 → " in a[2] for a in advice)
    assert not [a for a in fleet.audit() if a[0] == "autoscale"]
    desired = shown.autoscale.desired
    await fleet.rounds(2, rps=20, ttft_ms=3000.0)
    again = plane.snapshot().deployments[0].status
    assert again is not None and again.autoscale is not None
    if again.autoscale.desired == desired:  # the same advice is no new event
        assert len([a for a in fleet.audit() if a[0] == "autoscale-advise"]) == len(advice)


async def test_no_figures_hold_the_count_and_a_removed_policy_shows_none(
    plane: ControlPlane,
) -> None:
    await _apply(plane, 2, min=2)
    fleet = Fleet(plane)
    fleet.gateways.present = False
    await fleet.settle()
    await fleet.rounds(3)
    assert fleet.count() == 2
    status = plane.snapshot().deployments[0].status
    assert status is not None and status.autoscale is not None
    assert status.autoscale.ttft_p90_ms == -1.0 and status.autoscale.kv_usage == -1.0
    plain = Deployment(name="chat", profile=PROFILE.name, replicas=2)
    await plane.desired.apply(Change((), plain, PROFILE))
    await fleet.rounds(1)
    status = plane.snapshot().deployments[0].status
    assert status is not None and status.autoscale is None
    assert "chat" not in fleet.scaler.memory
    assert "llmgw_autoscale_desired{" not in server_metrics(plane, 1).decode()


async def test_engine_figures_are_read_from_the_ready_replicas_rows(plane: ControlPlane) -> None:
    await _apply(plane, 2, min=2)
    fleet = Fleet(plane)
    await fleet.settle()
    ready = sorted(plane.replicas)
    fleet.rows = [
        ReplicaRouterStats(replica_id=ready[0], kv_usage=0.5, engine_waiting=1),
        ReplicaRouterStats(replica_id=ready[1], kv_usage=0.25, engine_waiting=2),
        ReplicaRouterStats(replica_id="gone-1", kv_usage=1.0, engine_waiting=50),
    ]
    await fleet.rounds(1)
    status = plane.snapshot().deployments[0].status
    assert status is not None and status.autoscale is not None
    assert status.autoscale.kv_usage == 0.375


async def test_no_more_replicas_are_asked_for_while_some_have_no_place(
    plane: ControlPlane,
) -> None:
    whole_node = EngineProfile(
        name="chat-8", engine="sim", gpu_class="H100", tp=8, pp=1, gpus_per_node=8, nodes=1,
        model_path="/m/chat", served_model_name="chat",
    )  # fmt: skip
    await _apply(plane, 2, min=2, max=6, profile=whole_node)  # one node of 8 GPUs: one fits
    fleet = Fleet(plane)
    await fleet.settle()
    await fleet.rounds(4, rps=20, ttft_ms=3000.0)
    assert fleet.count() == 2
    status = plane.snapshot().deployments[0].status
    assert status is not None and status.autoscale is not None
    assert status.autoscale.desired == 2 and status.autoscale.reason in ("hold", "pending")
    if status.autoscale.reason == "hold":  # the loop's own rule, where the planner wanted more
        assert status.autoscale.message.startswith("no place for more replicas: ")
    assert fleet.audit() == []


async def test_a_pools_gpu_budget_caps_the_count_and_says_budget(tmp_path: Path) -> None:
    async with Store(tmp_path / "b.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        node = simulated_node("dgx-h100", node_id="g1", hostname="g1", labels={"pool": "gpu"})
        register = Register(protocol_version=PROTOCOL_VERSION, node=node)
        await plane.register(node, register, peer="10.0.0.2:5000")
        await _apply(plane, 1, max=6)
        chat = Deployment.parse(bytes(plane.desired.deployments["chat"]))
        chat.pool, chat.priority = "gpu", 1
        await plane.desired.apply(Change((), chat, PROFILE))
        batch = Deployment(name="batch", profile=PROFILE.name, replicas=2, pool="gpu")
        await plane.desired.apply(Change((), batch, PROFILE))  # a fixed count: 2 GPUs
        fleet = Fleet(plane, budgets={"gpu": 4})
        await fleet.settle()
        await fleet.rounds(4, rps=40, ttft_ms=3000.0)
        assert fleet.count() == 2  # 4 GPUs less the fixed deployment's 2
        assert plane.desired.deployments["batch"].replicas == 2
        shown = {d.name: d.status for d in plane.snapshot().deployments}
        status = shown["chat"]
        assert status is not None and status.autoscale is not None
        assert status.autoscale.gpu_budget == 4 and status.autoscale.reason == "budget"
        assert shown["batch"] is not None and shown["batch"].autoscale is None


async def test_a_planner_failure_for_one_deployment_leaves_the_others_decided(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    await _apply(plane, 1)
    other = Deployment(name="other", profile=PROFILE.name, replicas=1)
    other.autoscale = AutoscalePolicy(min=1, max=5, ttft_p90_ms=800, mode="act")
    await plane.desired.apply(Change((), other, PROFILE))
    planner = autoscale.plan

    def failing(policy: Policy, *args: Any, **kwargs: Any) -> Decision:
        if policy.max == 5:
            raise ZeroDivisionError("a planner bug")
        return planner(policy, *args, **kwargs)

    monkeypatch.setattr(autoscale_loop, "plan", failing)
    fleet = Fleet(plane)
    await fleet.settle()
    fleet.clock.now += 1.0
    decisions = await fleet.scaler.round()
    assert set(decisions) == {"chat"}
    shown = {d.name: d.status for d in plane.snapshot().deployments}
    assert shown["chat"] is not None and shown["chat"].autoscale is not None
    assert shown["other"] is not None and shown["other"].autoscale is None
    assert "no decision for deployment other" in caplog.text
    assert plane.desired.deployments["other"].replicas == 1
