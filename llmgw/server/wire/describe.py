"""``ControlService.Describe``: everything the server knows about one deployment, replica
or node, and its recent events.

- **deployment**: its spec with its status now (the autoscaler's decision in it), its
  profile now (env values ``<redacted>`` but for admins) and fingerprint, its profile
  revision, each live replica with its lifecycle, the shards the reconciler planned (node,
  GPUs, port) and the shards agents report (state, reason);
- **replica**: the same for one replica, RETIRED ones too (its profile is the one it was
  placed with);
- **node**: its registration (GPUs, MIG slices, host), state and reason, cordon, the latest
  telemetry of each GPU, the replicas placed on it and the shards it runs (whose events
  are shown with its own).

The events (``llmgw.server.state.history``) are those of the object and of what it holds:
a deployment's are its own, its replicas' (the newest ``_REPLICAS_FOLLOWED``, RETIRED ones
too) and their shards'. An unknown kind is INVALID_ARGUMENT, an unknown name NOT_FOUND
naming it (:class:`~llmgw.server.errors.ActionRefused`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from grpclib.const import Status

from llmgw.api.llmgw.v1 import (
    Deployment,
    DescribedNode,
    DescribedReplica,
    Description,
    EngineProfile,
    HistoryEvent,
    PlannedShard,
    Shard,
)
from llmgw.server.core.fingerprint import profile_fingerprint
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord
from llmgw.server.errors import ActionRefused, quoted
from llmgw.server.state.plane import ControlPlane

__all__ = ["KINDS", "describe"]

KINDS = ("deployment", "replica", "node")
_REPLICAS_FOLLOWED = 50

Redact = Callable[[EngineProfile], EngineProfile]


async def describe(plane: ControlPlane, kind: str, name: str, redact: Redact) -> Description:
    """The description of ``kind`` ``name``; ActionRefused when there is none."""
    if kind == "deployment":
        return await _deployment(plane, name, redact)
    if kind == "replica":
        return await _replica(plane, name, redact)
    if kind == "node":
        return await _node(plane, name)
    raise ActionRefused(
        Status.INVALID_ARGUMENT, f"cannot describe {quoted(kind)}: say {', '.join(KINDS)}"
    )


async def _deployment(plane: ControlPlane, name: str, redact: Redact) -> Description:
    deployment = plane.desired.deployments.get(name)
    if deployment is None:
        raise ActionRefused(Status.NOT_FOUND, f"no deployment named {quoted(name)}")
    records = sorted(
        (r for r in plane.replicas.values() if r.plan.deployment == name), key=lambda r: r.serial
    )
    live = [r for r in records if r.lifecycle is not Lifecycle.RETIRED]
    shown = plane.statuses.shown(deployment, remember=False)  # with its status (autoscaler's)
    followed = records[-_REPLICAS_FOLLOWED:]
    objects = [f"deployment/{name}", *(o for r in followed for o in _objects_of(r))]
    description = _with_profile(
        plane, Description(kind="deployment", name=name, deployment=shown), redact
    )
    description.replicas = [_described(plane, r) for r in live]
    description.shards = _shards(plane, live)
    description.events = await _events(plane, objects)
    return description


async def _replica(plane: ControlPlane, name: str, redact: Redact) -> Description:
    record = plane.replicas.get(name)
    if record is None:
        raise ActionRefused(Status.NOT_FOUND, f"no replica named {quoted(name)}")
    description = Description(kind="replica", name=name)
    deployment = plane.desired.deployments.get(record.plan.deployment)
    if deployment is not None:
        description = _with_profile(plane, description, redact, deployment)
    description.profile = redact(record.profile)  # the one it was placed with
    description.fingerprint = record.plan.fingerprint
    description.replicas = [_described(plane, record)]
    description.shards = _shards(plane, [record])
    description.events = await _events(plane, _objects_of(record))
    return description


async def _node(plane: ControlPlane, name: str) -> Description:
    record = plane.inventory.nodes.get(name)
    if record is None:
        raise ActionRefused(Status.NOT_FOUND, f"no node named {quoted(name)}")
    node = plane.inventory.node_view(record, time.monotonic())
    telemetry = node.telemetry.gpus if node.telemetry is not None else []
    described = DescribedNode(
        info=node.info,
        state=node.state.name.removeprefix("NODE_STATE_"),
        state_reason=node.state_reason,
        cordoned=node.cordoned,
        connected=node.connected,
        peer=node.peer,
        first_seen_unix_ms=node.first_seen_unix_ms,
        last_heartbeat_unix_ms=node.last_heartbeat_unix_ms,
        telemetry=list(telemetry),
    )
    on_node = sorted(
        (
            r
            for r in plane.replicas.values()
            if r.lifecycle is not Lifecycle.RETIRED and name in r.plan.nodes
        ),
        key=lambda r: r.replica_id,
    )
    shards = sorted(plane.inventory.shards_of(name), key=lambda s: s.shard_id)
    return Description(
        kind="node",
        name=name,
        node=described,
        replicas=[_described(plane, r) for r in on_node],
        shards=shards,
        events=await _events(plane, [f"node/{name}", name, *(s.shard_id for s in shards)]),
    )


def _with_profile(
    plane: ControlPlane,
    description: Description,
    redact: Redact,
    deployment: Deployment | None = None,
) -> Description:
    deployment = deployment or description.deployment
    if deployment is None:
        return description
    description.deployment = deployment
    profile = plane.desired.profiles.get(deployment.profile)
    if profile is not None:
        description.profile = redact(profile)
        description.fingerprint = profile_fingerprint(profile)
    latest = plane.desired.revisions.get(deployment.name)
    description.revision = latest.revision if latest is not None else 0
    return description


def _objects_of(record: ReplicaRecord) -> list[str]:
    """What a replica's events are about: its id (the reconciler's), ``replica/ID`` (an
    operator's) and its shards."""
    rid = record.replica_id
    return [rid, f"replica/{rid}", *(s.shard_id for s in record.plan.shards)]


def _described(plane: ControlPlane, record: ReplicaRecord) -> DescribedReplica:
    return DescribedReplica(
        replica=plane.replica_view(record),
        lifecycle=record.lifecycle.value,
        fingerprint=record.plan.fingerprint,
        planned=[
            PlannedShard(
                shard_id=s.shard_id,
                node_id=s.node_id,
                gpu_uuids=list(s.gpu_uuids),
                port=s.port,
                rank=s.rank,
                cpu_threads=s.cpu_threads,
            )
            for s in record.plan.shards
        ],
        replaces=record.replaces,
    )


def _shards(plane: ControlPlane, records: Iterable[ReplicaRecord]) -> list[Shard]:
    shards = plane.inventory.shards
    ids = [s.shard_id for r in records for s in r.plan.shards]
    return [shards[i] for i in ids if i in shards]


async def _events(plane: ControlPlane, objects: Sequence[str]) -> list[HistoryEvent]:
    return [
        HistoryEvent(
            at_unix_ms=e.at_ms,
            object=e.object,
            actor=e.actor,
            reason=e.reason,
            message=e.message,
            warning=e.warning,
        )
        for e in await plane.history.recent(objects)
    ]
