"""What retiring each replica would cost, for the reconciler's choice of which one a
scale-in retires (``ReconcileInput.costs``, ``llmgw.server.core.reconciler``'s rule 2).

:func:`scale_in_costs` looks only at deployments with more ACTIVE replicas than their count
(the rounds that retire one; most rounds compute nothing). For each ACTIVE or SURGE replica
of such a deployment it counts:

- **unique blocks**: the keys of the server's KV block store (``llmgw.server.state.kvblocks``:
  what its leader's engine reported cached, every rank) that no other ACTIVE or SURGE
  replica of the same deployment holds. Retiring it loses those prefixes for good; blocks
  another replica also holds stay served. Each count is of that replica alone, as if it
  were the only one retired (a round retiring two may lose blocks the two shared); past
  ``kvblocks.UNIQUE_SAMPLE_KEYS`` keys in all it is an estimate from a uniform share of
  the key space, so a large fleet's round stays short (``KvBlocks.unique_blocks``);
- **in flight**: the requests the gateways have in flight on it now (``ReplicaRouterStats
  .in_flight``, summed over every live gateway's report and the in-server gateway), read
  through the ``in_flight`` function the server hands the reconcile loop and the dry run
  (``ControlService.in_flight``).

A replica with neither blocks nor requests costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from llmgw.api.llmgw.v1 import Deployment
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord, ScaleInCost
from llmgw.server.state.kvblocks import KvBlocks

__all__ = ["InFlightFn", "no_in_flight", "scale_in_costs"]

InFlightFn = Callable[[], Mapping[str, int]]
"""Requests in flight per replica id now, over every gateway."""

_LIVE = (Lifecycle.ACTIVE, Lifecycle.SURGE)


def no_in_flight() -> Mapping[str, int]:
    """An ``InFlightFn`` for a server without gateways: nothing in flight anywhere."""
    return {}


def scale_in_costs(
    deployments: Mapping[str, Deployment],
    records: Mapping[str, ReplicaRecord],
    blocks: KvBlocks,
    in_flight: InFlightFn,
) -> dict[str, ScaleInCost]:
    """Replica id → what retiring it costs, for the replicas of deployments with more
    ACTIVE replicas than their count (see the module docstring)."""
    groups: dict[str, list[str]] = {}
    active: dict[str, int] = {}
    for record in records.values():
        if record.lifecycle in _LIVE:
            name = record.plan.deployment
            groups.setdefault(name, []).append(record.replica_id)
            active[name] = active.get(name, 0) + (record.lifecycle is Lifecycle.ACTIVE)
    surplus = [
        ids
        for name, ids in groups.items()
        if name in deployments and active.get(name, 0) > deployments[name].replicas
    ]
    if not surplus:
        return {}
    flights = in_flight()
    costs: dict[str, ScaleInCost] = {}
    for ids in surplus:
        for replica_id, unique in blocks.unique_blocks(ids).items():
            costs[replica_id] = ScaleInCost(unique, flights.get(replica_id, 0))
    return costs
