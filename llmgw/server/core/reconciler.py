"""The reconciler: desired replicas against what agents report, as one pure function.

:func:`reconcile` is level-based: it looks only at the state it is given and decides the
commands that move the fleet toward the deployments; run again on the same state (with
the decision applied) it sends nothing new, because a command already sent and not yet
reflected is in ``pending`` and is only sent again after ``command_retry_s``.

Rules, in the order a round applies them (every loop in sorted order):

1. **Replace** an ACTIVE or SURGE replica one of whose nodes has been NOT_READY past
   ``node_grace_s``, or one of whose shards is FAILED with ``restarts >= max_restarts``
   or with ``gave_up`` (its agent will not restart it, e.g. it refused the command):
   it goes RETIRED (its shards are fenced) and a new replica is placed avoiding that node.
   Replicas that fail are counted (``Decision.failed``): the first failure is replaced at
   once, elsewhere; after failures in a row (``streak``) the caller holds the deployment's
   next placements back (``held``, delays doubling as ``crash_delay`` says), and a replica
   that fails while its deployment has such a streak is not replaced but **crash-looping**
   (``Decision.crashloops``, kubelet's CrashLoopBackOff): it keeps its id and node, its
   failed shards are stopped at once (the reason, with the failure's, is the StopShard's,
   and ``unplaceable`` says it), and rule 4 starts them again after the delay of its
   failures in a row. A shard
   refused only for a port another process holds is always replaced (on another port). A
   loop is forgotten once its replica is gone, or READY ``crash_reset_s`` past its delay.
   Then a live replica named in ``retire`` (drained by an operator) goes RETIRING.
2. **Deployments**: a deleted deployment retires all its replicas. Otherwise replicas are
   placed until the deployment has its count, deployments with the largest shards first
   (so small ones fill the gaps rather than break up whole nodes); extras are retired
   (not-READY ones first, then out-of-date ones, then the one whose loss costs the fewest
   cached prefix blocks no other replica of its deployment holds, then the one with the
   fewest requests in flight, both from ``costs``, then the newest). A replica whose
   fingerprint differs from its deployment's profile is out of date and is replaced by a
   rolling surge of one: a SURGE replica with the new profile is placed, becomes ACTIVE
   once all its shards are READY, and only then is one out-of-date replica retired, so
   READY never drops below the count.
   A replica named in ``replace`` counts as out of date (a node drain moves it this way).
   With no room for the surge the reprofile waits (``unplaceable`` says why).
3. **Retiring** replicas: DrainShard every running shard (StopShard a FAILED one, lest its
   agent restart it); RETIRED once none runs.
4. **Start** every shard of an ACTIVE or SURGE replica that is not on its node (absent or
   STOPPED), unless a copy of it runs elsewhere; multi-node ranks get the leader's address,
   the plan's rendezvous port, their HCAs, the node count and their rank. Shards reported
   on their planned node are adopted as they are.
5. **Fence**: StopShard any shard reported running whose replica is unknown or RETIRED, or
   that runs on a node its plan does not name.

A live replica all of whose shards are READY is marked ``was_ready`` (once: its record
changes, no event), so its nodes count as warm for its model (``placing.warm_nodes``).

Nothing is sent to, or concluded from, a node that is not READY (its last reports are
stale), except that its absence past the grace replaces its replicas; a retiring replica's
shard there counts as stopped (fenced should the node return).

A FAILED shard with restarts left and not given up is its agent's to restart: the
reconciler waits.

A profile that :func:`llmgw.engineinput.profile_problems` refuses (one stored by an older
server, before the check existed) is started nowhere: its deployment places no replica and
no shard of it is started, and ``unplaceable`` says which keys are refused. Shards of it that
already run are left running; the stored profile and deployment are kept until an operator
applies a good profile.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmgw.api.llmgw.v1 import (
    ControlMessage,
    Deployment,
    DrainShard,
    EngineProfile,
    Shard,
    ShardState,
    StopShard,
)
from llmgw.server.core.fingerprint import remembered
from llmgw.server.core.placing import (
    holding,
    next_serials,
    placement_order,
    profile_refusal,
    ready_everywhere,
    replica_id_for,
    retire_key,
    shard_state,
    unusable_nodes,
)
from llmgw.server.core.plan import ReplicaPlan, ShardPlan, Unplaceable
from llmgw.server.core.reconcile_state import (
    CommandKind,
    CrashLoop,
    Decision,
    Event,
    Lifecycle,
    PendingCommand,
    ReconcileInput,
    ReplicaRecord,
    ScaleInCost,
    crash_delay,
    held_reason,
)
from llmgw.server.core.startshard import placement_why, start_message, where

__all__ = ["reconcile", "replica_id_for", "start_message"]

_LIVE = (Lifecycle.ACTIVE, Lifecycle.SURGE)
_RUNNING = (ShardState.PENDING, ShardState.STARTING, ShardState.LOADING, ShardState.READY)


def reconcile(state: ReconcileInput) -> Decision:
    """Decide one round (see the module docstring for the rules)."""
    round_ = _Round(state)
    round_.mark_ready()
    round_.replace_broken()
    round_.retire_requested()
    for name in sorted(round_.live_deployments() - state.deployments.keys()):
        round_.retire_deleted(name)
    for deployment in placement_order(state.deployments.values(), state.profiles):
        round_.scale(deployment)
    round_.retire_drained()
    round_.start_missing()
    round_.fence()
    round_.forget_crashloops()
    return round_.decision()


_state = shard_state


def _restarts(shard: Shard) -> int:
    return shard.status.restarts if shard.status else 0


class _Round:
    """The working state of one round: records as changed so far, commands, events."""

    def __init__(self, state: ReconcileInput) -> None:
        self.s = state
        self.cfg = state.config
        self.records: dict[str, ReplicaRecord] = dict(state.replicas)
        self.changed: dict[str, ReplicaRecord] = {}
        self.commands: list[tuple[str, ControlMessage]] = []
        self.pending: dict[str, PendingCommand] = {}
        self.events: list[Event] = []
        self.unplaceable: dict[str, str] = {}
        self.crashloops: dict[str, CrashLoop] = dict(state.crashloops)
        self.failed: dict[str, int] = {}  # deployment → replicas replaced for failing
        self.avoid: dict[str, set[str]] = {}  # deployment → nodes its replacements avoid
        self.replaced: dict[str, list[str]] = {}  # deployment → replica ids to replace
        self.by_deployment: dict[str, dict[str, ReplicaRecord]] = {}
        for record in self.records.values():
            self.by_deployment.setdefault(record.plan.deployment, {})[record.replica_id] = record
        self.unusable = unusable_nodes(state.nodes)
        self.taken = holding(self.records.values(), state.shards)
        self.refusal = remembered(profile_refusal)  # once per profile in a round

    # --- views ----------------------------------------------------------------------

    def sorted_records(self, *lifecycles: Lifecycle) -> list[ReplicaRecord]:
        return [
            r
            for _, r in sorted(self.records.items())
            if not lifecycles or r.lifecycle in lifecycles
        ]

    def live_deployments(self) -> set[str]:
        return {r.plan.deployment for r in self.sorted_records(*_LIVE, Lifecycle.RETIRING)}

    def node_ready(self, node_id: str) -> bool:
        node = self.s.nodes.get(node_id)
        return node is not None and node.ready

    def on_node(self, plan: ShardPlan) -> Shard | None:
        """The shard as reported on its planned node, when that node is READY."""
        shard = self.s.shards.get(plan.shard_id)
        if shard is None or shard.node_id != plan.node_id or not self.node_ready(plan.node_id):
            return None
        return shard

    def all_ready(self, record: ReplicaRecord) -> bool:
        return ready_everywhere(record, self.s.shards, self.s.nodes)

    # --- changes ----------------------------------------------------------------------

    def store(self, record: ReplicaRecord) -> None:
        self.records[record.replica_id] = self.changed[record.replica_id] = record
        self.by_deployment.setdefault(record.plan.deployment, {})[record.replica_id] = record

    def set_lifecycle(self, record: ReplicaRecord, lifecycle: Lifecycle, why: str) -> None:
        self.store(replace(record, lifecycle=lifecycle))
        what = f"replica {record.replica_id} {record.lifecycle.value} → {lifecycle.value}"
        self.events.append(Event(record.replica_id, what, why))

    def send(self, node_id: str, kind: CommandKind, message: ControlMessage, event: Event) -> None:
        """Send a command unless the same one is in flight and not yet due again."""
        shard_id = event.subject
        sent = self.s.pending.get(shard_id)
        if (
            sent is not None
            and (sent.kind, sent.node_id) == (kind, node_id)
            and self.s.now - sent.sent_at < self.cfg.command_retry_s
        ):
            self.pending[shard_id] = sent
            return
        self.commands.append((node_id, message))
        self.pending[shard_id] = PendingCommand(kind, node_id, self.s.now)
        self.events.append(event)

    def stop(self, node_id: str, shard_id: str, why: str) -> None:
        message = StopShard(shard_id=shard_id, grace_seconds=self.cfg.stop_grace_s, reason=why)
        event = Event(shard_id, f"stop shard {shard_id} on {node_id}", why)
        self.send(node_id, CommandKind.STOP, ControlMessage(stop_shard=message), event)

    def drain(self, node_id: str, shard_id: str, why: str) -> None:
        message = DrainShard(shard_id=shard_id, grace_seconds=self.cfg.drain_grace_s)
        event = Event(shard_id, f"drain shard {shard_id} on {node_id}", why)
        self.send(node_id, CommandKind.DRAIN, ControlMessage(drain_shard=message), event)

    def mark_ready(self) -> None:
        """Mark live replicas READY on every shard as ``was_ready`` (warm placement)."""
        for record in self.sorted_records(*_LIVE):
            if not record.was_ready and self.all_ready(record):
                self.store(replace(record, was_ready=True))

    # --- rule 1: replace broken replicas ----------------------------------------------

    def replace_broken(self) -> None:
        for record in self.sorted_records(*_LIVE):
            broken = self.broken(record)
            if broken is None:
                continue
            node_id, why, failed = broken
            name = record.plan.deployment
            if failed and node_id and self.crash_looping(record):
                self.restart_in_place(record, why)
                continue
            self.set_lifecycle(record, Lifecycle.RETIRED, why)
            if node_id:
                self.avoid.setdefault(name, set()).add(node_id)
            self.replaced.setdefault(name, []).append(record.replica_id)
            if failed:
                self.failed[name] = self.failed.get(name, 0) + 1

    def crash_looping(self, record: ReplicaRecord) -> bool:
        """A failed replica is restarted in place, not replaced, once it or another of its
        deployment failed in a row before (the first failure is replaced elsewhere)."""
        name = record.plan.deployment
        earlier = self.s.streak.get(name, 0) + self.failed.get(name, 0)
        return record.replica_id in self.crashloops or earlier > 0

    def restart_in_place(self, record: ReplicaRecord, why: str) -> None:
        """Count a new failure and stop the failed shards at once (its agent would restart
        them); rule 4 starts them again on the same node, under the same id, after the
        delay of its failures in a row."""
        rid = record.replica_id
        loop = self.crashloops.get(rid)
        if loop is not None and not loop.restarted:
            return  # stopped already, waiting for its delay
        name = record.plan.deployment
        count = (loop.failures if loop else self.s.streak.get(name, 0)) + 1
        delay = crash_delay(count, self.cfg)
        self.crashloops[rid] = CrashLoop(count, why, self.s.now + delay)
        what = f"replica {rid} is crash-looping ({count} failures in a row)"
        self.events.append(Event(rid, what, f"{why}; restarted in place in {delay:g} s"))
        for plan in record.plan.shards:
            if self.exhausted(plan):
                self.stop(plan.node_id, plan.shard_id, f"{what}, restarted in {delay:g} s: {why}")

    def waiting(self, record: ReplicaRecord) -> bool:
        """Whether a crash-looping replica still waits for its delay (then it may start)."""
        loop = self.crashloops.get(record.replica_id)
        if loop is None or loop.restarted:
            return False
        if self.s.now >= loop.until:
            self.crashloops[record.replica_id] = replace(loop, restarted=True)
            return False
        what = f"replica {record.replica_id} is crash-looping ({loop.failures} failures in a row)"
        self.unplaceable.setdefault(
            record.plan.deployment,
            f"{what}: {loop.reason}; restarted in {loop.until - self.s.now:.0f} s",
        )
        return True

    def forget_crashloops(self) -> None:
        """Drop the loops of replicas gone, and of those READY past ``crash_reset_s``."""
        for rid, loop in list(self.crashloops.items()):
            record = self.records.get(rid)
            recovered = record is not None and self.all_ready(record)
            if (
                record is None
                or record.lifecycle not in _LIVE
                or (recovered and self.s.now - loop.until > self.cfg.crash_reset_s)
            ):
                del self.crashloops[rid]

    def broken(self, record: ReplicaRecord) -> tuple[str, str, bool] | None:
        """The node to avoid ("" for none), why, and whether a shard failed (rather than its
        node went), when ``record`` must be replaced. A shard refused only because another
        process holds its port avoids no node and is no failure of the replica's (it counts
        toward no crash loop or back-off): its replacement gets another port."""
        for plan in record.plan.shards:
            if why := self.node_gone(plan.node_id):
                return plan.node_id, why, False
            if why := self.exhausted(plan):
                shard = self.on_node(plan)
                port_only = (
                    shard is not None
                    and shard.status is not None
                    and bool(shard.status.port_in_use)
                )
                return ("" if port_only else plan.node_id), why, not port_only
        return None

    def node_gone(self, node_id: str) -> str:
        node = self.s.nodes.get(node_id)
        if node is None:  # an operator deleted it (llmgw delete node --force)
            return f"node {node_id} was deleted"
        since = None if node is None or node.ready else node.not_ready_since
        if since is None or self.s.now - since < self.cfg.node_grace_s:
            return ""
        grace = self.cfg.node_grace_s
        return f"node {node_id} NOT_READY for {self.s.now - since:.0f}s (grace {grace:.0f}s)"

    def exhausted(self, plan: ShardPlan) -> str:
        shard = self.on_node(plan)
        if shard is None or _state(shard) is not ShardState.FAILED:
            return ""
        gave_up = shard.status is not None and shard.status.gave_up
        if not gave_up and _restarts(shard) < self.cfg.max_restarts:
            return ""  # its agent restarts it
        reason = shard.status.reason if shard.status else ""
        if gave_up:
            why = f"shard {plan.shard_id} FAILED and its agent gave up"
        else:
            why = f"shard {plan.shard_id} FAILED after {_restarts(shard)} restarts"
        return f"{why}: {reason}" if reason else why

    def retire_requested(self) -> None:
        for record in self.sorted_records(*_LIVE):
            if record.replica_id in self.s.retire:
                self.set_lifecycle(record, Lifecycle.RETIRING, "drained by an operator")

    # --- rule 2: deployments ------------------------------------------------------------

    def retire_deleted(self, name: str) -> None:
        for record in self.of(name, *_LIVE):
            self.set_lifecycle(record, Lifecycle.RETIRING, f"deployment {name} was deleted")

    def scale(self, deployment: Deployment) -> None:
        profile = self.s.profiles.get(deployment.profile)
        if profile is None:
            self.unplaceable[deployment.name] = f"profile {deployment.profile!r} is not defined"
            return
        if why := self.refusal(profile):
            self.unplaceable[deployment.name] = why
            return
        if not deployment.replicas and not self.by_deployment.get(deployment.name):
            return  # none wanted, none there: nothing to settle (most of a huge apply)
        fingerprint = self.s.fingerprint(profile)
        current = _Current(deployment.profile, fingerprint, self.s.replace)
        self.settle_surges(deployment.name, current)
        active = self.of(deployment.name, Lifecycle.ACTIVE)
        count = len(active) + len(self.of(deployment.name, Lifecycle.SURGE))
        if count < deployment.replicas:
            replaces = self.replaced.get(deployment.name, [])
            self.place(deployment, profile, deployment.replicas - count, replaces)
        elif len(active) > deployment.replicas:
            for record in self.retire_order(active, current)[: len(active) - deployment.replicas]:
                self.set_lifecycle(record, Lifecycle.RETIRING, self.surplus_why(record, current))
        self.surge(deployment, profile, current)

    def surge(self, deployment: Deployment, profile: EngineProfile, current: _Current) -> None:
        """Place one SURGE replica when the count is met and some replica is out of date."""
        active = self.of(deployment.name, Lifecycle.ACTIVE)
        if self.of(deployment.name, Lifecycle.SURGE) or len(active) < deployment.replicas:
            return
        outdated = [r for r in self.retire_order(active, current) if not current(r)]
        if outdated:
            self.place(deployment, profile, 1, [outdated[0].replica_id], Lifecycle.SURGE)

    def of(self, deployment: str, *lifecycles: Lifecycle) -> list[ReplicaRecord]:
        """The deployment's replicas in these lifecycles, oldest first."""
        records = self.by_deployment.get(deployment)
        if not records:
            return []
        return sorted((r for r in records.values() if r.lifecycle in lifecycles), key=_key)

    def settle_surges(self, name: str, current: _Current) -> None:
        """Promote READY surges, retire stale ones; keep at most one (the oldest)."""
        outdated = [r for r in self.of(name, Lifecycle.ACTIVE) if not current(r)]
        for surge in self.of(name, Lifecycle.SURGE):
            if not current(surge):
                self.set_lifecycle(surge, Lifecycle.RETIRING, "its profile is out of date")
            elif not outdated:
                self.set_lifecycle(surge, Lifecycle.ACTIVE, "no out-of-date replica left")
            elif self.all_ready(surge):
                self.set_lifecycle(surge, Lifecycle.ACTIVE, "all its shards are READY")
        for extra in self.of(name, Lifecycle.SURGE)[1:]:
            self.set_lifecycle(extra, Lifecycle.RETIRING, "one surge replica at a time")

    def surplus_why(self, record: ReplicaRecord, current: _Current) -> str:
        """Why a lowered count retires ``record`` rather than another (``retire_key``)."""
        why = "more replicas than desired"
        if not self.all_ready(record):
            return f"{why}; it is not READY"
        if not current(record):
            return f"{why}; it is out of date"
        if not self.s.costs:
            return f"{why}; the newest"
        cost = self.s.costs.get(record.replica_id, ScaleInCost())
        return (
            f"{why}; the cheapest to lose: {cost.unique_blocks} cached blocks no other "
            f"replica holds, {cost.in_flight} requests in flight"
        )

    def retire_order(self, active: list[ReplicaRecord], current: _Current) -> list[ReplicaRecord]:
        """Not-READY replicas first, then out-of-date ones, then the cheapest to lose (fewest
        unique cached blocks, then fewest in flight), then the newest."""

        def key(record: ReplicaRecord) -> tuple[bool, bool, int, int, int]:
            ready, now = self.all_ready(record), current(record)
            return retire_key(record, ready=ready, current=now, costs=self.s.costs)

        return sorted(active, key=key)

    def place(
        self,
        deployment: Deployment,
        profile: EngineProfile,
        count: int,
        replaces: list[str],
        lifecycle: Lifecycle = Lifecycle.ACTIVE,
    ) -> None:
        """Place ``count`` replicas; the first ones replace ``replaces`` (consumed) in order."""
        name = deployment.name
        if held := self.held(name):
            self.unplaceable[name] = held
            return
        serials = next_serials(self.records, name, count)
        ids = [replica_id_for(name, serial) for serial in serials]
        placed = self.s.place(
            deployment,
            profile,
            ids,
            excluding=self.unusable | self.avoid.get(name, set()),
            taken=tuple(self.taken),
        )
        for serial, result in zip(serials, placed, strict=True):
            if isinstance(result, Unplaceable):
                self.unplaceable[name] = result.reason
                return
            old = replaces.pop(0) if replaces else ""
            self.add(result, profile, (lifecycle, serial), old)

    def add(
        self,
        plan: ReplicaPlan,
        profile: EngineProfile,
        how: tuple[Lifecycle, int],
        old: str,
    ) -> None:
        lifecycle, serial = how
        api_key = self.s.api_key_for(plan.replica_id)
        self.store(ReplicaRecord(plan, profile, lifecycle, serial, api_key, old))
        self.taken.append(plan)
        places = "; ".join(where(s) for s in plan.shards)
        what = (
            f"placed {lifecycle.value} replica {plan.replica_id} of {plan.deployment} on {places}"
        )
        why = placement_why(lifecycle, old)
        self.events.append(Event(plan.replica_id, what, why))

    def held(self, name: str) -> str:
        """Why ``name`` places nothing now: held by its caller, or a replica of it failed
        this round after others had (the first failure is replaced at once)."""
        held = self.s.held.get(name, "")
        streak, failed = self.s.streak.get(name, 0), self.failed.get(name, 0)
        if not held and streak and failed:
            held = held_reason(name, streak + failed, self.cfg)
        return held

    # --- rule 3: retiring ---------------------------------------------------------------

    def retire_drained(self) -> None:
        for record in self.sorted_records(Lifecycle.RETIRING):
            running = False
            for plan in record.plan.shards:
                running = self.wind_down(record, plan) or running
            if not running:
                self.set_lifecycle(record, Lifecycle.RETIRED, "none of its shards runs")

    def wind_down(self, record: ReplicaRecord, plan: ShardPlan) -> bool:
        """Drain (or stop) one shard of a retiring replica; whether it still runs."""
        shard = self.on_node(plan)
        state = ShardState.STOPPED if shard is None else _state(shard)
        why = f"replica {record.replica_id} is retiring"
        if state in _RUNNING:
            self.drain(plan.node_id, plan.shard_id, why)
        elif state is ShardState.FAILED:
            self.stop(plan.node_id, plan.shard_id, why)
        return state is not ShardState.STOPPED

    # --- rule 4: start ------------------------------------------------------------------

    def start_missing(self) -> None:
        for record in self.sorted_records(*_LIVE):
            leader = self.s.nodes.get(record.plan.leader.node_id)
            if leader is None or not leader.ready or self.waiting(record):
                continue
            for plan in record.plan.shards:
                if self.node_ready(plan.node_id) and self.needs_start(plan):
                    self.start(record, plan, leader.address)

    def needs_start(self, plan: ShardPlan) -> bool:
        """Absent or STOPPED; otherwise adopted on its node, or a copy elsewhere (rule 5)."""
        shard = self.s.shards.get(plan.shard_id)
        return shard is None or _state(shard) is ShardState.STOPPED

    def start(self, record: ReplicaRecord, plan: ShardPlan, leader_address: str) -> None:
        if why := self.refusal(record.profile):
            self.unplaceable.setdefault(record.plan.deployment, why)
            return
        message = start_message(record, plan, leader_address)
        what = f"start shard {plan.shard_id} on {plan.node_id}"
        why = (
            f"replica {record.replica_id} is {record.lifecycle.value} and its shard is not running"
        )
        event = Event(plan.shard_id, what, why)
        self.send(plan.node_id, CommandKind.START, ControlMessage(start_shard=message), event)

    # --- rule 5: fence ------------------------------------------------------------------

    def fence(self) -> None:
        for shard_id, shard in sorted(self.s.shards.items()):
            if not self.node_ready(shard.node_id) or _state(shard) is ShardState.STOPPED:
                continue
            why = self.unwanted(shard)
            if why:
                self.stop(shard.node_id, shard_id, why)

    def unwanted(self, shard: Shard) -> str:
        """Why a reported shard must not run, or "" when it may."""
        record = self.records.get(shard.replica_id)
        if record is None:
            return f"replica {shard.replica_id!r} is unknown"
        if record.lifecycle is Lifecycle.RETIRED:
            return f"replica {shard.replica_id} is retired"
        planned = {p.shard_id: p.node_id for p in record.plan.shards}
        if planned.get(shard.shard_id) != shard.node_id:
            return f"shard {shard.shard_id} is not planned on node {shard.node_id}"
        return ""

    def decision(self) -> Decision:
        return Decision(
            replicas=self.changed,
            commands=tuple(self.commands),
            pending=self.pending,
            events=tuple(self.events),
            unplaceable=self.unplaceable,
            failed=self.failed,
            crashloops=self.crashloops,
        )


@dataclass(frozen=True, slots=True)
class _Current:
    """Whether a replica runs its deployment's profile as it is now."""

    profile: str
    fingerprint: str
    replace: frozenset[str] = frozenset()  # replica ids out of date whatever they run

    def __call__(self, record: ReplicaRecord) -> bool:
        if record.replica_id in self.replace:
            return False
        return (record.plan.profile, record.plan.fingerprint) == (self.profile, self.fingerprint)


def _key(record: ReplicaRecord) -> tuple[int, str]:
    return record.serial, record.replica_id
