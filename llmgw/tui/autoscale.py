"""A deployment's autoscaler as the console shows it (pure): its policy
(``Deployment.autoscale``) and the planner's last decision with the signal it acted on
(``DeploymentStatus.autoscale``, computed by the server)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llmgw.api.llmgw.v1 import AutoscaleStatus, Deployment

__all__ = ["AutoscaleRow", "autoscale_row"]


@dataclass(frozen=True, slots=True)
class AutoscaleRow:
    """The policy, and the planner's decision once it made one (``decided`` False before)."""

    mode: str  # "act" or "advise"
    min: int
    max: int
    ttft_p90_ms: int  # the targets; 0: none
    itl_p90_ms: int
    scale_down_after_s: int
    decided: bool = False
    current: int = 0
    desired: int = 0
    reason: str = ""  # scale_up, scale_down, hold, from_zero, to_zero, budget, pending, no_signal
    message: str = ""
    signal: str = ""
    window: str = ""  # the window's figures in words
    decided_ms: int = 0
    gpu_budget: int = 0

    @property
    def cell(self) -> str:
        """``2→3 scale_up``; ``advise`` before it when nothing is changed; ``waiting``
        before the first decision."""
        advise = "advise " if self.mode == "advise" else ""
        if not self.decided:
            return f"{advise}waiting"
        return f"{advise}{self.current}→{self.desired} {self.reason or 'hold'}"

    @property
    def policy(self) -> str:
        """``act, 1 to 8 replicas, ttft p90 <= 800 ms, down after 300 s``."""
        targets = [
            f"{name} p90 <= {value} ms"
            for name, value in (("ttft", self.ttft_p90_ms), ("itl", self.itl_p90_ms))
            if value
        ]
        bounds = f"{self.min} to {self.max} replicas"
        return ", ".join([self.mode, bounds, *targets, f"down after {self.scale_down_after_s} s"])

    @property
    def moving(self) -> bool:
        """The planner wants another count than the deployment has."""
        return self.decided and self.desired != self.current


def autoscale_row(deployment: Deployment) -> AutoscaleRow | None:
    """The console's view of ``deployment``'s autoscaler; None without a policy."""
    policy = deployment.autoscale
    if policy is None:
        return None
    row = AutoscaleRow(
        mode=policy.mode or "act",
        min=policy.min,
        max=policy.max,
        ttft_p90_ms=policy.ttft_p90_ms,
        itl_p90_ms=policy.itl_p90_ms,
        scale_down_after_s=policy.scale_down_after_s,
    )
    status = deployment.status.autoscale if deployment.status is not None else None
    if status is None:
        return row
    return dataclasses.replace(
        row,
        decided=True,
        current=status.current,
        desired=status.desired,
        reason=status.reason,
        message=status.message,
        signal=status.signal,
        window=_window(status),
        decided_ms=status.decided_unix_ms,
        gpu_budget=status.gpu_budget,
    )


def _window(status: AutoscaleStatus) -> str:
    def ms(value: float) -> str:
        return f"{value:.0f} ms" if value >= 0 else "unknown"

    parts = [
        f"ttft p90 {ms(status.ttft_p90_ms)}",
        f"itl p90 {ms(status.itl_p90_ms)}",
        f"{status.arrival_rps:.2f} req/s" if status.arrival_rps >= 0 else "req/s unknown",
        f"{status.in_flight} in flight",
        f"{status.waiting} waiting",
        f"kv {status.kv_usage:.0%}" if status.kv_usage >= 0 else "kv unknown",
    ]
    return ", ".join(parts)
