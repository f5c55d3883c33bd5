"""What separate gateways report (``RouterService.Report``), added into ``GetRouterStats``.

Each ``llmgw gateway`` process sends its figures every few seconds under its own
``gateway_id`` (``llmgw.gateway.reporter``). :class:`RouterReports` keeps the latest
report of each gateway instance, and :func:`combine` adds them to the in-server gateway's
figures (when it runs) into the fleet's ``RouterStats``:

- Counters (decisions, requests, reuse and prompt tokens) are summed over every report
  kept, live or stale, plus a **retired** total. They never go backwards while the server
  runs, because the console computes windowed rates from them: a gateway that restarts
  (the same id with another start time, or counters lower than before) or that stops
  reporting keeps what it counted, folded into the retired total when its report is
  dropped.
- A report is **live** for three of its gateway's intervals (10 s when it does not say);
  after that it is stale: its counters still count, its gauges (``in_flight``) and its
  replica rows do not. A stale report stays until a restart of its gateway replaces it or
  a new gateway needs its slot (the stalest goes first); then it is folded into the
  retired total. (So a stale gateway that comes back keeps counting where it was, unless
  its slot was taken meanwhile: then it counts again from its start, once too much,
  never too little.)
- Replica rows are those of the live figures, merged by replica id: ``in_flight`` summed
  over the live figures, ``requests`` summed over everything kept (the retired total too);
  the engine's own figures (``delivered_hit_ratio``, ``kv_capacity_tokens``, ``kv_usage``,
  ``engine_waiting``, ``engine_running``)
  are the freshest figures' that have them (the in-server gateway's are read now, so
  they are the freshest). The retired total keeps a replica's requests only while some
  kept report names that replica, so memory stays bounded; a row's own counter may then
  restart, as it does when a gateway forgets a replica that left its table.

- Recent decisions (``recent_decisions``) are every kept report's, each stamped with its
  gateway's id, and the in-server gateway's, merged by time: the last ``max_decisions``.
  The retired total keeps none.

- Signals per model (``RouterReport.models``, for the autoscaler): only the latest of each
  live gateway counts, with the in-server gateway's, read now: :meth:`RouterReports.signals`
  (``llmgw.server.wire.reportsignals``). Nothing of them is folded into the retired total.

Memory is bounded: at most ``max_gateways`` reports (a new gateway beyond that, with every
slot live, is refused with RESOURCE_EXHAUSTED naming the limit), each checked by
:func:`check_report` (bad input is refused with INVALID_ARGUMENT naming the field, and
changes nothing). Refusals are :class:`ReportRefused` (a ``ServerError``); the service maps
them to gRPC statuses.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from grpclib.const import Status

from llmgw.api.llmgw.v1 import ReplicaRouterStats, RouteDecision, RouterReport, RouterStats
from llmgw.gateway import Gateway, router_stats
from llmgw.server.core.autoscale_window import GatewayReport
from llmgw.server.errors import ServerError, quoted
from llmgw.server.wire.reportsignals import (
    GatewaySignals,
    SignalsRefused,
    check_signals,
    local_signals,
)

log = logging.getLogger(__name__)

U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
DEFAULT_LIVE_S = 10.0
"""How long a report that does not say its gateway's interval stays live."""
LIVE_INTERVALS = 3
"""A report stays live for this many of its gateway's intervals."""
MIN_LIVE_S = 1.0
"""...but never less than this (a busy server must not see a fast reporter flicker)."""

MAX_DECISIONS = 200
"""Recent decisions in one report and in the merged answer (each gateway keeps 200)."""

_K = TypeVar("_K")


@dataclass(frozen=True, slots=True)
class ReportLimits:
    """What one server keeps of reported figures, at most."""

    max_gateways: int = 256  # gateway instances kept (live or stale)
    max_replicas: int = 1024  # replica rows in one report
    max_keys: int = 64  # entries in one counter map of a report
    max_key_chars: int = 64  # characters in one tier or "tier/outcome" key
    max_id_chars: int = 320  # characters in a gateway or replica id
    max_interval_ms: int = 300_000  # a gateway's reporting interval
    max_decisions: int = MAX_DECISIONS  # recent decisions in one report
    max_candidates: int = 64  # candidates of one reported decision
    max_models: int = 256  # models of one report's signals (llmgw.gateway.modelsignals)
    max_bounds: int = 64  # histogram bounds of one report's signals


class ReportRefused(ServerError):
    """A report that is not taken: the gRPC status to answer with, and why in words."""

    def __init__(self, status: Status, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why


def _invalid(why: str) -> ReportRefused:
    return ReportRefused(Status.INVALID_ARGUMENT, why)


# --- checking a report ---------------------------------------------------------------------


def check_report(report: RouterReport, limits: ReportLimits = ReportLimits()) -> RouterStats:
    """``report``'s stats when the report is well formed; else ReportRefused naming the field."""
    _check_id("gateway_id", report.gateway_id, limits)
    if report.started_at_unix_ms <= 0:
        raise _invalid(f"started_at_unix_ms must be positive, not {report.started_at_unix_ms}")
    if report.interval_ms > limits.max_interval_ms:
        raise _invalid(
            f"interval_ms {report.interval_ms} is over the limit of {limits.max_interval_ms}"
        )
    stats = report.stats
    if stats is None:
        raise _invalid("stats is required")
    _check_keys("stats.decisions_by_tier", stats.decisions_by_tier, limits)
    _check_keys("stats.decisions_by_tier_outcome", stats.decisions_by_tier_outcome, limits)
    if len(stats.requests_by_status) > limits.max_keys:
        raise _invalid(f"stats.requests_by_status has more than {limits.max_keys} entries")
    _check_rows(stats.replicas, limits)
    _check_decisions(stats.recent_decisions, limits)
    try:
        check_signals(
            report,
            max_models=limits.max_models,
            max_bounds=limits.max_bounds,
            max_id_chars=limits.max_id_chars,
        )
    except SignalsRefused as exc:
        raise _invalid(str(exc)) from exc
    return stats


def _check_id(field: str, value: str, limits: ReportLimits) -> None:
    if not value:
        raise _invalid(f"{field} is required")
    if len(value) > limits.max_id_chars or not value.isprintable():
        raise _invalid(
            f"{field} {quoted(value)} must be printable and at most "
            f"{limits.max_id_chars} characters"
        )


def _check_keys(field: str, counts: Mapping[str, int], limits: ReportLimits) -> None:
    if len(counts) > limits.max_keys:
        raise _invalid(f"{field} has more than {limits.max_keys} entries")
    for key in counts:
        if not key or len(key) > limits.max_key_chars or not key.isprintable():
            raise _invalid(f"{field} key {quoted(key)} is not a tier name")


def _check_rows(rows: Sequence[ReplicaRouterStats], limits: ReportLimits) -> None:
    if len(rows) > limits.max_replicas:
        raise _invalid(f"stats.replicas has more than {limits.max_replicas} rows")
    seen: set[str] = set()
    for i, row in enumerate(rows):
        field = f"stats.replicas[{i}]"
        _check_id(f"{field}.replica_id", row.replica_id, limits)
        if row.replica_id in seen:
            raise _invalid(f"{field}.replica_id {quoted(row.replica_id)} is repeated")
        seen.add(row.replica_id)
        shares = (("delivered_hit_ratio", row.delivered_hit_ratio), ("kv_usage", row.kv_usage))
        for name, share in shares:
            if share is not None and not 0.0 <= share <= 1.0:  # NaN fails both
                raise _invalid(f"{field}.{name} {share!r} is not a share between 0 and 1")


def _check_decisions(decisions: Sequence[RouteDecision], limits: ReportLimits) -> None:
    if len(decisions) > limits.max_decisions:
        raise _invalid(f"stats.recent_decisions has more than {limits.max_decisions} entries")
    for i, decision in enumerate(decisions):
        field = f"stats.recent_decisions[{i}]"
        _check_id(f"{field}.replica_id", decision.replica_id, limits)
        for name in ("model", "tier", "outcome", "reason", "unit", "fallback"):
            value = getattr(decision, name)
            if len(value) > limits.max_id_chars or not value.isprintable():
                raise _invalid(
                    f"{field}.{name} must be printable and at most {limits.max_id_chars} characters"
                )
        if len(decision.candidates) > limits.max_candidates:
            raise _invalid(f"{field}.candidates has more than {limits.max_candidates} entries")
        for j, candidate in enumerate(decision.candidates):
            _check_id(f"{field}.candidates[{j}].replica_id", candidate.replica_id, limits)


# --- adding figures up (pure) --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StatsPart:
    """One gateway's figures as :func:`combine` adds them."""

    stats: RouterStats  # never changed once made a part
    live: bool  # its gauges and rows count now (else only its counters)
    fresh_s: float  # when it was read (monotonic; larger is fresher)
    gateway_id: str = ""  # who reported it ("" the in-server gateway, the retired total)


def _summed(maps: Iterable[Mapping[_K, int]]) -> dict[_K, int]:
    total: dict[_K, int] = {}
    for counts in maps:
        for key, count in counts.items():
            total[key] = total.get(key, 0) + count
    return {key: min(count, U64_MAX) for key, count in total.items()}


def _sum(stats: Sequence[RouterStats], field: Callable[[RouterStats], int]) -> int:
    return min(sum(field(s) for s in stats), U64_MAX)


def sum_counters(stats: Sequence[RouterStats]) -> RouterStats:
    """The counters of ``stats`` added up (no replica rows, no time)."""
    return RouterStats(
        decisions=_sum(stats, lambda s: s.decisions),
        decisions_by_tier=_summed(s.decisions_by_tier for s in stats),
        decisions_by_tier_outcome=_summed(s.decisions_by_tier_outcome for s in stats),
        requests_by_status=_summed(s.requests_by_status for s in stats),
        reuse_available_tokens=_sum(stats, lambda s: s.reuse_available_tokens),
        reuse_captured_tokens=_sum(stats, lambda s: s.reuse_captured_tokens),
        reuse_delivered_tokens=_sum(stats, lambda s: s.reuse_delivered_tokens),
        router_prompt_tokens=_sum(stats, lambda s: s.router_prompt_tokens),
        engine_prompt_tokens=_sum(stats, lambda s: s.engine_prompt_tokens),
        route_predicted_tokens=_sum(stats, lambda s: s.route_predicted_tokens),
        route_cached_tokens=_sum(stats, lambda s: s.route_cached_tokens),
        route_gap_tokens=_sum(stats, lambda s: s.route_gap_tokens),
        route_checked_requests=_sum(stats, lambda s: s.route_checked_requests),
        route_checked_prompt_tokens=_sum(stats, lambda s: s.route_checked_prompt_tokens),
    )


def _requests(stats: Iterable[RouterStats]) -> dict[str, int]:
    return _summed({row.replica_id: row.requests for row in s.replicas} for s in stats)


def fold(retired: RouterStats, gone: RouterStats, keep: set[str] | None = None) -> RouterStats:
    """``retired`` plus the counters of ``gone`` (a report dropped) and its replicas'
    requests, as a retired total: no gauges, no engine figures; rows only of the replicas
    in ``keep`` (all when None)."""
    total = sum_counters([retired, gone])
    requests = _requests([retired, gone])
    total.replicas = [
        ReplicaRouterStats(replica_id=replica_id, requests=count)
        for replica_id, count in sorted(requests.items())
        if keep is None or replica_id in keep
    ]
    return total


def combine(
    parts: Sequence[StatsPart], now_ms: int, max_decisions: int = MAX_DECISIONS
) -> RouterStats:
    """The fleet's ``RouterStats`` read at wall clock ``now_ms``: every part's counters,
    the live parts' rows merged by replica id, the last decisions of all (module
    docstring)."""
    total = sum_counters([part.stats for part in parts])
    total.replicas = _merged_rows(parts)
    total.recent_decisions = merged_decisions(parts, max_decisions)
    total.at_unix_ms = now_ms
    return total


def merged_decisions(parts: Sequence[StatsPart], limit: int) -> list[RouteDecision]:
    """Every part's recent decisions, stamped with its gateway id, the last ``limit`` by
    time (oldest first; a tie keeps each part's own order)."""
    stamped: list[RouteDecision] = []
    for part in parts:
        for decision in part.stats.recent_decisions:
            if part.gateway_id:  # a shallow copy: the kept report stays as received
                decision = copy.copy(decision)
                decision.gateway_id = part.gateway_id
            stamped.append(decision)
    stamped.sort(key=lambda d: d.at_unix_ms)
    return stamped[-limit:] if limit > 0 else []


def _merged_rows(parts: Sequence[StatsPart]) -> list[ReplicaRouterStats]:
    live = sorted((p for p in parts if p.live), key=lambda p: p.fresh_s, reverse=True)
    shown = {row.replica_id for part in live for row in part.stats.replicas}
    requests = _requests(part.stats for part in parts)
    rows: dict[str, ReplicaRouterStats] = {}
    for part in live:  # the freshest first: its engine figures win
        for row in part.stats.replicas:
            merged = rows.get(row.replica_id)
            if merged is None:
                rows[row.replica_id] = _first_row(row, requests.get(row.replica_id, 0))
            else:
                _merge_row(merged, row)
    return [rows[replica_id] for replica_id in sorted(shown)]


def _first_row(row: ReplicaRouterStats, requests: int) -> ReplicaRouterStats:
    return ReplicaRouterStats(
        replica_id=row.replica_id,
        in_flight=row.in_flight,
        requests=requests,
        delivered_hit_ratio=row.delivered_hit_ratio,
        kv_capacity_tokens=row.kv_capacity_tokens,
        kv_usage=row.kv_usage,
        engine_waiting=row.engine_waiting,
        engine_running=row.engine_running,
    )


def _merge_row(merged: ReplicaRouterStats, older: ReplicaRouterStats) -> None:
    """Add ``older``'s gauge to ``merged`` (a row of this merge's own); take its engine
    figures only where the fresher ones did not say."""
    merged.in_flight = min(merged.in_flight + older.in_flight, U32_MAX)
    if merged.delivered_hit_ratio is None:
        merged.delivered_hit_ratio = older.delivered_hit_ratio
    if merged.kv_capacity_tokens == 0:
        merged.kv_capacity_tokens = older.kv_capacity_tokens
    if merged.kv_usage is None:
        merged.kv_usage = older.kv_usage
    if merged.engine_waiting is None:
        merged.engine_waiting = older.engine_waiting
    if merged.engine_running is None:
        merged.engine_running = older.engine_running


_SCALARS: tuple[Callable[[RouterStats], int], ...] = (
    lambda s: s.decisions,
    lambda s: s.reuse_available_tokens,
    lambda s: s.reuse_captured_tokens,
    lambda s: s.reuse_delivered_tokens,
    lambda s: s.router_prompt_tokens,
    lambda s: s.engine_prompt_tokens,
    lambda s: s.route_predicted_tokens,
    lambda s: s.route_cached_tokens,
    lambda s: s.route_gap_tokens,
    lambda s: s.route_checked_requests,
    lambda s: s.route_checked_prompt_tokens,
)


def went_back(before: RouterStats, after: RouterStats) -> bool:
    """Whether any of ``after``'s counters is lower than ``before``'s (a restart). Replica
    rows are not looked at: a gateway forgets the requests of a replica that left its table."""
    return (
        any(field(after) < field(before) for field in _SCALARS)
        or _lower(before.decisions_by_tier, after.decisions_by_tier)
        or _lower(before.decisions_by_tier_outcome, after.decisions_by_tier_outcome)
        or _lower(before.requests_by_status, after.requests_by_status)
    )


def _lower(old: Mapping[_K, int], new: Mapping[_K, int]) -> bool:
    return any(new.get(key, 0) < count for key, count in old.items())


# --- the store -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Kept:
    """The latest report of one gateway instance."""

    gateway_id: str
    started_at_ms: int
    stats: RouterStats  # as received and checked; never changed
    received_s: float  # monotonic
    live_for_s: float
    signals: GatewaySignals  # its models' signals (reportsignals.py)

    def live(self, now_s: float) -> bool:
        return now_s - self.received_s <= self.live_for_s


def _live_for(interval_ms: int) -> float:
    if interval_ms <= 0:
        return DEFAULT_LIVE_S
    return max(MIN_LIVE_S, LIVE_INTERVALS * interval_ms / 1000)


class RouterReports:
    """The latest report per gateway instance, and the retired total (module docstring)."""

    def __init__(
        self,
        limits: ReportLimits = ReportLimits(),
        *,
        clock: Callable[[], float] = time.monotonic,
        local: Callable[[], Gateway | None] | None = None,
    ) -> None:
        self._limits = limits
        self._clock = clock
        self._local = local  # the in-server gateway while it serves (for signals())
        self._kept: dict[str, _Kept] = {}
        self._retired = RouterStats()
        self._ever = False

    @property
    def ever_reported(self) -> bool:
        """Whether any gateway has reported since the server started."""
        return self._ever

    def __len__(self) -> int:
        return len(self._kept)

    def take(self, report: RouterReport) -> None:
        """Keep ``report`` as its gateway's latest; ReportRefused (and nothing changes)
        when it is malformed, names a gateway id another live process uses, or would be
        one gateway too many."""
        stats = check_report(report, self._limits)
        now = self._clock()
        before = self._kept.get(report.gateway_id)
        gone = None
        if before is not None:
            self._check_same_gateway(before, report, now)
            if before.started_at_ms != report.started_at_unix_ms or went_back(before.stats, stats):
                log.info("gateway %s restarted: its earlier counters are kept", before.gateway_id)
                gone = before
        elif len(self._kept) >= self._limits.max_gateways:
            gone = self._stalest(report.gateway_id, now)
            log.info("gateway %s stopped reporting: its counters are kept", gone.gateway_id)
            del self._kept[gone.gateway_id]
        else:
            log.info("gateway %s reports its figures", report.gateway_id)
        live_for = _live_for(report.interval_ms)
        signals = GatewaySignals(
            report.gateway_id,
            report.started_at_unix_ms,
            tuple(report.latency_bounds_ms),
            tuple(sorted(report.models, key=lambda m: m.model)),
            now,
        )
        kept = _Kept(report.gateway_id, report.started_at_unix_ms, stats, now, live_for, signals)
        self._kept[report.gateway_id] = kept
        if gone is not None:  # after the new report is kept: its replicas' requests stay
            self._fold(gone)
        self._ever = True

    def parts(self) -> list[StatsPart]:
        """Every kept report and the retired total, as parts for :func:`combine`."""
        now = self._clock()
        parts = [StatsPart(self._retired, live=False, fresh_s=-math.inf)]
        parts.extend(
            StatsPart(k.stats, k.live(now), k.received_s, k.gateway_id) for k in self._kept.values()
        )
        return parts

    def signals(self) -> list[GatewaySignals]:
        """Every live gateway's latest signals per model (reportsignals.py), by gateway id,
        and the in-server gateway's (gateway id ``""``, read now) while it serves. The
        autoscale loop's one source of what the gateways measured."""
        now = self._clock()
        out = [k.signals for _, k in sorted(self._kept.items()) if k.live(now)]
        gateway = self._local() if self._local is not None else None
        if gateway is not None:
            out.insert(0, local_signals(gateway, now))
        return out

    def _check_same_gateway(self, before: _Kept, report: RouterReport, now: float) -> None:
        if report.started_at_unix_ms < before.started_at_ms and before.live(now):
            raise ReportRefused(
                Status.FAILED_PRECONDITION,
                f"gateway_id {quoted(report.gateway_id)} is reported by another gateway "
                "process (started later); give each gateway its own --gateway-id",
            )

    def _stalest(self, gateway_id: str, now: float) -> _Kept:
        """The stale report that has waited longest, to make room for ``gateway_id``."""
        stale = [k for k in self._kept.values() if not k.live(now)]
        if not stale:
            raise ReportRefused(
                Status.RESOURCE_EXHAUSTED,
                f"this server keeps the figures of at most {self._limits.max_gateways} "
                f"gateways (max_gateways); {quoted(gateway_id)} is one too many",
            )
        return min(stale, key=lambda k: k.received_s)

    def _fold(self, gone: _Kept) -> None:
        """Add ``gone`` (no longer kept) to the retired total."""
        keep = {row.replica_id for k in self._kept.values() for row in k.stats.replicas}
        self._retired = fold(self._retired, gone.stats, keep)


def fleet_rows(reports: RouterReports, gateway: Gateway | None) -> list[ReplicaRouterStats]:
    """Every gateway's replica rows merged, as ``GetRouterStats`` answers them."""
    now_ms = int(time.time() * 1000)
    parts = reports.parts()
    if gateway is not None:  # read now: the freshest figures there are
        parts.append(StatsPart(router_stats(gateway, now_ms), live=True, fresh_s=math.inf))
    return list(combine(parts, now_ms).replicas)


def gateway_reports(reports: RouterReports) -> list[GatewayReport]:
    """Every live gateway's latest signals (the in-server gateway's read now), as the
    autoscaler's window takes them: one gateway process per id and start time."""
    return [
        GatewayReport(
            gateway=f"{s.gateway_id}@{s.started_at_unix_ms}",
            at=s.received_s,
            bounds=s.bounds_ms,
            models={m.model: m for m in s.models},
        )
        for s in reports.signals()
    ]


__all__ = [
    "DEFAULT_LIVE_S",
    "LIVE_INTERVALS",
    "GatewaySignals",
    "ReportLimits",
    "ReportRefused",
    "RouterReports",
    "StatsPart",
    "check_report",
    "combine",
    "fleet_rows",
    "fold",
    "gateway_reports",
    "merged_decisions",
    "sum_counters",
    "went_back",
]
