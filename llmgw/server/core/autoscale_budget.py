"""The pool's GPU budget over the planner's decisions (:func:`share_budget`).

Pure, like the planner (``llmgw.server.core.autoscale``): the autoscale loop calls it once a
round over every deployment's :class:`~llmgw.server.core.autoscale.Claim`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from llmgw.server.core.autoscale import Claim, Decision

__all__ = ["share_budget"]


def share_budget(claims: Mapping[str, Claim], budgets: Mapping[str, int]) -> dict[str, Decision]:
    """Each deployment's decision once every pool's GPU budget (``budgets[pool]``, in GPUs)
    holds: deployments of higher ``priority`` get GPUs first and may take them from lower
    ones (down to their ``min``); a cut decision says ``budget``. Pools without a budget
    and deployments without a claim pass as they are. A fixed-count deployment of a pool
    counts against its budget: the loop passes it as a claim whose policy has
    ``min == max == count`` (mode "advise").

    Within a pool every claim first gets its ``min`` (a floor the budget never cuts: a
    pool whose floors exceed its budget is over it, and each decision that met its floor
    only says so); then, highest priority first, a priority level keeps what it runs now
    (up to what it wants) before it grows, so two deployments of one priority never take
    replicas from each other; ties are granted in name order.
    """
    out = {name: claim.decision for name, claim in claims.items()}
    pools: dict[str, list[str]] = {}
    for name, claim in claims.items():
        if claim.current.pool in budgets:
            pools.setdefault(claim.current.pool, []).append(name)
    for pool, names in pools.items():
        granted = _grant(pool, {name: claims[name] for name in names}, budgets[pool])
        out.update(granted)
    return out


def _grant(pool: str, claims: Mapping[str, Claim], budget: int) -> dict[str, Decision]:
    """One pool's claims cut to ``budget`` GPUs (the rules in :func:`share_budget`)."""
    grant = {name: min(claim.policy.min, claim.decision.desired) for name, claim in claims.items()}
    left = budget - sum(
        grant[name] * claim.current.gpus_per_replica for name, claim in claims.items()
    )
    for priority in sorted({claim.current.priority for claim in claims.values()}, reverse=True):
        level = sorted(name for name, claim in claims.items() if claim.current.priority == priority)
        for name in level:  # keep what runs now
            keep = min(claims[name].decision.desired, claims[name].current.count)
            left -= _give(grant, name, keep, claims[name].current.gpus_per_replica, left)
        for name in level:  # then grow
            left -= _give(
                grant,
                name,
                claims[name].decision.desired,
                claims[name].current.gpus_per_replica,
                left,
            )
    return {
        name: _cut(pool, budget, claim, grant[name])
        for name, claim in claims.items()
        if grant[name] < claim.decision.desired
    }


def _give(grant: dict[str, int], name: str, upto: int, gpus: int, left: int) -> int:
    """Raise ``grant[name]`` toward ``upto`` within ``left`` GPUs; the GPUs it took."""
    more = max(upto - grant[name], 0)
    if gpus > 0:
        more = min(more, max(left, 0) // gpus)
    grant[name] += more
    return more * gpus


def _cut(pool: str, budget: int, claim: Claim, granted: int) -> Decision:
    decision = claim.decision
    gpus = claim.current.gpus_per_replica
    message = (
        f"pool {pool} budget {budget} GPUs: wants {decision.desired} × {gpus} GPUs, "
        f"granted {granted} (priority {claim.current.priority}); planner: {decision.message}"
    )
    return replace(decision, desired=granted, reason="budget", message=message)
