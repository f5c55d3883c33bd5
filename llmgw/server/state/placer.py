"""The fleet as placement sees it now, for the reconciler and the dry run alike.

:class:`LazyPlacer` is the reconciler's ``place`` function over the nodes the plane holds;
:func:`plan_change` asks :func:`llmgw.server.core.applyplan.plan_apply` what storing some
deployments and profiles would change, with the same placer, the same engine port range
(``ControlPlane.engine_ports``, ``llmgw server --engine-ports``) and the replicas the plane
holds, so a dry run names the replicas, nodes, GPUs and ports the reconciler will choose.
Ports that agents refused lately (held by other processes) are the reconciler's memory and
are not seen by a dry run. A dry run that lowers a count removes the replicas the
reconciler would retire: given the same ``in_flight`` (``ControlService`` passes it), it
sees the same scale-in costs (``llmgw.server.state.scalein``). Both prefer the nodes warm
for the profile's model (:func:`llmgw.server.core.placing.warm_nodes` over the plane's
replica records, RETIRED ones included).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from llmgw.api.llmgw.v1 import Deployment, EngineProfile, NodeState
from llmgw.engineports import PortRange
from llmgw.server.core.applyplan import ApplyPlan, plan_apply
from llmgw.server.core.capacity import NodeCapacity, node_capacity
from llmgw.server.core.fingerprint import profile_fingerprint
from llmgw.server.core.placement import FleetPlacer
from llmgw.server.core.placing import warm_nodes
from llmgw.server.core.plan import ReplicaPlan, ShardPlan, Unplaceable
from llmgw.server.core.reconcile_state import NodeView, ReconcileInput
from llmgw.server.state.plane import ControlPlane, node_address
from llmgw.server.state.scalein import InFlightFn, no_in_flight, scale_in_costs

__all__ = ["LazyPlacer", "plan_change"]


def plan_change(
    plane: ControlPlane,
    deployments: Sequence[Deployment],
    profiles: Sequence[EngineProfile] = (),
    in_flight: InFlightFn = no_in_flight,
) -> tuple[ApplyPlan, Mapping[str, NodeCapacity]]:
    """What storing ``deployments`` and ``profiles`` would change now, and the node views
    it was planned on (by id: the GPUs' indices). Changes nothing. ``in_flight`` reads the
    gateways' requests in flight per replica (the reconcile loop's, for scale-in costs)."""
    now = time.monotonic()
    desired = plane.desired
    placer = LazyPlacer(plane, plane.engine_ports, now)
    inventory = plane.inventory
    nodes = {
        node_id: NodeView(
            node_id,
            ready=inventory.state(record, now) is not NodeState.NOT_READY,
            cordoned=record.cordoned,
        )
        for node_id, record in inventory.nodes.items()
    }
    state = ReconcileInput(
        deployments={**desired.deployments, **{d.name: d for d in deployments}},
        profiles={**desired.profiles, **{p.name: p for p in profiles}},
        fingerprint=profile_fingerprint,
        place=placer,
        replicas=dict(plane.replicas),
        shards=dict(inventory.shards),
        nodes=nodes,
        pending={},
        now=now,
        api_key_for=lambda _: "",
        retire=frozenset(desired.retire),
        replace=frozenset(desired.replace),
    )
    names = list(dict.fromkeys(d.name for d in deployments))
    after = state.deployments
    state = replace(state, costs=scale_in_costs(after, plane.replicas, plane.kv_blocks, in_flight))
    plan = plan_apply(state, names, live=dict(desired.deployments), applied=dict(desired.applied))
    return plan, {n.node_id: n for n in placer.capacity}


class LazyPlacer:
    """A :class:`FleetPlacer` over the nodes as they are now, built on first use (most
    rounds place nothing).

    Nodes reached at one address (simulated agents on one host) share one port space: an
    engine port taken on one is taken on all of them. Then replicas are placed one at a
    time, each seeing the ports the ones before it took on its neighbours.
    """

    def __init__(
        self,
        plane: ControlPlane,
        port_range: PortRange,
        now: float,
        busy: frozenset[tuple[str, int]] = frozenset(),
    ) -> None:
        self._plane = plane
        self._port_range = port_range
        self._now = now
        self._busy = busy
        self._built: tuple[FleetPlacer, dict[str, tuple[str, ...]]] | None = None

    def _warm(self, profile: EngineProfile) -> frozenset[str]:
        return warm_nodes(self._plane.replicas.values(), profile.model_path)

    @property
    def capacity(self) -> tuple[NodeCapacity, ...]:
        """The node views it places on."""
        return self._build()[0].nodes

    def _build(self) -> tuple[FleetPlacer, dict[str, tuple[str, ...]]]:
        if self._built is None:
            inventory, now = self._plane.inventory, self._now
            records = list(inventory.nodes.values())
            capacity = [node_capacity(inventory.node_view(r, now)) for r in records]
            placer = FleetPlacer(
                capacity, profile_fingerprint, port_range=self._port_range, warm=self._warm
            )
            self._built = placer, _neighbours([(r.info.node_id, node_address(r)) for r in records])
        return self._built

    def __call__(
        self,
        deployment: Deployment,
        profile: EngineProfile,
        replica_ids: Sequence[str],
        *,
        excluding: frozenset[str],
        taken: Sequence[ReplicaPlan],
    ) -> Sequence[ReplicaPlan | Unplaceable]:
        placer, neighbours = self._build()
        if self._busy:  # ports other processes hold: taken, on the node and its neighbours
            busy = [
                (n, port)
                for node_id, port in self._busy
                for n in (node_id, *neighbours.get(node_id, ()))
            ]
            shards = tuple(ShardPlan("", n, 0, (), port) for n, port in sorted(set(busy)))
            taken = [*taken, ReplicaPlan("", "", "", "", shards)]
        if not neighbours:
            return placer(deployment, profile, replica_ids, excluding=excluding, taken=taken)
        held = list(taken)
        results: list[ReplicaPlan | Unplaceable] = []
        for replica_id in replica_ids:
            seen = [*held, _ports_of_neighbours(held, neighbours)]
            (placed,) = placer(deployment, profile, [replica_id], excluding=excluding, taken=seen)
            results.append(placed)
            if isinstance(placed, Unplaceable):
                return results + [placed] * (len(replica_ids) - len(results))
            held.append(placed)
        return results


def _neighbours(addresses: Sequence[tuple[str, str]]) -> dict[str, tuple[str, ...]]:
    """Node id → the other nodes at its address, for nodes that share one."""
    by_address: dict[str, list[str]] = {}
    for node_id, address in addresses:
        by_address.setdefault(address, []).append(node_id)
    return {
        node_id: tuple(other for other in group if other != node_id)
        for group in by_address.values()
        if len(group) > 1
        for node_id in group
    }


def _ports_of_neighbours(
    taken: Sequence[ReplicaPlan], neighbours: Mapping[str, tuple[str, ...]]
) -> ReplicaPlan:
    """A plan of no deployment holding, on each node, the ports its neighbours use."""
    used: list[tuple[str, int]] = []
    for plan in taken:
        ports = [(s.node_id, s.port) for s in plan.shards]
        if plan.master_port:
            ports.append((plan.leader.node_id, plan.master_port))
        used.extend(
            (other, port) for node_id, port in ports for other in neighbours.get(node_id, ())
        )
    shards = tuple(ShardPlan("", node_id, 0, (), port) for node_id, port in sorted(set(used)))
    return ReplicaPlan("", "", "", "", shards)
