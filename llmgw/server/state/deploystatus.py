"""Deployment statuses as the plane shows them, and when they change.

:class:`DeploymentBoard` keeps, per deployment, its live replica records (ACTIVE or SURGE),
what the reconciler's last round said about it (``set_verdicts``: why replicas have no
place, which deployments a crash-loop back-off holds) and the status last shown. The plane
asks it for a deployment's status (``status``, for snapshots and published deployments)
and, after anything that may change one (a shard report, replica records, a node's state,
a round), for the statuses that changed (``changed``), which it publishes as ``deployment``
Watch events. The computation itself is the pure
:func:`llmgw.server.core.deployment_status.deployment_status`.

The autoscaler's view of a deployment with a policy (``DeploymentStatus.autoscale``) is
what the autoscale loop (``llmgw.server.autoscale_loop``) set last (``set_autoscale``),
its ``current`` always the deployment's count now; it counts the loop's decisions by
reason for the server's ``/metrics`` (``decisions``). A deployment without a policy shows
none.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import replace

from llmgw.api.llmgw.v1 import (
    AutoscaleStatus,
    Deployment,
    DeploymentStatus,
    NodeState,
    Shard,
    ShardState,
)
from llmgw.protocol import read_shard_state
from llmgw.server.core.deployment_status import (
    ReplicaFacts,
    RoundVerdict,
    deployment_status,
    replica_state,
)
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord
from llmgw.server.state.inventory import Inventory
from llmgw.server.state.store import now_ms

__all__ = ["DeploymentBoard"]

_LIVE = (Lifecycle.ACTIVE, Lifecycle.SURGE)


class DeploymentBoard:
    """Live replicas, round verdicts and shown statuses, per deployment."""

    def __init__(self, inventory: Inventory, fingerprint: Callable[[str], str]) -> None:
        self._inventory = inventory
        self._fingerprint = fingerprint  # a stored profile's fingerprint by name ("" if none)
        self._live: dict[str, dict[str, ReplicaRecord]] = {}  # deployment → id → record
        self._retiring: dict[str, set[str]] = {}  # deployment → ids of its RETIRING replicas
        self._verdicts: dict[str, RoundVerdict] = {}
        self._shown: dict[str, DeploymentStatus] = {}
        self._inputs: dict[str, tuple[object, ...]] = {}  # what each shown status stood on
        self._autoscale: dict[str, AutoscaleStatus] = {}  # deployment → the loop's last view
        self.decisions: Counter[tuple[str, str]] = Counter()  # (deployment, reason) → rounds

    def set_autoscale(self, name: str, status: AutoscaleStatus | None) -> None:
        """The autoscaler's view of deployment ``name`` now (None: it has no policy)."""
        if status is None:
            self._autoscale.pop(name, None)
            for key in [k for k in self.decisions if k[0] == name]:
                del self.decisions[key]
        else:
            self._autoscale[name] = status

    def autoscale_of(self, name: str) -> AutoscaleStatus | None:
        """The autoscaler's last view of deployment ``name`` (None: none)."""
        return self._autoscale.get(name)

    def autoscaled(self) -> dict[str, AutoscaleStatus]:
        """The autoscaler's view of every deployment it has decided for, by name."""
        return dict(self._autoscale)

    def track(self, records: Iterable[ReplicaRecord]) -> set[str]:
        """Take new or changed replica records; the deployments they belong to."""
        names = set()
        for record in records:
            name = record.plan.deployment
            names.add(name)
            replicas = self._live.setdefault(name, {})
            retiring = self._retiring.setdefault(name, set())
            if record.lifecycle in _LIVE:
                replicas[record.replica_id] = record
            else:
                replicas.pop(record.replica_id, None)
            if record.lifecycle is Lifecycle.RETIRING:
                retiring.add(record.replica_id)
            else:
                retiring.discard(record.replica_id)
        return names

    def on_node(self, node_id: str) -> set[str]:
        """The deployments with a live replica planned on ``node_id``."""
        return {
            name
            for name, replicas in self._live.items()
            if any(node_id in r.plan.nodes for r in replicas.values())
        }

    def set_verdicts(self, unplaceable: Mapping[str, str], backoff: Collection[str]) -> None:
        """What the reconciler's last round could not place, and which back-offs hold."""
        self._verdicts = {
            name: RoundVerdict(why, name in backoff) for name, why in unplaceable.items()
        }

    def shown(self, deployment: Deployment, *, remember: bool = True) -> Deployment:
        """A copy of ``deployment`` with its status now, as snapshots and Watch show it.

        A snapshot does not ``remember`` it: a change only it saw would never be published
        to the watchers that took an earlier snapshot."""
        return replace(deployment, status=self.status(deployment, remember=remember))

    def status(self, deployment: Deployment, *, remember: bool = True) -> DeploymentStatus:
        """The deployment's status now (remembered as the one shown, unless not to).

        ``deployment_status`` is a function of its inputs (the transition times change only
        with a condition's status): where they are those of the status shown, that status
        is the answer, the same object, so :meth:`changed` need not compare them (each
        round asks it of every deployment)."""
        name = deployment.name
        now = time.monotonic()
        replicas = sorted(self._live.get(name, {}).values(), key=_serial)
        facts = tuple(self._facts(deployment, r, now) for r in replicas)
        verdict = self._verdicts.get(name, RoundVerdict())
        retiring = len(self._retiring.get(name, ()))
        autoscale = self._autoscale.get(name) if deployment.autoscale is not None else None
        inputs = (deployment.replicas, deployment.profile, facts, verdict, retiring)
        shown = self._shown.get(name)
        if shown is not None and autoscale is None and shown.autoscale is None:
            if self._inputs.get(name) == inputs:
                return shown
        status = deployment_status(
            deployment, facts, verdict, previous=shown, now_ms=now_ms(), retiring=retiring
        )
        if autoscale is not None:
            status.autoscale = replace(autoscale, current=deployment.replicas)
        if remember:
            self._shown[name] = status
            self._inputs[name] = inputs
        return status

    def changed(
        self, deployments: Mapping[str, Deployment], names: Iterable[str] | None = None
    ) -> list[Deployment]:
        """Refresh ``names`` (None: every deployment); the deployments whose status is no
        longer the one shown, each with its new status set (a copy; the plane's stays)."""
        out = []
        for name in sorted(deployments if names is None else set(names)):
            deployment = deployments.get(name)
            if deployment is None:
                self._shown.pop(name, None)
                self._inputs.pop(name, None)
                continue
            before = self._shown.get(name)
            status = self.status(deployment)
            if status is not before and status != before:
                out.append(replace(deployment, status=status))
        return out

    def _facts(self, deployment: Deployment, record: ReplicaRecord, now: float) -> ReplicaFacts:
        shards = [self._on_node(p.shard_id, p.node_id) for p in record.plan.shards]
        state = replica_state(record, shards)
        lost = [n for n in record.plan.nodes if not self._node_ready(n, now)]
        reason = ""
        if lost:
            reason = f"node {lost[0]} is NOT_READY"
        elif state is not ShardState.READY:
            reason = _shard_reason(shards, state)
        return ReplicaFacts(
            replica_id=record.replica_id,
            state=state,
            ready=state is ShardState.READY and not lost,
            up_to_date=record.plan.profile == deployment.profile
            and record.plan.fingerprint == self._fingerprint(deployment.profile),
            reason=reason,
        )

    def _on_node(self, shard_id: str, node_id: str) -> Shard | None:
        shard = self._inventory.shards.get(shard_id)
        return shard if shard is not None and shard.node_id == node_id else None

    def _node_ready(self, node_id: str, now: float) -> bool:
        record = self._inventory.nodes.get(node_id)
        return record is not None and self._inventory.state(record, now) is not NodeState.NOT_READY


def _shard_reason(shards: list[Shard | None], state: ShardState) -> str:
    """The reason the first shard in ``state`` gives, as "STATE: reason"."""
    for shard in shards:
        if shard is None or shard.status is None:
            continue
        if read_shard_state(shard.status.state) is state and shard.status.reason:
            return f"{state.name}: {shard.status.reason}"
    return ""


def _serial(record: ReplicaRecord) -> tuple[int, str]:
    return record.serial, record.replica_id
