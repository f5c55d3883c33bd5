"""A fake ``pynvml`` for discovery tests: the API llmgw uses, answering from a described machine.

``fake_nvml(machine)`` returns a new module object with pynvml's names: the ``NVML_*``
constants and ctypes structures are pynvml's own (importing pynvml loads no driver); the
error classes are made here the way pynvml makes them (``NVMLError(value)`` returns the
subclass for the value, one ``NVMLError_<CamelCase>`` subclass per ``NVML_ERROR_*``), so
``except pynvml.NVMLError_NotSupported`` means what it does with the real library.

The functions behave as the real ones do where discovery cares: every call but
``nvmlInit`` needs NVML started (else ``NVMLError_Uninitialized``); a field the machine
leaves as ``None`` raises ``NVMLError_NotSupported``; a link index past a GPU's last link
raises ``NVMLError_InvalidArgument``; an empty MIG slot raises ``NVMLError_NotFound``; a
function named in ``FakeMachine.missing`` raises ``NVMLError_FunctionNotFound`` (an older
driver); a function named in ``FakeGpu.errors`` raises the error with that code for that
GPU (and its MIG devices). ``FakeMachine.calls`` counts calls by function name.
"""

from __future__ import annotations

import ctypes
import string
import sys
import types
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pynvml as _real

_T = TypeVar("_T")

# --- errors, made the way pynvml makes them ------------------------------------------------


class NVMLError(Exception):
    value: int
    _valClassMapping: dict[int, type[NVMLError]] = {}
    _errcode_to_string: dict[int, str] = dict(_real.NVMLError._errcode_to_string)

    def __new__(cls, value: int) -> NVMLError:
        typ = NVMLError._valClassMapping.get(value, cls) if cls is NVMLError else cls
        obj = Exception.__new__(typ)
        obj.value = value
        return obj

    def __str__(self) -> str:
        return NVMLError._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return self.value == getattr(other, "value", None)


ERROR_CODES = {n: getattr(_real, n) for n in dir(_real) if n.startswith("NVML_ERROR_")}


def _error_classes() -> dict[str, type[NVMLError]]:
    classes: dict[str, type[NVMLError]] = {}
    for err_name, err_val in ERROR_CODES.items():
        words = string.capwords(err_name.replace("NVML_ERROR_", ""), "_").replace("_", "")

        def gen_new(val: int) -> Callable[..., NVMLError]:
            def new(typ: type[NVMLError], *args: Any) -> NVMLError:
                return NVMLError.__new__(typ, val)

            return new

        cls = type(f"NVMLError_{words}", (NVMLError,), {"__new__": gen_new(err_val)})
        cls.__module__ = __name__
        NVMLError._valClassMapping[err_val] = cls
        classes[cls.__name__] = cls
    return classes


ERROR_CLASSES = _error_classes()
for _name, _cls in ERROR_CLASSES.items():
    setattr(sys.modules[__name__], _name, _cls)


# --- the machine -----------------------------------------------------------------------------


@dataclass
class FakeLink:
    remote_bus_id: str
    remote_type: int = _real.NVML_NVLINK_DEVICE_TYPE_SWITCH
    active: bool = True
    version: int = _real.NVML_NVLINK_VERSION_4_0


@dataclass
class FakeFabric:
    state: int = _real.NVML_GPU_FABRIC_STATE_COMPLETED
    status: int = _real.NVML_SUCCESS
    cluster_uuid: str = ""
    clique_id: int = 0
    health_mask: int = 0


@dataclass
class FakeMig:
    uuid: str
    memory_total: int
    gpu_instance_id: int
    compute_instance_id: int
    profile_id: int
    memory_used: int = 0


@dataclass
class FakeGpu:
    uuid: str
    name: str
    bus_id: str
    memory_total: int
    memory_used: int = 0
    utilization: int | None = 0
    compute_capability: tuple[int, int] | None = (9, 0)
    temperature: int | None = 30
    power_mw: int | None = 70_000
    # (corrected, volatile uncorrected, aggregate uncorrected); None: ECC off
    ecc: tuple[int, int, int] | None = (0, 0, 0)
    retired_pages: dict[int, list[int]] | None = None
    retired_pending: int | None = None
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    links: list[FakeLink] = field(default_factory=list)
    fabric: FakeFabric | None = None
    mig_mode: int | None = None  # None: MIG not supported on this GPU
    mig_slots: list[FakeMig | None] = field(default_factory=list)
    max_mig_devices: int = 7
    # profile index (NVML_GPU_INSTANCE_PROFILE_*) → (profile id, name as NVML gives it)
    mig_profiles: dict[int, tuple[int, str]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # function name → NVML error code


@dataclass
class FakeMachine:
    gpus: list[FakeGpu] = field(default_factory=list)
    driver_version: str = "550.54.15"
    cuda_version: int = 12040
    init_error: int | None = None
    missing: set[str] = field(default_factory=set)
    calls: Counter[str] = field(default_factory=Counter)
    started: int = 0  # nvmlInit reference count, as the library keeps it


@dataclass(frozen=True)
class FakeHandle:
    gpu: int
    mig: int | None = None  # the MIG slot, for a MIG device handle


@dataclass(frozen=True)
class FakeGpuInstance:
    gpu: int
    gpu_instance_id: int


# --- the module ------------------------------------------------------------------------------


class _Api:
    """The functions of the fake module, bound to one machine."""

    def __init__(self, machine: FakeMachine) -> None:
        self.m = machine

    def _enter(self, name: str, handle: FakeHandle | None = None) -> FakeGpu | None:
        self.m.calls[name] += 1
        if name in self.m.missing:
            raise NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
        if self.m.started <= 0:
            raise NVMLError(_real.NVML_ERROR_UNINITIALIZED)
        if handle is None:
            return None
        if not 0 <= handle.gpu < len(self.m.gpus):
            raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.m.gpus[handle.gpu]
        if name in gpu.errors:
            raise NVMLError(gpu.errors[name])
        return gpu

    def _gpu(self, name: str, handle: FakeHandle) -> FakeGpu:
        gpu = self._enter(name, handle)
        assert gpu is not None
        return gpu

    def _mig(self, name: str, handle: FakeHandle) -> FakeMig:
        gpu = self._gpu(name, handle)
        if handle.mig is None:
            raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        mig = gpu.mig_slots[handle.mig]
        assert mig is not None
        return mig

    def _physical(self, name: str, handle: FakeHandle) -> FakeGpu:
        gpu = self._gpu(name, handle)
        if handle.mig is not None:  # most device queries are not supported on MIG handles
            raise NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    # -- system ------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.m.calls["nvmlInit"] += 1
        if self.m.init_error is not None:
            raise NVMLError(self.m.init_error)
        self.m.started += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.m.started -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.m.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.m.cuda_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.m.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._gpu("nvmlDeviceGetHandleByIndex", FakeHandle(index))
        return FakeHandle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByUUID")
        for i, gpu in enumerate(self.m.gpus):
            if gpu.uuid == uuid:
                return FakeHandle(i)
            for slot, mig in enumerate(gpu.mig_slots):
                if mig is not None and mig.uuid == uuid:
                    return FakeHandle(i, slot)
        raise NVMLError(_real.NVML_ERROR_NOT_FOUND)

    # -- identity and usage --------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        if handle.mig is not None:
            return self._mig("nvmlDeviceGetUUID", handle).uuid
        return self._gpu("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._physical("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> Any:
        return _pci(self._physical("nvmlDeviceGetPciInfo", handle).bus_id)

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeHandle) -> tuple[int, int]:
        gpu = self._physical("nvmlDeviceGetCudaComputeCapability", handle)
        return _supported(gpu.compute_capability)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: int | None = None) -> Any:
        memory = _real.c_nvmlMemory_t()
        if handle.mig is not None:
            mig = self._mig("nvmlDeviceGetMemoryInfo", handle)
            total, used = mig.memory_total, mig.memory_used
        else:
            gpu = self._gpu("nvmlDeviceGetMemoryInfo", handle)
            total, used = gpu.memory_total, gpu.memory_used
        memory.total, memory.used, memory.free = total, used, total - used
        return memory

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> Any:
        gpu = self._physical("nvmlDeviceGetUtilizationRates", handle)
        rates = _real.c_nvmlUtilization_t()
        rates.gpu = _supported(gpu.utilization)
        return rates

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return _supported(self._physical("nvmlDeviceGetPowerUsage", handle).power_mw)

    def nvmlDeviceGetTemperatureV(self, handle: FakeHandle, sensor: int, version: int = 0) -> int:
        gpu = self._physical("nvmlDeviceGetTemperatureV", handle)
        return _supported(gpu.temperature)

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        return _supported(self._physical("nvmlDeviceGetTemperature", handle).temperature)

    # -- memory errors ---------------------------------------------------------------------

    def nvmlDeviceGetTotalEccErrors(
        self, handle: FakeHandle, errorType: int, counterType: int
    ) -> int:
        corrected, volatile, aggregate = _supported(
            self._physical("nvmlDeviceGetTotalEccErrors", handle).ecc
        )
        if errorType == _real.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return corrected
        return volatile if counterType == _real.NVML_VOLATILE_ECC else aggregate

    def nvmlDeviceGetRetiredPages(self, device: FakeHandle, sourceFilter: int) -> list[int]:
        pages = _supported(self._physical("nvmlDeviceGetRetiredPages", device).retired_pages)
        return list(pages.get(sourceFilter, []))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: FakeHandle) -> int:
        gpu = self._physical("nvmlDeviceGetRetiredPagesPendingStatus", device)
        return _supported(gpu.retired_pending)

    def nvmlDeviceGetRemappedRows(self, device: FakeHandle) -> tuple[int, int, int, int]:
        return _supported(self._physical("nvmlDeviceGetRemappedRows", device).remapped_rows)

    # -- NVLink and fabric -------------------------------------------------------------------

    def _link(self, name: str, device: FakeHandle, link: int) -> FakeLink:
        gpu = self._physical(name, device)
        if not gpu.links:
            raise NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(gpu.links):
            raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.links[link]

    def nvmlDeviceGetNvLinkState(self, device: FakeHandle, link: int) -> int:
        return int(self._link("nvmlDeviceGetNvLinkState", device, link).active)

    def nvmlDeviceGetNvLinkVersion(self, device: FakeHandle, link: int) -> int:
        return self._link("nvmlDeviceGetNvLinkVersion", device, link).version

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: FakeHandle, link: int) -> Any:
        return _pci(self._link("nvmlDeviceGetNvLinkRemotePciInfo", device, link).remote_bus_id)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: FakeHandle, link: int) -> int:
        return self._link("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link).remote_type

    def nvmlDeviceGetGpuFabricInfoV(self, device: FakeHandle, gpuFabricInfo: Any) -> int:
        fabric = _supported(self._physical("nvmlDeviceGetGpuFabricInfoV", device).fabric)
        info = gpuFabricInfo._obj  # what ctypes.byref points at, as the C library writes it
        if info.version != _real.nvmlGpuFabricInfo_v2:
            raise NVMLError(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        info.state, info.status = fabric.state, fabric.status
        info.cliqueId, info.healthMask = fabric.clique_id, fabric.health_mask
        if fabric.cluster_uuid:
            ctypes.memmove(info.clusterUuid, uuid.UUID(fabric.cluster_uuid).bytes, 16)
        return int(_real.NVML_SUCCESS)

    # -- MIG ---------------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, device: FakeHandle) -> list[int]:
        mode = _supported(self._physical("nvmlDeviceGetMigMode", device).mig_mode)
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: FakeHandle) -> int:
        gpu = self._physical("nvmlDeviceGetMaxMigDeviceCount", device)
        _supported(gpu.mig_mode)
        return gpu.max_mig_devices

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: FakeHandle, index: int) -> FakeHandle:
        gpu = self._physical("nvmlDeviceGetMigDeviceHandleByIndex", device)
        if gpu.mig_mode != _real.NVML_DEVICE_MIG_ENABLE or index >= gpu.max_mig_devices:
            raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        if index >= len(gpu.mig_slots) or gpu.mig_slots[index] is None:
            raise NVMLError(_real.NVML_ERROR_NOT_FOUND)
        return FakeHandle(device.gpu, index)

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: FakeHandle, profile: int, version: int = 2
    ) -> Any:
        gpu = self._physical("nvmlDeviceGetGpuInstanceProfileInfo", device)
        if not 0 <= profile < _real.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        profile_id, name = _supported(gpu.mig_profiles.get(profile))
        info = _real.c_nvmlGpuInstanceProfileInfo_v2_t()
        info.id, info.name = profile_id, name
        return info

    def nvmlDeviceGetGpuInstanceId(self, device: FakeHandle) -> int:
        return self._mig("nvmlDeviceGetGpuInstanceId", device).gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, device: FakeHandle) -> int:
        return self._mig("nvmlDeviceGetComputeInstanceId", device).compute_instance_id

    def nvmlDeviceGetGpuInstanceById(self, device: FakeHandle, gpuInstanceId: int) -> Any:
        gpu = self._physical("nvmlDeviceGetGpuInstanceById", device)
        if not any(m and m.gpu_instance_id == gpuInstanceId for m in gpu.mig_slots):
            raise NVMLError(_real.NVML_ERROR_NOT_FOUND)
        return FakeGpuInstance(device.gpu, gpuInstanceId)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: FakeGpuInstance) -> Any:
        self._enter("nvmlGpuInstanceGetInfo")
        gpu = self.m.gpus[gpuInstance.gpu]
        mig = next(
            m for m in gpu.mig_slots if m and m.gpu_instance_id == gpuInstance.gpu_instance_id
        )
        info = _real.c_nvmlGpuInstanceInfo_t()
        info.id, info.profileId = mig.gpu_instance_id, mig.profile_id
        return info


FUNCTIONS = [name for name in vars(_Api) if name.startswith("nvml")]
STRUCTURES = ["c_nvmlGpuFabricInfoV_t"]


def fake_nvml(machine: FakeMachine) -> types.ModuleType:
    """A fresh fake ``pynvml`` module answering from ``machine``."""
    module = types.ModuleType("pynvml", "fake pynvml for tests")
    for name in dir(_real):
        if name.startswith("NVML_") or name.startswith("nvmlGpuFabricInfo_v"):
            setattr(module, name, getattr(_real, name))
    for name in STRUCTURES:
        setattr(module, name, getattr(_real, name))
    for name, cls in {"NVMLError": NVMLError, **ERROR_CLASSES}.items():
        setattr(module, name, cls)
    api = _Api(machine)
    for name in FUNCTIONS:
        setattr(module, name, getattr(api, name))
    return module


def _supported(value: _T | None) -> _T:
    if value is None:
        raise NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
    return value


def _pci(bus_id: str) -> Any:
    info = _real.nvmlPciInfo_t()
    info.busId = bus_id
    info.busIdLegacy = bus_id
    return info
