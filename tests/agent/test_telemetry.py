"""Telemetry deltas: only what moved by a step since it was last sent."""

from __future__ import annotations

from typing import Any

from llmgw.agent.discovery import SimulatedTelemetry, simulated_node
from llmgw.agent.telemetry import advance_baseline, telemetry_delta
from llmgw.api.llmgw.v1 import GpuTelemetry, Health

MIB = 1 << 20


def _reading(uuid: str = "GPU-0", **values: Any) -> GpuTelemetry:
    base: dict[str, Any] = {
        "uuid": uuid,
        "memory_used_bytes": 1000 * MIB,
        "utilization_pct": 50,
        "temperature_c": 60,
        "health": Health.HEALTHY,
        "power_watts": 300,
    }
    return GpuTelemetry(**(base | values))


def test_new_gpus_are_always_sent() -> None:
    current = [_reading("GPU-0"), _reading("GPU-1")]
    assert telemetry_delta({}, current) == current


def test_unchanged_gpus_are_not_sent() -> None:
    previous = {"GPU-0": _reading()}
    assert telemetry_delta(previous, [_reading()]) == []


def test_each_value_counts_from_its_step() -> None:
    previous = {"GPU-0": _reading()}
    below = [
        _reading(utilization_pct=54),
        _reading(memory_used_bytes=1063 * MIB),
        _reading(temperature_c=61),
        _reading(power_watts=324),
    ]
    at = [
        _reading(utilization_pct=45),
        _reading(memory_used_bytes=936 * MIB),
        _reading(temperature_c=58),
        _reading(power_watts=275),
    ]
    steps = {"util_step": 5, "mem_step_bytes": 64 * MIB, "temp_step": 2, "power_step_watts": 25}
    for reading in below:
        assert telemetry_delta(previous, [reading], **steps) == [], reading
    for reading in at:
        assert telemetry_delta(previous, [reading], **steps) == [reading], reading


def test_default_steps() -> None:
    previous = {"GPU-0": _reading()}
    assert telemetry_delta(previous, [_reading(utilization_pct=51)]) != []
    assert telemetry_delta(previous, [_reading(temperature_c=59)]) != []
    assert telemetry_delta(previous, [_reading(memory_used_bytes=1063 * MIB)]) == []
    assert telemetry_delta(previous, [_reading(memory_used_bytes=1064 * MIB)]) != []


def test_health_and_problems_are_never_thresholded() -> None:
    previous = {"GPU-0": _reading()}
    sick = _reading(health=Health.UNHEALTHY, problems=["XID 79: fallen off the bus"])
    assert telemetry_delta(previous, [sick]) == [sick]
    worse = _reading(health=Health.UNHEALTHY, problems=["XID 79", "XID 48"])
    assert telemetry_delta({"GPU-0": sick}, [worse]) == [worse]
    unknown = _reading(health=Health.UNKNOWN)
    assert telemetry_delta(previous, [unknown]) == [unknown]


def test_only_changed_gpus_in_current_order() -> None:
    previous = {u: _reading(u) for u in ("GPU-0", "GPU-1", "GPU-2")}
    current = [
        _reading("GPU-2", utilization_pct=90),
        _reading("GPU-1"),
        _reading("GPU-0", temperature_c=80),
    ]
    assert [r.uuid for r in telemetry_delta(previous, current)] == ["GPU-2", "GPU-0"]


def test_creeping_change_is_reported_against_what_was_sent() -> None:
    baseline = advance_baseline({}, [_reading(utilization_pct=50)])
    sent_at = []
    for tick, util in enumerate(range(51, 61)):  # one point a tick, step of five
        delta = telemetry_delta(baseline, [_reading(utilization_pct=util)], util_step=5)
        baseline = advance_baseline(baseline, delta)
        sent_at += [tick] * len(delta)
    assert sent_at == [4, 9]
    assert baseline["GPU-0"].utilization_pct == 60


def test_advance_baseline_does_not_touch_previous() -> None:
    previous = {"GPU-0": _reading()}
    newer = _reading(utilization_pct=99)
    baseline = advance_baseline(previous, [newer, _reading("GPU-1")])
    assert previous == {"GPU-0": _reading()}
    assert baseline == {"GPU-0": newer, "GPU-1": _reading("GPU-1")}


def test_simulated_heartbeats_carry_fewer_readings_than_snapshots() -> None:
    node = simulated_node("dgx-h100", node_id="n1", hostname="h1")
    sim = SimulatedTelemetry(node, seed=9)
    baseline: dict[str, GpuTelemetry] = {}
    sent = []
    for _ in range(200):
        delta = telemetry_delta(baseline, sim.sample(), util_step=3, temp_step=2)
        baseline = advance_baseline(baseline, delta)
        sent.append(len(delta))
    assert sent[0] == 8
    assert 0 < sum(sent[1:]) < 0.6 * 8 * 199
