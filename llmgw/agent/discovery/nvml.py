"""GPU discovery through NVML (nvidia-ml-py's ``pynvml``).

``nvml_gpus`` describes every GPU and MIG device NVML sees; ``nvml_node`` adds this host's
facts, fabrics, IMEX, storage and weights (``NvmlTelemetry`` in ``nvml_telemetry`` then
samples the devices for heartbeats). Each takes the ``pynvml`` module as a parameter
(default: the installed one), so tests inject a fake with the same API and error classes.

Health fails closed (the read rules are in ``nvml_probe``): an NVML error other than "not
supported" while reading a GPU marks it unhealthy with the reason, and so do volatile
uncorrected ECC errors, a pending page retirement, a pending or failed row remapping, a
failed NVLink fabric registration and an unhealthy fabric route. A GPU's problems are its
MIG devices' too. With no usable driver there are no GPUs and ``discovery`` says why
("none: NVIDIA driver not found (NVML: …)"); ``nvmlShutdown`` follows every successful
``nvmlInit``.

Derived fields: ``gpu_class`` is the model word of NVML's name (``gpu_class``); NVLink
versions are generations (NVML's ``NVML_NVLINK_VERSION_4_0`` is 4); NVLink peers are the
GPUs at the far end of active GPU links plus, for a GPU with an active NVSwitch link,
every other such GPU; the NUMA node and NIC path classes come from sysfs (see
``llmgw.agent.discovery.sysfs``). NVML does not report fabric bandwidth: it stays 0.
"""

from __future__ import annotations

import ctypes
import logging
import uuid as uuid_module
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from llmgw.agent.discovery.host import (
    cpu_count,
    host_facts,
    host_memory,
    infiniband_hcas,
    local_weights,
    storage,
)
from llmgw.agent.discovery.nvml_probe import (
    NvmlProbe,
    init_failure,
    load_pynvml,
    no_driver,
    nvml_error,
    read_temperature,
    shutdown_nvml,
    verdict,
)
from llmgw.agent.discovery.sysfs import (
    PciPath,
    imex_state,
    nic_path_class,
    pci_numa_node,
    pci_path,
    sysfs_bus_id,
)
from llmgw.api.llmgw.v1 import (
    FabricAttachment,
    Gpu,
    GpuHealth,
    Health,
    MigDevice,
    NicPath,
    NodeInfo,
    NvLink,
    NvLinkFabric,
)

logger = logging.getLogger(__name__)

__all__ = ["NvmlGpus", "cuda_version", "gpu_class", "nvml_gpus", "nvml_node"]

_ROOT = Path("/")
# NVML's nvmlNvlinkVersion_t → the NVLink generation (what the fixtures call version).
_NVLINK_GENERATION = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5, 8: 6}
_VENDOR_WORDS = frozenset({"NVIDIA", "Tesla", "Quadro", "GeForce"})
_SERIES_WORDS = frozenset({"RTX", "PRO", "TITAN"})


def gpu_class(name: str) -> str:
    """The short class placement matches, from NVML's device name.

    "NVIDIA H100 80GB HBM3" → "H100", "NVIDIA A100-SXM4-40GB" → "A100", "NVIDIA GB200" →
    "GB200", "NVIDIA GeForce RTX 4090" → "RTX 4090": vendor words dropped, series words
    (RTX, PRO, TITAN) kept, then the model word up to its first "-".
    """
    words = [w for w in name.split() if w not in _VENDOR_WORDS]
    series: list[str] = []
    while words and words[0] in _SERIES_WORDS:
        series.append(words.pop(0))
    model = words[0].split("-")[0] if words else ""
    return " ".join([*series, model]).strip()


def cuda_version(value: int | None) -> str:
    """ "12.4" from ``nvmlSystemGetCudaDriverVersion``'s 12040; "" when unknown."""
    if not value:
        return ""
    return f"{value // 1000}.{value % 1000 // 10}"


# --- discovery -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NvmlGpus:
    """What NVML says about this node's GPUs."""

    gpus: tuple[Gpu, ...]  # each GPU, followed by its MIG devices
    driver_version: str
    cuda_version: str
    discovery: str  # "nvml", or "none: …" saying why there are no GPUs


@dataclass(frozen=True, slots=True)
class _Context:
    """What every GPU read needs to know about the node."""

    driver: str
    cuda: str
    system_problems: tuple[str, ...]
    root: Path


def nvml_gpus(
    nvml: ModuleType | None = None,
    *,
    fabrics: Sequence[FabricAttachment] = (),
    root: Path = _ROOT,
) -> NvmlGpus:
    """Every GPU and MIG device NVML sees, with NIC paths to the HCAs of ``fabrics``.

    Never raises for an NVML error: a driver that cannot be used gives no GPUs and the
    reason in ``discovery``; a GPU that cannot be read is reported unhealthy.
    """
    nvml = nvml or load_pynvml()
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        reason = init_failure(nvml, exc)
        # A CPU-only node is normal; a driver that is there but fails is not.
        logger.log(logging.INFO if no_driver(nvml, exc) else logging.WARNING, "no GPUs: %s", reason)
        return NvmlGpus((), "", "", f"none: {reason}")
    try:
        return _discover(nvml, fabrics, root)
    finally:
        shutdown_nvml(nvml)


def nvml_node(
    *,
    node_id: str,
    hostname: str,
    labels: dict[str, str] | None = None,
    model_dirs: Sequence[Path] = (),
    storage_paths: Sequence[Path] = (),
    nvml: ModuleType | None = None,
    root: Path = _ROOT,
) -> NodeInfo:
    """This node as NVML and the host's files describe it."""
    fabrics = infiniband_hcas(root)
    found = nvml_gpus(nvml, fabrics=fabrics, root=root)
    host = host_facts(root)
    host.nvidia_driver_version = found.driver_version
    host.cuda_version = found.cuda_version
    return NodeInfo(
        node_id=node_id,
        hostname=hostname,
        labels=dict(labels or {}),
        host=host,
        gpus=list(found.gpus),
        imex=imex_state(root),
        fabrics=fabrics,
        weights=local_weights(list(model_dirs)),
        storage=storage(list(storage_paths)),
        memory=host_memory(root),
        cpu_count=cpu_count(),
        discovery=found.discovery,
    )


def _discover(nvml: ModuleType, fabrics: Sequence[FabricAttachment], root: Path) -> NvmlGpus:
    system = NvmlProbe(nvml)
    driver = str(system.get("driver version", nvml.nvmlSystemGetDriverVersion) or "")
    cuda = cuda_version(system.get("CUDA version", nvml.nvmlSystemGetCudaDriverVersion))
    count = system.get("GPU count", nvml.nvmlDeviceGetCount)
    if not count:
        why = "; ".join(system.problems) or "NVML sees no GPUs"
        logger.warning("no GPUs: %s", why)
        return NvmlGpus((), driver, cuda, f"none: {why}")
    ctx = _Context(driver, cuda, tuple(system.problems), root)
    devices = [device for index in range(int(count)) for device in _read_gpu(nvml, index, ctx)]
    _resolve_nvlinks(devices)
    _add_nic_paths(devices, fabrics, root)
    for gpu in devices:
        if gpu.health is not None and gpu.health.health == Health.UNHEALTHY:
            logger.warning("GPU %d (%s) unhealthy: %s", gpu.index, gpu.uuid, gpu.health.problems)
    return NvmlGpus(tuple(devices), driver, cuda, "nvml")


def _read_gpu(nvml: ModuleType, index: int, ctx: _Context) -> list[Gpu]:
    """GPU ``index`` followed by its MIG devices."""
    probe = NvmlProbe(nvml, ctx.system_problems)
    gpu = Gpu(index=index, numa_node=-1, driver_version=ctx.driver, cuda_version=ctx.cuda)
    handle = probe.get("handle", nvml.nvmlDeviceGetHandleByIndex, index)
    if handle is None:
        if not probe.problems:
            probe.problems.append("handle: NVML gives no handle for this index")
        gpu.health = probe.health()
        return [gpu]
    _read_identity(probe, handle, gpu, ctx.root)
    _read_usage(probe, handle, gpu)
    gpu.nvlinks = _read_nvlinks(probe, handle)
    gpu.fabric = _read_fabric(probe, handle)
    counters = _read_counters(probe, handle)
    migs = _read_migs(probe, handle, gpu)
    gpu.health = probe.health(counters)
    return [gpu, *(_finish_mig(mig, gpu, problems) for mig, problems in migs)]


def _read_identity(probe: NvmlProbe, handle: Any, gpu: Gpu, root: Path) -> None:
    nvml = probe.nvml
    gpu.uuid = str(probe.get("uuid", nvml.nvmlDeviceGetUUID, handle) or "")
    gpu.name = str(probe.get("name", nvml.nvmlDeviceGetName, handle) or "")
    gpu.gpu_class = gpu_class(gpu.name)
    pci = probe.get("PCI info", nvml.nvmlDeviceGetPciInfo, handle)
    gpu.pci_bus_id = str(pci.busId) if pci is not None else ""
    gpu.numa_node = pci_numa_node(gpu.pci_bus_id, root) if gpu.pci_bus_id else -1
    capability = probe.get("compute capability", nvml.nvmlDeviceGetCudaComputeCapability, handle)
    gpu.compute_capability = f"{capability[0]}.{capability[1]}" if capability else ""


def _read_usage(probe: NvmlProbe, handle: Any, gpu: Gpu) -> None:
    nvml = probe.nvml
    memory = probe.get("memory", nvml.nvmlDeviceGetMemoryInfo, handle)
    if memory is not None:
        gpu.memory_total_bytes, gpu.memory_used_bytes = int(memory.total), int(memory.used)
    utilization = probe.get("utilization", nvml.nvmlDeviceGetUtilizationRates, handle)
    gpu.utilization_pct = int(utilization.gpu) if utilization is not None else 0
    gpu.power_watts = int(probe.get("power", nvml.nvmlDeviceGetPowerUsage, handle) or 0) // 1000


def _read_counters(probe: NvmlProbe, handle: Any) -> GpuHealth:
    """Temperature, ECC and retired pages; what in them is a health problem goes to ``probe``."""
    nvml = probe.nvml

    def ecc(error: int, counter: int, what: str) -> int:
        return int(
            probe.get(f"ecc {what}", nvml.nvmlDeviceGetTotalEccErrors, handle, error, counter) or 0
        )

    corrected, uncorrected = (
        nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
        nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    )
    health = GpuHealth(
        temperature_c=int(probe.get("temperature", read_temperature, nvml, handle) or 0),
        ecc_volatile_corrected=ecc(corrected, nvml.NVML_VOLATILE_ECC, "volatile corrected"),
        ecc_volatile_uncorrected=ecc(uncorrected, nvml.NVML_VOLATILE_ECC, "volatile uncorrected"),
        ecc_aggregate_uncorrected=ecc(
            uncorrected, nvml.NVML_AGGREGATE_ECC, "aggregate uncorrected"
        ),
        retired_pages=_retired_pages(probe, handle),
    )
    if health.ecc_volatile_uncorrected:
        probe.problems.append(f"ecc: {health.ecc_volatile_uncorrected} volatile uncorrected errors")
    if probe.get("retired pages pending", nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle):
        probe.problems.append("retired pages: a page retirement is pending (reset the GPU)")
    rows = probe.get("remapped rows", nvml.nvmlDeviceGetRemappedRows, handle)
    if rows is not None and rows[2]:
        probe.problems.append("remapped rows: a row remapping is pending (reset the GPU)")
    if rows is not None and rows[3]:
        probe.problems.append("remapped rows: a row remapping failed")
    return health


def _retired_pages(probe: NvmlProbe, handle: Any) -> int:
    nvml = probe.nvml
    causes = (
        nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
        nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
    )
    pages = (probe.get("retired pages", nvml.nvmlDeviceGetRetiredPages, handle, c) for c in causes)
    return sum(len(found) for found in pages if found)


# --- NVLink and fabric -----------------------------------------------------------------------


def _read_nvlinks(probe: NvmlProbe, handle: Any) -> list[NvLink]:
    """Every link NVML knows of; stops at the first link that cannot be read."""
    links: list[NvLink] = []
    for index in range(int(probe.nvml.NVML_NVLINK_MAX_LINKS)):
        before = len(probe.problems)
        link = _read_nvlink(probe, handle, index)
        if len(probe.problems) > before:
            break
        if link is not None:
            links.append(link)
    return links


def _read_nvlink(probe: NvmlProbe, handle: Any, link: int) -> NvLink | None:
    nvml = probe.nvml
    # A link index past the GPU's last link is an invalid argument, not a failure.
    state = probe.get(
        f"nvlink {link} state",
        nvml.nvmlDeviceGetNvLinkState,
        handle,
        link,
        absent=("NVMLError_InvalidArgument",),
    )
    if state is None:
        return None
    version = probe.get(f"nvlink {link} version", nvml.nvmlDeviceGetNvLinkVersion, handle, link)
    entry = NvLink(
        link=link,
        remote_gpu_index=-1,
        version=_NVLINK_GENERATION.get(int(version or 0), 0),
        active=bool(state),
    )
    if entry.active:
        pci = probe.get(
            f"nvlink {link} remote", nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link
        )
        kind = probe.get(
            f"nvlink {link} remote type", nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link
        )
        entry.remote_pci_bus_id = str(pci.busId) if pci is not None else ""
        entry.remote_kind = _remote_kind(nvml, kind)
    return entry


def _remote_kind(nvml: ModuleType, kind: int | None) -> str:
    kinds = {
        nvml.NVML_NVLINK_DEVICE_TYPE_GPU: "gpu",
        nvml.NVML_NVLINK_DEVICE_TYPE_IBMNPU: "cpu",
        nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH: "switch",
    }
    return kinds.get(kind, "") if kind is not None else ""


def _resolve_nvlinks(devices: Sequence[Gpu]) -> None:
    """Peer GPU indices for every GPU link and every GPU."""
    physical = [g for g in devices if g.mig is None]
    index_of = {sysfs_bus_id(g.pci_bus_id): g.index for g in physical if g.pci_bus_id}
    for gpu in physical:
        for link in gpu.nvlinks:
            peer = index_of.get(sysfs_bus_id(link.remote_pci_bus_id), -1)
            if link.active and peer >= 0 and peer != gpu.index:
                link.remote_gpu_index = peer
                link.remote_kind = link.remote_kind or "gpu"
    switched = {g.index for g in physical if any(_on_switch(link) for link in g.nvlinks)}
    for gpu in physical:  # MIG devices have no NVLink peers: MIG has no peer-to-peer
        gpu.nvlink_peers = _peers(gpu, switched)


def _on_switch(link: NvLink) -> bool:
    return link.active and link.remote_kind == "switch"


def _peers(gpu: Gpu, switched: set[int]) -> list[int]:
    direct = {n.remote_gpu_index for n in gpu.nvlinks if n.active and n.remote_gpu_index >= 0}
    via_switch = switched - {gpu.index} if gpu.index in switched else set()
    return sorted(direct | via_switch)


def _read_fabric(probe: NvmlProbe, handle: Any) -> NvLinkFabric | None:
    """NVLink fabric membership; ``None`` when it could not be read (a problem is recorded)."""
    nvml = probe.nvml
    info = nvml.c_nvmlGpuFabricInfoV_t()
    before = len(probe.problems)
    done = probe.get("fabric", nvml.nvmlDeviceGetGpuFabricInfoV, handle, ctypes.byref(info))
    if done is None:
        return None if len(probe.problems) > before else NvLinkFabric(state="not_supported")
    states = {
        nvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED: "not_supported",
        nvml.NVML_GPU_FABRIC_STATE_NOT_STARTED: "not_started",
        nvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS: "in_progress",
        nvml.NVML_GPU_FABRIC_STATE_COMPLETED: "completed",
    }
    fabric = NvLinkFabric(state=states.get(int(info.state), f"unknown ({info.state})"))
    if fabric.state == "completed":  # status, cluster and clique mean something only now
        fabric.status = (
            "success" if info.status == nvml.NVML_SUCCESS else _error_text(nvml, info.status)
        )
        cluster = bytes(info.clusterUuid)
        fabric.cluster_uuid = str(uuid_module.UUID(bytes=cluster)) if any(cluster) else ""
        fabric.clique_id = int(info.cliqueId)
        if info.status != nvml.NVML_SUCCESS:
            probe.problems.append(f"fabric: registration failed: {fabric.status}")
    if _route_unhealthy(nvml, int(info.healthMask)):
        probe.problems.append("fabric: route unhealthy")
    return fabric


def _route_unhealthy(nvml: ModuleType, mask: int) -> bool:
    """Whether the fabric health mask's "route unhealthy" field says true."""
    shift = nvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY
    width = nvml.NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_ROUTE_UNHEALTHY
    return bool((mask >> shift) & width == nvml.NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_UNHEALTHY_TRUE)


def _error_text(nvml: ModuleType, code: int) -> str:
    return nvml_error(nvml.NVMLError(int(code)))


# --- MIG ---------------------------------------------------------------------------------


def _read_migs(probe: NvmlProbe, handle: Any, parent: Gpu) -> list[tuple[Gpu, list[str]]]:
    """The MIG devices of a MIG-enabled GPU, each with its own problems."""
    nvml = probe.nvml
    mode = probe.get("MIG mode", nvml.nvmlDeviceGetMigMode, handle)
    if not mode or mode[0] != nvml.NVML_DEVICE_MIG_ENABLE:
        return []
    parent.mig_enabled = True
    slots = int(probe.get("MIG device count", nvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0)
    profiles = _mig_profiles(probe, handle)
    found: list[tuple[Gpu, list[str]]] = []
    for slot in range(slots):
        mig = probe.get(
            f"MIG device {slot}",
            nvml.nvmlDeviceGetMigDeviceHandleByIndex,
            handle,
            slot,
            absent=("NVMLError_NotFound",),  # an empty slot
        )
        if mig is not None:
            found.append(_read_mig(nvml, handle, mig, profiles))
    return found


def _mig_profiles(probe: NvmlProbe, handle: Any) -> dict[int, str]:
    """GPU instance profile id → name ("3g.40gb") for the profiles this GPU offers."""
    nvml = probe.nvml
    names: dict[int, str] = {}
    for profile in range(int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
        info = probe.get(
            f"MIG profile {profile}",
            nvml.nvmlDeviceGetGpuInstanceProfileInfo,
            handle,
            profile,
            absent=("NVMLError_InvalidArgument",),  # not a profile of this GPU
        )
        if info is not None:
            names[int(info.id)] = str(info.name).removeprefix("MIG ").strip()
    return names


def _read_mig(
    nvml: ModuleType, parent_handle: Any, handle: Any, profiles: dict[int, str]
) -> tuple[Gpu, list[str]]:
    """What a MIG device alone knows: UUID, memory, instance ids and profile."""
    probe = NvmlProbe(nvml)
    device = Gpu(uuid=str(probe.get("uuid", nvml.nvmlDeviceGetUUID, handle) or ""))
    memory = probe.get("memory", nvml.nvmlDeviceGetMemoryInfo, handle)
    if memory is not None:
        device.memory_total_bytes, device.memory_used_bytes = int(memory.total), int(memory.used)
    gi = probe.get("GPU instance id", nvml.nvmlDeviceGetGpuInstanceId, handle)
    ci = probe.get("compute instance id", nvml.nvmlDeviceGetComputeInstanceId, handle)
    profile = _mig_profile(probe, parent_handle, gi, profiles) if gi is not None else ""
    device.mig = MigDevice(
        profile=profile, gpu_instance_id=int(gi or 0), compute_instance_id=int(ci or 0)
    )
    return device, probe.problems


def _mig_profile(probe: NvmlProbe, parent_handle: Any, gi: int, profiles: dict[int, str]) -> str:
    """The profile name of GPU instance ``gi``; "" when it cannot be told."""
    nvml = probe.nvml
    instance = probe.get("GPU instance", nvml.nvmlDeviceGetGpuInstanceById, parent_handle, gi)
    if instance is None:
        return ""
    info = probe.get("GPU instance info", nvml.nvmlGpuInstanceGetInfo, instance)
    return profiles.get(int(info.profileId), "") if info is not None else ""


def _finish_mig(device: Gpu, parent: Gpu, problems: list[str]) -> Gpu:
    """A MIG device shares its parent's place, links, fabric, counters and problems."""
    mig = device.mig or MigDevice()
    parent_health = parent.health or GpuHealth()
    device.index = parent.index
    device.name = f"{parent.name} MIG {mig.profile}" if mig.profile else f"{parent.name} MIG"
    device.gpu_class, device.compute_capability = parent.gpu_class, parent.compute_capability
    device.numa_node, device.pci_bus_id = parent.numa_node, parent.pci_bus_id
    device.driver_version, device.cuda_version = parent.driver_version, parent.cuda_version
    device.fabric = parent.fabric
    mig.parent_uuid, mig.parent_index = parent.uuid, parent.index
    device.mig = mig
    device.health = verdict(parent_health, [*parent_health.problems, *problems])
    return device


# --- NIC paths ---------------------------------------------------------------------------


def _add_nic_paths(devices: Sequence[Gpu], fabrics: Sequence[FabricAttachment], root: Path) -> None:
    """The path class from every device to every HCA (MIG devices share their parent's)."""
    hcas: dict[str, tuple[PciPath | None, int]] = {}
    for f in fabrics:
        hcas.setdefault(
            f.hca, (pci_path(root / "sys/class/infiniband" / f.hca / "device"), f.numa_node)
        )
    paths: dict[str, list[NicPath]] = {}
    for gpu in (g for g in devices if g.pci_bus_id):
        if gpu.pci_bus_id not in paths:
            own = pci_path(root / "sys/bus/pci/devices" / sysfs_bus_id(gpu.pci_bus_id))
            paths[gpu.pci_bus_id] = [
                NicPath(hca=hca, path=nic_path_class(own, where, gpu.numa_node, numa))
                for hca, (where, numa) in hcas.items()
            ]
        gpu.nic_paths = [NicPath(hca=p.hca, path=p.path) for p in paths[gpu.pci_bus_id]]
