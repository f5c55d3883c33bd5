"""The autoscaler's I/O edge: rounds of the planner (``llmgw.server.core.autoscale``) over
every deployment with an autoscale policy, against the control plane.

Every ``interval_s`` (``llmgw server --autoscale-interval``, default 5 s) a round

1. takes every live gateway's latest report (``reports``: the separate gateways' as the
   server last received them, and the in-server gateway's read now) and keeps each gateway
   process's reports of the last ``window_s`` (``--autoscale-window``, default 30 s) and
   the one before them (``llmgw.server.core.autoscale_window.keep``);
2. builds, per deployment with a policy, the planner's :class:`Signals` (the window's
   differences over the gateways' cumulative figures for the deployment's models: the p90
   of TTFT and ITL, answered requests, the arrival rate; in-flight and held requests now;
   the engines' waiting and running requests and KV cache usage over its READY replicas,
   from the gateways' replica rows, ``rows``) and its :class:`Current` (its count, READY
   and coming replicas from its status, its profile's GPUs, pool and priority);
3. calls :func:`plan` with the :class:`Memory` the deployment's last round returned (kept
   in memory only: a restarted server starts afresh), then :func:`share_budget` over every
   deployment when a pool has a GPU budget (``--gpu-budget POOL=N``; a fixed-count
   deployment of such a pool weighs as a claim of its count, mode "advise"); a decision
   for more replicas while the reconciler finds no place for some the count already asks
   for holds the count instead (reason ``hold``, saying why: more would find none either);
4. in mode "act", stores a new count through the path ``llmgw scale`` takes
   (``DesiredState.update``: durable before it shows, published on Watch) and pokes the
   reconciler; mode "advise" changes nothing;
5. sets the deployment's ``DeploymentStatus.autoscale`` (``llmgw.server.state.deploystatus``,
   published on Watch when it changes) and counts the decision by reason (the server's
   ``/metrics``: ``llmgw_autoscale_decisions_total``, ``llmgw_autoscale_desired``).

Every decision that changes the planner's count (``desired``; a new policy's first one
when it differs from the count) is an audit record: actor ``autoscaler``, target
``deployment/NAME``, action ``autoscale`` (the count changed: "REASON: FROM → TO: why
(signal)") or ``autoscale-advise`` (mode advise: "REASON: would scale FROM → TO: …"). The
audit log is what ``llmgw describe deployment`` and the console's events view show.

A round that fails (the store, a bug) is logged and the next one tries again; a count the
store could not take is decided again next round (the planner's memory of that round is
not kept).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from llmgw.api.llmgw.v1 import (
    AutoscaleStatus,
    Deployment,
    DeploymentStatus,
    ReplicaRouterStats,
    ShardState,
)
from llmgw.server.core.autoscale import (
    ACT,
    ADVISE,
    Claim,
    Current,
    Decision,
    Memory,
    Policy,
    Signals,
    Tuning,
    plan,
)
from llmgw.server.core.autoscale_budget import share_budget
from llmgw.server.core.autoscale_window import (
    EngineFigures,
    GatewayReport,
    WindowFigures,
    deployment_models,
    engine_figures,
    gpus_per_replica,
    keep,
    measure,
)
from llmgw.server.core.reconcile_state import Lifecycle
from llmgw.server.errors import Deposed, StoreUnwritable
from llmgw.server.state.history import ACTING
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import now_ms
from llmgw.server.state.storeschema import AuditRecord

__all__ = [
    "ACTOR",
    "DEFAULT_INTERVAL_S",
    "DEFAULT_WINDOW_S",
    "AutoscaleConfig",
    "AutoscaleLoop",
    "ReportsFn",
    "RowsFn",
]

log = logging.getLogger(__name__)

ACTOR = "autoscaler"
"""The actor of the audit records the autoscaler appends."""
DEFAULT_INTERVAL_S = 5.0
DEFAULT_WINDOW_S = 30.0

ReportsFn = Callable[[], Iterable[GatewayReport]]
"""Every live gateway's latest report, each stamped with when it was taken (monotonic s)."""
RowsFn = Callable[[], Iterable[ReplicaRouterStats]]
"""The gateways' replica rows, merged (GetRouterStats' ``replicas``)."""

_LIVE = (Lifecycle.ACTIVE, Lifecycle.SURGE)
_BATCH = 64  # deployments measured or settled between two turns of the event loop


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """How often the autoscaler decides, over how long a window, and the GPU budgets."""

    interval_s: float = DEFAULT_INTERVAL_S
    window_s: float = DEFAULT_WINDOW_S
    budgets: Mapping[str, int] = field(default_factory=dict)  # pool → GPUs
    tuning: Tuning | None = None  # None: Tuning(window_s=window_s)

    @property
    def planner(self) -> Tuning:
        return self.tuning or Tuning(window_s=self.window_s)


@dataclass(frozen=True, slots=True)
class _Round:
    """What one deployment's round stands on."""

    deployment: Deployment
    policy: Policy
    current: Current
    signals: Signals
    unplaceable: str = ""  # why replicas it already asks for have no place ("": none)


class AutoscaleLoop:
    """Runs the autoscaler's rounds against ``plane`` (see the module docstring)."""

    def __init__(
        self,
        plane: ControlPlane,
        reports: ReportsFn,
        rows: RowsFn,
        config: AutoscaleConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.plane = plane
        self.reports = reports
        self.rows = rows
        self.config = config or AutoscaleConfig()
        self.clock = clock
        self.memory: dict[str, Memory] = {}  # deployment → what its last round returned
        self._histories: dict[str, tuple[GatewayReport, ...]] = {}  # gateway → its reports
        self._lock = asyncio.Lock()

    async def run(self) -> None:
        """A round every ``interval_s`` seconds, until cancelled."""
        log.info(
            "autoscaler: a round every %g s over a %g s window",
            self.config.interval_s,
            self.config.window_s,
        )
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Deposed as exc:  # the lease ran out: the term ends, nothing was stored
                log.warning("autoscaler round not stored: %s", exc)
            except StoreUnwritable as exc:  # logged by the store's health
                log.debug("autoscaler round not stored (%s); trying again next round", exc)
            except Exception:  # one failed round must not end autoscaling
                log.exception("autoscaler round failed; trying again next round")

    async def round(self) -> dict[str, Decision]:
        """One round: measure, decide, store, show. The decisions by deployment (one the
        planner failed for has none: its count and status stay as they were)."""
        async with self._lock:
            now = self.clock()
            self._take(now)
            rounds = await self._rounds()
            decisions = self._decide(rounds, now)
            for i, name in enumerate(sorted(decisions)):
                if i % _BATCH == _BATCH - 1:
                    await asyncio.sleep(0)  # let the in-server gateway serve meanwhile
                await self._settle(rounds[name], decisions[name])
            self._forget(rounds.keys())
            self.plane.publish_statuses(rounds.keys())
            return decisions

    def _take(self, now: float) -> None:
        """Keep each live gateway's new report; forget the gateways that left."""
        window = self.config.window_s
        kept = {}
        for report in self.reports():
            kept[report.gateway] = keep(self._histories.get(report.gateway, ()), report, window)
        self._histories = kept

    async def _rounds(self) -> dict[str, _Round]:
        """What each deployment with a policy stands on now."""
        desired = self.plane.desired
        rows = {row.replica_id: row for row in self.rows()}
        ready = self._ready()
        out = {}
        for i, (name, deployment) in enumerate(list(desired.deployments.items())):
            if i % _BATCH == _BATCH - 1:
                await asyncio.sleep(0)  # let the in-server gateway serve meanwhile
            profile = desired.profiles.get(deployment.profile)
            if deployment.autoscale is None or profile is None:
                continue
            figures = measure(self._histories, deployment_models(profile))
            status = self.plane.statuses.status(deployment, remember=False)
            mine = ready.get(name, set())
            engines = engine_figures([rows[r] for r in mine if r in rows], mine)
            out[name] = _Round(
                deployment=deployment,
                policy=Policy.from_proto(deployment.autoscale),
                current=_current(deployment, status, gpus_per_replica(profile)),
                signals=_signals(figures, engines),
                unplaceable=status.unplaceable_reason if status.unplaceable else "",
            )
        return out

    def _ready(self) -> dict[str, set[str]]:
        """The READY live replicas of each deployment, by deployment."""
        plane = self.plane
        out: dict[str, set[str]] = {}
        for record in plane.replicas.values():
            if record.lifecycle in _LIVE and plane.replica_view(record).state is ShardState.READY:
                out.setdefault(record.plan.deployment, set()).add(record.replica_id)
        return out

    def _decide(self, rounds: Mapping[str, _Round], now: float) -> dict[str, Decision]:
        """The planner's decisions, then the pools' GPU budgets over them."""
        tuning = self.config.planner
        claims = {}
        for name, one in rounds.items():
            memory = self.memory.get(name, Memory())
            try:
                decision = plan(one.policy, one.signals, one.current, memory, now, tuning)
            except Exception:  # a planner bug: this deployment's count holds, the others go on
                log.exception("autoscaler: no decision for deployment %s this round", name)
                continue
            claims[name] = Claim(decision, one.current, one.policy)
        budgets = self.config.budgets
        if budgets:
            claims.update(self._fixed_claims(rounds.keys()))
            decisions = share_budget(claims, budgets)
        else:
            decisions = {name: claim.decision for name, claim in claims.items()}
        return {
            name: self._placeable(one, decisions[name])
            for name, one in rounds.items()
            if name in decisions
        }

    def _placeable(self, one: _Round, decision: Decision) -> Decision:
        """``decision``, unless it asks for more replicas while some it already asks for
        have no place: then the count holds (more would find none either), saying why."""
        if not one.unplaceable or decision.desired <= one.current.count:
            return decision
        memory = self.memory.get(one.deployment.name, Memory())  # the planner changed nothing
        why = f"no place for more replicas: {one.unplaceable}"
        return Decision(one.current.count, "hold", why, decision.signal, memory)

    def _fixed_claims(self, autoscaled: Iterable[str]) -> dict[str, Claim]:
        """The deployments of a budgeted pool without a policy, as claims of their count."""
        skip = set(autoscaled)
        desired = self.plane.desired
        out = {}
        for name, deployment in desired.deployments.items():
            profile = desired.profiles.get(deployment.profile)
            if name in skip or profile is None or deployment.pool not in self.config.budgets:
                continue
            count = deployment.replicas
            status = self.plane.statuses.status(deployment, remember=False)
            current = _current(deployment, status, gpus_per_replica(profile))
            decision = Decision(count, "hold", "a fixed count", "", Memory())
            out[name] = Claim(decision, current, Policy(min=count, max=count, mode=ADVISE))
        return out

    async def _settle(self, one: _Round, decision: Decision) -> None:
        """Act on one deployment's decision (mode act), show it, audit a change."""
        name, count = one.deployment.name, one.current.count
        board = self.plane.statuses
        before = board.autoscale_of(name)
        at = now_ms()
        changed = one.policy.mode == ACT and decision.desired != count
        if changed:
            ACTING.set((ACTOR, f"autoscale {decision.reason}"))  # who a revision names
            stored = await self.plane.desired.update(name, _set_count(decision.desired))
            if stored is None:  # deleted meanwhile
                return
            self.plane.reconcile_soon()
        self.memory[name] = decision.memory
        board.decisions[(name, decision.reason)] += 1
        was = before.desired if before is not None else count
        decided = at if decision.desired != was else (before.decided_unix_ms if before else 0)
        board.set_autoscale(
            name,
            _status(
                one,
                decision,
                decided_ms=decided,
                changed_ms=at if changed else (before.changed_unix_ms if before else 0),
                budget=self.config.budgets.get(one.deployment.pool, 0),
            ),
        )
        # In mode act a count changed by someone else (a re-apply clamping it) is no decision.
        if decision.desired != was and (changed or one.policy.mode != ACT):
            await self.plane.audit_all([_record(one, decision, at, acted=changed)])
            log.info(
                "autoscaler: deployment %s %s %d → %d: %s",
                name,
                decision.reason if changed else f"would {decision.reason}",
                count,
                decision.desired,
                decision.message,
            )

    def _forget(self, autoscaled: Iterable[str]) -> None:
        """Drop what is kept of deployments that are gone or have no policy any more."""
        keep_names = set(autoscaled)
        board = self.plane.statuses
        for name in set(self.memory) - keep_names:
            del self.memory[name]
        for name in set(board.autoscaled()) - keep_names:
            board.set_autoscale(name, None)


def _current(deployment: Deployment, status: DeploymentStatus, gpus: int) -> Current:
    # Replicas the count asks for and the reconciler has not placed yet are coming too,
    # unless it found no place for them.
    unplaced = 0 if status.unplaceable_reason else max(0, status.desired - status.replicas)
    return Current(
        count=deployment.replicas,
        ready=status.ready,
        coming=status.starting + unplaced,
        gpus_per_replica=gpus,
        pool=deployment.pool,
        priority=deployment.priority,
    )


def _set_count(n: int) -> Callable[[Deployment], None]:
    """The edit storing the planner's count, unless the stored deployment (re-applied
    meanwhile) is no longer in mode act."""

    def edit(deployment: Deployment) -> None:
        policy = deployment.autoscale
        if policy is not None and (policy.mode or ACT) == ACT:
            deployment.replicas = min(max(n, policy.min), max(policy.max, policy.min))

    return edit


def _signals(window: WindowFigures, engines: EngineFigures) -> Signals:
    return Signals(
        ttft_p90_ms=window.ttft_p90_ms,
        itl_p90_ms=window.itl_p90_ms,
        samples=window.samples,
        arrival_rps=window.arrival_rps,
        in_flight=window.in_flight,
        waiting=window.waiting,
        engine_waiting=engines.waiting,
        engine_running=engines.running,
        kv_usage=engines.kv_usage,
    )


def _known(value: float | None, digits: int = 1) -> float:
    """A figure as AutoscaleStatus carries it: rounded (fewer Watch events), -1 unknown."""
    return -1.0 if value is None else round(value, digits)


def _status(
    one: _Round, decision: Decision, *, decided_ms: int, changed_ms: int, budget: int
) -> AutoscaleStatus:
    signals = one.signals
    return AutoscaleStatus(
        mode=one.policy.mode,
        current=one.current.count,
        desired=decision.desired,
        reason=decision.reason,
        message=decision.message,
        signal=decision.signal,
        decided_unix_ms=decided_ms,
        changed_unix_ms=changed_ms,
        ttft_p90_ms=_known(signals.ttft_p90_ms),
        itl_p90_ms=_known(signals.itl_p90_ms),
        arrival_rps=round(signals.arrival_rps, 2),
        in_flight=signals.in_flight,
        waiting=signals.waiting,
        kv_usage=_known(signals.kv_usage, 3),
        gpu_budget=budget,
    )


def _record(one: _Round, decision: Decision, at: int, *, acted: bool) -> AuditRecord:
    """The audit record of a decision that changed the planner's count."""
    count, name = one.current.count, one.deployment.name
    why = decision.message + (f" ({decision.signal})" if decision.signal else "")
    if acted:
        result = f"{decision.reason}: {count} → {decision.desired}: {why}"
        return AuditRecord(at, ACTOR, "autoscale", f"deployment/{name}", result)
    result = f"{decision.reason}: would scale {count} → {decision.desired}: {why}"
    return AuditRecord(at, ACTOR, "autoscale-advise", f"deployment/{name}", result)
