"""The router view's last decisions and the precise tier's drift warning (pure, no I/O).

`routes_view` turns a ``GetRouterStats`` answer and the router's counter window into a
`RoutesView`: the last decisions, newest first (`DecisionRow`: when, which gateway, model,
tier, the chosen replica, its match, the cached tokens its engine reported, each candidate's
match and load, the reason), and the drift of the precise tier's check over the window.

**Drift** is Δ(Σ |predicted - cached| tokens) / Δ(prompt tokens) of the requests the
precise tier decided and whose engine reported ``cached_tokens``, over the console's
window (60 s of samples). With the gateway's block keys matching the engines', it stays
within a block per request (a few %). The console warns when it is over `DRIFT_THRESHOLD`
(10 % of the prompt tokens) with at least `DRIFT_MIN_REQUESTS` (20) checked requests in
the window: a tokenizer, chat template, block-key or KV event format mismatch between the
gateway and its engines shows here before hit rates quietly collapse.

When too few answers in the window reported ``cached_tokens`` (engines without
``--enable-prompt-tokens-details``, streams without ``include_usage``), the drift is judged
on the engines' own prefix-cache counters instead (``source`` "counters"): the share of
routed prompt tokens the precise tier expected the chosen replicas to hold (Δcaptured /
Δrouter prompt tokens) against the share of their prompt tokens the engines served from
cache (Δdelivered / Δengine prompt tokens), as polled from their ``/metrics``. That is an
aggregate (the engines count every request, however routed), so it warns only when the two
shares are more than `DRIFT_THRESHOLD` apart over at least `DRIFT_MIN_PROMPT_TOKENS` routed
prompt tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from llmgw.api.llmgw.v1 import RouteDecision, RouterStats
from llmgw.tui.rates import CounterWindow

DRIFT_THRESHOLD = 0.10
"""Drift (share of checked prompt tokens) over which the console warns."""
DRIFT_MIN_REQUESTS = 20
"""Checked requests a window needs before its drift is judged."""
DRIFT_MIN_PROMPT_TOKENS = 20_000
"""Routed prompt tokens a window needs before drift is judged on the engines' counters."""

_GAP, _PROMPT, _CHECKED = "check:gap", "check:prompt", "check:requests"
# the reuse counters the model keeps in the same window (llmgw.tui.model._router_counters)
_CAPTURED, _ROUTER_PROMPT = "reuse:captured", "prompt:router"
_DELIVERED, _ENGINE_PROMPT = "reuse:delivered", "prompt:engine"
_ADVICE = "check the tokenizer, block keys and KV event format of gateway and engines"

__all__ = [
    "DRIFT_MIN_PROMPT_TOKENS",
    "DRIFT_MIN_REQUESTS",
    "DRIFT_THRESHOLD",
    "DecisionRow",
    "RoutesView",
    "check_counters",
    "routes_view",
]


@dataclass(frozen=True, slots=True)
class DecisionRow:
    """One routing decision as the router view lists it."""

    at_ms: int
    gateway: str  # "" the in-server gateway
    model: str
    tier: str
    replica_id: str
    matched: str  # "50/62b" (blocks), "120/400c" (characters), "" (nothing matched)
    cached_tokens: int | None  # what its engine reported; None: it did not say
    candidates: str  # "r1:50/0 r2:20/1": each candidate's match / requests in flight
    reason: str


@dataclass(frozen=True, slots=True)
class RoutesView:
    """The last decisions and the drift of the precise tier's check."""

    recent: tuple[DecisionRow, ...] = ()  # newest first
    drift: float | None = None  # over the window; None: nothing checked in it
    checked: int = 0  # checked requests in the window
    warning: str = ""  # "" unless the drift is over the threshold (module docstring)
    source: str = ""  # what the drift compares: "usage", "counters" or "" (nothing to judge)
    at_ms: int = 0  # the server's wall clock when it answered (decisions' ages count from it)


def check_counters(stats: RouterStats) -> Mapping[str, int]:
    """The check's counters, for the router's counter window."""
    return {
        _GAP: stats.route_gap_tokens,
        _PROMPT: stats.route_checked_prompt_tokens,
        _CHECKED: stats.route_checked_requests,
    }


def decision_row(decision: RouteDecision) -> DecisionRow:
    unit = {"blocks": "b", "chars": "c"}.get(decision.unit)
    matched = f"{decision.matched}/{decision.total}{unit}" if unit else ""
    candidates = " ".join(f"{c.replica_id}:{c.matched}/{c.in_flight}" for c in decision.candidates)
    return DecisionRow(
        at_ms=decision.at_unix_ms,
        gateway=decision.gateway_id,
        model=decision.model,
        tier=decision.tier,
        replica_id=decision.replica_id,
        matched=matched,
        cached_tokens=decision.cached_tokens,
        candidates=candidates,
        reason=decision.reason,
    )


def drift_warning(drift: float | None, checked: int, window_s: float) -> str:
    """The warning for this window's drift, or ""."""
    if drift is None or checked < DRIFT_MIN_REQUESTS or drift <= DRIFT_THRESHOLD:
        return ""
    return (
        f"reuse drift {drift:.0%}: the precise tier's predicted cache hits miss what engines "
        f"report by {drift:.0%} of prompt tokens over {window_s:.0f}s ({checked} requests); "
        + _ADVICE
    )


def counter_drift(window: CounterWindow) -> tuple[float | None, str]:
    """The drift judged on the engines' counters (module docstring), and its warning."""
    expected = window.ratio([_CAPTURED], [_ROUTER_PROMPT])
    served = window.ratio([_DELIVERED], [_ENGINE_PROMPT])
    if expected is None or served is None:
        return None, ""
    drift = abs(expected - served)
    if window.increase([_ROUTER_PROMPT]) < DRIFT_MIN_PROMPT_TOKENS or drift <= DRIFT_THRESHOLD:
        return drift, ""
    return drift, (
        f"reuse drift {drift:.0%}: the precise tier expected {expected:.0%} of routed prompt "
        f"tokens cached, engines served {served:.0%} of theirs from cache over "
        f"{window.span_s():.0f}s; " + _ADVICE
    )


def routes_view(stats: RouterStats, window: CounterWindow, shown: int = 50) -> RoutesView:
    """The newest ``shown`` decisions of ``stats`` and the window's drift."""
    recent = tuple(decision_row(d) for d in reversed(stats.recent_decisions[-shown:]))
    checked, at_ms = window.increase([_CHECKED]), stats.at_unix_ms
    if checked < DRIFT_MIN_REQUESTS:  # too few answers said: the engines' counters judge
        drift, warning = counter_drift(window)
        if drift is not None:
            return RoutesView(recent, drift, checked, warning, "counters", at_ms)
    drift = window.ratio([_GAP], [_PROMPT])
    warning = drift_warning(drift, checked, window.span_s())
    return RoutesView(recent, drift, checked, warning, "" if drift is None else "usage", at_ms)
