"""The console's rows: frozen values built from the wire messages, one per thing shown.

Every row is a ``@dataclass(frozen=True, slots=True)`` (a ``NamedTuple`` for a node's
fabrics) holding plain values (no proto message inside), so a snapshot can cross from the
watch worker to the widgets safely and two rows compare by value. Static facts a detail
view needs (NVLink peers, NIC paths, the fabric clique, host facts) sit in separate frozen
objects built once per registration and shared by every row built from it, so a telemetry
update copies a few numbers only.

Enum values this build does not know read as the safe value: a shard state nobody knows
is FAILED (never READY), a node state NOT_READY, a health UNKNOWN.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from llmgw.api.llmgw.v1 import (
    AuditEvent,
    Deployment,
    Gpu,
    GpuTelemetry,
    Health,
    Node,
    NodeInfo,
    NodeState,
    NvLink,
    Replica,
    Shard,
    ShardState,
)
from llmgw.tui.autoscale import AutoscaleRow, autoscale_row

__all__ = [
    "ConditionRow",
    "DeploymentRow",
    "EventRow",
    "FabricRow",
    "GpuInfo",
    "GpuRow",
    "NodeDetail",
    "NodeRow",
    "ReplicaRow",
    "ShardRow",
    "AuditIdentity",
    "audit_identity",
    "event_identity",
    "deployment_row",
    "gpu_infos",
    "gpu_key",
    "gpu_row",
    "node_detail",
    "node_row",
    "read_health",
    "read_node_state",
    "read_shard_state",
    "replica_row",
    "shard_row",
    "with_router_figures",
    "with_shards",
]

_SHARD_STATES = frozenset(ShardState) - {ShardState.UNSPECIFIED}
_NODE_STATES = frozenset(NodeState) - {NodeState.UNSPECIFIED}
_STOPPED = ShardState.STOPPED


def read_shard_state(value: ShardState | int) -> ShardState:
    """A shard state this build knows; anything else (unset, newer) reads as FAILED."""
    try:
        state = ShardState(int(value))
    except ValueError:
        return ShardState.FAILED
    return state if state in _SHARD_STATES else ShardState.FAILED


def read_node_state(value: NodeState | int) -> NodeState:
    """A node state this build knows; anything else reads as NOT_READY."""
    try:
        state = NodeState(int(value))
    except ValueError:
        return NodeState.NOT_READY
    return state if state in _NODE_STATES else NodeState.NOT_READY


def read_health(value: Health | int) -> Health:
    """HEALTHY or UNHEALTHY as sent; anything else reads as UNKNOWN."""
    try:
        health = Health(int(value))
    except ValueError:
        return Health.UNKNOWN
    return health if health in (Health.HEALTHY, Health.UNHEALTHY) else Health.UNKNOWN


# --- GPUs ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """What a GPU (or MIG device) is, as registered; static until its node registers again."""

    index: int
    uuid: str
    name: str
    gpu_class: str
    memory_total_bytes: int
    compute_capability: str
    numa_node: int  # -1 when unknown
    pci_bus_id: str
    driver_version: str
    cuda_version: str
    nvlink_peers: tuple[int, ...]
    # Each NVLink in words ("link 3: gpu 1, v4, active"): plain strings, so 18 links per
    # GPU add no objects for the garbage collector to scan; the counts for the summary.
    nvlinks: tuple[str, ...]
    nvlinks_active: int
    nvlink_versions: tuple[int, ...]
    nvlink_remotes: tuple[str, ...]  # "gpu 1", "switch 0000:c3:00.0", distinct, sorted
    nic_paths: tuple[tuple[str, str], ...]  # (HCA, PIX|PXB|PHB|NODE|SYS), closest first
    fabric_state: str  # "" when the GPU reports no NVLink fabric
    fabric_clique: str  # "CLUSTER-UUID/CLIQUE" or ""
    fabric_gbps: float
    mig_enabled: bool  # a MIG parent: not itself a device to place on
    mig_profile: str  # set on a MIG device: "3g.40gb"
    mig_instance: int  # its GPU instance id
    ecc_uncorrected: int

    @property
    def is_mig(self) -> bool:
        return bool(self.mig_profile)

    @property
    def label(self) -> str:
        """``3`` for a GPU, ``3/mig1:1g.10gb`` for a MIG device of GPU 3."""
        if not self.is_mig:
            return str(self.index)
        return f"{self.index}/mig{self.mig_instance}:{self.mig_profile}"


@dataclass(frozen=True, slots=True)
class GpuRow:
    """One GPU or MIG device of a node with its latest telemetry and the shard holding it."""

    node_id: str
    info: GpuInfo
    utilization_pct: int
    memory_used_bytes: int
    temperature_c: int
    power_watts: int
    health: Health
    problems: tuple[str, ...]
    shard_id: str = ""  # the shard holding it (any state but STOPPED), "" when free

    @property
    def key(self) -> str:
        return gpu_key(self.node_id, self.info.uuid)

    @property
    def order(self) -> tuple[str, int, int, int, int]:
        """Topology order: node, NUMA, GPU index, parent before its MIG slices."""
        info = self.info
        return (self.node_id, info.numa_node, info.index, int(info.is_mig), info.mig_instance)


def gpu_key(node_id: str, uuid: str) -> str:
    return f"{node_id}/{uuid}"


def gpu_infos(info: NodeInfo) -> list[GpuInfo]:
    return [_gpu_info(gpu) for gpu in info.gpus]


def _gpu_info(gpu: Gpu) -> GpuInfo:
    fabric, mig, health = gpu.fabric, gpu.mig, gpu.health
    return GpuInfo(
        index=gpu.index,
        uuid=gpu.uuid,
        name=gpu.name,
        gpu_class=gpu.gpu_class,
        memory_total_bytes=gpu.memory_total_bytes,
        compute_capability=gpu.compute_capability,
        numa_node=gpu.numa_node,
        pci_bus_id=gpu.pci_bus_id,
        driver_version=gpu.driver_version,
        cuda_version=gpu.cuda_version,
        nvlink_peers=tuple(sorted(gpu.nvlink_peers)),
        nvlinks=tuple(_nvlink_words(link) for link in gpu.nvlinks),
        nvlinks_active=sum(1 for link in gpu.nvlinks if link.active),
        nvlink_versions=tuple(sorted({link.version for link in gpu.nvlinks})),
        nvlink_remotes=tuple(sorted({_nvlink_remote(link) for link in gpu.nvlinks})),
        nic_paths=tuple((p.hca, p.path) for p in gpu.nic_paths),
        fabric_state=fabric.state if fabric else "",
        fabric_clique=f"{fabric.cluster_uuid}/{fabric.clique_id}"
        if fabric and fabric.cluster_uuid
        else "",
        fabric_gbps=fabric.bandwidth_gbps if fabric else 0.0,
        mig_enabled=gpu.mig_enabled,
        mig_profile=mig.profile if mig else "",
        mig_instance=mig.gpu_instance_id if mig else 0,
        ecc_uncorrected=health.ecc_volatile_uncorrected if health else 0,
    )


def _nvlink_remote(link: NvLink) -> str:
    if link.remote_kind == "gpu":
        return f"gpu {link.remote_gpu_index}"
    return f"{link.remote_kind} {link.remote_pci_bus_id}".strip()


def _nvlink_words(link: NvLink) -> str:
    state = "active" if link.active else "down"
    return f"link {link.link}: {_nvlink_remote(link)}, v{link.version}, {state}"


def gpu_row(
    node_id: str, info: GpuInfo, gpu: Gpu | None, live: GpuTelemetry | None, shard_id: str = ""
) -> GpuRow:
    """A GPU's row from its registration (``gpu``), its latest telemetry (``live``) and the
    shard holding it."""
    if live is not None:
        return GpuRow(
            node_id,
            info,
            live.utilization_pct,
            live.memory_used_bytes,
            live.temperature_c,
            live.power_watts,
            read_health(live.health),
            tuple(live.problems),
            shard_id,
        )
    health = gpu.health if gpu is not None else None
    return GpuRow(
        node_id,
        info,
        gpu.utilization_pct if gpu else 0,
        gpu.memory_used_bytes if gpu else 0,
        health.temperature_c if health else 0,
        gpu.power_watts if gpu else 0,
        read_health(health.health) if health else Health.UNKNOWN,
        tuple(health.problems) if health else (),
        shard_id,
    )


# --- nodes ---------------------------------------------------------------------------------


class FabricRow(NamedTuple):
    """A network the node reaches others on, through one HCA port."""

    fabric: str
    hca: str
    port: int
    rate_gbps: float
    link_layer: str
    state: str
    numa_node: int


@dataclass(frozen=True, slots=True)
class NodeDetail:
    """What a node's agent registered beyond its GPUs, for the detail view."""

    hostname: str
    management_address: str
    labels: tuple[tuple[str, str], ...]
    agent_version: str
    os: str
    kernel: str
    cpu_model: str
    cpu_count: int
    driver_version: str
    cuda_version: str
    memory_total_bytes: int
    engine_versions: tuple[tuple[str, str], ...]
    fabrics: tuple[FabricRow, ...]
    imex: str  # "up (domain d1, channels 0-3)", "" when none


@dataclass(frozen=True, slots=True)
class NodeRow:
    """A node: its state and what its agent registered."""

    node_id: str
    state: NodeState
    cordoned: bool
    connected: bool
    reason: str
    discovery: str
    gpu_classes: str  # of its physical GPUs: "H100" or "A100,L4"
    devices: int  # GPUs and MIG devices placement may use (MIG parents excluded)
    last_heartbeat_ms: int
    memory_available_bytes: int
    peer: str
    detail: NodeDetail
    gpus: int = 0  # physical GPUs, MIG parents included
    mig_slices: int = 0  # MIG devices carved from them

    @property
    def key(self) -> str:
        return self.node_id

    @property
    def gpu_words(self) -> str:
        """``8×H100``, ``4×A100 (12 MIG slices)``, ``no GPU``: physical GPUs, slices apart."""
        if not self.gpus:
            return "no GPU"
        words = f"{self.gpus}×{self.gpu_classes or 'GPU'}"
        if self.mig_slices:
            words += f" ({self.mig_slices} MIG slice{'' if self.mig_slices == 1 else 's'})"
        return words

    @property
    def ready(self) -> bool:
        return self.state is NodeState.READY


def node_row(node: Node, detail: NodeDetail | None = None) -> NodeRow:
    """A node's row; ``detail`` reuses the static part of an earlier row of the same info."""
    info = node.info or NodeInfo()
    devices = [g for g in info.gpus if not g.mig_enabled]
    physical = [g for g in info.gpus if g.mig is None]
    memory = node.telemetry.memory if node.telemetry and node.telemetry.memory else info.memory
    return NodeRow(
        node_id=info.node_id,
        state=read_node_state(node.state),
        cordoned=node.cordoned,
        connected=node.connected,
        reason=node.state_reason,
        discovery=info.discovery,
        gpu_classes=",".join(sorted({g.gpu_class for g in physical if g.gpu_class})),
        devices=len(devices),
        last_heartbeat_ms=node.last_heartbeat_unix_ms,
        memory_available_bytes=memory.available_bytes if memory else 0,
        peer=node.peer,
        detail=detail or node_detail(info),
        gpus=len(physical),
        mig_slices=len(info.gpus) - len(physical),
    )


def node_detail(info: NodeInfo) -> NodeDetail:
    host, imex = info.host, info.imex
    return NodeDetail(
        hostname=info.hostname,
        management_address=info.management_address,
        labels=tuple(sorted(info.labels.items())),
        agent_version=info.agent_version,
        os=f"{host.os_id} {host.os_version}".strip() if host else "",
        kernel=host.kernel if host else "",
        cpu_model=host.cpu_model if host else "",
        cpu_count=info.cpu_count,
        driver_version=host.nvidia_driver_version if host else "",
        cuda_version=host.cuda_version if host else "",
        memory_total_bytes=info.memory.total_bytes if info.memory else 0,
        engine_versions=tuple(sorted(info.engine_versions.items())),
        fabrics=tuple(
            FabricRow(f.fabric, f.hca, f.port, f.rate_gbps, f.link_layer, f.state, f.numa_node)
            for f in info.fabrics
        ),
        imex=_imex_text(imex.state, imex.domain, list(imex.channels)) if imex else "",
    )


def _imex_text(state: str, domain: str, channels: list[int]) -> str:
    if not state:
        return ""
    parts = [f"domain {domain}"] if domain else []
    if channels:
        parts.append(f"channels {','.join(str(c) for c in sorted(channels))}")
    return f"{state} ({', '.join(parts)})" if parts else state


# --- shards, replicas, deployments, events -------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardRow:
    """A shard as the control server knows it."""

    shard_id: str
    replica_id: str
    node_id: str
    rank: int
    state: ShardState
    reason: str
    exit_code: int | None  # None unless it exited
    endpoint: str
    gpu_uuids: tuple[str, ...]
    pid: int
    since_ms: int  # in this state since
    restarts: int
    engine: str
    gave_up: bool
    fingerprint: str

    @property
    def key(self) -> str:
        return self.shard_id

    @property
    def holds_gpus(self) -> bool:
        """Whether its GPUs count as taken: everything but STOPPED."""
        return self.state is not _STOPPED


def shard_row(shard: Shard) -> ShardRow:
    status = shard.status
    if status is None:
        return ShardRow(
            shard.shard_id, shard.replica_id, shard.node_id, 0, ShardState.FAILED,
            "no status reported", None, "", (), 0, shard.updated_unix_ms, 0, "", False, "",
        )  # fmt: skip
    return ShardRow(
        shard_id=shard.shard_id,
        replica_id=shard.replica_id or status.replica_id,
        node_id=shard.node_id,
        rank=status.rank,
        state=read_shard_state(status.state),
        reason=status.reason,
        exit_code=status.exit_code if status.exited else None,
        endpoint=status.endpoint,
        gpu_uuids=tuple(status.gpu_uuids),
        pid=status.pid,
        since_ms=status.since_unix_ms or shard.updated_unix_ms,
        restarts=status.restarts,
        engine=status.engine,
        gave_up=status.gave_up,
        fingerprint=status.profile_fingerprint,
    )


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    """A replica with what its shards add (nodes, GPUs, since when it is in its state).

    ``in_flight``, ``kv_usage`` and ``prefix_hit`` (shares 0..1) are the gateway's figures
    (GetRouterStats), joined in by the model's snapshot; None while the server does not report
    them for this replica (the views say "not reported" instead of inventing a zero).
    """

    replica_id: str
    deployment: str
    profile: str
    model: str
    endpoint: str
    state: ShardState
    out_of_date: bool
    shard_ids: tuple[str, ...]
    nodes: tuple[str, ...] = ()
    gpus: int = 0
    since_ms: int = 0  # the newest state change among its shards; 0 when unknown
    in_flight: int | None = None
    kv_usage: float | None = None
    prefix_hit: float | None = None

    @property
    def key(self) -> str:
        return self.replica_id


def replica_row(replica: Replica, shards: list[ShardRow]) -> ReplicaRow:
    row = ReplicaRow(
        replica_id=replica.replica_id,
        deployment=replica.deployment,
        profile=replica.profile,
        model=replica.model,
        endpoint=replica.endpoint,
        state=read_shard_state(replica.state),
        out_of_date=replica.out_of_date,
        shard_ids=tuple(replica.shard_ids),
    )
    return with_shards(row, shards)


def with_shards(row: ReplicaRow, shards: list[ShardRow]) -> ReplicaRow:
    """``row`` with the nodes, GPU count and state age its ``shards`` give (same row if equal)."""
    live = [s for s in shards if s.holds_gpus]
    nodes = tuple(sorted({s.node_id for s in live}))
    gpus = sum(len(s.gpu_uuids) for s in live)
    since = max((s.since_ms for s in shards), default=0)
    if (nodes, gpus, since) == (row.nodes, row.gpus, row.since_ms):
        return row
    return dataclasses.replace(row, nodes=nodes, gpus=gpus, since_ms=since)


def with_router_figures(
    row: ReplicaRow, in_flight: int | None, kv_usage: float | None, prefix_hit: float | None
) -> ReplicaRow:
    """``row`` with the gateway's figures for it (same row if equal)."""
    if (in_flight, kv_usage, prefix_hit) == (row.in_flight, row.kv_usage, row.prefix_hit):
        return row
    return dataclasses.replace(row, in_flight=in_flight, kv_usage=kv_usage, prefix_hit=prefix_hit)


@dataclass(frozen=True, slots=True)
class ConditionRow:
    """One of a deployment's conditions (Available, Progressing, ReplicaFailure)."""

    type: str
    status: bool
    reason: str
    message: str
    since_ms: int


@dataclass(frozen=True, slots=True)
class DeploymentRow:
    """A deployment with the status the server computed (counts 0 until one is given)."""

    name: str
    profile: str
    replicas: int  # desired
    pool: str
    ready: int = 0
    up_to_date: int = 0
    available: int = 0
    starting: int = 0
    failed: int = 0
    unplaceable: int = 0
    reason: str = ""  # what keeps it from done, in the server's words
    conditions: tuple[ConditionRow, ...] = ()
    autoscale: AutoscaleRow | None = None  # its autoscaler; None: a fixed count

    @property
    def key(self) -> str:
        return self.name

    @property
    def short(self) -> bool:
        """Fewer replicas available than desired."""
        return self.available < self.replicas


def deployment_row(deployment: Deployment) -> DeploymentRow:
    status = deployment.status
    if status is None:
        return DeploymentRow(
            deployment.name, deployment.profile, deployment.replicas, deployment.pool,
            autoscale=autoscale_row(deployment),
        )  # fmt: skip
    conditions = tuple(
        ConditionRow(c.type, c.status, c.reason, c.message, c.since_unix_ms)
        for c in status.conditions
    )
    return DeploymentRow(
        deployment.name,
        deployment.profile,
        deployment.replicas,
        deployment.pool,
        ready=status.ready,
        up_to_date=status.up_to_date,
        available=status.available,
        starting=status.starting,
        failed=status.failed,
        unplaceable=status.unplaceable,
        reason=status.reason,
        conditions=conditions,
        autoscale=autoscale_row(deployment),
    )


@dataclass(frozen=True, slots=True)
class EventRow:
    """An operator action from the audit log, or a state change the console saw.

    ``kind`` is "audit", "node", "shard" or "replica"; ``seq`` orders them as they arrived.
    """

    seq: int
    at_ms: int
    kind: str
    actor: str
    action: str
    target: str
    result: str

    @property
    def key(self) -> str:
        return f"e{self.seq}"


AuditIdentity = tuple[int, str, str, str, str]


def audit_identity(event: AuditEvent) -> AuditIdentity:
    """What makes an audit record the same one when a fresh snapshot repeats it."""
    return (event.at_unix_ms, event.actor, event.action, event.target, event.result)


def event_identity(row: EventRow) -> AuditIdentity:
    """``audit_identity`` of the record an audit row was made from."""
    return (row.at_ms, row.actor, row.action, row.target, row.result)
