"""``llmgw get routes``: the last routing decisions, as ``GetRouterStats`` answers them.

One row per decision, oldest first (the server merges every gateway's last 200 by time):
when, the gateway that decided (``-`` the in-server one), the model, the tier, the chosen
replica, what it held of the request (blocks for the precise tier, characters for the
approximate one), the cached tokens its engine reported, each candidate's match and
requests in flight, and the reason (``llmgw.gateway.routing.explain``). ``-o json`` prints
``{"recentDecisions": [...], "predictedTokens", "cachedTokens", "gapTokens",
"checkedRequests", "checkedPromptTokens"}`` (the decisions in proto3 JSON; the rest the
precise tier's check, cumulative over every gateway: ``RouterStats.route_*``).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from llmgw.api.llmgw.v1 import RouteDecision
from llmgw.cli.rpc import call
from llmgw.cli.tables import render_table

__all__ = ["decision_rows", "run_get_routes"]

HEADER = ["TIME", "GATEWAY", "MODEL", "TIER", "REPLICA", "MATCHED", "CACHED", "CANDIDATES"]


async def run_get_routes(server: str, output: str) -> int:
    stats = await call(server, lambda client: client.get_router_stats())
    decisions = list(stats.recent_decisions)
    if output == "json":
        body: dict[str, Any] = {
            "recentDecisions": [d.to_dict() for d in decisions],
            "predictedTokens": stats.route_predicted_tokens,
            "cachedTokens": stats.route_cached_tokens,
            "gapTokens": stats.route_gap_tokens,
            "checkedRequests": stats.route_checked_requests,
            "checkedPromptTokens": stats.route_checked_prompt_tokens,
        }
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
    else:
        sys.stdout.write(render_table(decision_rows(decisions)) + "\n")
    return 0


def decision_rows(decisions: list[RouteDecision]) -> list[list[str]]:
    """The table: a header, then one row per decision (the reason last, unpadded)."""
    return [[*HEADER, "REASON"], *(_row(decision) for decision in decisions)]


def _row(decision: RouteDecision) -> list[str]:
    candidates = " ".join(f"{c.replica_id}:{c.matched}/{c.in_flight}" for c in decision.candidates)
    return [
        _clock(decision.at_unix_ms),
        decision.gateway_id or "-",
        decision.model,
        decision.tier,
        decision.replica_id,
        _matched(decision),
        "-" if decision.cached_tokens is None else str(decision.cached_tokens),
        candidates or "-",
        decision.reason,
    ]


def _clock(at_ms: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at_ms / 1000)) if at_ms > 0 else "-"


def _matched(decision: RouteDecision) -> str:
    if not decision.unit:
        return "-"
    suffix = "b" if decision.unit == "blocks" else "c"
    return f"{decision.matched}/{decision.total}{suffix}"
