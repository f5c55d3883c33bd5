"""The gateways' signals per model (``RouterReport.models``), as the autoscaler reads them.

Every gateway counts, per model, arrivals, answers, TTFT and ITL histograms, requests in
flight and held (``llmgw.gateway.modelsignals`` says how), cumulative since it started.
``RouterReports`` keeps each gateway's latest report; ``RouterReports.signals()`` gives
every live one as a :class:`GatewaySignals`, the in-server gateway's read at that moment.
The autoscale loop takes differences between two of them of the same gateway (the same
``gateway_id`` and ``started_at_unix_ms``; a counter lower than before is a restart too).

:func:`check_signals` refuses a malformed report naming the field: bounds that are not
finite, positive and increasing, a model named twice or not at all, a histogram of the
wrong length or whose cumulative counts go down, or more models or bounds than the limits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from llmgw.api.llmgw.v1 import ModelSignals, RouterReport
from llmgw.gateway import LATENCY_BOUNDS_MS, Gateway, model_signals
from llmgw.server.errors import quoted

IN_SERVER_GATEWAY = ""
"""The ``gateway_id`` of the in-server gateway's signals."""


@dataclass(frozen=True, slots=True)
class GatewaySignals:
    """One gateway's latest signals per model (messages as received: never change them)."""

    gateway_id: str  # IN_SERVER_GATEWAY for the in-server gateway
    started_at_unix_ms: int  # the gateway process's start: another value is a restart
    bounds_ms: tuple[float, ...]  # the histograms' bucket bounds (the last count is +Inf)
    models: tuple[ModelSignals, ...]  # sorted by model
    received_s: float  # monotonic: when the server took the report (the in-server's: now)


def local_signals(gateway: Gateway, now_s: float) -> GatewaySignals:
    """The in-server gateway's signals, read now (monotonic ``now_s``)."""
    return GatewaySignals(
        IN_SERVER_GATEWAY,
        gateway.started_at_unix_ms,
        LATENCY_BOUNDS_MS,
        tuple(model_signals(gateway)),
        now_s,
    )


class SignalsRefused(ValueError):
    """What is wrong with a report's signals, in words naming the field."""


def check_signals(
    report: RouterReport, *, max_models: int, max_bounds: int, max_id_chars: int
) -> None:
    """SignalsRefused naming the field when ``report.models`` or its bounds are malformed."""
    bounds = report.latency_bounds_ms
    if len(bounds) > max_bounds:
        raise SignalsRefused(f"latency_bounds_ms has more than {max_bounds} bounds")
    for i, bound in enumerate(bounds):
        if not math.isfinite(bound) or bound <= 0 or (i and bound <= bounds[i - 1]):
            raise SignalsRefused(
                f"latency_bounds_ms[{i}] {bound!r} is not a positive bound above the one before"
            )
    if len(report.models) > max_models:
        raise SignalsRefused(f"models has more than {max_models} entries")
    if report.models and not bounds:
        raise SignalsRefused("latency_bounds_ms is required with models")
    seen: set[str] = set()
    for i, signals in enumerate(report.models):
        field = f"models[{i}]"
        name = signals.model
        if not name or len(name) > max_id_chars or not name.isprintable():
            raise SignalsRefused(
                f"{field}.model must be printable and 1 to {max_id_chars} characters"
            )
        if name in seen:
            raise SignalsRefused(f"{field}.model {quoted(name)} is repeated")
        seen.add(name)
        _check_histogram(f"{field}.ttft_counts", signals.ttft_counts, len(bounds))
        _check_histogram(f"{field}.itl_counts", signals.itl_counts, len(bounds))


def _check_histogram(field: str, counts: Sequence[int], bounds: int) -> None:
    if len(counts) != bounds + 1:
        raise SignalsRefused(
            f"{field} has {len(counts)} counts; latency_bounds_ms asks for {bounds + 1}"
        )
    for i in range(1, len(counts)):
        if counts[i] < counts[i - 1]:
            raise SignalsRefused(
                f"{field}[{i}] {counts[i]} is below {counts[i - 1]}: not cumulative"
            )


__all__ = [
    "IN_SERVER_GATEWAY",
    "GatewaySignals",
    "SignalsRefused",
    "check_signals",
    "local_signals",
]
