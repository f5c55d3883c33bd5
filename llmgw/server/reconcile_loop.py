"""The reconciler's I/O edge: rounds of :func:`~llmgw.server.core.reconciler.reconcile` against
the control plane, run every tick and as soon as something changed.

A round builds a :class:`~llmgw.server.core.reconcile_state.ReconcileInput` from what the plane
holds now: the deployments and profiles, the replica records, the shards agents report,
one :class:`NodeView` per node of the inventory (ready while its agent is connected and
heartbeating; a node NOT_READY since it was last seen ready, and one the store remembers
that has not come back since this server started since the start, on the monotonic clock)
and the commands in flight (kept in memory only: a restarted server sends them again,
which agents take as no-ops for an engine already running the same command).

Then, in this order, so that a kill -9 at any point never loses a placement that engines
may already run:

1. the changed records are written to the store (one transaction) and published as
   ``replica`` / ``replica_removed`` Watch events;
2. the commands are sent through the agent service; one that cannot be sent (the agent
   is not connected) is dropped from the in-flight table, so the next round tries again;
3. each of the reconciler's events is appended to the audit log with actor
   ``reconciler``, action ``reconcile``, the replica or shard as target and "WHAT: WHY"
   as result.

**Scale-in costs**: when a deployment has more ACTIVE replicas than its count, the round's
input carries what retiring each of its replicas would cost
(``llmgw.server.state.scalein``: its cached prefix blocks no other replica of the
deployment holds, from the plane's KV block store, and its requests in flight, from the
``in_flight`` function the server passes: every gateway's figures), so the reconciler
retires the cheapest.

**Unplaceable replicas** are made visible in the audit log: when the reason a deployment
lacks replicas changes, one record (action ``unplaceable``, target ``deployment/NAME``,
the reason as result) is appended and the reason is logged; it is not repeated every
round. :attr:`ReconcileLoop.unplaceable` holds the current reasons, and each round hands them
(with the deployments a crash-loop back-off holds) to the plane's deployment statuses
(``llmgw.server.state.deploystatus``), which publishes those that changed.

**Operator requests**: the replicas an operator drained (``DesiredState.retire``) and those
a node drain moves (``DesiredState.replace``) go into each round's input; once such a
replica is no longer ACTIVE or SURGE its request is forgotten. They are stored with the
action that made them, so a server killed before the round that carries one out does it
after its restart (a drained replica, not one of its own choice, is retired).

**Engine ports** come from ``port_range`` (``llmgw server --engine-ports``); it is not
stored: a server restarted with another range places new replicas in it and leaves the
ones it already placed on their ports.

**Ports held by other processes**: an agent refuses a shard whose engine port another
process holds (``ShardStatus.port_in_use``); for ``BUSY_PORT_S`` that port counts as taken
on that node and the nodes sharing its address, so the replacement gets another one.

A round that fails (the store, a bug) is logged and the next tick tries again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping

from llmgw.api.llmgw.v1 import ControlMessage, NodeState
from llmgw.engineports import DEFAULT_ENGINE_PORTS, PortRange, format_port_range
from llmgw.server.core.fingerprint import profile_fingerprint, remembered
from llmgw.server.core.reconcile_state import (
    CrashLoop,
    Decision,
    Lifecycle,
    NodeView,
    PendingCommand,
    ReconcileConfig,
    ReconcileInput,
    ReplicaRecord,
    crash_delay,
    held_reason,
)
from llmgw.server.core.reconciler import reconcile
from llmgw.server.errors import Deposed, StoreUnwritable
from llmgw.server.state.placer import LazyPlacer
from llmgw.server.state.plane import ControlPlane, node_address
from llmgw.server.state.scalein import InFlightFn, no_in_flight, scale_in_costs
from llmgw.server.state.store import now_ms
from llmgw.server.state.storeschema import AuditRecord

__all__ = ["ACTOR", "ReconcileLoop", "SendFn", "api_key_for"]

log = logging.getLogger(__name__)

ACTOR = "reconciler"
"""The actor of the audit records a round appends."""

SendFn = Callable[[str, ControlMessage], Awaitable[bool]]
"""Sends a command to a node's agent; False when it is not connected (AgentService.send)."""


BUSY_PORT_S = 600.0
"""How long a port an agent refused (another process held it) is kept out of placement."""


def api_key_for(replica_id: str) -> str:
    """A fresh secret API key for a new replica (its engines require it as a bearer token).

    It never starts with "-": an engine's argument parser would read ``--api-key -x…`` as
    a flag with no value."""
    return "llmgw-" + secrets.token_urlsafe(24)


class ReconcileLoop:
    """Runs reconciliation rounds against ``plane``, sending commands with ``send``."""

    def __init__(
        self,
        plane: ControlPlane,
        send: SendFn,
        *,
        config: ReconcileConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        port_range: PortRange = DEFAULT_ENGINE_PORTS,
        in_flight: InFlightFn = no_in_flight,
    ) -> None:
        self.plane = plane
        self.in_flight = in_flight
        self.send = send
        self.config = config or ReconcileConfig()
        self.clock = clock
        self.port_range = port_range
        self.pending: dict[str, PendingCommand] = {}
        self.unplaceable: dict[str, str] = {}  # deployment → why some replicas have no place
        self._started = clock()
        self._down_since: dict[str, float] = {}  # node id → monotonic time it was seen down
        self.failures: dict[str, tuple[int, float]] = {}  # deployment → (in a row, last at)
        self.crashloops: dict[str, CrashLoop] = {}  # replica id → its loop (memory only)
        self.busy_ports: dict[tuple[str, int], float] = {}  # (node, port) → held until
        self._wakeup = asyncio.Event()
        self._lock = asyncio.Lock()
        plane.reconcile_soon = self.poke

    def poke(self) -> None:
        """Run a round soon (on the loop's next turn), not only at the next tick."""
        self._wakeup.set()

    async def run(self, every_s: float) -> None:
        """Run a round every ``every_s`` seconds and whenever poked, until cancelled."""
        log.info("reconciler: engine ports %s", format_port_range(self.port_range))
        while True:
            try:
                async with asyncio.timeout(every_s):
                    await self._wakeup.wait()
            except TimeoutError:
                pass
            self._wakeup.clear()
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Deposed as exc:  # the lease ran out: the term ends, nothing was stored
                log.warning("reconciliation round not stored: %s", exc)
            except StoreUnwritable as exc:  # logged by the store's health; nothing was sent
                log.debug("reconciliation round not stored (%s); trying again next tick", exc)
            except Exception:  # one failed round must not end reconciliation
                log.exception("reconciliation round failed; trying again next tick")

    async def round(self) -> Decision:
        """One round: decide, store, send, audit. Rounds never overlap."""
        async with self._lock:
            state = self.snapshot()
            decision = reconcile(state)
            self._count_failures(decision, state.now)
            self.crashloops = dict(decision.crashloops)
            self.plane.crash_looping = frozenset(
                rid for rid, loop in self.crashloops.items() if not loop.restarted
            )
            # Before the records show, so their statuses change once, with the reason.
            held = self._held(state.now)
            self.plane.statuses.set_verdicts(decision.unplaceable, held.keys())
            await self.plane.save_replicas(decision.replicas)
            await self.plane.desired.keep_requests(_live(self.plane.replicas))
            self.pending = dict(decision.pending)
            for node_id, message in decision.commands:
                await self._send(node_id, message)
            await self._audit(decision)
            self.plane.publish_statuses()
            return decision

    def snapshot(self) -> ReconcileInput:
        """The reconciler's input, from the plane as it is now."""
        plane = self.plane
        now = self.clock()
        deployments = dict(plane.desired.deployments)
        return ReconcileInput(
            deployments=deployments,
            profiles=dict(plane.desired.profiles),
            fingerprint=remembered(profile_fingerprint),
            place=LazyPlacer(plane, self.port_range, now, self._busy(now)),
            replicas=dict(plane.replicas),
            shards=dict(plane.inventory.shards),
            nodes=self._nodes(now),
            pending=dict(self.pending),
            now=now,
            api_key_for=api_key_for,
            config=self.config,
            retire=frozenset(plane.desired.retire),
            replace=frozenset(plane.desired.replace),
            held=self._held(now),
            streak=self._streak(now),
            crashloops=dict(self.crashloops),
            costs=scale_in_costs(deployments, plane.replicas, plane.kv_blocks, self.in_flight),
        )

    def _busy(self, now: float) -> frozenset[tuple[str, int]]:
        """Engine ports another process holds on a node, as agents refused them lately."""
        for shard in self.plane.inventory.shards.values():
            port = shard.status.port_in_use if shard.status is not None else 0
            if port:
                self.busy_ports[(shard.node_id, port)] = now + BUSY_PORT_S
        self.busy_ports = {k: until for k, until in self.busy_ports.items() if until > now}
        return frozenset(self.busy_ports)

    def _count_failures(self, decision: Decision, now: float) -> None:
        for name, failed in decision.failed.items():
            count, last = self.failures.get(name, (0, now))
            if now - last > self.config.crash_reset_s:
                count = 0
            self.failures[name] = (count + failed, now)

    def _held(self, now: float) -> dict[str, str]:
        """Deployments whose next placement waits (failed replicas in a row), and why."""
        return {
            name: held_reason(name, count, self.config)
            for name, (count, last) in self.failures.items()
            if now < last + crash_delay(count, self.config)
        }

    def _streak(self, now: float) -> dict[str, int]:
        """Failed replicas in a row, by deployment, not yet forgiven."""
        reset = self.config.crash_reset_s
        return {n: count for n, (count, last) in self.failures.items() if now - last <= reset}

    def _nodes(self, now: float) -> dict[str, NodeView]:
        inventory = self.plane.inventory
        views = {}
        for node_id, record in inventory.nodes.items():
            state = inventory.state(record, now)
            ready = state is not NodeState.NOT_READY
            if ready:
                self._down_since.pop(node_id, None)
            else:  # first seen down now, or (restored, never back) since this server started
                first = self._started if record.registered_ms == 0 else now
                self._down_since.setdefault(node_id, first)
            views[node_id] = NodeView(
                node_id=node_id,
                ready=ready,
                cordoned=record.cordoned,
                not_ready_since=None if ready else self._down_since[node_id],
                address=node_address(record),
            )
        return views

    async def _send(self, node_id: str, message: ControlMessage) -> None:
        shard_id = _shard_of(message)
        try:
            sent = await self.send(node_id, message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken stream: its agent reconnects, we resend then
            log.warning("node %s: command for shard %s not sent (%s)", node_id, shard_id, exc)
            sent = False
        if not sent:
            self.pending.pop(shard_id, None)

    async def _audit(self, decision: Decision) -> None:
        at = now_ms()
        records = [
            AuditRecord(at, ACTOR, "reconcile", e.subject, f"{e.what}: {e.why}")
            for e in decision.events
        ]
        for name, why in sorted(decision.unplaceable.items()):
            if self.unplaceable.get(name) != why:
                log.warning("deployment %s: replicas cannot be placed: %s", name, why)
                records.append(AuditRecord(at, ACTOR, "unplaceable", f"deployment/{name}", why))
        for name in sorted(self.unplaceable.keys() - decision.unplaceable.keys()):
            log.info("deployment %s: every replica it lacked is placed now", name)
        self.unplaceable = dict(decision.unplaceable)
        await self.plane.audit_all(records)


def _live(records: Mapping[str, ReplicaRecord]) -> set[str]:
    return {k for k, r in records.items() if r.lifecycle in (Lifecycle.ACTIVE, Lifecycle.SURGE)}


def _shard_of(message: ControlMessage) -> str:
    for command in (message.start_shard, message.stop_shard, message.drain_shard):
        if command is not None:
            return command.shard_id
    return ""
