"""A gateway's figures as ``RouterStats``: what ``GetRouterStats`` answers for the in-server
gateway, and what a separate ``llmgw gateway`` reports (``RouterService.Report``).

One function for both (and one for the signals per model the autoscaler reads, and one
for the tenant keys' metering, ``RouterReport.usage``), so the
server's own figures and every reported gateway's add up field by field. Counters are
cumulative since the gateway started; ``in_flight`` is a gauge.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.api.llmgw.v1 import (
    ModelSignals,
    ReplicaRouterStats,
    RouteCandidate,
    RouteDecision,
    RouterStats,
    TenantUsage,
)
from llmgw.gateway.app import Gateway
from llmgw.gateway.routelog import RouteRecord
from llmgw.gateway.routing.explain import explain, predicted_reuse

MAX_CANDIDATES = 8
"""Candidates kept per reported decision: the chosen one and those holding the most."""
_U32 = 2**32 - 1


def router_stats(gateway: Gateway, now_ms: int) -> RouterStats:
    """``gateway``'s counters as ``RouterStats`` (cumulative), read at wall clock ``now_ms``."""
    figures = gateway.metrics.figures()
    totals = gateway.reuse.totals()
    by_tier: dict[str, int] = {}
    for (tier, _), count in figures.decisions.items():
        by_tier[tier] = by_tier.get(tier, 0) + count
    return RouterStats(
        decisions=sum(by_tier.values()),
        decisions_by_tier=by_tier,
        decisions_by_tier_outcome={f"{t}/{o}": n for (t, o), n in figures.decisions.items()},
        requests_by_status=dict(figures.requests),
        reuse_available_tokens=figures.reuse.get("available", 0),
        reuse_captured_tokens=figures.reuse.get("captured", 0),
        reuse_delivered_tokens=figures.reuse.get("delivered", 0),
        router_prompt_tokens=figures.reuse_prompt.get("router", 0),
        engine_prompt_tokens=figures.reuse_prompt.get("engine", 0),
        replicas=replica_rows(gateway, figures.routed),
        at_unix_ms=now_ms,
        recent_decisions=[route_decision(r) for r in gateway.route_log.records()],
        route_predicted_tokens=totals.predicted,
        route_cached_tokens=totals.cached,
        route_gap_tokens=totals.gap,
        route_checked_requests=totals.checked,
        route_checked_prompt_tokens=totals.prompt,
    )


def model_signals(gateway: Gateway) -> list[ModelSignals]:
    """``gateway``'s signals per model for the autoscaler (cumulative; ``modelsignals``),
    their histograms over ``modelsignals.LATENCY_BOUNDS_MS``."""
    return gateway.signals.signals(gateway.holding.waiting())


def tenant_usage(gateway: Gateway) -> list[TenantUsage]:
    """``gateway``'s metering per tenant key and model (cumulative; tenantmeter.py)."""
    return gateway.tenants.meter.usage()


def route_decision(record: RouteRecord) -> RouteDecision:
    """One kept decision, explained, as the wire carries it."""
    explained = explain(record.decision, record.fallback)
    chosen = explained.replica_id
    ranked = sorted(
        explained.candidates,
        key=lambda c: (c.replica_id != chosen, -c.matched, c.in_flight, c.replica_id),
    )[:MAX_CANDIDATES]
    return RouteDecision(
        at_unix_ms=record.at_ms,
        model=record.model,
        tier=explained.tier,
        outcome=explained.outcome,
        replica_id=chosen,
        reason=explained.reason,
        matched=min(explained.matched, _U32),
        total=min(explained.total, _U32),
        unit=explained.unit,
        candidates=[
            RouteCandidate(
                replica_id=c.replica_id,
                matched=min(c.matched, _U32),
                in_flight=min(c.in_flight, _U32),
            )
            for c in sorted(ranked, key=lambda c: c.replica_id)
        ],
        fallback=record.fallback,
        predicted_tokens=_u32(predicted_reuse(record.decision)),
        cached_tokens=_u32(record.cached_tokens),
    )


def _u32(value: int | None) -> int | None:
    return None if value is None else min(max(0, value), _U32)


def replica_rows(gateway: Gateway, routed: Mapping[str, int]) -> list[ReplicaRouterStats]:
    """One row per replica in the routing table or with requests in flight, by id."""
    in_flight = gateway.load.snapshot()
    ids = sorted({t.replica_id for t in gateway.table.targets()} | set(in_flight))
    rows: list[ReplicaRouterStats] = []
    for replica_id in ids:
        facts = gateway.engines.facts(replica_id)
        rows.append(
            ReplicaRouterStats(
                replica_id=replica_id,
                in_flight=in_flight.get(replica_id, 0),
                requests=routed.get(replica_id, 0),
                delivered_hit_ratio=facts.hit_ratio if facts is not None else None,
                kv_capacity_tokens=facts.kv_tokens if facts is not None else 0,
                kv_usage=facts.kv_usage if facts is not None else None,
                engine_waiting=facts.waiting if facts is not None else None,
                engine_running=facts.running if facts is not None else None,
            )
        )
    return rows


__all__ = [
    "MAX_CANDIDATES",
    "model_signals",
    "replica_rows",
    "route_decision",
    "router_stats",
    "tenant_usage",
]
