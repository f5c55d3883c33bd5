"""A gateway's figures as ``RouterStats``: what ``GetRouterStats`` answers for the in-server
gateway, and what a separate ``llmgw gateway`` reports (``RouterService.Report``).

One function for both, so the server's own figures and every reported gateway's add up
field by field. Counters are cumulative since the gateway started; ``in_flight`` is a gauge.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.api.llmgw.v1 import ReplicaRouterStats, RouterStats
from llmgw.gateway.app import Gateway


def router_stats(gateway: Gateway, now_ms: int) -> RouterStats:
    """``gateway``'s counters as ``RouterStats`` (cumulative), read at wall clock ``now_ms``."""
    figures = gateway.metrics.figures()
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
    )


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
            )
        )
    return rows


__all__ = ["replica_rows", "router_stats"]
