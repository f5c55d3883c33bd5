"""The autoscaler's planner: a deployment's window of signals and its state → a count.

Pure: no clock, no I/O. The server's autoscale loop (``llmgw.server.autoscale_loop``) builds
a :class:`Signals` window per deployment from the gateways' reports and the engines' polled
figures, calls :func:`plan` once per round with the :class:`Memory` it returned last time,
then :func:`share_budget` over every deployment of a pool with a GPU budget, and (mode
"act") stores the count.

INTERFACE FIXED FOR THE PARALLEL WORK OF ISSUE #16: the names and fields below are what
the loop, the benchmark and the tests use; the planner's rules are filled in behind them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from llmgw.api.llmgw.v1 import AutoscalePolicy

__all__ = [
    "ACT", "ADVISE", "Claim", "Current", "Decision", "Memory", "Policy", "Signals", "Tuning",
    "plan", "share_budget",
]  # fmt: skip

ACT = "act"
ADVISE = "advise"


@dataclass(frozen=True, slots=True)
class Policy:
    """``[deployments.NAME.autoscale]`` as checked (targets 0.0: none)."""

    min: int
    max: int
    ttft_p90_ms: float = 0.0
    itl_p90_ms: float = 0.0
    scale_down_after_s: float = 300.0
    mode: str = ACT

    @classmethod
    def from_proto(cls, policy: AutoscalePolicy) -> Policy:
        return cls(
            min=policy.min,
            max=policy.max,
            ttft_p90_ms=float(policy.ttft_p90_ms),
            itl_p90_ms=float(policy.itl_p90_ms),
            scale_down_after_s=float(policy.scale_down_after_s),
            mode=policy.mode or ACT,
        )


@dataclass(frozen=True, slots=True)
class Signals:
    """One deployment's window (the last ``Tuning.window_s`` seconds), every gateway's
    figures added up; None where nothing was measured in the window."""

    ttft_p90_ms: float | None = None
    itl_p90_ms: float | None = None
    samples: int = 0  # requests answered in the window: what the percentiles stand on
    arrival_rps: float = 0.0  # requests that arrived per second over the window
    in_flight: int = 0  # upstream now, every gateway together
    waiting: int = 0  # held now by gateways for a READY replica (scale from zero)
    engine_waiting: int | None = None  # the engines' queues, summed over READY replicas
    engine_running: int | None = None
    kv_usage: float | None = None  # mean over READY replicas, 0..1


@dataclass(frozen=True, slots=True)
class Current:
    """The deployment as it is now."""

    count: int  # Deployment.replicas: the count the reconciler works toward
    ready: int  # live replicas all READY
    coming: int  # live replicas placed but not READY yet (PENDING, STARTING, LOADING)
    gpus_per_replica: int  # 0 for a CPU profile
    pool: str = ""
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Memory:
    """What the planner carries from one round to the next for one deployment (kept by the
    loop in memory; a restarted server starts from ``Memory()``)."""

    low_since: float | None = None  # the window has been below target since (loop clock, s)
    idle_since: float | None = None  # no arrivals and nothing in flight since
    last_change: float | None = None  # when the planner last changed the count
    capacity_rps: float | None = None  # learned requests/s one replica serves at target
    extra: Mapping[str, float] = field(default_factory=dict)  # the planner's own


@dataclass(frozen=True, slots=True)
class Tuning:
    """The planner's constants (tests and the benchmark may change them)."""

    window_s: float = 30.0
    max_step_up: int = 4  # replicas added in one decision at most
    max_step_down: int = 1
    min_samples: int = 5  # fewer answered requests in the window: the percentiles say nothing


@dataclass(frozen=True, slots=True)
class Decision:
    """The planner's count for one deployment, why (one word and in words), and on what."""

    desired: int
    reason: str  # scale_up, scale_down, hold, from_zero, to_zero, budget, pending, no_signal
    message: str
    signal: str  # e.g. "ttft_p90_ms=1240"
    memory: Memory


@dataclass(frozen=True, slots=True)
class Claim:
    """One deployment's decision as the pool's GPU budget weighs it."""

    decision: Decision
    current: Current
    policy: Policy


def plan(
    policy: Policy,
    signals: Signals,
    current: Current,
    memory: Memory,
    now: float,
    tuning: Tuning = Tuning(),
) -> Decision:
    """The count ``policy`` wants now, always within ``[policy.min, policy.max]``."""
    raise NotImplementedError  # filled in by the planner's part of issue #16


def share_budget(claims: Mapping[str, Claim], budgets: Mapping[str, int]) -> dict[str, Decision]:
    """Each deployment's decision once every pool's GPU budget (``budgets[pool]``, in GPUs)
    holds: deployments of higher ``priority`` get GPUs first and may take them from lower
    ones (down to their ``min``); a cut decision says ``budget``. Pools without a budget
    and deployments without a claim pass as they are. A fixed-count deployment of a pool
    counts against its budget: the loop passes it as a claim whose policy has
    ``min == max == count`` (mode "advise")."""
    raise NotImplementedError  # filled in by the planner's part of issue #16
