"""Metered usage: the deltas of the gateways' cumulative ``TenantUsage`` counters, by UTC hour.

A gateway reports its counters cumulative since it started (``RouterReport.usage``). The
``UsageLedger`` keeps each gateway instance's previous report and turns the next into
differences: a new instance (another ``gateway_id``, or the same with another
``started_at_unix_ms``: a restart) counts whole, and a counter that went down counts its whole
new value, as Prometheus' ``rate`` does. The differences are added into the current UTC hour's
row (hour, tenant, key_id, model); ``take`` hands out what is pending, for the store to write
(in one batch, off the request path), and ``give_back`` returns a batch whose write failed.
Rows per hour are capped (``MAX_ROWS_PER_HOUR``): past it a row's deltas are dropped and
counted in ``dropped``. A gateway first seen that started before the ledger (the leader's
term: a restarted or new leader) gives a baseline with its first report, counting nothing:
what it counted before may already be stored by the previous leader, which would otherwise
be counted twice; what it counted after the previous leader's last write and before this
report is lost (at most the write interval and the failover). ``Store.add_usage`` writes a
batch; llmgw.server.wire.usage feeds the ledger from the reports and drains it into the store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

HOUR_MS = 3_600_000
MAX_ROWS_PER_HOUR = 10_000
MAX_GATEWAYS = 4096
"""Gateway instances whose last counters are kept (a restart is a new instance)."""

UsageKey = tuple[int, str, str, str]
"""(hour's start in Unix ms, tenant, key_id, model)."""


@dataclass(slots=True)
class UsageCounts:
    """One row's counters; gpu_ms: GPU-milliseconds attributed."""

    requests: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    gpu_ms: int = 0

    def add(self, other: UsageCounts) -> None:
        self.requests += other.requests
        self.refused += other.refused
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.completion_tokens += other.completion_tokens
        self.gpu_ms += other.gpu_ms

    def delta(self, before: UsageCounts) -> UsageCounts:
        """What grew since ``before``; a counter that went down counts its whole value."""

        def d(now: int, was: int) -> int:
            return now - was if now >= was else now

        return UsageCounts(
            d(self.requests, before.requests),
            d(self.refused, before.refused),
            d(self.prompt_tokens, before.prompt_tokens),
            d(self.cached_tokens, before.cached_tokens),
            d(self.completion_tokens, before.completion_tokens),
            d(self.gpu_ms, before.gpu_ms),
        )


def hour_of(unix_ms: int) -> int:
    """The start of the UTC hour ``unix_ms`` falls in, in Unix ms."""
    return unix_ms - unix_ms % HOUR_MS


@dataclass
class UsageLedger:
    """Each gateway instance's last counters and the pending per-hour deltas."""

    _last: dict[str, tuple[int, dict[tuple[str, str, str], UsageCounts]]] = field(
        default_factory=dict
    )
    pending: dict[UsageKey, UsageCounts] = field(default_factory=dict)
    dropped: int = 0
    reported_at_ms: int = 0  # the newest report taken (wall clock)
    # A gateway first seen that started before this (the ledger's start: the leader's term)
    # may have been counted by the leader before: its first report is a baseline only.
    since_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    stored_at_ms: int = 0  # the last successful write of pending deltas

    def report(
        self,
        gateway_id: str,
        started_at_ms: int,
        usage: dict[tuple[str, str, str], UsageCounts],
        now_ms: int,
    ) -> None:
        """Add one report's differences (``usage`` by tenant, key_id, model) at ``now_ms``."""
        prev = self._last.get(gateway_id)
        if prev is None and started_at_ms < self.since_ms:  # running before we were: a baseline
            self._remember(gateway_id, started_at_ms, usage, now_ms)
            return
        before = prev[1] if prev is not None and prev[0] == started_at_ms else {}
        hour = hour_of(now_ms)
        rows_this_hour = sum(1 for k in self.pending if k[0] == hour)
        for label, counts in usage.items():
            grew = counts.delta(before.get(label, UsageCounts()))
            if grew == UsageCounts():
                continue
            key = (hour, *label)
            row = self.pending.get(key)
            if row is None:
                if rows_this_hour >= MAX_ROWS_PER_HOUR:
                    self.dropped += 1
                    continue
                row = self.pending[key] = UsageCounts()
                rows_this_hour += 1
            row.add(grew)
        self._remember(gateway_id, started_at_ms, usage, now_ms)

    def _remember(
        self,
        gateway_id: str,
        started_at_ms: int,
        usage: dict[tuple[str, str, str], UsageCounts],
        now_ms: int,
    ) -> None:
        if gateway_id not in self._last and len(self._last) >= MAX_GATEWAYS:
            del self._last[next(iter(self._last))]  # the longest known: a baseline again
        self._last[gateway_id] = (started_at_ms, dict(usage))
        self.reported_at_ms = max(self.reported_at_ms, now_ms)

    def take(self) -> dict[UsageKey, UsageCounts]:
        """The pending deltas, handed out (the ledger forgets them)."""
        out, self.pending = self.pending, {}
        return out

    def give_back(self, batch: dict[UsageKey, UsageCounts]) -> None:
        """A batch whose write failed: added back, to be retried."""
        for key, counts in batch.items():
            self.pending.setdefault(key, UsageCounts()).add(counts)
