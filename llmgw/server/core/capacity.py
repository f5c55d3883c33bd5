"""A placement view of nodes: what each node offers, read once from its ``Node`` message.

:func:`node_capacity` turns the operator API's ``Node`` (the registration as the agent sent
it, its live ``telemetry`` and its ``state``) into a frozen :class:`NodeCapacity` that
placement reads many times:

- **devices** are the things an engine can be given: whole GPUs, and the MIG slices of a
  MIG-enabled GPU (whose parent is then not a device of its own). A device's free memory
  comes from the latest telemetry when there is one, else from the registration; it is
  healthy only while its latest health (and its parent's, for a slice) is HEALTHY, so
  unknown health fails closed.
- **schedulable** is true only for a READY node that is not cordoned.
- **ib_fabrics** are the InfiniBand fabrics the node has an ACTIVE attachment to, with the
  HCAs on each (``ib_hcas``); **nvlink_domain** is ``"CLUSTER_UUID/CLIQUE"`` when every GPU
  reports a completed NVLink fabric in that clique and IMEX is up, else None.

:func:`choose_group` picks the GPUs of one shard on one node by topology (see there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from llmgw.api.llmgw.v1 import Gpu, GpuTelemetry, Health, Node, NodeInfo, NodeState

__all__ = [
    "TIER_NAMES",
    "Device",
    "NodeCapacity",
    "choose_group",
    "node_capacity",
]

# Path classes an HCA may have to count as a GPU's nearest, closest first.
_NEAR_PATHS = ("PIX", "PXB", "NODE")

# Topology tiers of a group of devices on one node, best first (see choose_group).
TIER_NAMES = (
    "NVLink within one NUMA node",
    "NVLink across NUMA nodes",
    "PCIe within one NUMA node",
    "PCIe across NUMA nodes",
)


@dataclass(frozen=True, slots=True)
class Device:
    """A GPU or a MIG slice that an engine can be given."""

    uuid: str
    index: int  # NVML index; a MIG slice's is its parent's
    gpu_class: str
    memory_total_bytes: int
    memory_free_bytes: int
    numa_node: int  # -1 when unknown
    nvlink_peers: frozenset[int]  # indices of GPUs reachable over NVLink
    nic_paths: tuple[tuple[str, str], ...]  # (hca, path class), as discovered
    healthy: bool
    mig_profile: str | None = None  # "3g.40gb" on a MIG slice
    parent_uuid: str | None = None  # the GPU a MIG slice is carved from

    def nearest_hca(self, among: Iterable[str] | None = None) -> str | None:
        """The closest HCA (PIX, else PXB, else NODE), optionally only among ``among``."""
        allowed = None if among is None else frozenset(among)
        for wanted in _NEAR_PATHS:
            for hca, path in self.nic_paths:
                if path == wanted and (allowed is None or hca in allowed):
                    return hca
        return None


@dataclass(frozen=True, slots=True)
class NodeCapacity:
    """What one node offers to placement."""

    node_id: str
    address: str  # management address, else hostname
    state: NodeState
    schedulable: bool  # READY and not cordoned
    labels: Mapping[str, str]
    pool: str  # labels["pool"] or ""
    devices: tuple[Device, ...]
    ib_fabrics: frozenset[str]
    nvlink_domain: str | None
    cpu_count: int
    ib_hcas: Mapping[str, frozenset[str]] = field(default_factory=dict)  # fabric -> HCAs here

    @property
    def status(self) -> str:
        """The node's state as an operator reads it: READY, NOT_READY or CORDONED."""
        if self.state is NodeState.READY and not self.schedulable:
            return "CORDONED"
        return self.state.name if self.state.name != "UNSPECIFIED" else "NOT_READY"


def node_capacity(node: Node) -> NodeCapacity:
    """The placement view of ``node``."""
    info = node.info or NodeInfo()
    live = {t.uuid: t for t in node.telemetry.gpus} if node.telemetry is not None else {}
    labels = dict(info.labels)
    state = node.state if isinstance(node.state, NodeState) else NodeState.NOT_READY
    return NodeCapacity(
        node_id=info.node_id,
        address=info.management_address or info.hostname,
        state=state,
        schedulable=state is NodeState.READY and not node.cordoned,
        labels=MappingProxyType(labels),
        pool=labels.get("pool", ""),
        devices=_devices(info.gpus, live),
        ib_fabrics=frozenset(_ib_hcas(info)),
        nvlink_domain=_nvlink_domain(info),
        cpu_count=info.cpu_count,
        ib_hcas=MappingProxyType(_ib_hcas(info)),
    )


def _devices(gpus: Sequence[Gpu], live: Mapping[str, GpuTelemetry]) -> tuple[Device, ...]:
    health = {g.uuid: _healthy(g, live.get(g.uuid)) for g in gpus}
    return tuple(_device(g, live.get(g.uuid), health) for g in gpus if not g.mig_enabled)


def _healthy(gpu: Gpu, latest: GpuTelemetry | None) -> bool:
    """HEALTHY by the latest word on it: the telemetry's when there is one."""
    if latest is not None:
        return latest.health == Health.HEALTHY
    return gpu.health is not None and gpu.health.health == Health.HEALTHY


def _device(gpu: Gpu, latest: GpuTelemetry | None, health: Mapping[str, bool]) -> Device:
    used = latest.memory_used_bytes if latest is not None else gpu.memory_used_bytes
    mig = gpu.mig
    parent = mig.parent_uuid if mig is not None else None
    healthy = health[gpu.uuid] and (parent is None or health.get(parent, True))
    return Device(
        uuid=gpu.uuid,
        index=gpu.index,
        gpu_class=gpu.gpu_class,
        memory_total_bytes=gpu.memory_total_bytes,
        memory_free_bytes=max(0, gpu.memory_total_bytes - used),
        numa_node=gpu.numa_node,
        nvlink_peers=frozenset(gpu.nvlink_peers),
        nic_paths=tuple((p.hca, p.path.upper()) for p in gpu.nic_paths),
        healthy=healthy,
        mig_profile=mig.profile if mig is not None else None,
        parent_uuid=parent,
    )


def _ib_hcas(info: NodeInfo) -> dict[str, frozenset[str]]:
    by_fabric: dict[str, set[str]] = {}
    for att in info.fabrics:
        if att.link_layer.lower() == "infiniband" and att.state.upper() == "ACTIVE":
            by_fabric.setdefault(att.fabric, set()).add(att.hca)
    return {fabric: frozenset(hcas) for fabric, hcas in by_fabric.items()}


def _nvlink_domain(info: NodeInfo) -> str | None:
    if info.imex is None or info.imex.state.lower() != "up":
        return None
    domains = set()
    for gpu in info.gpus:
        if gpu.mig is not None:
            continue
        fabric = gpu.fabric
        if fabric is None or fabric.state.lower() != "completed" or not fabric.cluster_uuid:
            return None
        if fabric.status and fabric.status.lower() != "success":
            return None
        domains.add(f"{fabric.cluster_uuid}/{fabric.clique_id}")
    return domains.pop() if len(domains) == 1 else None


# --- choosing the devices of one shard ---------------------------------------------------


def choose_group(free: Sequence[Device], count: int) -> tuple[int, tuple[Device, ...]] | None:
    """The tightest ``count`` devices among ``free`` and their tier (0 best, see TIER_NAMES),
    or None when there are too few.

    Tiers, best first: all pairwise NVLink within one NUMA node; all pairwise NVLink
    across NUMA nodes; one NUMA node over PCIe; anything. Within tier 0 and 2 the NUMA node
    with the fewest free devices that still fits wins (best fit keeps whole halves free for
    larger groups); devices are taken in index order. Deterministic for equal inputs.
    """
    if count <= 0 or len(free) < count:
        return None if count > 0 else (0, ())
    ordered = sorted(free, key=lambda d: (d.numa_node, d.index, d.uuid))
    by_numa: dict[int, list[Device]] = {}
    for device in ordered:
        by_numa.setdefault(device.numa_node, []).append(device)
    halves = sorted(by_numa.values(), key=lambda g: (len(g), g[0].numa_node))
    for group in halves:
        clique = _clique(group, count)
        if clique is not None:
            return 0, clique
    clique = _clique(ordered, count)
    if clique is not None:
        return 1, clique
    for group in halves:
        if len(group) >= count:
            return 2, tuple(group[:count])
    return 3, tuple(ordered[:count])


def _clique(devices: Sequence[Device], count: int) -> tuple[Device, ...] | None:
    """The first ``count`` devices (in order) that are all pairwise NVLink peers."""
    if len(devices) < count:
        return None
    if count == 1:
        return (devices[0],)
    chosen: list[Device] = []

    def extend(start: int) -> bool:
        if len(chosen) == count:
            return True
        for i in range(start, len(devices) - (count - len(chosen)) + 1):
            candidate = devices[i]
            if all(_linked(candidate, other) for other in chosen):
                chosen.append(candidate)
                if extend(i + 1):
                    return True
                chosen.pop()
        return False

    return tuple(chosen) if extend(0) else None


def _linked(a: Device, b: Device) -> bool:
    return a.index != b.index and b.index in a.nvlink_peers and a.index in b.nvlink_peers
