"""Operator actions on replicas and nodes: start, drain, reprofile, drain a node.

Each action changes desired state (through :class:`~llmgw.server.state.desired.DesiredState`,
durably, before it answers) and leaves the replacing to the reconciler:

- **start**: the deployment's count goes up by one (named by its deployment, or by a
  replica of it that is no longer running; naming a running replica is refused);
- **drain**: the count goes down by one and the reconciler retires *that* replica
  (``DesiredState.retire``): its shards are drained, so in-flight requests finish; for a
  deployment the autoscaler owns (mode act) the count stays, and the replica is replaced;
- **reprofile**: the deployment (named, or the deployment of a named replica) points at
  another stored profile; the reconciler's rolling surge of one replaces its replicas, so
  READY never drops below the count. A profile of another model name is refused unless
  the caller allows it, and so is one whose replicas cannot be placed;
- **scale**: the deployment's count is set (``llmgw scale``); the reconciler starts or
  retires replicas to meet it. Scale and start are refused for a deployment whose
  autoscale policy is in mode "act": the autoscaler sets its count (change the policy's
  bounds, or its mode to "advise");
- **drain a node**: the node is cordoned and each of its live replicas is marked for
  replacement (``DesiredState.replace``): the same surge places a replacement elsewhere,
  waits until it is READY, then retires the old replica; a dry run changes nothing and
  says where placement would put each replacement now (``drain_preview``);
- **uncordon a node**: a drain of it that has not finished is cancelled (its replace
  requests are forgotten): the replicas still running there keep their ids, and a
  replacement not yet READY is retired as one replica too many.

A refusal raises :class:`ActionRefused` and changes nothing; every action, refused or not,
is audited by :class:`~llmgw.server.wire.controlsvc.ControlService`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from grpclib.const import Status

from llmgw.api.llmgw.v1 import Deployment, EngineProfile, ShardState
from llmgw.server.core.capacity import node_capacity
from llmgw.server.core.deployment_keys import MAX_REPLICAS, is_act
from llmgw.server.core.drainplan import drain_text, moving_replicas, plan_node_drain
from llmgw.server.core.fingerprint import profile_fingerprint
from llmgw.server.core.placement import FleetPlacer
from llmgw.server.core.placing import warm_nodes
from llmgw.server.core.plan import ReplicaPlan
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord
from llmgw.server.errors import ActionRefused, UnknownNode, quoted
from llmgw.server.state.placer import plan_change
from llmgw.server.state.plane import ControlPlane

__all__ = [
    "ActionRefused",
    "delete_node",
    "deployment_of",
    "drain_node",
    "drain_preview",
    "drain_replica",
    "reprofile",
    "scale",
    "start_replica",
    "uncordon_node",
]

_LIVE = (Lifecycle.ACTIVE, Lifecycle.SURGE)


def _deployment(plane: ControlPlane, name: str) -> Deployment:
    deployment = plane.desired.deployments.get(name)
    if deployment is None:
        raise ActionRefused(Status.NOT_FOUND, f"no deployment named {quoted(name)}")
    return Deployment.parse(bytes(deployment))  # a copy: the stored one changes on apply


def _replica(plane: ControlPlane, replica_id: str) -> ReplicaRecord:
    record = plane.replicas.get(replica_id)
    if record is None:
        raise ActionRefused(Status.NOT_FOUND, f"no replica named {quoted(replica_id)}")
    return record


def _named(plane: ControlPlane, deployment: str, replica_id: str) -> Deployment:
    """The deployment a request names, directly or through one of its replicas."""
    if not deployment and not replica_id:
        raise ActionRefused(Status.INVALID_ARGUMENT, "name a deployment or a replica")
    if replica_id:
        deployment = _replica(plane, replica_id).plan.deployment
    return _deployment(plane, deployment)


def _scale(delta: int) -> Callable[[Deployment], None]:
    def edit(deployment: Deployment) -> None:
        deployment.replicas = max(0, deployment.replicas + delta)

    return edit


def _set_count(n: int) -> Callable[[Deployment], None]:
    def edit(deployment: Deployment) -> None:
        deployment.replicas = n

    return edit


def _point_at(profile: str) -> Callable[[Deployment], None]:
    def edit(deployment: Deployment) -> None:
        deployment.profile = profile

    return edit


async def _edit(
    plane: ControlPlane, deployment: Deployment, edit: Callable[[Deployment], None], **kw: str
) -> Deployment:
    """Edit a stored deployment, durably; NOT_FOUND when it was deleted meanwhile."""
    edited = await plane.desired.update(deployment.name, edit, **kw)
    if edited is None:
        raise ActionRefused(Status.NOT_FOUND, f"no deployment named {quoted(deployment.name)}")
    return edited


def _count(n: int) -> str:
    return f"{n} replica{'' if n == 1 else 's'}"


def _not_autoscaled(deployment: Deployment) -> None:
    """Refuse to set the count of a deployment whose count the autoscaler owns."""
    if is_act(deployment) and deployment.autoscale is not None:
        bounds = f"[{deployment.autoscale.min}, {deployment.autoscale.max}]"
        why = (
            f"deployment {deployment.name} is autoscaled (mode act, {bounds}): the autoscaler "
            "sets its count; change autoscale.min/max in its file and apply it, or set "
            'autoscale.mode = "advise" to set the count by hand'
        )
        raise ActionRefused(Status.FAILED_PRECONDITION, why)


async def start_replica(plane: ControlPlane, deployment: str, replica_id: str) -> str:
    """Scale a deployment up by one; refused for a replica that is running, and for an
    autoscaled deployment (mode act)."""
    if replica_id and _replica(plane, replica_id).lifecycle in _LIVE:
        raise ActionRefused(Status.FAILED_PRECONDITION, f"replica {replica_id} already running")
    named = _named(plane, deployment, replica_id)
    _not_autoscaled(named)
    target = await _edit(plane, named, _scale(+1))
    plane.reconcile_soon()
    return f"deployment {target.name} scaled up to {_count(target.replicas)}"


async def scale(plane: ControlPlane, deployment: str, replicas: int) -> str:
    """Set a deployment's replica count, durably; refused (FAILED_PRECONDITION) for an
    autoscaled deployment (mode act), whose count the autoscaler sets."""
    if replicas > MAX_REPLICAS:
        why = f"replicas: {replicas} is more than {MAX_REPLICAS}"
        raise ActionRefused(Status.INVALID_ARGUMENT, why)
    named = _deployment(plane, deployment)
    _not_autoscaled(named)
    if named.replicas == replicas:
        return f"deployment {named.name} already has {_count(replicas)}; nothing changed"
    target = await _edit(plane, named, _set_count(replicas))
    plane.reconcile_soon()
    return f"deployment {target.name} scaled from {named.replicas} to {_count(target.replicas)}"


async def drain_replica(plane: ControlPlane, replica_id: str) -> str:
    """Drain one replica; its deployment's count drops by one, but for an autoscaled
    deployment (mode act), whose count stays (the replica is replaced, as a pod deleted
    under a HorizontalPodAutoscaler is)."""
    if not replica_id:
        raise ActionRefused(Status.INVALID_ARGUMENT, "name the replica to drain")
    record = _replica(plane, replica_id)
    if replica_id in plane.desired.retire:
        raise ActionRefused(Status.FAILED_PRECONDITION, f"replica {replica_id} already draining")
    if record.lifecycle is not Lifecycle.ACTIVE:
        why = f"replica {replica_id} is {record.lifecycle.value}, not active"
        raise ActionRefused(Status.FAILED_PRECONDITION, why)
    named = _deployment(plane, record.plan.deployment)
    if is_act(named):  # the autoscaler's count stays: the replica is replaced
        target = await _edit(plane, named, _scale(0), retire=replica_id)
        plane.reconcile_soon()
        return (
            f"replica {replica_id} draining; deployment {target.name} is autoscaled and "
            f"keeps {_count(target.replicas)}: a replacement is placed"
        )
    target = await _edit(plane, named, _scale(-1), retire=replica_id)
    plane.reconcile_soon()
    return (
        f"replica {replica_id} draining; deployment {target.name} "
        f"scaled down to {_count(target.replicas)}"
    )


async def reprofile(
    plane: ControlPlane,
    deployment: str,
    replica_id: str,
    profile: str,
    *,
    allow_model_change: bool = False,
) -> str:
    """Point a deployment at another stored profile (a rolling replacement follows).

    Refused (FAILED_PRECONDITION, nothing changed) when the profile serves another model
    name than the deployment's profile, unless ``allow_model_change``, and when the rolling
    replacement cannot place its replicas (the dry run's rule, ``state.placer``)."""
    new = plane.desired.profiles.get(profile)
    if new is None:
        raise ActionRefused(Status.NOT_FOUND, f"no profile named {quoted(profile)}")
    target = _named(plane, deployment, replica_id)
    if target.profile == profile:
        return f"deployment {target.name} already uses profile {profile}; nothing changed"
    old = plane.desired.profiles.get(target.profile)
    if old is not None and not allow_model_change:
        _same_model(target, old, new)
    moved = Deployment.parse(bytes(target))
    moved.profile = profile
    plan, _ = plan_change(plane, [moved])
    if not plan.placeable:
        why = "; ".join(plan.reasons())
        raise ActionRefused(
            Status.FAILED_PRECONDITION,
            f"profile {profile} cannot be placed for deployment {target.name} ({why}); "
            "nothing changed",
        )
    target = await _edit(plane, target, _point_at(profile))
    plane.reconcile_soon()
    fingerprint = plane.desired.fingerprint(profile)
    return (
        f"deployment {target.name} reprofiled to {profile} ({fingerprint}): "
        f"rolling replacement of {_count(target.replicas)}, one at a time"
    )


def _same_model(target: Deployment, old: EngineProfile, new: EngineProfile) -> None:
    if old.served_model_name == new.served_model_name:
        return
    raise ActionRefused(
        Status.FAILED_PRECONDITION,
        f"profile {new.name} serves model {quoted(new.served_model_name)}, but deployment "
        f"{target.name} serves {quoted(old.served_model_name)} (profile {old.name}): clients "
        f"asking for {quoted(old.served_model_name)} would get 404; pass "
        "--allow-model-change (allow_model_change) to switch the model",
    )


def deployment_of(plane: ControlPlane, deployment: str, replica_id: str) -> str:
    """The deployment a request names, directly or through one of its replicas, or ""."""
    if deployment or not replica_id:
        return deployment
    record = plane.replicas.get(replica_id)
    return record.plan.deployment if record is not None else ""


async def drain_node(plane: ControlPlane, node_id: str, *, actor: str) -> str:
    """Cordon a node and replace each replica on it elsewhere before it is retired."""
    try:
        await plane.set_cordoned(node_id, True, actor=actor)
    except UnknownNode as exc:
        raise ActionRefused(Status.NOT_FOUND, str(exc)) from exc
    moving = [r.replica_id for r in moving_replicas(plane.replicas, node_id)]
    await plane.desired.request_replace(moving)
    plane.reconcile_soon()
    if not moving:
        return f"node {node_id} cordoned; no replica runs there"
    return f"node {node_id} cordoned; replacing {', '.join(moving)} elsewhere, one at a time"


def drain_preview(plane: ControlPlane, node_id: str) -> tuple[str, bool]:
    """Where a drain of ``node_id`` would move each of its replicas now, by the placement
    rules (``llmgw.server.core.drainplan``), in words, and whether every one can move;
    nothing is changed."""
    inventory, now = plane.inventory, time.monotonic()
    if node_id not in inventory.nodes:
        raise ActionRefused(Status.NOT_FOUND, f"no node named {quoted(node_id)}")
    nodes = [node_capacity(inventory.node_view(r, now)) for r in inventory.nodes.values()]
    records = plane.replicas.values()
    placer = FleetPlacer(
        nodes, profile_fingerprint, warm=lambda p: warm_nodes(records, p.model_path)
    )
    moves = plan_node_drain(
        node_id,
        plane.replicas,
        plane.desired.deployments,
        plane.desired.profiles,
        placer,
        unusable=frozenset(n.node_id for n in nodes if not n.schedulable),
        taken=_holding(plane),
    )
    movable = all(isinstance(m.placed, ReplicaPlan) for m in moves)
    return drain_text(node_id, moves, nodes), movable


def _holding(plane: ControlPlane) -> list[ReplicaPlan]:
    """The plans holding devices: every replica not RETIRED, and RETIRED ones whose shards
    still run (as the reconciler counts them)."""
    shards = plane.inventory.shards

    def running(record: ReplicaRecord) -> bool:
        reported = (shards.get(p.shard_id) for p in record.plan.shards)
        return any(
            s is not None and s.status is not None and s.status.state != ShardState.STOPPED
            for s in reported
        )

    return [
        r.plan
        for _, r in sorted(plane.replicas.items())
        if r.lifecycle is not Lifecycle.RETIRED or running(r)
    ]


async def uncordon_node(plane: ControlPlane, node_id: str, *, actor: str) -> str:
    """Uncordon a node; a drain of it still under way is cancelled: the replicas it was
    moving stay on it under their ids, and replacements not yet READY are retired by the
    reconciler (their deployments have one replica too many)."""
    try:
        await plane.set_cordoned(node_id, False, actor=actor)
    except UnknownNode as exc:
        raise ActionRefused(Status.NOT_FOUND, str(exc)) from exc
    staying = await plane.desired.cancel_replace(
        [r.replica_id for r in plane.replicas.values() if node_id in r.plan.nodes]
    )
    plane.reconcile_soon()
    if not staying:
        return f"node {node_id} uncordoned"
    verb = "stays" if len(staying) == 1 else "stay"
    return f"node {node_id} uncordoned; drain cancelled: {', '.join(staying)} {verb} on {node_id}"


async def delete_node(plane: ControlPlane, node_id: str, *, force: bool) -> str:
    """Forget a gone node (refused while connected, or running shards without ``force``)."""
    try:
        return await plane.delete_node(node_id, force=force)
    except UnknownNode as exc:
        raise ActionRefused(Status.NOT_FOUND, str(exc)) from exc
