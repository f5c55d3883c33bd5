"""Topology fixtures: reading one, checking it, and expanding it into a ``NodeInfo``.

The shipped fixtures live in ``llmgw.sim.fixtures`` (``dgx-h100``, ``a100-mig``,
``gb200-nvl4``, ``l4-pcie``, ``cpu-only``); any other ``.json`` file in the same format
works too (``--simulate ./my-node.json``).

Fixture format (version 1). Keys are the proto's field names where one exists; sizes carry
their unit in the key (``_mib``, ``_gib``); keys starting with ``_`` are comments. An
unknown key is an error, so a typo cannot silently drop a field::

    format: 1                      description: str        discovery_note: str (optional)
    host: {os_id, os_version, os_codename, arch, kernel, cpu_model,
           cpu_flags: "space separated", nvidia_driver_version, cuda_version}
    cpu_count: int                 memory: {total_gib, available_gib}
    storage: [{path, total_gib, free_gib}]      weights: [{path, model, size_gib}]
    imex: {state, channels: [int], domain}
    fabrics: [{fabric, hca, port, rate_gbps, link_layer, state, numa_node}]
    gpu_defaults: {any GPU key}    merged under every entry of ``gpus``
    gpus: [{index, pci_bus_id, numa_node, name, gpu_class, memory_mib, memory_used_mib,
            compute_capability, utilization_pct, power_watts,
            health: healthy|unhealthy|unknown, problems, temperature_c, retired_pages,
            ecc_volatile_corrected, ecc_volatile_uncorrected, ecc_aggregate_uncorrected,
            nvlinks: [{count, remote_kind: gpu|switch|cpu, remote_gpu_index,
                       remote_pci_bus_id, version, active}],
            nvlink_peers: [int]        (default: derived from nvlinks, see below)
            nearest_hca: str | nic_paths: {hca: PIX|PXB|PHB|NODE|SYS},
            fabric: {state, status, cluster_uuid, clique_id, bandwidth_gbps},
            mig_enabled: bool, mig: [{profile, memory_mib, memory_used_mib,
                                      gpu_instance_id, compute_instance_id}]}]

Expansion makes everything explicit in the ``NodeInfo``: a group of ``count`` links
becomes that many numbered ``NvLink`` entries (a GPU-kind link gets its peer's PCI bus
id); ``nvlink_peers`` defaults to the GPUs named by GPU-kind links plus, for a GPU with
switch links, every other GPU with switch links (NVSwitch is all-to-all); without explicit
``nic_paths`` every HCA gets a path class: ``nearest_hca`` is PIX, an HCA on the GPU's
NUMA node is NODE, any other SYS. MIG slices are listed right after their parent with
``mig`` set; the parent gets ``mig_enabled``.

GPU and MIG UUIDs are derived from the node id (uuid5), so two nodes simulated from the
same fixture never share a UUID, and a node keeps its UUIDs across restarts. Fabric
cluster UUIDs and clique ids are not derived: nodes simulated from one fixture share an
NVLink domain, as trays of one rack do.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from llmgw.agent.discovery.errors import FixtureError
from llmgw.api.llmgw.v1 import (
    FabricAttachment,
    Gpu,
    GpuHealth,
    Health,
    HostFacts,
    Imex,
    LocalWeights,
    Memory,
    MigDevice,
    NicPath,
    NodeInfo,
    NvLink,
    NvLinkFabric,
    Storage,
)

__all__ = ["expand_fixture"]

_FORMAT = 1
_MIB = 1 << 20
_GIB = 1 << 30
# Fixed namespace for simulated GPU UUIDs; changing it changes every simulated UUID.
_UUID_NAMESPACE = uuid.UUID("5d0c7e3a-2f41-4c55-8d6e-3b9a1f0e7c21")
_HEALTH = {"healthy": Health.HEALTHY, "unhealthy": Health.UNHEALTHY, "unknown": Health.UNKNOWN}
_REMOTE_KINDS = frozenset({"gpu", "switch", "cpu"})
_PATH_CLASSES = frozenset({"PIX", "PXB", "PHB", "NODE", "SYS"})

_TOP_KEYS = frozenset(
    {"format", "description", "discovery_note", "host", "cpu_count", "memory", "storage"}
    | {"weights", "imex", "fabrics", "gpu_defaults", "gpus"}
)
_HOST_KEYS = frozenset(
    {"os_id", "os_version", "os_codename", "arch", "kernel", "cpu_model", "cpu_flags"}
    | {"nvidia_driver_version", "cuda_version"}
)
_GPU_KEYS = frozenset(
    {"index", "pci_bus_id", "numa_node", "name", "gpu_class", "memory_mib", "memory_used_mib"}
    | {"compute_capability", "utilization_pct", "power_watts", "health", "problems"}
    | {"temperature_c", "retired_pages", "ecc_volatile_corrected", "ecc_volatile_uncorrected"}
    | {"ecc_aggregate_uncorrected", "nvlinks", "nvlink_peers", "nearest_hca", "nic_paths"}
    | {"fabric", "mig_enabled", "mig"}
)
_LINK_KEYS = frozenset(
    {"count", "remote_kind", "remote_gpu_index", "remote_pci_bus_id", "version", "active"}
)
_MIG_KEYS = frozenset(
    {"profile", "memory_mib", "memory_used_mib", "gpu_instance_id", "compute_instance_id"}
)
_FABRIC_KEYS = frozenset({"state", "status", "cluster_uuid", "clique_id", "bandwidth_gbps"})
_ATTACHMENT_KEYS = frozenset(
    {"fabric", "hca", "port", "rate_gbps", "link_layer", "state", "numa_node"}
)


# --- reading a fixture, with the key path of every value for errors ----------------------


@dataclass(frozen=True, slots=True)
class _Obj:
    """A JSON object in a fixture and where it sits, so an error can name the key path.

    ``fallback`` is consulted for keys this object lacks (``gpu_defaults`` under a GPU).
    """

    source: str
    where: str
    data: Mapping[str, Any]
    fallback: _Obj | None = None

    def fail(self, key: str, why: str) -> NoReturn:
        raise FixtureError(f"{self.source}: {self._path(key)}: {why}")

    def has(self, key: str) -> bool:
        return self._owner(key) is not None

    def _owner(self, key: str) -> _Obj | None:
        if key in self.data:
            return self
        return self.fallback._owner(key) if self.fallback is not None else None

    def _get(self, key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        owner = self._owner(key)
        if owner is None:
            if default is None:
                self.fail(key, "missing")
            return default
        value = owner.data[key]
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            owner.fail(key, f"expected {_kind_name(kind)}, got {json.dumps(value)[:60]}")
        return value

    def text(self, key: str, default: str | None = None) -> str:
        return str(self._get(key, str, default))

    def integer(self, key: str, default: int | None = None, *, low: int = 0) -> int:
        value = int(self._get(key, int, default))
        if value < low:
            (self._owner(key) or self).fail(key, f"must be at least {low}, got {value}")
        return value

    def number(self, key: str, default: float | None = None) -> float:
        value = float(self._get(key, (int, float), default))
        if value < 0:
            (self._owner(key) or self).fail(key, f"must not be negative, got {value}")
        return value

    def flag(self, key: str, default: bool | None = None) -> bool:
        return bool(self._get(key, bool, default))

    def child(self, key: str) -> _Obj | None:
        owner = self._owner(key)
        if owner is None:
            return None
        return _Obj.of(owner.source, owner._path(key), owner.data[key])

    def children(self, key: str, allowed: frozenset[str]) -> list[_Obj]:
        owner = self._owner(key) or self
        items = self._get(key, list, [])
        where = owner._path(key)
        return [_Obj.of(self.source, f"{where}[{i}]", v).only(allowed) for i, v in enumerate(items)]

    def texts(self, key: str) -> list[str]:
        return [str(v) for v in self._items(key, str)]

    def integers(self, key: str) -> list[int]:
        return [int(v) for v in self._items(key, int)]

    def _items(self, key: str, kind: type) -> list[Any]:
        items: list[Any] = self._get(key, list, [])
        owner = self._owner(key) or self
        for i, item in enumerate(items):
            if isinstance(item, bool) or not isinstance(item, kind):
                owner.fail(f"{key}[{i}]", f"expected {_kind_name(kind)}, got {json.dumps(item)}")
        return items

    def only(self, allowed: frozenset[str]) -> _Obj:
        for key in self.data:
            if key not in allowed and not key.startswith("_"):
                self.fail(key, f"unknown key (known: {', '.join(sorted(allowed))})")
        return self

    def _path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    @classmethod
    def of(cls, source: str, where: str, value: object) -> _Obj:
        if not isinstance(value, dict):
            raise FixtureError(f"{source}: {where or '(top level)'}: expected an object")
        return cls(source, where, value)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
    names |= {list: "a list", dict: "an object"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


# --- expanding a fixture into a NodeInfo -------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Context:
    """What every GPU of a node needs to know about the rest of it."""

    node_id: str
    host: HostFacts
    fabrics: list[FabricAttachment]


def expand_fixture(
    name: str, source: str, data: object, *, node_id: str, hostname: str
) -> NodeInfo:
    """The node a parsed fixture describes; ``source`` names the file in errors.

    Raises ``FixtureError`` naming ``source`` and the key path of the first thing wrong.
    """
    top = _Obj.of(source, "", data)
    top.only(_TOP_KEYS)
    if top.integer("format") != _FORMAT:
        top.fail("format", f"unsupported version (this llmgw reads {_FORMAT})")
    top.text("description", "")
    note = top.text("discovery_note", "")
    ctx = _Context(node_id, _host(_required(top, "host")), _fabrics(top))
    return NodeInfo(
        node_id=node_id,
        hostname=hostname,
        discovery=f"simulated:{name}" + (f": {note}" if note else ""),
        host=ctx.host,
        gpus=_gpus(top, ctx),
        imex=_imex(top.child("imex")),
        fabrics=ctx.fabrics,
        weights=_weights(top),
        storage=_storage(top),
        memory=_memory(_required(top, "memory")),
        cpu_count=top.integer("cpu_count", low=1),
    )


def _required(obj: _Obj, key: str) -> _Obj:
    child = obj.child(key)
    if child is None:
        obj.fail(key, "missing")
    return child


def _host(o: _Obj) -> HostFacts:
    o.only(_HOST_KEYS)
    return HostFacts(
        os_id=o.text("os_id"),
        os_version=o.text("os_version"),
        os_codename=o.text("os_codename", ""),
        arch=o.text("arch"),
        cpu_flags=o.text("cpu_flags", "").split(),
        kernel=o.text("kernel", ""),
        nvidia_driver_version=o.text("nvidia_driver_version", ""),
        cuda_version=o.text("cuda_version", ""),
        cpu_model=o.text("cpu_model", ""),
    )


def _memory(o: _Obj) -> Memory:
    o.only(frozenset({"total_gib", "available_gib"}))
    total, available = o.number("total_gib"), o.number("available_gib")
    if available > total:
        o.fail("available_gib", "is more than total_gib")
    return Memory(total_bytes=_gib(total), available_bytes=_gib(available))


def _storage(top: _Obj) -> list[Storage]:
    keys = frozenset({"path", "total_gib", "free_gib"})
    return [
        Storage(
            path=s.text("path"),
            total_bytes=_gib(s.number("total_gib")),
            free_bytes=_gib(s.number("free_gib")),
        )
        for s in top.children("storage", keys)
    ]


def _weights(top: _Obj) -> list[LocalWeights]:
    keys = frozenset({"path", "model", "size_gib"})
    return [
        LocalWeights(
            path=w.text("path"), model=w.text("model"), size_bytes=_gib(w.number("size_gib"))
        )
        for w in top.children("weights", keys)
    ]


def _imex(o: _Obj | None) -> Imex:
    if o is None:
        return Imex(state="not_installed")
    o.only(frozenset({"state", "channels", "domain"}))
    return Imex(state=o.text("state"), channels=o.integers("channels"), domain=o.text("domain", ""))


def _fabrics(top: _Obj) -> list[FabricAttachment]:
    fabrics = [
        FabricAttachment(
            fabric=f.text("fabric"),
            hca=f.text("hca"),
            port=f.integer("port", 1, low=1),
            rate_gbps=f.number("rate_gbps"),
            link_layer=f.text("link_layer"),
            state=f.text("state"),
            numa_node=f.integer("numa_node", -1, low=-1),
        )
        for f in top.children("fabrics", _ATTACHMENT_KEYS)
    ]
    _unique(top, "fabrics", [(f.hca, f.port) for f in fabrics], "HCA port")
    return fabrics


def _unique(obj: _Obj, key: str, values: Sequence[object], what: str) -> None:
    seen: set[object] = set()
    for i, value in enumerate(values):
        if value in seen:
            obj.fail(f"{key}[{i}]", f"duplicate {what} {value}")
        seen.add(value)


def _gib(value: float) -> int:
    return round(value * _GIB)


# --- GPUs --------------------------------------------------------------------------------


def _gpus(top: _Obj, ctx: _Context) -> list[Gpu]:
    defaults = top.child("gpu_defaults")
    if defaults is not None:
        defaults.only(_GPU_KEYS)
    entries = [_Obj(e.source, e.where, e.data, defaults) for e in top.children("gpus", _GPU_KEYS)]
    physical = [_physical_gpu(e, ctx) for e in entries]
    _unique(top, "gpus", [g.index for g in physical], "index")
    _unique(top, "gpus", [g.pci_bus_id for g in physical], "pci_bus_id")
    links = [_nvlinks(e, physical) for e in entries]
    switched = {g.index for g, ls in zip(physical, links, strict=True) if _has_switch(ls)}
    devices: list[Gpu] = []
    for gpu, entry, gpu_links in zip(physical, entries, links, strict=True):
        gpu.nvlinks = gpu_links
        gpu.nvlink_peers = _peers(entry, gpu, switched, {g.index for g in physical})
        devices.append(gpu)
        devices.extend(_mig_devices(entry, gpu, ctx))
    return devices


def _physical_gpu(e: _Obj, ctx: _Context) -> Gpu:
    index = e.integer("index")
    gpu = _device(e, ctx, index)
    gpu.uuid = _device_uuid("GPU", ctx.node_id, f"gpu/{index}")
    gpu.memory_total_bytes = e.integer("memory_mib", low=1) * _MIB
    gpu.memory_used_bytes = e.integer("memory_used_mib", 0) * _MIB
    if gpu.memory_used_bytes > gpu.memory_total_bytes:
        e.fail("memory_used_mib", "is more than memory_mib")
    gpu.utilization_pct = e.integer("utilization_pct", 0)
    gpu.power_watts = e.integer("power_watts", 0)
    gpu.mig_enabled = e.flag("mig_enabled", bool(e.children("mig", _MIG_KEYS)))
    return gpu


def _device(e: _Obj, ctx: _Context, index: int) -> Gpu:
    """The fields a GPU and each of its MIG devices share."""
    return Gpu(
        index=index,
        name=e.text("name"),
        gpu_class=e.text("gpu_class"),
        compute_capability=e.text("compute_capability"),
        numa_node=e.integer("numa_node", -1, low=-1),
        pci_bus_id=e.text("pci_bus_id"),
        driver_version=ctx.host.nvidia_driver_version,
        cuda_version=ctx.host.cuda_version,
        nic_paths=_nic_paths(e, ctx.fabrics),
        fabric=_nvlink_fabric(e.child("fabric")),
        health=_health(e),
    )


def _device_uuid(prefix: str, node_id: str, key: str) -> str:
    return f"{prefix}-{uuid.uuid5(_UUID_NAMESPACE, f'{node_id}/{key}')}"


def _health(e: _Obj) -> GpuHealth:
    word = e.text("health", "healthy")
    if word not in _HEALTH:
        e.fail("health", f"expected one of {', '.join(_HEALTH)}, got {word!r}")
    return GpuHealth(
        health=_HEALTH[word],
        temperature_c=e.integer("temperature_c", 0),
        problems=e.texts("problems"),
        retired_pages=e.integer("retired_pages", 0),
        ecc_volatile_corrected=e.integer("ecc_volatile_corrected", 0),
        ecc_volatile_uncorrected=e.integer("ecc_volatile_uncorrected", 0),
        ecc_aggregate_uncorrected=e.integer("ecc_aggregate_uncorrected", 0),
    )


def _nvlink_fabric(o: _Obj | None) -> NvLinkFabric | None:
    if o is None:
        return None
    o.only(_FABRIC_KEYS)
    return NvLinkFabric(
        state=o.text("state"),
        status=o.text("status", ""),
        cluster_uuid=o.text("cluster_uuid", ""),
        clique_id=o.integer("clique_id", 0),
        bandwidth_gbps=o.number("bandwidth_gbps", 0.0),
    )


def _nic_paths(e: _Obj, fabrics: list[FabricAttachment]) -> list[NicPath]:
    hcas = list(dict.fromkeys(f.hca for f in fabrics))
    explicit = e.child("nic_paths")
    if explicit is not None:
        keys = [key for key in explicit.data if not key.startswith("_")]
        return [_explicit_nic_path(explicit, hca, hcas) for hca in keys]
    nearest = e.text("nearest_hca", "")
    if nearest and nearest not in hcas:
        e.fail("nearest_hca", f"{nearest!r} is not among the fabrics' HCAs {hcas}")
    numa = e.integer("numa_node", -1, low=-1)
    numa_of = {f.hca: f.numa_node for f in fabrics}
    return [NicPath(hca=hca, path=_path_class(hca, nearest, numa, numa_of[hca])) for hca in hcas]


def _explicit_nic_path(o: _Obj, hca: str, hcas: list[str]) -> NicPath:
    if hca not in hcas:
        o.fail(hca, f"not among the fabrics' HCAs {hcas}")
    path = o.text(hca)
    if path not in _PATH_CLASSES:
        o.fail(hca, f"expected one of {', '.join(sorted(_PATH_CLASSES))}, got {path!r}")
    return NicPath(hca=hca, path=path)


def _path_class(hca: str, nearest: str, gpu_numa: int, hca_numa: int) -> str:
    if hca == nearest:
        return "PIX"
    return "NODE" if gpu_numa >= 0 and gpu_numa == hca_numa else "SYS"


def _nvlinks(e: _Obj, physical: list[Gpu]) -> list[NvLink]:
    """Every link of a GPU, numbered from 0 across its link groups."""
    links: list[NvLink] = []
    for group in e.children("nvlinks", _LINK_KEYS):
        links.extend(_link_group(group, physical, e.integer("index"), first=len(links)))
    return links


def _link_group(group: _Obj, physical: list[Gpu], own_index: int, *, first: int) -> list[NvLink]:
    kind = group.text("remote_kind")
    if kind not in _REMOTE_KINDS:
        group.fail("remote_kind", f"expected one of {', '.join(sorted(_REMOTE_KINDS))}")
    remote, bus = -1, group.text("remote_pci_bus_id", "")
    if kind == "gpu":
        bus_of = {g.index: g.pci_bus_id for g in physical if g.index != own_index}
        remote = group.integer("remote_gpu_index")
        if remote not in bus_of:
            group.fail("remote_gpu_index", f"no other GPU has index {remote}")
        bus = bus or bus_of[remote]
    version, active = group.integer("version", low=1), group.flag("active", True)
    return [
        NvLink(
            link=first + i,
            remote_kind=kind,
            remote_pci_bus_id=bus,
            remote_gpu_index=remote,
            version=version,
            active=active,
        )
        for i in range(group.integer("count", low=1))
    ]


def _has_switch(links: list[NvLink]) -> bool:
    return any(link.remote_kind == "switch" and link.active for link in links)


def _peers(e: _Obj, gpu: Gpu, switched: set[int], indices: set[int]) -> list[int]:
    if e.has("nvlink_peers"):
        peers = e.integers("nvlink_peers")
        for peer in peers:
            if peer not in indices or peer == gpu.index:
                e.fail("nvlink_peers", f"no other GPU has index {peer}")
        return sorted(set(peers))
    direct = {n.remote_gpu_index for n in gpu.nvlinks if n.remote_kind == "gpu" and n.active}
    via_switch = switched - {gpu.index} if gpu.index in switched else set()
    return sorted(direct | via_switch)


def _mig_devices(e: _Obj, parent: Gpu, ctx: _Context) -> Iterator[Gpu]:
    slices = e.children("mig", _MIG_KEYS)
    if slices and not parent.mig_enabled:
        e.fail("mig_enabled", "is false but the GPU lists MIG slices")
    instances = [(s.integer("gpu_instance_id"), s.integer("compute_instance_id")) for s in slices]
    _unique(e, "mig", instances, "GPU/compute instance id pair")
    total = sum(s.integer("memory_mib", low=1) for s in slices) * _MIB
    if total > parent.memory_total_bytes:
        e.fail("mig", f"slices hold {total >> 20} MiB, more than the GPU's memory_mib")
    for s in slices:
        yield _mig_device(e, s, parent, ctx)


def _mig_device(e: _Obj, s: _Obj, parent: Gpu, ctx: _Context) -> Gpu:
    gi, ci = s.integer("gpu_instance_id"), s.integer("compute_instance_id")
    profile = s.text("profile")
    device = _device(e, ctx, parent.index)
    device.uuid = _device_uuid("MIG", ctx.node_id, f"gpu/{parent.index}/mig/{gi}/{ci}")
    device.name = f"{parent.name} MIG {profile}"
    device.memory_total_bytes = s.integer("memory_mib", low=1) * _MIB
    device.memory_used_bytes = s.integer("memory_used_mib", 0) * _MIB
    device.mig = MigDevice(
        parent_uuid=parent.uuid,
        parent_index=parent.index,
        profile=profile,
        gpu_instance_id=gi,
        compute_instance_id=ci,
    )
    return device
