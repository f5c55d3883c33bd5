"""Plans on the wire: a core :class:`~llmgw.server.core.applyplan.ApplyPlan` as the API's
``ApplyPlan`` message, and as the few lines an ``ActionResult`` message says.

A planned change names its node (nodes joined by commas for a multi-node replica), its
GPUs by NVML index on that node (``IDX/MIG`` for a MIG slice; ``NODE:IDX`` across nodes)
and its leader's engine port. ``ActionResult.desired`` is what the planned deployments ask
for and ``placeable`` how many of those replicas will run.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.api.llmgw.v1 import ActionResult, PlannedChange
from llmgw.api.llmgw.v1 import ApplyPlan as ApplyPlanMessage
from llmgw.server.core.applyplan import Action, ApplyPlan, PlannedReplica
from llmgw.server.core.capacity import NodeCapacity
from llmgw.server.core.plan import ReplicaPlan

__all__ = ["counted", "plan_message", "plan_summary"]

_SHOWN_REASONS = 3


def plan_message(plan: ApplyPlan, nodes: Mapping[str, NodeCapacity]) -> ApplyPlanMessage:
    """The API's view of ``plan``; ``nodes`` give the GPUs' indices."""
    return ApplyPlanMessage(
        placeable=plan.placeable, changes=[_change(c, nodes) for c in plan.changes]
    )


def _change(change: PlannedReplica, nodes: Mapping[str, NodeCapacity]) -> PlannedChange:
    out = PlannedChange(
        action=change.action.value,
        deployment=change.deployment,
        replica=change.replica,
        profile=change.profile,
        from_profile=change.from_profile,
        reason=change.reason,
    )
    if change.plan is not None:
        out.node = ",".join(change.plan.nodes)
        out.gpus = _gpus(change.plan, nodes)
        out.port = change.plan.leader.port
    return out


def _gpus(plan: ReplicaPlan, nodes: Mapping[str, NodeCapacity]) -> list[str]:
    names = []
    for shard in plan.shards:
        node = nodes.get(shard.node_id)
        index = {d.uuid: d for d in node.devices} if node is not None else {}
        for uuid in shard.gpu_uuids:
            device = index.get(uuid)
            name = uuid if device is None else str(device.index)
            if device is not None and device.mig_profile:
                name += f"/{device.mig_profile}"
            names.append(f"{shard.node_id}:{name}" if len(plan.shards) > 1 else name)
    return names


def counted(result: ActionResult, plan: ApplyPlan) -> str:
    """Set ``result``'s counts from the plan; the line saying why replicas cannot be
    placed, or "" when every one can."""
    result.desired = sum(plan.desired.values())
    result.placeable = plan.placed
    reasons = plan.reasons()
    if not reasons:
        return ""
    shown = "; ".join(reasons[:_SHOWN_REASONS])
    more = len(reasons) - _SHOWN_REASONS
    return f"{result.placeable} of {result.desired} replicas can be placed: {shown}" + (
        f"; and {more} more" if more > 0 else ""
    )


def plan_summary(plan: ApplyPlan) -> str:
    """A dry run in a few lines: the count of each action, then what cannot be placed."""
    counts = {a: sum(1 for c in plan.changes if c.action is a) for a in Action}
    words = ", ".join(f"{n} {a.value}" for a, n in counts.items() if n) or "no replicas"
    if plan.placeable:
        return f"dry run: {words}; every replica can be placed; nothing was changed"
    lines = [f"dry run: {words}; some replicas cannot be placed; nothing was changed"]
    lines += [f"  {reason}" for reason in plan.reasons()[:_SHOWN_REASONS]]
    return "\n".join(lines)
