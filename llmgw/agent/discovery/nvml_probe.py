"""The boundary to NVML: loading ``pynvml``, reading without raising, health verdicts.

Health fails closed. A read through ``NvmlProbe.get`` that raises

- ``NVMLError_NotSupported`` leaves the field empty and says nothing about health; so does
  ``NVMLError_FunctionNotFound`` (the installed driver predates the call, which says
  nothing about the GPU either);
- any other ``NVMLError`` is a problem of the device read: it is recorded as
  "<what>: NVML error <text> (<code>)" ("temperature: NVML error GPU is lost (15)") and
  the device's verdict is ``HEALTH_UNHEALTHY``.

``nvmlInit`` failing with ``NVMLError_LibraryNotFound`` or ``NVMLError_DriverNotLoaded``
means no driver; ``init_failure`` says so in words. No ``NVMLError`` leaves this package:
each is caught where the call is made and becomes a problem or a reason.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

from llmgw.api.llmgw.v1 import GpuHealth, Health

logger = logging.getLogger(__name__)

__all__ = [
    "NvmlProbe",
    "init_failure",
    "load_pynvml",
    "no_driver",
    "nvml_error",
    "read_temperature",
    "shutdown_nvml",
    "verdict",
]

_NO_DRIVER = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")
_ABSENT = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")


def load_pynvml() -> ModuleType:
    """The installed nvidia-ml-py (importing it loads no driver library)."""
    return importlib.import_module("pynvml")


def nvml_error(exc: BaseException) -> str:
    """ "NVML error GPU is lost (15)" for an ``NVMLError``."""
    return f"NVML error {exc} ({getattr(exc, 'value', '?')})"


class NvmlProbe:
    """NVML reads for one device that keep, rather than raise, what went wrong."""

    def __init__(self, nvml: ModuleType, inherited: Iterable[str] = ()) -> None:
        self.nvml = nvml
        self.problems: list[str] = list(inherited)

    def get(
        self, what: str, call: Callable[..., Any], *args: Any, absent: Sequence[str] = ()
    ) -> Any:
        """``call(*args)``; ``None`` when NVML does not support it (or raises one of the
        ``absent`` error classes, named as in pynvml), or on an error, which is recorded."""
        quiet = tuple(getattr(self.nvml, name) for name in (*_ABSENT, *absent))
        try:
            return call(*args)
        except quiet:
            return None
        except self.nvml.NVMLError as exc:
            self.problems.append(f"{what}: {nvml_error(exc)}")
            return None

    def health(self, counters: GpuHealth | None = None) -> GpuHealth:
        """``counters`` with this device's verdict and problems."""
        return verdict(counters, self.problems)


def verdict(counters: GpuHealth | None, problems: Iterable[str]) -> GpuHealth:
    """A new ``GpuHealth``: the counters, the problems (each once, in order), and the verdict."""
    c = counters or GpuHealth()
    unique = list(dict.fromkeys(problems))
    return GpuHealth(
        health=Health.UNHEALTHY if unique else Health.HEALTHY,
        ecc_volatile_corrected=c.ecc_volatile_corrected,
        ecc_volatile_uncorrected=c.ecc_volatile_uncorrected,
        ecc_aggregate_uncorrected=c.ecc_aggregate_uncorrected,
        temperature_c=c.temperature_c,
        problems=unique,
        retired_pages=c.retired_pages,
    )


def no_driver(nvml: ModuleType, exc: BaseException) -> bool:
    """Whether an ``nvmlInit`` error means there is no NVIDIA driver here."""
    return isinstance(exc, tuple(getattr(nvml, name) for name in _NO_DRIVER))


def init_failure(nvml: ModuleType, exc: BaseException) -> str:
    """Why ``nvmlInit`` failed, in words for ``NodeInfo.discovery``."""
    if no_driver(nvml, exc):
        return f"NVIDIA driver not found (NVML: {exc})"
    return f"NVML cannot start ({nvml_error(exc)})"


def shutdown_nvml(nvml: ModuleType) -> None:
    """``nvmlShutdown``; a failure is logged, never raised."""
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError as exc:
        logger.warning("nvmlShutdown failed: %s", nvml_error(exc))


def read_temperature(nvml: ModuleType, handle: Any) -> int:
    """The GPU's core temperature, through ``nvmlDeviceGetTemperatureV`` where the driver has it."""
    try:
        return int(nvml.nvmlDeviceGetTemperatureV(handle, nvml.NVML_TEMPERATURE_GPU))
    except nvml.NVMLError_FunctionNotFound:
        return int(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
