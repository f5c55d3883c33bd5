"""Telemetry deltas: which GPUs changed enough since the server last heard of them.

Heartbeats are the agent's hot path (every node, every second or so) and the betterproto2
runtime costs hundreds of microseconds per small message, so a heartbeat carries only the
GPUs whose readings moved by at least a step, never a snapshot of every GPU. The server
keeps the last value it received for each GPU; a GPU missing from a heartbeat is unchanged.

Measure against what was last *sent*, not what was last sampled: utilisation creeping up
one point per sample under a five-point step would otherwise never be reported. Hence
``telemetry_delta`` against a baseline, then ``advance_baseline`` with what was sent.
Health and problems are never thresholded: any change is sent at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmgw.api.llmgw.v1 import GpuTelemetry

__all__ = ["advance_baseline", "telemetry_delta"]


def telemetry_delta(
    previous: Mapping[str, GpuTelemetry],
    current: Sequence[GpuTelemetry],
    *,
    util_step: int = 1,
    mem_step_bytes: int = 64 << 20,
    temp_step: int = 1,
    power_step_watts: int = 25,
) -> list[GpuTelemetry]:
    """The readings of ``current`` worth sending, given what was last sent (``previous``).

    A GPU is included when it is new (not in ``previous``), when its health or problems
    changed, or when utilisation, memory used, temperature or power moved by at least its
    step. The readings are returned as they are (whole ``GpuTelemetry`` messages, in the
    order of ``current``), since the server replaces a GPU's reading wholesale.
    """
    steps = (util_step, mem_step_bytes, temp_step, power_step_watts)
    return [
        gpu
        for gpu in current
        if (before := previous.get(gpu.uuid)) is None or _changed(before, gpu, steps)
    ]


def advance_baseline(
    previous: Mapping[str, GpuTelemetry], sent: Sequence[GpuTelemetry]
) -> dict[str, GpuTelemetry]:
    """The baseline for the next delta: ``previous`` with the readings just sent."""
    baseline = dict(previous)
    baseline.update((gpu.uuid, gpu) for gpu in sent)
    return baseline


def _changed(before: GpuTelemetry, now: GpuTelemetry, steps: tuple[int, int, int, int]) -> bool:
    util_step, mem_step, temp_step, power_step = steps
    if now.health != before.health or list(now.problems) != list(before.problems):
        return True
    return bool(
        abs(now.utilization_pct - before.utilization_pct) >= util_step
        or abs(now.memory_used_bytes - before.memory_used_bytes) >= mem_step
        or abs(now.temperature_c - before.temperature_c) >= temp_step
        or abs(now.power_watts - before.power_watts) >= power_step
    )
