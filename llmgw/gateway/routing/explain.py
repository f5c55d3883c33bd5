"""Why a request went where it went: a routing decision in words and numbers.

`explain(decision, fallback)` turns a `Decision` (and, for the prefix policies, the
`Basis` it was scored on) into an `Explanation`: the tier, the chosen replica, what the
chosen replica holds of the request out of the whole, a reason, and every candidate's
match and load. The gateway writes it as the ``x-llmgw-route`` response header
(`header_value`) for a client that asks and may see it, and keeps the last decisions for
``GetRouterStats``.

Reasons (``reason``):

=====================  ==================================================================
``precise-hit``        the KV index shows the chosen replica holding enough of the prompt
``precise-claimed``    a hit on a claim: the replica was sent this prefix moments ago
                       (``claim_ttl_s``) and its KV events have not shown it yet
``precise-miss``       no candidate holds ``min_share`` of the prompt: the least loaded
``precise-guarded``    the best holder was too busy (the hot-replica guard): the next best
``approximate-hit``    the prefix tree of recent text matched the chosen replica
``approximate-miss``   no replica served enough of the text recently: the least loaded
``approximate-guarded``  the best match was too busy: the next best
``least-load``         the ``least_load`` policy (or a session policy without a key)
``round-robin``        the ``round_robin`` policy
``session-pinned``     the session's pinned replica; ``session-new``: a new pin
=====================  ==================================================================

When the precise tier was on but could not decide (no replica publishes KV events, none
holds blocks, ``/tokenize`` failed …), the reason is ``fallback-REASON because WHY``, e.g.
``fallback-approximate-hit because no_blocks`` (WHY is the precise tier's fallback reason,
as ``llmgw_precise_fallbacks_total{reason}`` counts it).

``matched`` is in blocks for the precise tier (the chosen replica's leading blocks the
index shows / the prompt's full blocks at its block size) and in characters for the
approximate tier (the tree's match / the text's length); other policies match nothing.

`predicted_reuse` is what the precise tier expects the engine to find cached: the chosen
replica's matched tokens as it scored them (its claims included), at most the prompt's
full blocks before its last token (vLLM, like the simulated engine, never serves a
prompt's last token from the cache: it needs its logits). The gateway checks it against
the engine's ``cached_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.gateway.routing.policy import (
    OUTCOME_HIT,
    TIER_AFFINITY,
    TIER_APPROXIMATE,
    TIER_LOAD,
    TIER_PRECISE,
    TIER_ROUND_ROBIN,
    Basis,
    Decision,
)

UNIT_BLOCKS = "blocks"
UNIT_CHARS = "chars"

__all__ = [
    "UNIT_BLOCKS",
    "UNIT_CHARS",
    "CandidateFacts",
    "Explanation",
    "explain",
    "header_value",
    "predicted_reuse",
    "reason_of",
]


@dataclass(frozen=True, slots=True)
class CandidateFacts:
    """One candidate as the decision saw it: what it holds of the request, its load."""

    replica_id: str
    matched: int  # blocks (precise tier) or characters (approximate tier)
    in_flight: int


@dataclass(frozen=True, slots=True)
class Explanation:
    """A routing decision explained (module docstring)."""

    tier: str
    outcome: str
    replica_id: str
    matched: int  # the chosen replica's, in ``unit``
    total: int  # the request's whole, in ``unit`` (0 when nothing was matched against)
    unit: str  # "blocks", "chars" or "" (a policy that matches nothing)
    reason: str
    candidates: tuple[CandidateFacts, ...] = ()


def _base_reason(decision: Decision) -> str:
    tier, outcome, basis = decision.tier, decision.outcome, decision.basis
    if tier == TIER_PRECISE:
        if outcome == OUTCOME_HIT and basis is not None and basis.claimed is not None:
            chosen = decision.target.replica_id
            if basis.claimed.get(chosen, 0) > basis.matched.get(chosen, 0):
                return "precise-claimed"
        return f"precise-{outcome}"
    if basis is not None:  # the approximate tree's scoring (tier load on a miss)
        return f"approximate-{outcome}"
    if tier == TIER_ROUND_ROBIN:
        return "round-robin"
    if tier == TIER_AFFINITY:
        return "session-pinned" if outcome == OUTCOME_HIT else "session-new"
    if tier in (TIER_LOAD, TIER_APPROXIMATE):
        return "least-load"
    return f"{tier}-{outcome}"


def reason_of(decision: Decision, fallback: str = "") -> str:
    """The decision's reason (module docstring); ``fallback``: why the precise tier did not
    decide ("" when it did or was off)."""
    base = _base_reason(decision)
    if fallback and decision.tier != TIER_PRECISE:
        return f"fallback-{base} because {fallback}"
    return base


def _blocks(tokens: float, block_size: int) -> int:
    return int(tokens) // block_size if block_size > 0 else 0


def _facts(basis: Basis) -> tuple[CandidateFacts, ...]:
    sizes = basis.block_sizes
    facts = []
    for target in basis.candidates:
        replica_id = target.replica_id
        held = basis.matched.get(replica_id, 0)
        matched = _blocks(held, sizes.get(replica_id, 0)) if sizes else int(held)
        facts.append(CandidateFacts(replica_id, matched, basis.loads.get(replica_id, 0)))
    return tuple(facts)


def explain(decision: Decision, fallback: str = "") -> Explanation:
    """``decision`` explained; ``fallback`` as for `reason_of`."""
    chosen = decision.target.replica_id
    reason = reason_of(decision, fallback)
    basis = decision.basis
    if basis is None:
        return Explanation(decision.tier, decision.outcome, chosen, 0, 0, "", reason)
    candidates = _facts(basis)
    mine = next((c.matched for c in candidates if c.replica_id == chosen), 0)
    if basis.block_sizes:
        total, unit = _blocks(basis.total, basis.block_sizes.get(chosen, 0)), UNIT_BLOCKS
    else:
        total, unit = int(basis.total), UNIT_CHARS
    return Explanation(
        decision.tier, decision.outcome, chosen, mine, total, unit, reason, candidates
    )


def header_value(explanation: Explanation) -> str:
    """``tier=…; replica=…; matched=M/N[ chars]; reason=…`` (blocks unless it says chars)."""
    matched = f"{explanation.matched}/{explanation.total}"
    if explanation.unit == UNIT_CHARS:
        matched += " chars"
    return (
        f"tier={explanation.tier}; replica={explanation.replica_id}; "
        f"matched={matched}; reason={explanation.reason}"
    )


def predicted_reuse(decision: Decision) -> int | None:
    """The prompt tokens the precise tier expects the chosen engine to find cached (module
    docstring); None for a decision of another tier."""
    basis = decision.basis
    if decision.tier != TIER_PRECISE or basis is None:
        return None
    chosen = decision.target.replica_id
    size = basis.block_sizes.get(chosen, 0)
    scored = basis.matched if basis.claimed is None else basis.claimed
    held = int(scored.get(chosen, 0))
    if size <= 0:
        return held
    cacheable = (max(0, int(basis.total) - 1) // size) * size
    return min(held, cacheable)
