"""Metered usage on the server (issue #18): the gateways' reports into the hourly ledger,
the ledger into the store, and ``GetUsage``.

Every ``RouterReport.usage`` (a separate gateway's, relayed to the leader by a follower)
and, every round, the in-server gateway's own meter go into the plane's ``UsageLedger``
(``llmgw.server.state.usage``: differences of cumulative counters, by UTC hour); every
``FLUSH_S`` the pending deltas are written to ``tenant_usage_hourly`` in one transaction,
off the request path. A failed write (a full or read-only disk, a lost PostgreSQL) gives
the batch back to the ledger, which retries it at the next flush: nothing counted is lost
while the server runs. ``GetUsage`` answers the stored rows plus what is pending, so an
answer is current to the latest report. A report's usage rows are bounded
(``MAX_USAGE_ROWS``; past it the report's usage is refused with a warning, its routing
figures kept).
"""

from __future__ import annotations

import logging
import math
import time

from llmgw.api.llmgw.v1 import TenantUsage, UsageRequest, UsageResponse, UsageRow
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.usage import UsageCounts, UsageKey, UsageLedger, hour_of

log = logging.getLogger(__name__)

FLUSH_S = 5.0
"""How often pending usage is written to the store."""
MAX_COUNT = 2**48
"""The largest cumulative counter taken from a report (sums of them stay within int64)."""
MAX_USAGE_ROWS = 4096
"""Usage rows one report may carry (tenant × key × model)."""


def counts_of(usage: TenantUsage) -> UsageCounts:
    """A reported row's counters, each clamped to ``[0, MAX_COUNT]`` (a lying gateway's
    huge or non-finite figures must not make every later write of the store fail)."""
    gpu_ms = usage.gpu_seconds * 1000 if math.isfinite(usage.gpu_seconds) else 0.0
    return UsageCounts(
        requests=min(usage.requests, MAX_COUNT),
        refused=min(usage.refused, MAX_COUNT),
        prompt_tokens=min(usage.prompt_tokens, MAX_COUNT),
        cached_tokens=min(usage.cached_prompt_tokens, usage.prompt_tokens, MAX_COUNT),
        completion_tokens=min(usage.completion_tokens, MAX_COUNT),
        gpu_ms=round(min(max(gpu_ms, 0.0), MAX_COUNT)),
    )


def take_usage(
    ledger: UsageLedger, gateway_id: str, started_at_ms: int, rows: list[TenantUsage]
) -> None:
    """One gateway's cumulative usage into the ledger (bounded: module docstring)."""
    if len(rows) > MAX_USAGE_ROWS:
        log.warning(
            "gateway %s reported %d usage rows (at most %d): its usage is not counted",
            gateway_id[:128], len(rows), MAX_USAGE_ROWS,
        )  # fmt: skip
        return
    usage = {(u.tenant, u.key_id, u.model): counts_of(u) for u in rows}
    ledger.report(gateway_id, started_at_ms, usage, int(time.time() * 1000))


async def flush(plane: ControlPlane) -> None:
    """Write the pending deltas; on failure they go back to the ledger (module docstring)."""
    ledger = plane.usage
    batch = ledger.take()
    if not batch:
        return
    try:
        await plane.store.add_usage(batch)
    except Exception as exc:  # the store says why (full disk, fenced, lost database)
        ledger.give_back(batch)
        log.warning("usage not stored yet (%s); kept in memory and retried", exc)
    else:
        ledger.stored_at_ms = int(time.time() * 1000)


async def usage_response(plane: ControlPlane, request: UsageRequest) -> UsageResponse:
    """``GetUsage``: stored rows and pending deltas of the hours in [since, until)."""
    since = hour_of(max(0, request.since_unix_ms))
    until = request.until_unix_ms or 2**62
    rows: dict[UsageKey, UsageCounts] = await plane.store.load_usage(since)
    for key, counts in plane.usage.pending.items():
        rows.setdefault(key, UsageCounts()).add(counts)
    out = [
        UsageRow(
            hour_unix_ms=hour,
            tenant=tenant,
            key_id=key_id,
            model=model,
            requests=c.requests,
            refused=c.refused,
            prompt_tokens=c.prompt_tokens,
            cached_prompt_tokens=c.cached_tokens,
            completion_tokens=c.completion_tokens,
            gpu_seconds=c.gpu_ms / 1000,
        )  # fmt: skip
        for (hour, tenant, key_id, model), c in sorted(rows.items())
        if since <= hour < until and (not request.tenant or tenant == request.tenant)
    ]
    return UsageResponse(rows=out, as_of_unix_ms=plane.usage.reported_at_ms)


__all__ = [
    "FLUSH_S",
    "MAX_COUNT",
    "MAX_USAGE_ROWS",
    "counts_of",
    "flush",
    "take_usage",
    "usage_response",
]
