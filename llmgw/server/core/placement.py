"""Placement: where the replicas of a deployment go, as a pure function of the fleet.

Inputs are plain values: the placement view of every node (``llmgw.server.core.capacity``), the
deployment's ``EngineProfile`` and ``Deployment``, and what is already taken (devices and
engine ports per node, CPU threads per node, this deployment's replicas per node). The
result is a :class:`~llmgw.server.core.plan.ReplicaPlan` per replica, or an
:class:`~llmgw.server.core.plan.Unplaceable` saying why not, in an operator's words, naming the
closest misses.

Rules:

- **GPU class**, case-insensitive. ``gpu_class = "cpu"`` asks for no GPU: the replica goes
  to any node with ``cpu_threads`` (at least one) threads free. ``"A100:3g.40gb"`` asks
  for MIG slices of that profile (``CLASS:MIG_PROFILE``); a plain class is only ever given
  whole GPUs, never slices. A MIG replica takes one slice per shard (engines cannot span
  slices). An empty class matches any GPU.
- **Free memory**: every device has at least ``min_gpu_memory_bytes`` free.
- **Topology**: a shard's ``tp × pp / nodes`` devices (or ``gpus_per_node``) are the
  tightest group on the node: pairwise NVLink within one NUMA node, else NVLink across
  NUMA, else one NUMA node over PCIe, else any (``capacity.choose_group``).
- **Nodes**: only schedulable ones (READY, not cordoned), only healthy devices; the node's
  pool equals ``deployment.pool`` when that is set and its labels include all of
  ``deployment.labels``. Among the nodes that fit, the best topology tier wins, then the
  node with the fewest replicas of this deployment (spread), then a *warm* node (one in
  ``Taken.warm``: the model's weights were loaded there, ``placing.warm_nodes``), then
  the most free matching devices, then the node id.
- **Multi-node** (``nodes > 1``): all shards on nodes sharing an NVLink domain with IMEX
  (preferred) or an InfiniBand fabric; for InfiniBand each shard records the nearest HCA
  on that fabric of each of its GPUs (PIX, else PXB, else NODE) in ``ShardPlan.hcas``, or
  every HCA of the node on that fabric when none of its GPUs has one that near.
- **Ports**: each shard gets the lowest engine port of ``port_range`` (``llmgw server
  --engine-ports``, ``llmgw.engineports``) not in use on its node; a multi-node leader also
  gets a rendezvous ``master_port``. Ports of placed replicas are taken wherever they are:
  a replica placed under another range keeps its port.

Shard ids are ``REPLICA_ID.RANK``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from llmgw.api.llmgw.v1 import Deployment, EngineProfile
from llmgw.engineports import DEFAULT_ENGINE_PORTS, PortRange
from llmgw.server.core.capacity import Device, NodeCapacity, choose_group
from llmgw.server.core.plan import ReplicaPlan, ShardPlan, Unplaceable

__all__ = [
    "FleetPlacer",
    "Requirement",
    "Taken",
    "place_deployment",
    "place_replica",
    "requirement",
]

Placed = ReplicaPlan | Unplaceable
SortKey = tuple[object, ...]
# a node that could take one shard: its sort key, the node, the devices it would give
Candidate = tuple[SortKey, NodeCapacity, tuple[Device, ...]]

_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
_SHOWN_MISSES = 4
_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Requirement:
    """What one replica of a profile needs, read from its ``EngineProfile``."""

    cpu: bool
    gpu_class: str  # lower case; "" matches any class
    mig_profile: str | None  # lower case MIG profile, when slices are asked for
    per_node: int  # devices per shard
    nodes: int
    tp: int
    pp: int
    min_memory: int
    threads: int  # CPU threads per shard (CPU engines)
    label: str  # how reasons name the device kind: "H100", "A100 3g.40gb MIG"


def requirement(profile: EngineProfile) -> Requirement | Unplaceable:
    """What a replica of ``profile`` needs, or why no replica of it can ever be placed."""
    raw = profile.gpu_class.strip()
    klass, _, mig = raw.partition(":")
    tp, pp, nodes = profile.tp or 1, profile.pp or 1, profile.nodes or 1
    per_node = profile.gpus_per_node or -(-(tp * pp) // nodes)
    cpu = klass.lower() == "cpu"
    req = Requirement(
        cpu=cpu,
        gpu_class=klass.lower(),
        mig_profile=mig.strip().lower() or None,
        per_node=0 if cpu else per_node,
        nodes=nodes,
        tp=tp,
        pp=pp,
        min_memory=profile.min_gpu_memory_bytes,
        threads=max(1, profile.cpu_threads) if cpu else profile.cpu_threads,
        label=f"{klass} {mig.strip()} MIG" if mig.strip() else (klass or "any-class"),
    )
    problem = _profile_problem(profile.name, req)
    return Unplaceable(problem) if problem else req


def _profile_problem(name: str, req: Requirement) -> str:
    """Why no replica of the profile can ever be placed, or "" when it can."""
    total = req.tp * req.pp
    if req.cpu and req.nodes > 1:
        return f"profile {name!r}: CPU engines run on one node, not {req.nodes}"
    if not req.cpu and req.per_node * req.nodes != total:
        return (
            f"profile {name!r}: TP×PP = {total} GPUs do not split into "
            f"{req.nodes} nodes × {req.per_node} GPUs"
        )
    if req.mig_profile and req.per_node != 1:
        return (
            f"profile {name!r}: a MIG slice cannot be combined with others in one engine; "
            f"TP×PP per node must be 1, not {req.per_node}"
        )
    return ""


@dataclass(frozen=True, slots=True)
class Taken:
    """What other replicas hold already, per node id: what a replica placed now avoids;
    and the nodes it prefers, warm for its model (``placing.warm_nodes``)."""

    devices: Mapping[str, frozenset[str]] = field(default_factory=dict)  # GPU uuids
    ports: Mapping[str, frozenset[int]] = field(default_factory=dict)
    threads: Mapping[str, int] = field(default_factory=dict)  # CPU threads of CPU engines
    replicas: Mapping[str, int] = field(default_factory=dict)  # of this deployment (spread)
    warm: frozenset[str] = frozenset()  # node ids where its model's weights were loaded


def place_replica(
    nodes: Sequence[NodeCapacity],
    profile: EngineProfile,
    deployment: Deployment,
    *,
    replica_id: str,
    fingerprint: str,
    taken: Taken,
    port_range: PortRange = DEFAULT_ENGINE_PORTS,
) -> Placed:
    """Place one replica of ``deployment`` (see the module docstring for the rules)."""
    return place_deployment(
        nodes,
        profile,
        deployment,
        replica_ids=(replica_id,),
        fingerprint=fingerprint,
        taken=taken,
        port_range=port_range,
    )[0]


def place_deployment(
    nodes: Sequence[NodeCapacity],
    profile: EngineProfile,
    deployment: Deployment,
    *,
    replica_ids: Sequence[str],
    fingerprint: str,
    taken: Taken = Taken(),
    port_range: PortRange = DEFAULT_ENGINE_PORTS,
) -> list[Placed]:
    """Place one replica per id, in order, each seeing what the ones before it took.

    Returns a plan or a reason per id. Once one replica cannot be placed the rest get the
    same reason (they need the same and there is only less left).
    """
    need = requirement(profile)
    if isinstance(need, Unplaceable):
        return [need] * len(replica_ids)
    ledger = _Ledger(taken, port_range)
    scope = _Scope(nodes, deployment, need, ledger, taken.warm)
    placer: _SinglePlacer | _MultiPlacer = (
        _MultiPlacer(scope) if need.nodes > 1 else _SinglePlacer(scope)
    )
    results: list[Placed] = []
    failure: Unplaceable | None = None
    for replica_id in replica_ids:
        if failure is None:
            placed = placer.place(replica_id, deployment.name, profile.name, fingerprint)
            failure = placed if isinstance(placed, Unplaceable) else None
            results.append(placed)
        else:
            results.append(failure)
    return results


class FleetPlacer:
    """Placement over a fixed set of node views, in the reconciler's terms: called with a
    deployment, its profile, the new replica ids, the nodes to avoid and every plan that
    holds devices now (``taken``), it derives what is used from ``taken`` and places,
    preferring the nodes ``warm`` names for the profile (none by default)."""

    def __init__(
        self,
        nodes: Sequence[NodeCapacity],
        fingerprint: Callable[[EngineProfile], str],
        *,
        port_range: PortRange = DEFAULT_ENGINE_PORTS,
        warm: Callable[[EngineProfile], frozenset[str]] = lambda _: frozenset(),
    ) -> None:
        self.nodes = tuple(nodes)
        self.fingerprint = fingerprint
        self.port_range = port_range
        self.warm = warm

    def __call__(
        self,
        deployment: Deployment,
        profile: EngineProfile,
        replica_ids: Sequence[str],
        *,
        excluding: frozenset[str],
        taken: Sequence[ReplicaPlan],
    ) -> list[Placed]:
        devices: dict[str, set[str]] = {}
        ports: dict[str, set[int]] = {}
        threads: dict[str, int] = {}
        mine: dict[str, int] = {}
        for plan in taken:
            for shard in plan.shards:
                devices.setdefault(shard.node_id, set()).update(shard.gpu_uuids)
                ports.setdefault(shard.node_id, set()).add(shard.port)
                threads[shard.node_id] = threads.get(shard.node_id, 0) + shard.cpu_threads
                if plan.deployment == deployment.name:
                    mine[shard.node_id] = mine.get(shard.node_id, 0) + 1
            if plan.master_port:
                ports.setdefault(plan.leader.node_id, set()).add(plan.master_port)
        return place_deployment(
            [n for n in self.nodes if n.node_id not in excluding],
            profile,
            deployment,
            replica_ids=replica_ids,
            fingerprint=self.fingerprint(profile),
            taken=Taken(
                devices={k: frozenset(v) for k, v in devices.items()},
                ports={k: frozenset(v) for k, v in ports.items()},
                threads=threads,
                replicas=mine,
                warm=self.warm(profile),
            ),
            port_range=self.port_range,
        )


# --- what is taken ---------------------------------------------------------------------


class _Ledger:
    """Devices, ports, threads and replicas taken so far in this call (mutable, private)."""

    def __init__(self, taken: Taken, port_range: PortRange) -> None:
        self.devices = {k: set(v) for k, v in taken.devices.items()}
        self.ports = {k: set(v) for k, v in taken.ports.items()}
        self.threads = dict(taken.threads)
        self.replicas = dict(taken.replicas)
        self.port_range = port_range

    def free(self, node_id: str, devices: Sequence[Device]) -> list[Device]:
        taken = self.devices.get(node_id)
        return list(devices) if not taken else [d for d in devices if d.uuid not in taken]

    def free_ports(self, node_id: str, count: int) -> list[int] | None:
        """The lowest ``count`` free ports of the range on the node, or None."""
        taken = self.ports.get(node_id, set())
        low, high = self.port_range
        found = []
        for port in range(low, high + 1):
            if port not in taken:
                found.append(port)
                if len(found) == count:
                    return found
        return None

    def claim(self, plan: ReplicaPlan) -> None:
        for shard in plan.shards:
            self.devices.setdefault(shard.node_id, set()).update(shard.gpu_uuids)
            self.ports.setdefault(shard.node_id, set()).add(shard.port)
            self.threads[shard.node_id] = self.threads.get(shard.node_id, 0) + shard.cpu_threads
            self.replicas[shard.node_id] = self.replicas.get(shard.node_id, 0) + 1
        if plan.master_port:
            self.ports[plan.leader.node_id].add(plan.master_port)


# --- which nodes are in scope, and what each one offers ----------------------------------


class _Scope:
    """The nodes a deployment may use, and the matching devices on each."""

    def __init__(
        self,
        nodes: Sequence[NodeCapacity],
        deployment: Deployment,
        need: Requirement,
        ledger: _Ledger,
        warm: frozenset[str] = frozenset(),
    ) -> None:
        self.need = need
        self.ledger = ledger
        self.warm = warm
        self.all = sorted(nodes, key=lambda n: n.node_id)
        self.excluded: dict[str, str] = {}  # node id -> why it is out of scope
        self.nodes: list[NodeCapacity] = []
        self.devices: dict[str, tuple[Device, ...]] = {}
        for node in self.all:
            why = _out_of_scope(node, deployment)
            if why:
                self.excluded[node.node_id] = why
            else:
                self.nodes.append(node)
                self.devices[node.node_id] = tuple(d for d in node.devices if self.fits(d))

    def fits(self, device: Device) -> bool:
        """The device may be given now: of the kind asked, healthy, with the memory free."""
        return (
            device.healthy
            and device.memory_free_bytes >= self.need.min_memory
            and self.of_kind(device)
        )

    def of_kind(self, device: Device) -> bool:
        """The device is of the asked class and kind, whatever its health and memory."""
        need = self.need
        if need.gpu_class and device.gpu_class.lower() != need.gpu_class:
            return False
        return (device.mig_profile.lower() if device.mig_profile else None) == need.mig_profile

    def free(self, node_id: str) -> list[Device]:
        return self.ledger.free(node_id, self.devices[node_id])

    def free_threads(self, node: NodeCapacity) -> int:
        return node.cpu_count - self.ledger.threads.get(node.node_id, 0)

    def group(self, node: NodeCapacity) -> tuple[SortKey, tuple[Device, ...]] | None:
        """The node's sort key and the devices it would give one shard, or None."""
        spread = self.ledger.replicas.get(node.node_id, 0)
        cold = node.node_id not in self.warm
        if self.need.cpu:
            free = self.free_threads(node)
            if free < self.need.threads:
                return None
            return (0, spread, cold, -free, node.node_id), ()
        free_devices = self.free(node.node_id)
        chosen = choose_group(free_devices, self.need.per_node)
        if chosen is None:
            return None
        tier, devices = chosen
        return (tier, spread, cold, -len(free_devices), node.node_id), devices


def _out_of_scope(node: NodeCapacity, deployment: Deployment) -> str:
    if not node.schedulable:
        return f"{node.node_id} is {node.status}"
    if deployment.pool and node.pool != deployment.pool:
        where = f"in pool {node.pool!r}" if node.pool else "in no pool"
        return f"{node.node_id} is {where}"
    for key, value in sorted(deployment.labels.items()):
        if node.labels.get(key) != value:
            return f"{node.node_id} lacks label {key}={value}"
    return ""


# --- single-node replicas ----------------------------------------------------------------


class _SinglePlacer:
    """Replicas of one shard: a heap of nodes by preference, refreshed per placement."""

    def __init__(self, scope: _Scope) -> None:
        self.scope = scope
        self.heap: list[tuple[SortKey, int, str]] = []
        self.version: dict[str, int] = {}
        self.groups: dict[str, tuple[Device, ...]] = {}
        self.by_id = {n.node_id: n for n in scope.nodes}
        self.portless: set[str] = set()
        for node in scope.nodes:
            self._push(node)

    def _push(self, node: NodeCapacity) -> None:
        version = self.version.get(node.node_id, 0) + 1
        self.version[node.node_id] = version
        found = self.scope.group(node)
        if found is not None:
            key, devices = found
            self.groups[node.node_id] = devices
            heapq.heappush(self.heap, (key, version, node.node_id))

    def place(self, replica_id: str, deployment: str, profile: str, fingerprint: str) -> Placed:
        while self.heap:
            _, version, node_id = heapq.heappop(self.heap)
            if version != self.version[node_id]:
                continue
            ports = self.scope.ledger.free_ports(node_id, 1)
            if ports is None:
                self.portless.add(node_id)
                continue
            shard = ShardPlan(
                shard_id=f"{replica_id}.0",
                node_id=node_id,
                rank=0,
                gpu_uuids=tuple(d.uuid for d in self.groups[node_id]),
                port=ports[0],
                cpu_threads=self.scope.need.threads,
            )
            plan = ReplicaPlan(replica_id, deployment, profile, fingerprint, (shard,))
            self.scope.ledger.claim(plan)
            self._push(self.by_id[node_id])
            return plan
        return Unplaceable(_single_reason(self.scope, self.portless))


# --- multi-node replicas -----------------------------------------------------------------


class _MultiPlacer:
    """Replicas spanning nodes: every shard on nodes sharing one fabric."""

    def __init__(self, scope: _Scope) -> None:
        self.scope = scope

    def place(self, replica_id: str, deployment: str, profile: str, fingerprint: str) -> Placed:
        scope = self.scope
        candidates: list[Candidate] = []
        portless: set[str] = set()
        for node in scope.nodes:
            found = scope.group(node)
            if found is None:
                continue
            # every rank gets an engine port; the leader also the rendezvous port, and any
            # candidate may lead, so each must have two free
            if scope.ledger.free_ports(node.node_id, 2) is None:
                portless.add(node.node_id)
            else:
                candidates.append((found[0], node, found[1]))
        candidates.sort(key=lambda c: c[0])
        for fabric, members in _by_fabric(candidates):
            if len(members) >= scope.need.nodes:
                chosen = members[: scope.need.nodes]
                plan = self._plan(replica_id, fabric, chosen, (deployment, profile, fingerprint))
                scope.ledger.claim(plan)
                return plan
        return Unplaceable(_multi_reason(scope, [c[1] for c in candidates], portless))

    def _plan(
        self,
        replica_id: str,
        fabric: tuple[int, str],
        chosen: Sequence[Candidate],
        names: tuple[str, str, str],
    ) -> ReplicaPlan:
        shards = []
        master_port = 0
        for rank, (_, node, devices) in enumerate(chosen):
            ports = self.scope.ledger.free_ports(node.node_id, 2)
            assert ports is not None  # checked when it became a candidate
            if rank == 0:
                master_port = ports[1]
            shard = ShardPlan(
                shard_id=f"{replica_id}.{rank}",
                node_id=node.node_id,
                rank=rank,
                gpu_uuids=tuple(d.uuid for d in devices),
                port=ports[0],
                hcas=_hcas(node, fabric, devices),
                cpu_threads=self.scope.need.threads,
            )
            shards.append(shard)
        deployment, profile, fingerprint = names
        return ReplicaPlan(replica_id, deployment, profile, fingerprint, tuple(shards), master_port)


def _hcas(
    node: NodeCapacity, fabric: tuple[int, str], devices: Sequence[Device]
) -> tuple[str, ...]:
    """On InfiniBand, each GPU's nearest HCA on that fabric (every HCA of the node on it when
    none is near); nothing over an NVLink domain."""
    if fabric[0] != 1:
        return ()
    on_fabric = node.ib_hcas.get(fabric[1], frozenset())
    near = (d.nearest_hca(on_fabric) for d in devices)
    return tuple(dict.fromkeys(h for h in near if h is not None)) or tuple(sorted(on_fabric))


def _by_fabric(candidates: Sequence[Candidate]) -> list[tuple[tuple[int, str], list[Candidate]]]:
    """Candidates grouped by shared fabric: NVLink domains (kind 0) before InfiniBand (1)."""
    groups: dict[tuple[int, str], list[Candidate]] = {}
    for candidate in candidates:
        node = candidate[1]
        if node.nvlink_domain:
            groups.setdefault((0, node.nvlink_domain), []).append(candidate)
        for fabric in node.ib_fabrics:
            groups.setdefault((1, fabric), []).append(candidate)
    return sorted(groups.items(), key=lambda item: item[0])


# --- why not -----------------------------------------------------------------------------


def _single_reason(scope: _Scope, portless: set[str]) -> str:
    need = scope.need
    if not scope.all:
        return "no nodes are registered"
    if need.cpu:
        head = f"no schedulable node has {need.threads} CPU threads free"
    else:
        head = f"no schedulable node has {need.per_node} free {need.label} {_gpus(need)}"
    if need.min_memory and not need.cpu:
        head += f" with {_size(need.min_memory)} free each"
    return f"{head}: {_misses(scope, portless)}"


def _multi_reason(scope: _Scope, qualifying: Sequence[NodeCapacity], portless: set[str]) -> str:
    need = scope.need
    shape = f"TP={need.tp}" + (f" × PP={need.pp}" if need.pp > 1 else "")
    count = _WORDS.get(need.nodes, str(need.nodes))
    head = (
        f"{shape} × {need.nodes} nodes needs {count} nodes on one InfiniBand fabric or "
        f"NVLink domain with {need.per_node} free {need.label} each"
    )
    if len(qualifying) >= need.nodes:
        fabrics = "; ".join(f"{n.node_id}: {_fabrics(n)}" for n in qualifying[:_SHOWN_MISSES])
        return f"{head}: the nodes that qualify share no fabric ({fabrics})"
    if qualifying:
        names = ", ".join(n.node_id for n in qualifying)
        return f"{head}: only {names} {'qualifies' if len(qualifying) == 1 else 'qualify'}"
    return f"{head}: no node qualifies ({_misses(scope, portless)})"


def _fabrics(node: NodeCapacity) -> str:
    names = [f"NVLink domain {node.nvlink_domain}"] if node.nvlink_domain else []
    names += [f"InfiniBand {f}" for f in sorted(node.ib_fabrics)]
    return ", ".join(names) or "no InfiniBand fabric or NVLink domain"


def _misses(scope: _Scope, portless: set[str]) -> str:
    """The closest misses first: nodes with the most matching devices free, then nodes out
    of scope, then nodes without the device kind at all."""
    ranked = sorted((_miss(scope, node, portless) for node in scope.all), key=lambda m: m[0])
    shown = [text for _, text in ranked[:_SHOWN_MISSES]]
    rest = len(ranked) - len(shown)
    return ", ".join(shown) + (f" and {rest} more" if rest > 0 else "")


def _miss(
    scope: _Scope, node: NodeCapacity, portless: set[str]
) -> tuple[tuple[int, int, str], str]:
    node_id = node.node_id
    if node_id in scope.excluded:
        return (2, 0, node_id), scope.excluded[node_id]
    if node_id in portless:
        low, high = scope.ledger.port_range
        return (1, 0, node_id), f"{node_id} has no free engine port in {low}-{high}"
    need = scope.need
    if need.cpu:
        free = scope.free_threads(node)
        used = node.cpu_count - free
        return (0, -free, node_id), f"{node_id} has {free} free of {node.cpu_count} ({used} in use)"
    kind = [d for d in node.devices if scope.of_kind(d)]
    if not kind:
        return (3, 0, node_id), f"{node_id} has no {need.label} {_gpus(need)}"
    free = len(scope.free(node_id))
    return (0, -free, node_id), f"{node_id} has {free} free ({_unavailable(scope, node, kind)})"


def _unavailable(scope: _Scope, node: NodeCapacity, kind: Sequence[Device]) -> str:
    taken = scope.ledger.devices.get(node.node_id, set())
    in_use = sum(1 for d in kind if d.uuid in taken)
    sick = sum(1 for d in kind if not d.healthy and d.uuid not in taken)
    low = sum(
        1
        for d in kind
        if d.healthy and d.uuid not in taken and d.memory_free_bytes < scope.need.min_memory
    )
    parts = [f"{in_use} in use"]
    if sick:
        parts.append(f"{sick} unhealthy")
    if low:
        parts.append(f"{low} with less than {_size(scope.need.min_memory)} free")
    return ", ".join(parts)


def _gpus(need: Requirement) -> str:
    return "slices" if need.mig_profile else "GPUs"


def _size(n: int) -> str:
    return f"{n / _GIB:.0f} GiB" if n >= _GIB else f"{n} bytes"
