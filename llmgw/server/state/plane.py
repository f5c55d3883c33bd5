"""The control plane's state and its effects: inventory + store + watch fan-out.

The services call this; it keeps the inventory, the desired state (``desired``: profiles and
deployments), the tenants' gateway keys (``tenant_keys``: ``state.tenantkeys``) and their
usage not yet stored (``usage``: ``state.usage``), writes what must survive a kill to the
store before answering, and publishes every change to watchers. Snapshots carry the
deployments and the audit log's most recent records. A periodic ``tick`` marks silent nodes
NOT_READY and flushes heartbeat times to the store in one batch. Time the server did not run
(stopped, starved: a tick at least ``STALL_S`` later than the shortest gap between ticks
seen) does not count toward a heartbeat's age: its heartbeats sit unread in its sockets.

After a start, :meth:`ControlPlane.agents_back` waits (at most ``WARMUP_S``) until every
node the store remembers has registered again: until then the replicas on the others look
not READY although their engines serve, and a router feed's first snapshot waits for it
(bench/chaos.py saw gateways answer 503 for a model whose agents were not back).

It holds the replica records the reconciler decided on (``server.reconcile_loop`` writes them
through :meth:`ControlPlane.save_replicas`), each one not RETIRED shown as a ``Replica``: its
state from its shards on their planned nodes (READY only when every shard is), its endpoint
``http://ADDRESS:PORT`` of the leader, ``out_of_date`` when its fingerprint is not its
deployment's profile's now. Every change that may need
a reconciliation round (a registration, a shard report, a node lost or cordoned, an apply
or delete) calls :attr:`ControlPlane.reconcile_soon`.

``kv_blocks`` holds the KV cache blocks of each replica as its leader's agent reports them
(``state.kvblocks``); the plane drops a replica's blocks when it is RETIRED, when its leader
stops, fails or starts afresh, and when its node's stream ends or it registers again. A node
that only missed heartbeats keeps them: once it speaks again its stream carries every change
since, in order, while nothing would send back blocks dropped then (bench/chaos.py).

Every agent is told the cluster id of the store (``Registered.cluster_id``). A registration
whose ``cluster_id`` names another cluster and that reports shards is not adopted: its
shards are kept apart on the node (``Node.unadopted_shards``), never in the inventory, so
the reconciler neither stops them nor places anything on the node, which is NOT_READY
saying why until its agent registers with this cluster's id (``llmgw.agent.cluster``). A
stored row that cannot be read stops :meth:`ControlPlane.load`, naming it. ``kv_follow``
holds each engine's KV event subscriber counters as its agent's heartbeats last reported
them (``llmgw.server.state.kvfollow``), for the server's ``/metrics``.

While the state database cannot be written (a full or read-only disk: ``state.storehealth``),
the plane keeps in memory what no caller waits for (heartbeat times, registrations, audit
records) and :meth:`ControlPlane.flush` writes it once writes work again, trying with capped,
jittered backoff (and, with nothing to write, a probe write, so that ``/healthz`` turns
healthy by itself). What a caller waits for (an apply, a cordon, a round's replica records)
is written first and shown after; a failed write raises StoreUnwritable, changing nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from grpclib.const import Status

from llmgw.api.llmgw.v1 import (
    AuditEvent,
    Cluster,
    Heartbeat,
    Leadership,
    NodeInfo,
    Register,
    Replica,
    Shard,
    ShardState,
    ShardStatus,
    WatchEvent,
)
from llmgw.engineports import DEFAULT_ENGINE_PORTS, PortRange
from llmgw.protocol import read_shard_state
from llmgw.server.core.deployment_status import replica_state
from llmgw.server.core.plan import ShardPlan
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord
from llmgw.server.errors import ActionRefused, StoreUnwritable, UnknownNode
from llmgw.server.state.deploystatus import DeploymentBoard
from llmgw.server.state.desired import DesiredState
from llmgw.server.state.encoded import freeze_node_info
from llmgw.server.state.history import History
from llmgw.server.state.inventory import Inventory, InventoryConfig, NodeRecord
from llmgw.server.state.kvblocks import DecodedKvDelta, KvBlocks, leader_replica
from llmgw.server.state.kvfollow import KvFollowBoard
from llmgw.server.state.statefile import unreadable_row
from llmgw.server.state.store import Store, now_ms
from llmgw.server.state.storehealth import WriteRetry
from llmgw.server.state.storeschema import AuditRecord, StoredNode
from llmgw.server.state.tenantkeys import TenantKeyBook
from llmgw.server.state.usage import UsageLedger
from llmgw.server.state.watch import WatchHub

log = logging.getLogger(__name__)

RECENT_AUDIT = 100
"""How many of the newest audit records snapshots carry (``Cluster.events``)."""
STALL_S = 1.0
"""A tick this much later than usual means the server did not run meanwhile."""
WARMUP_S = 10.0
"""After a start, how long `ControlPlane.agents_back` waits at most for remembered nodes."""


class ControlPlane:
    """Inventory, persistence and watch fan-out, behind one async API."""

    def __init__(self, store: Store, config: InventoryConfig | None = None) -> None:
        self.store = store
        self.inventory = Inventory(config)
        self.hub = WatchHub(self.snapshot)
        self.desired = DesiredState(store, self.hub)
        self.statuses = DeploymentBoard(self.inventory, self.desired.fingerprint)
        self.desired.shown = self.statuses.shown
        self.history = History(store)  # state changes of shards and nodes (describe)
        self.tenant_keys = TenantKeyBook(store)  # every live tenant key (the router feed's)
        self.usage = UsageLedger()
        self._seen: dict[str, int] = {}  # node id → last heartbeat ms not yet in the store
        self._unsaved_nodes: set[str] = set()  # registrations the store could not take yet
        self._unsaved_audit: list[AuditRecord] = []  # audit records it could not take yet
        self._retry = WriteRetry()  # when flush may try again after a failed write
        self._ready: set[str] = set()  # nodes whose ever-READY mark may not be stored yet
        self._stored_ready: dict[str, bool] = {}  # node id → ever-READY as the store has it
        self._recent: deque[AuditEvent] = deque(maxlen=RECENT_AUDIT)
        self.replicas: dict[str, ReplicaRecord] = {}  # every record, RETIRED ones too
        self.reconcile_soon: Callable[[], None] = _nothing  # set by the reconcile loop
        self.engine_ports: PortRange = DEFAULT_ENGINE_PORTS  # --engine-ports, for dry runs
        self.leadership: Callable[[], Leadership] = Leadership  # who leads (app sets it)
        self.crash_looping: frozenset[str] = frozenset()  # set by the loop: waiting replicas
        self.kv_blocks = KvBlocks()
        self.kv_follow = KvFollowBoard()  # agents' KV event counters, per (node, shard)
        self._last_tick: float | None = None
        self._tick_gap = float("inf")  # the shortest time between two ticks seen
        self._started = time.monotonic()
        self._agents_back = asyncio.Event()  # every remembered node registered since start
        self._agents_back.set()  # none remembered until `load`

    async def load(self) -> None:
        """Restore desired state, tenant keys, the audit tail and every node remembered."""
        self.inventory.cluster_id = self.cluster_id
        await self.desired.load()
        await self.tenant_keys.load()
        self.replicas.update((r.replica_id, r) for r in await self.store.load_replicas())
        self.statuses.track(self.replicas.values())
        self._recent.extend(_audit_event(r) for r in await self.store.recent_audit(RECENT_AUDIT))
        for stored in await self.store.load_nodes():
            try:
                info = freeze_node_info(NodeInfo.parse(stored.info), wire=stored.info)
            except Exception as exc:  # whatever the row holds, it is named, never dropped
                raise unreadable_row(self.store.path, "nodes", stored.node_id, exc) from exc
            if info.node_id != stored.node_id:
                why = f"it holds the registration of node {info.node_id!r}"
                raise unreadable_row(self.store.path, "nodes", stored.node_id, why)
            self.inventory.restore(
                stored.node_id,
                info,
                cordoned=stored.cordoned,
                first_seen_ms=stored.first_seen_ms,
                ever_ready=stored.ever_ready,
            )
        log.info(
            "cluster %s: restored %d nodes from the store",
            self.cluster_id,
            len(self.inventory.nodes),
        )
        self._started = time.monotonic()
        self._agents_back.clear()
        self._note_agents_back()

    def _note_agents_back(self) -> None:
        if all(record.connected for record in self.inventory.nodes.values()):
            self._agents_back.set()

    async def agents_back(self, timeout_s: float = WARMUP_S) -> None:
        """Return once every node remembered at the start has registered again, or
        ``timeout_s`` after the start (a node that never comes back must not hold anyone)."""
        left = self._started + timeout_s - time.monotonic()
        if left > 0 and not self._agents_back.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._agents_back.wait()

    def snapshot(self, revision: int | None = None) -> Cluster:
        rev = self.hub.revision if revision is None else revision
        cluster = self.inventory.cluster(revision=rev, now_ms=now_ms(), now_mono=time.monotonic())
        cluster.deployments = [
            self.statuses.shown(d, remember=False)
            for _, d in sorted(self.desired.deployments.items())
        ]
        cluster.replicas = [
            self.replica_view(r)
            for _, r in sorted(self.replicas.items())
            if r.lifecycle is not Lifecycle.RETIRED
        ]
        cluster.events = list(self._recent)
        cluster.cluster_id, cluster.leadership = self.inventory.cluster_id, self.leadership()
        return cluster

    # --- replicas --------------------------------------------------------------------

    def replica_view(self, record: ReplicaRecord) -> Replica:
        """The operator API's view of a replica record."""
        plan = record.plan
        leader = self.inventory.nodes.get(plan.leader.node_id)
        address = node_address(leader) if leader is not None else plan.leader.node_id
        return Replica(
            replica_id=plan.replica_id,
            deployment=plan.deployment,
            profile=plan.profile,
            model=record.profile.served_model_name,
            endpoint=f"http://{_host(address)}:{plan.leader.port}",
            state=self._replica_state(record),
            shard_ids=[p.shard_id for p in plan.shards],
            out_of_date=plan.fingerprint != self.desired.fingerprint(plan.profile)
            or self._profile_changed(record),
        )

    def _replica_state(self, record: ReplicaRecord) -> ShardState:  # FAILED in a crash loop
        state = replica_state(record, [self._on_node(p) for p in record.plan.shards])
        looping = record.replica_id in self.crash_looping and state is not ShardState.READY
        return ShardState.FAILED if looping else state

    def _profile_changed(self, record: ReplicaRecord) -> bool:
        deployment = self.desired.deployments.get(record.plan.deployment)
        return deployment is not None and deployment.profile != record.plan.profile

    def _on_node(self, plan: ShardPlan) -> Shard | None:
        shard = self.inventory.shards.get(plan.shard_id)
        return shard if shard is not None and shard.node_id == plan.node_id else None

    async def save_replicas(self, changed: Mapping[str, ReplicaRecord]) -> None:
        """Store changed records durably, then make them visible and publish them."""
        if not changed:
            return
        await self.store.save_replicas(changed.values())
        self.replicas.update(changed)
        for replica_id, record in sorted(changed.items()):
            if record.lifecycle is Lifecycle.RETIRED:
                self.kv_blocks.drop(replica_id, "the replica is retired")
                self.hub.publish(WatchEvent(replica_removed=replica_id))
            else:
                self.hub.publish(WatchEvent(replica=self.replica_view(record)))
        self.publish_statuses(self.statuses.track(changed.values()))

    def _publish_replica_of(self, shard: Shard) -> None:
        record = self.replicas.get(shard.replica_id)
        if record is not None and record.lifecycle is not Lifecycle.RETIRED:
            self.hub.publish(WatchEvent(replica=self.replica_view(record)))
            self.publish_statuses([record.plan.deployment])

    def publish_statuses(self, names: Iterable[str] | None = None) -> None:
        """Publish a ``deployment`` event for each of ``names`` (None: every deployment)
        whose status changed (``llmgw.server.state.deploystatus``)."""
        for deployment in self.statuses.changed(self.desired.deployments, names):
            self.hub.publish(WatchEvent(deployment=deployment))

    # --- agents ----------------------------------------------------------------------

    async def register(self, node: NodeInfo, message: Register, *, peer: str) -> int:
        """Accept an agent (``node`` is ``message.node``, checked); persists the node,
        adopts the shards it reports, and returns the new connection's number."""
        at = now_ms()
        connection, record = self.inventory.register(
            node, message.protocol_version, peer=peer, now_ms=at, now_mono=time.monotonic()
        )
        # Before any await: a reconciliation round must never see the node READY without
        # the shards it runs (it would start them again), nor with shards it no longer has.
        adopted = self._adoptable(node.node_id, message)
        if not adopted:
            self.inventory.hold_unadopted(record, message.cluster_id, message.shards)
        reported = {s.shard_id for s in message.shards} if adopted else set()
        gone = [s.shard_id for s in self.inventory.shards_of(node.node_id)]
        gone = [shard_id for shard_id in gone if shard_id not in reported]
        for shard_id in gone:
            del self.inventory.shards[shard_id]
        self.kv_blocks.drop_node(node.node_id, "its agent registered again (a full copy follows)")
        self.kv_follow.drop_node(node.node_id)  # its first heartbeat reports every engine
        shards = [
            self.inventory.report_shard(node.node_id, s, now_ms=at)
            for s in (message.shards if adopted else ())
        ]
        try:
            await self.store.save_node(self._stored_node(record, at))
        except StoreUnwritable:  # the agent is served all the same; flush stores it later
            self._unsaved_nodes.add(node.node_id)
        self._publish_node(record)
        for shard_id in gone:
            self.hub.publish(WatchEvent(shard_removed=shard_id))
        self._publish_shards(shards)
        self.reconcile_soon()
        log.info("node %s registered from %s (%d GPUs)", node.node_id, peer, len(node.gpus))
        self.history.note(f"node/{node.node_id}", "Registered", f"from {peer}", actor="server")
        self._note_agents_back()
        return connection

    @property
    def cluster_id(self) -> str:
        """This server's cluster id, as its database holds it."""
        return self.store.cluster_id

    def _adoptable(self, node_id: str, message: Register) -> bool:
        """Whether the shards a registration reports are this cluster's to adopt: yes
        unless the agent remembers another cluster and runs engines for it."""
        theirs = message.cluster_id
        if not theirs or theirs == self.cluster_id or not message.shards:
            return True
        log.warning(
            "node %s runs %d engine(s) of cluster %s, not of this cluster %s: they are not "
            "adopted and not stopped, and the node takes no new work, until its agent is "
            "restarted with --join-cluster %s",
            node_id,
            len(message.shards),
            theirs,
            self.cluster_id,
            self.cluster_id,
        )
        return False

    def heartbeat(self, node_id: str, connection: int, beat: Heartbeat) -> bool:
        """Apply a heartbeat; False when this connection no longer owns the node."""
        at = now_ms()
        delta, changed = self.inventory.heartbeat(
            node_id, connection, beat, now_ms=at, now_mono=time.monotonic()
        )
        if delta is None:
            return False
        if node_id not in self._seen and node_id not in self._ready:
            self._ready.add(node_id)  # its first heartbeat since the last flush: ever READY
        self._seen[node_id] = at
        if beat.kv_follow:
            self.kv_follow.update(node_id, beat.kv_follow)
        if changed:
            self._publish_node(self.inventory.nodes[node_id])
        else:
            self.hub.publish(WatchEvent(node_telemetry=delta))
        return True

    def shard_status(self, node_id: str, status: ShardStatus) -> None:
        record = self.inventory.nodes.get(node_id)
        if record is not None and record.unadopted_cluster:
            record.unadopted[status.shard_id] = status  # another cluster's: still not ours
            self._publish_node(record)
            return
        before = self.inventory.shards.get(status.shard_id)
        shard = self.inventory.report_shard(node_id, status, now_ms=now_ms())
        self.history.shard_changed(node_id, before, shard)
        self.kv_blocks.shard_state(shard.shard_id, read_shard_state(status.state))
        self.kv_follow.shard_state(node_id, shard.shard_id, read_shard_state(status.state))
        self._publish_shards([shard])
        self.reconcile_soon()

    def _publish_shards(self, shards: Iterable[Shard]) -> None:
        for shard in shards:
            self.hub.publish(WatchEvent(shard=shard))
            self._publish_replica_of(shard)

    def kv_delta(self, node_id: str, connection: int, delta: DecodedKvDelta) -> None:
        """Apply a checked KV delta from ``node_id``'s stream number ``connection`` to its
        replica's blocks (ignored, and counted, unless it is a live leader's on the stream
        that owns the node)."""
        record = self.inventory.nodes.get(node_id)
        if record is None or record.connection != connection:
            self.kv_blocks.ignore()
            return
        replica_id = leader_replica(delta.shard_id, node_id, self.inventory.shards, self.replicas)
        self.kv_blocks.apply(node_id, replica_id, delta)

    def disconnect(self, node_id: str, connection: int, reason: str) -> None:
        record = self.inventory.disconnect(node_id, connection, reason)
        if record is not None:
            log.warning("node %s is NOT_READY: %s", node_id, reason)
            self.history.node_down(node_id, reason)
            self.kv_blocks.drop_node(node_id, f"its node is NOT_READY: {reason}")
            self.kv_follow.drop_node(node_id)
            self._publish_node(record)
            self.reconcile_soon()

    # --- operators -------------------------------------------------------------------

    async def set_cordoned(self, node_id: str, cordoned: bool, *, actor: str) -> NodeRecord:
        """Cordon or uncordon a node, durably (stored before it shows), with an audit record."""
        if node_id not in self.inventory.nodes:
            raise UnknownNode(node_id)
        if node_id in self._unsaved_nodes:  # its row may not be there yet: write it first
            await self.store.save_node(self._stored_node(self.inventory.nodes[node_id], now_ms()))
            self._unsaved_nodes.discard(node_id)
        await self.store.set_cordoned(node_id, cordoned)
        record = self.inventory.set_cordoned(node_id, cordoned)
        self._publish_node(record)
        self.reconcile_soon()
        await self.audit(actor, "cordon" if cordoned else "uncordon", node_id, "ok")
        return record

    async def audit(self, actor: str, action: str, target: str, result: str) -> None:
        """Append an audit record and publish it."""
        await self.audit_all([AuditRecord(now_ms(), actor, action, target, result)])

    async def audit_all(self, records: Sequence[AuditRecord]) -> None:
        """Append several audit records (one transaction) and publish each; kept for
        :meth:`flush` when the store cannot take them now (the change they record is done)."""
        if not records:
            return
        try:
            await self.store.append_audits(records)
        except StoreUnwritable:
            self._unsaved_audit.extend(records)
        for record in records:
            event = _audit_event(record)
            self._recent.append(event)
            self.hub.publish(WatchEvent(audit=event))

    # --- periodic --------------------------------------------------------------------

    async def tick(self) -> None:
        """Mark silent nodes NOT_READY and flush heartbeat times to the store."""
        now = time.monotonic()
        self._credit_stall(now)
        expired = self.inventory.expire(now)
        for record in expired:
            log.warning("node %s is NOT_READY: %s", record.info.node_id, record.reason)
            self.history.node_down(record.info.node_id, record.reason)
            self._publish_node(record)
        if expired:
            self.reconcile_soon()
        await self.flush()
        await self.prune_never_ready()

    def _credit_stall(self, now: float) -> None:
        """Leave out of every heartbeat's age the time since the last tick beyond the usual."""
        last, self._last_tick = self._last_tick, now
        if last is None:
            return
        self._tick_gap = min(self._tick_gap, now - last)
        stall = now - last - self._tick_gap
        if stall < STALL_S:
            return
        log.warning("the server did not run for %.1fs: not counted as node silence", stall)
        for record in self.inventory.nodes.values():
            if record.last_heartbeat_mono is not None:
                record.last_heartbeat_mono += stall

    async def flush(self, *, now: bool = False) -> None:
        """Write what is only in memory (registrations, heartbeat times, audit records, the
        event history); while the store cannot take writes, try again at most as the backoff
        allows (``now``: regardless), and keep it. Never raises StoreUnwritable."""
        await self.history.flush(now=now)
        at = time.monotonic()
        if not now and not self._retry.due(at):
            return
        try:
            await self._write_unsaved()
        except StoreUnwritable:
            self._retry.failed(at)
        else:
            self._retry.succeeded()

    async def _write_unsaved(self) -> None:
        if not (self._seen or self._unsaved_nodes or self._unsaved_audit or self._ready):
            if self.store.health.problem is not None:
                await self.store.probe_write()  # nothing to write: does it take writes?
            return
        for node_id in sorted(self._unsaved_nodes):
            record = self.inventory.nodes[node_id]
            await self.store.save_node(self._stored_node(record, now_ms()))
            self._unsaved_nodes.discard(node_id)
        seen, self._seen = self._seen, {}
        try:
            await self.store.touch_nodes(seen.items())
        except StoreUnwritable:
            self._seen = {**seen, **self._seen}  # newer beats since win
            raise
        audit, self._unsaved_audit = self._unsaved_audit, []
        try:
            await self.store.append_audits(audit)
        except StoreUnwritable:
            self._unsaved_audit[:0] = audit
            raise
        ready, self._ready = self._ready, set()
        for node_id in sorted(ready):
            if self._stored_ready.get(node_id, False):
                continue
            try:
                await self.store.mark_ever_ready(node_id)
            except StoreUnwritable:
                self._ready |= {n for n in ready if not self._stored_ready.get(n, False)}
                raise
            self._stored_ready[node_id] = True

    @staticmethod
    def _stored_node(record: NodeRecord, last_seen_ms: int) -> StoredNode:
        info = record.info
        return StoredNode(
            info.node_id,
            bytes(info),
            record.cordoned,
            record.first_seen_ms,
            last_seen_ms,
            record.ever_ready,
        )

    async def prune_never_ready(self) -> list[str]:
        """Forget nodes that registered, never beat and are gone (``Inventory.never_ready``)."""
        after_ms = int(self.inventory.config.never_ready_prune_s * 1000)
        pruned = self.inventory.never_ready(now_ms(), after_ms)
        for node_id in pruned:
            await self._forget_node(node_id)
            log.info(
                "node %s pruned: it registered but never became READY in %gs",
                node_id,
                self.inventory.config.never_ready_prune_s,
            )
        return pruned

    async def delete_node(self, node_id: str, *, force: bool) -> str:
        """Forget a node an operator deleted; raises ActionRefused (why) or UnknownNode.

        Refused while its agent is connected (it would register again at once), and while
        shards the server thinks run are on it unless ``force``: their replicas are then
        replaced elsewhere by the reconciler, as for a node gone past its grace."""
        record = self.inventory.nodes.get(node_id)
        if record is None:
            raise UnknownNode(node_id)
        if record.connected:
            raise ActionRefused(
                Status.FAILED_PRECONDITION,
                f"node {node_id} is connected (agent at {record.peer or 'an unknown address'}): "
                "stop its agent first, or drain it with 'llmgw drain-node'",
            )
        running = self._running_on(node_id)
        if running and not force:
            raise ActionRefused(
                Status.FAILED_PRECONDITION,
                f"node {node_id} has replicas the server thinks are running: "
                f"{', '.join(running)}; drain them first, or give --force to forget the node "
                "and have them placed elsewhere",
            )
        await self._forget_node(node_id)
        if running:
            return f"node {node_id} deleted; replicas {', '.join(running)} will be placed elsewhere"
        return f"node {node_id} deleted"

    def _running_on(self, node_id: str) -> list[str]:
        """The live replicas with a shard planned on ``node_id`` or reported there running."""
        ended = (ShardState.STOPPED, ShardState.FAILED)
        replicas = {
            record.replica_id
            for record in self.replicas.values()
            if record.lifecycle is not Lifecycle.RETIRED
            and any(plan.node_id == node_id for plan in record.plan.shards)
        }
        replicas.update(
            shard.replica_id or shard.shard_id
            for shard in self.inventory.shards_of(node_id)
            if read_shard_state(shard.status.state if shard.status else 0) not in ended
        )
        return sorted(replicas)

    async def _forget_node(self, node_id: str) -> None:
        """Remove a disconnected node from the store, the inventory and every watcher."""
        await self.store.delete_node(node_id)
        gone = self.inventory.remove(node_id)
        self._seen.pop(node_id, None)
        self._stored_ready.pop(node_id, None)
        self.kv_blocks.drop_node(node_id, "its node was deleted")
        self.kv_follow.drop_node(node_id)
        for shard_id in gone:
            self.hub.publish(WatchEvent(shard_removed=shard_id))
        self.hub.publish(WatchEvent(node_removed=node_id))
        self.publish_statuses(self.statuses.on_node(node_id))
        self.reconcile_soon()
        self._note_agents_back()

    def _publish_node(self, record: NodeRecord) -> None:
        node = self.inventory.node_view(record, time.monotonic())
        self.hub.publish(WatchEvent(node=node))
        self.publish_statuses(self.statuses.on_node(record.info.node_id))


def _audit_event(record: AuditRecord) -> AuditEvent:
    return AuditEvent(
        at_unix_ms=record.at_ms,
        actor=record.actor,
        action=record.action,
        target=record.target,
        result=record.result,
    )


def _nothing() -> None:
    pass


def node_address(record: NodeRecord) -> str:
    """Where a node is reached: its management address, else the address its agent
    connected from, else its hostname."""
    info = record.info
    peer_host = record.peer.rpartition(":")[0].strip("[]") if record.peer else ""
    return info.management_address or peer_host or info.hostname or info.node_id


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address
