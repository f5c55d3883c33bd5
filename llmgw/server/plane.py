"""The control plane's state and its effects: inventory + store + watch fan-out.

The services call this; it keeps the inventory and the desired state (``desired``: profiles
and deployments), writes what must survive a kill to the store before answering, and
publishes every change to watchers. Snapshots carry the deployments and the audit log's
most recent records. A periodic ``tick`` marks
silent nodes NOT_READY and flushes heartbeat times to the store in one batch.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from llmgw.api.llmgw.v1 import (
    AuditEvent,
    Cluster,
    Heartbeat,
    NodeInfo,
    Register,
    ShardStatus,
    WatchEvent,
)
from llmgw.server.desired import DesiredState
from llmgw.server.encoded import freeze_node_info
from llmgw.server.inventory import Inventory, InventoryConfig, NodeRecord
from llmgw.server.store import AuditRecord, Store, StoredNode, now_ms
from llmgw.server.watch import WatchHub

log = logging.getLogger(__name__)

RECENT_AUDIT = 100
"""How many of the newest audit records snapshots carry (``Cluster.events``)."""


class ControlPlane:
    """Inventory, persistence and watch fan-out, behind one async API."""

    def __init__(self, store: Store, config: InventoryConfig | None = None) -> None:
        self.store = store
        self.inventory = Inventory(config)
        self.hub = WatchHub(self.snapshot)
        self.desired = DesiredState(store, self.hub)
        self._seen: dict[str, int] = {}  # node id → last heartbeat ms not yet in the store
        self._recent: deque[AuditEvent] = deque(maxlen=RECENT_AUDIT)

    async def load(self) -> None:
        """Restore the desired state, the audit log's tail and every node the store
        remembers (NOT_READY until their agents return)."""
        await self.desired.load()
        self._recent.extend(_audit_event(r) for r in await self.store.recent_audit(RECENT_AUDIT))
        for stored in await self.store.load_nodes():
            try:
                info = freeze_node_info(NodeInfo.parse(stored.info), wire=stored.info)
            except Exception as exc:  # a row we cannot read must not stop the server
                log.error("node %s: stored registration unreadable (%s)", stored.node_id, exc)
                continue
            self.inventory.restore(
                stored.node_id, info, cordoned=stored.cordoned, first_seen_ms=stored.first_seen_ms
            )
        log.info("restored %d nodes from the store", len(self.inventory.nodes))

    def snapshot(self, revision: int | None = None) -> Cluster:
        rev = self.hub.revision if revision is None else revision
        cluster = self.inventory.cluster(revision=rev, now_ms=now_ms(), now_mono=time.monotonic())
        cluster.deployments = [d for _, d in sorted(self.desired.deployments.items())]
        cluster.events = list(self._recent)
        return cluster

    # --- agents ----------------------------------------------------------------------

    async def register(self, node: NodeInfo, message: Register, *, peer: str) -> int:
        """Accept an agent (``node`` is ``message.node``, checked); persists the node,
        adopts the shards it reports, and returns the new connection's number."""
        at = now_ms()
        connection, record = self.inventory.register(
            node, message.protocol_version, peer=peer, now_ms=at, now_mono=time.monotonic()
        )
        await self.store.save_node(
            StoredNode(node.node_id, bytes(record.info), record.cordoned, record.first_seen_ms, at)
        )
        self._publish_node(record)
        for status in message.shards:
            self.shard_status(node.node_id, status)
        log.info("node %s registered from %s (%d GPUs)", node.node_id, peer, len(node.gpus))
        return connection

    def heartbeat(self, node_id: str, connection: int, beat: Heartbeat) -> bool:
        """Apply a heartbeat; False when this connection no longer owns the node."""
        at = now_ms()
        delta, changed = self.inventory.heartbeat(
            node_id, connection, beat, now_ms=at, now_mono=time.monotonic()
        )
        if delta is None:
            return False
        self._seen[node_id] = at
        if changed:
            self._publish_node(self.inventory.nodes[node_id])
        else:
            self.hub.publish(WatchEvent(node_telemetry=delta))
        return True

    def shard_status(self, node_id: str, status: ShardStatus) -> None:
        shard = self.inventory.report_shard(node_id, status, now_ms=now_ms())
        self.hub.publish(WatchEvent(shard=shard))

    def disconnect(self, node_id: str, connection: int, reason: str) -> None:
        record = self.inventory.disconnect(node_id, connection, reason)
        if record is not None:
            log.warning("node %s is NOT_READY: %s", node_id, reason)
            self._publish_node(record)

    # --- operators -------------------------------------------------------------------

    async def set_cordoned(self, node_id: str, cordoned: bool, *, actor: str) -> NodeRecord:
        """Cordon or uncordon a node, durably, with an audit record."""
        record = self.inventory.set_cordoned(node_id, cordoned)
        await self.store.set_cordoned(node_id, cordoned)
        self._publish_node(record)
        await self.audit(actor, "cordon" if cordoned else "uncordon", node_id, "ok")
        return record

    async def audit(self, actor: str, action: str, target: str, result: str) -> None:
        record = AuditRecord(now_ms(), actor, action, target, result)
        await self.store.append_audit(record)
        event = _audit_event(record)
        self._recent.append(event)
        self.hub.publish(WatchEvent(audit=event))

    # --- periodic --------------------------------------------------------------------

    async def tick(self) -> None:
        """Mark silent nodes NOT_READY and flush heartbeat times to the store."""
        for record in self.inventory.expire(time.monotonic()):
            log.warning("node %s is NOT_READY: %s", record.info.node_id, record.reason)
            self._publish_node(record)
        await self.flush()

    async def flush(self) -> None:
        seen, self._seen = self._seen, {}
        await self.store.touch_nodes(seen.items())

    def _publish_node(self, record: NodeRecord) -> None:
        node = self.inventory.node_view(record, time.monotonic())
        self.hub.publish(WatchEvent(node=node))


def _audit_event(record: AuditRecord) -> AuditEvent:
    return AuditEvent(
        at_unix_ms=record.at_ms,
        actor=record.actor,
        action=record.action,
        target=record.target,
        result=record.result,
    )
