"""The autoscaler as ``llmgw get deployments`` and ``llmgw describe deployment`` print it:
a deployment's policy (``Deployment.autoscale``) and what the planner last decided on
which signals (``DeploymentStatus.autoscale``, computed by the server)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llmgw.api.llmgw.v1 import AutoscalePolicy, AutoscaleStatus, Deployment

__all__ = ["autoscale_fields", "decision_cell", "policy_text", "window_text"]


def policy_text(policy: AutoscalePolicy) -> str:
    """``act, 1 to 8 replicas, ttft p90 <= 800 ms, down after 300 s``."""
    targets = [
        f"{name} p90 <= {value} ms"
        for name, value in (("ttft", policy.ttft_p90_ms), ("itl", policy.itl_p90_ms))
        if value
    ]
    return ", ".join(
        [
            policy.mode or "act",
            f"{policy.min} to {policy.max} replicas",
            *targets,
            f"down after {policy.scale_down_after_s} s",
        ]
    )


def decision_cell(deployment: Deployment) -> str:
    """``2→3 scale_up`` (current → the planner's count, its reason); ``advise`` before it
    when nothing is changed; "-" without a policy, ``waiting`` before the first round."""
    policy = deployment.autoscale
    if policy is None:
        return "-"
    status = deployment.status.autoscale if deployment.status is not None else None
    advise = "advise " if (policy.mode or "act") == "advise" else ""
    if status is None:
        return f"{advise}waiting"
    return f"{advise}{status.current}→{status.desired} {status.reason or 'hold'}"


def window_text(status: AutoscaleStatus) -> str:
    """The window's figures as the planner saw them; "unknown" where none was measured."""
    parts = [
        f"ttft p90 {_ms(status.ttft_p90_ms)}",
        f"itl p90 {_ms(status.itl_p90_ms)}",
        f"{status.arrival_rps:.2f} req/s" if status.arrival_rps >= 0 else "req/s unknown",
        f"{status.in_flight} in flight",
        f"{status.waiting} waiting",
        f"kv {status.kv_usage:.0%}" if status.kv_usage >= 0 else "kv unknown",
    ]
    return ", ".join(parts)


def _ms(value: float) -> str:
    return f"{value:.0f} ms" if value >= 0 else "unknown"


def autoscale_fields(
    deployment: Deployment, when: Callable[[int], str]
) -> Sequence[tuple[str, str]]:
    """``describe deployment``'s lines for the autoscaler (none without a policy);
    ``when`` formats a wall-clock time in ms."""
    policy = deployment.autoscale
    if policy is None:
        return [("Priority", str(deployment.priority))] if deployment.priority else []
    fields = [("Autoscale", policy_text(policy)), ("Priority", str(deployment.priority))]
    status = deployment.status.autoscale if deployment.status is not None else None
    if status is None:
        return [*fields, ("Autoscaler", "no decision yet")]
    decided = f"{status.current} → {status.desired} ({status.reason or 'hold'})"
    fields += [
        ("Autoscaler", decided + (f": {status.message}" if status.message else "")),
        ("Signal", status.signal or "-"),
        ("Window", window_text(status)),
        ("Decided", when(status.decided_unix_ms)),
        ("Scaled", when(status.changed_unix_ms)),
    ]
    if status.gpu_budget:
        fields.append(("GPU budget", f"{status.gpu_budget} GPUs in pool {deployment.pool}"))
    return fields
