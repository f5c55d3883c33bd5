"""Live telemetry of a node's NVML GPUs for heartbeats (``NvmlTelemetry``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from llmgw.agent.discovery.nvml_probe import (
    NvmlProbe,
    init_failure,
    load_pynvml,
    read_temperature,
    shutdown_nvml,
)
from llmgw.api.llmgw.v1 import Gpu, GpuTelemetry, Health, NodeInfo

logger = logging.getLogger(__name__)

__all__ = ["NvmlTelemetry"]


@dataclass(frozen=True, slots=True)
class _Tracked:
    """A registered device the sampler reads."""

    uuid: str
    parent_uuid: str  # "" for a physical GPU
    problems: tuple[str, ...]  # found at discovery; kept until the agent rediscovers


class NvmlTelemetry:
    """Live readings of a node's registered GPUs and MIG devices, through NVML.

    ``sample()`` has the shape of ``SimulatedTelemetry.sample()``: one ``GpuTelemetry``
    per device with a UUID, never raising. NVML is started at the first sample and kept
    until ``close()`` (also a context manager); if it cannot start, every device reads
    unhealthy with the reason and the next sample tries again. A reading that fails marks
    its device unhealthy (a GPU's problems are its MIG devices' too); problems found at
    discovery stay. Volatile uncorrected ECC errors are read every sample. MIG devices
    report their own memory, their parent's temperature and no utilisation or power
    (NVML reports neither per MIG device).
    """

    def __init__(self, node: NodeInfo, nvml: ModuleType | None = None) -> None:
        self._nvml = nvml or load_pynvml()
        self._tracked = [
            _Tracked(g.uuid, g.mig.parent_uuid if g.mig else "", tuple(_problems(g)))
            for g in node.gpus
            if g.uuid
        ]
        self._handles: dict[str, Any] = {}
        self._started = False
        self._reported: dict[str, list[str]] = {}

    def sample(self) -> list[GpuTelemetry]:
        """One reading per registered device, in registration order."""
        failure = self._start()
        readings: dict[str, GpuTelemetry] = {}
        for device in sorted(self._tracked, key=lambda t: bool(t.parent_uuid)):
            if failure:
                reading = GpuTelemetry(uuid=device.uuid, problems=[failure])
            else:
                reading = self._read(device, readings.get(device.parent_uuid))
            readings[device.uuid] = self._judge(device, reading)
        return [readings[t.uuid] for t in self._tracked]

    def close(self) -> None:
        """Shut NVML down if a sample started it."""
        if self._started:
            self._started = False
            self._handles.clear()
            shutdown_nvml(self._nvml)

    def __enter__(self) -> NvmlTelemetry:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start(self) -> str:
        """ "" once NVML is started, else why it cannot be."""
        if self._started:
            return ""
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            return f"nvml: {init_failure(self._nvml, exc)}"
        self._started = True
        return ""

    def _read(self, device: _Tracked, parent: GpuTelemetry | None) -> GpuTelemetry:
        nvml = self._nvml
        probe = NvmlProbe(nvml, parent.problems if parent is not None else ())
        reading = GpuTelemetry(uuid=device.uuid)
        handle = self._handle(probe, device.uuid)
        if handle is None:
            reading.problems = probe.problems
            return reading
        memory = probe.get("memory", nvml.nvmlDeviceGetMemoryInfo, handle)
        reading.memory_used_bytes = int(memory.used) if memory is not None else 0
        if parent is not None:
            reading.temperature_c = parent.temperature_c
        else:
            _read_live(probe, handle, reading)
        reading.problems = list(dict.fromkeys(probe.problems))
        return reading

    def _handle(self, probe: NvmlProbe, uuid: str) -> Any:
        if uuid not in self._handles:
            handle = probe.get("handle", self._nvml.nvmlDeviceGetHandleByUUID, uuid)
            if handle is None:
                if not probe.problems:
                    probe.problems.append("handle: NVML no longer knows this device")
                return None
            self._handles[uuid] = handle
        return self._handles[uuid]

    def _judge(self, device: _Tracked, reading: GpuTelemetry) -> GpuTelemetry:
        reading.problems = list(dict.fromkeys([*device.problems, *reading.problems]))
        reading.health = Health.UNHEALTHY if reading.problems else Health.HEALTHY
        if reading.problems != self._reported.get(device.uuid, []):
            if reading.problems:
                logger.warning("GPU %s unhealthy: %s", device.uuid, reading.problems)
            else:
                logger.info("GPU %s healthy again", device.uuid)
            self._reported[device.uuid] = list(reading.problems)
        return reading


def _read_live(probe: NvmlProbe, handle: Any, reading: GpuTelemetry) -> None:
    """Utilisation, temperature, power and volatile uncorrected ECC of a physical GPU."""
    nvml = probe.nvml
    utilization = probe.get("utilization", nvml.nvmlDeviceGetUtilizationRates, handle)
    reading.utilization_pct = int(utilization.gpu) if utilization is not None else 0
    reading.temperature_c = int(probe.get("temperature", read_temperature, nvml, handle) or 0)
    reading.power_watts = int(probe.get("power", nvml.nvmlDeviceGetPowerUsage, handle) or 0) // 1000
    errors = probe.get(
        "ecc volatile uncorrected",
        nvml.nvmlDeviceGetTotalEccErrors,
        handle,
        nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        nvml.NVML_VOLATILE_ECC,
    )
    if errors:
        probe.problems.append(f"ecc: {errors} volatile uncorrected errors")


def _problems(gpu: Gpu) -> list[str]:
    return list(gpu.health.problems) if gpu.health is not None else []
