"""The fleet as the control server sees it: nodes, their GPUs and the shards they run.

Pure state, no I/O: the agent service feeds it registrations, heartbeats and shard reports
with explicit clocks, and publishes what each call returns. A node is READY while its
agent is connected and heartbeating, NOT_READY when its stream closed or no heartbeat came
within the grace, and CORDONED when it is heartbeating but an operator cordoned it. A node
whose agent runs engines of another cluster (``NodeRecord.unadopted``) is NOT_READY while
it holds them: they are not this cluster's, and its GPUs are not free.

A node's registration is kept as registered (frozen, its encoding computed once: see
``llmgw.server.state.encoded``); heartbeats only replace the latest telemetry of each GPU, which
the operator API shows beside it in ``Node.telemetry``.

Connections are numbered: when an agent reconnects before the server noticed its old
stream die, the newer connection owns the node and the end of the older one changes
nothing. A connection is *live* (:meth:`Inventory.live`) while it owns the node and its
last heartbeat is within the grace; ``llmgw.server.wire.agentsvc`` refuses a second agent of a
node while the first one's connection is live.

A node that registered but never sent a heartbeat (``ever_ready`` false: a registration
flood, an agent that never got going) and has no shards is pruned once it has been
disconnected and first seen longer ago than the bound (:meth:`Inventory.never_ready`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from llmgw.api.llmgw.v1 import (
    Cluster,
    GpuTelemetry,
    Heartbeat,
    Memory,
    Node,
    NodeInfo,
    NodeState,
    NodeTelemetry,
    Shard,
    ShardStatus,
)
from llmgw.protocol import read_shard_state
from llmgw.server.errors import UnknownNode
from llmgw.server.state.encoded import EncodedNodeInfo, freeze_node_info


@dataclass(slots=True)
class NodeRecord:
    """What the server holds for one node (mutable; only the event loop touches it)."""

    info: EncodedNodeInfo
    first_seen_ms: int
    cordoned: bool = False
    registered_ms: int = 0
    last_heartbeat_ms: int = 0
    last_heartbeat_mono: float | None = None
    connection: int = 0  # the connection that owns the node; 0 = none
    peer: str = ""
    protocol_version: int = 0
    reason: str = "not connected since the server started"
    telemetry: dict[str, GpuTelemetry] = field(default_factory=dict)  # by GPU UUID
    memory: Memory | None = None  # the latest host memory reading, when one came
    # Engines its agent runs for another cluster (Register.cluster_id differs from this
    # server's): neither adopted nor stopped; the node is NOT_READY while it holds them.
    unadopted: dict[str, ShardStatus] = field(default_factory=dict)  # by shard id
    unadopted_cluster: str = ""  # the cluster they belong to; "" when none are held
    ever_ready: bool = True  # a heartbeat came on one of its streams (False: newly registered)

    @property
    def connected(self) -> bool:
        return self.connection != 0


@dataclass(frozen=True, slots=True)
class InventoryConfig:
    """How long a node may stay silent before it is NOT_READY, and how long one that never
    sent a heartbeat is kept."""

    grace_s: float = 5.0
    never_ready_prune_s: float = 300.0


class Inventory:
    """Nodes and shards, with the rules that derive a node's state."""

    def __init__(self, config: InventoryConfig | None = None) -> None:
        self.config = config or InventoryConfig()
        self.nodes: dict[str, NodeRecord] = {}
        self.shards: dict[str, Shard] = {}
        self.cluster_id = ""  # this server's (the store's), for what nodes are told
        self._next_connection = 0

    # --- nodes -----------------------------------------------------------------------

    def restore(
        self,
        node_id: str,
        info: EncodedNodeInfo,
        *,
        cordoned: bool,
        first_seen_ms: int,
        ever_ready: bool = True,
    ) -> None:
        """Bring back a node the store remembers; it is NOT_READY until its agent returns."""
        self.nodes[node_id] = NodeRecord(
            info=info, first_seen_ms=first_seen_ms, cordoned=cordoned, ever_ready=ever_ready
        )

    def register(
        self, node: NodeInfo, protocol_version: int, *, peer: str, now_ms: int, now_mono: float
    ) -> tuple[int, NodeRecord]:
        """Accept a registration; returns the new connection's number and the record."""
        frozen = freeze_node_info(node)
        record = self.nodes.get(node.node_id)
        if record is None:
            record = NodeRecord(info=frozen, first_seen_ms=now_ms, ever_ready=False)
            self.nodes[node.node_id] = record
        self._next_connection += 1
        record.info = frozen
        record.telemetry = {}
        record.memory = None
        record.connection = self._next_connection
        record.registered_ms = record.last_heartbeat_ms = now_ms
        record.last_heartbeat_mono = now_mono
        record.peer = peer
        record.protocol_version = protocol_version
        record.reason = ""
        record.unadopted, record.unadopted_cluster = {}, ""
        return record.connection, record

    def heartbeat(
        self, node_id: str, connection: int, beat: Heartbeat, *, now_ms: int, now_mono: float
    ) -> tuple[NodeTelemetry | None, bool]:
        """Apply a heartbeat. Returns the telemetry delta to publish (None when the
        connection no longer owns the node) and whether the node's state changed."""
        record = self.nodes.get(node_id)
        if record is None or record.connection != connection:
            return None, False
        was = self.state(record, now_mono)
        record.last_heartbeat_ms = now_ms
        record.last_heartbeat_mono = now_mono
        record.reason = ""
        record.ever_ready = True
        known = record.info.gpu_uuids
        record.telemetry.update((gpu.uuid, gpu) for gpu in beat.gpus if gpu.uuid in known)
        if beat.memory is not None:
            record.memory = beat.memory
        delta = NodeTelemetry(
            node_id=node_id, last_heartbeat_unix_ms=now_ms, gpus=beat.gpus, memory=beat.memory
        )
        return delta, was is not self.state(record, now_mono)

    def disconnect(self, node_id: str, connection: int, reason: str) -> NodeRecord | None:
        """The stream of ``connection`` ended; returns the record if that changed the node."""
        record = self.nodes.get(node_id)
        if record is None or record.connection != connection:
            return None
        record.connection = 0
        record.last_heartbeat_mono = None
        record.reason = reason
        return record

    def expire(self, now_mono: float) -> list[NodeRecord]:
        """Nodes whose heartbeat is older than the grace, newly NOT_READY."""
        expired = []
        for record in self.nodes.values():
            seen = record.last_heartbeat_mono
            if seen is not None and now_mono - seen > self.config.grace_s:
                record.last_heartbeat_mono = None
                record.reason = f"no heartbeat for {self.config.grace_s:g}s"
                expired.append(record)
        return expired

    def live(self, node_id: str, connection: int, now_mono: float) -> bool:
        """Whether ``connection`` owns the node and heartbeated within the grace."""
        record = self.nodes.get(node_id)
        if record is None or record.connection != connection or connection == 0:
            return False
        seen = record.last_heartbeat_mono
        return seen is not None and now_mono - seen <= self.config.grace_s

    def never_ready(self, now_ms: int, after_ms: int) -> list[str]:
        """Disconnected nodes without shards that never sent a heartbeat and were first seen
        more than ``after_ms`` ago (to be pruned)."""
        with_shards = {shard.node_id for shard in self.shards.values()}
        return [
            node_id
            for node_id, record in self.nodes.items()
            if not record.ever_ready
            and not record.connected
            and node_id not in with_shards
            and now_ms - record.first_seen_ms > after_ms
        ]

    def remove(self, node_id: str) -> list[str]:
        """Forget a node and the shards reported on it; the removed shards' ids."""
        self.nodes.pop(node_id, None)
        gone = [shard_id for shard_id, s in self.shards.items() if s.node_id == node_id]
        for shard_id in gone:
            del self.shards[shard_id]
        return gone

    def set_cordoned(self, node_id: str, cordoned: bool) -> NodeRecord:
        """Cordon or uncordon a node; raises UnknownNode."""
        record = self.nodes.get(node_id)
        if record is None:
            raise UnknownNode(node_id)
        record.cordoned = cordoned
        return record

    def state(self, record: NodeRecord, now_mono: float) -> NodeState:
        """A node's state, derived from its connection, heartbeat age and cordon."""
        seen = record.last_heartbeat_mono
        if not record.connected or seen is None or now_mono - seen > self.config.grace_s:
            return NodeState.NOT_READY
        if record.unadopted_cluster:
            return NodeState.NOT_READY  # its GPUs hold another cluster's engines
        return NodeState.CORDONED if record.cordoned else NodeState.READY

    def node_view(self, record: NodeRecord, now_mono: float) -> Node:
        """The operator API's view of a node."""
        state = self.state(record, now_mono)
        return Node(
            info=record.info,
            state=state,
            cordoned=record.cordoned,
            connected=record.connected,
            first_seen_unix_ms=record.first_seen_ms,
            registered_unix_ms=record.registered_ms,
            last_heartbeat_unix_ms=record.last_heartbeat_ms,
            peer=record.peer,
            protocol_version=record.protocol_version,
            state_reason=(record.reason or unadopted_reason(record, self.cluster_id))
            if state is NodeState.NOT_READY
            else "",
            telemetry=NodeTelemetry(
                node_id=record.info.node_id,
                last_heartbeat_unix_ms=record.last_heartbeat_ms,
                gpus=list(record.telemetry.values()),
                memory=record.memory,
            ),
            unadopted_shards=sorted(record.unadopted),
            unadopted_cluster_id=record.unadopted_cluster,
        )

    # --- shards ----------------------------------------------------------------------

    def report_shard(self, node_id: str, status: ShardStatus, *, now_ms: int) -> Shard:
        """Record a shard's state as its agent reports it (unknown states read FAILED)."""
        status.state = read_shard_state(status.state)
        shard = Shard(
            shard_id=status.shard_id,
            replica_id=status.replica_id,
            node_id=node_id,
            status=status,
            updated_unix_ms=now_ms,
        )
        self.shards[status.shard_id] = shard
        return shard

    def hold_unadopted(
        self, record: NodeRecord, cluster_id: str, shards: Iterable[ShardStatus]
    ) -> None:
        """Note engines a node runs for cluster ``cluster_id`` (not this one), unadopted."""
        record.unadopted_cluster = cluster_id
        record.unadopted = {s.shard_id: s for s in shards}

    def shards_of(self, node_id: str) -> list[Shard]:
        return [s for s in self.shards.values() if s.node_id == node_id]

    # --- views -----------------------------------------------------------------------

    def cluster(self, *, revision: int, now_ms: int, now_mono: float) -> Cluster:
        """The whole cluster, as GetCluster and a Watch snapshot show it."""
        return Cluster(
            nodes=[self.node_view(r, now_mono) for _, r in sorted(self.nodes.items())],
            shards=[s for _, s in sorted(self.shards.items())],
            revision=revision,
            server_time_unix_ms=now_ms,
        )


def unadopted_reason(record: NodeRecord, ours: str) -> str:
    """Why a node holding another cluster's engines is NOT_READY, and what to do ("" if not)."""
    if not record.unadopted_cluster:
        return ""
    return (
        f"its agent runs {len(record.unadopted)} engine(s) of cluster "
        f"{record.unadopted_cluster}, not of this cluster {ours}: not adopted, not stopped; "
        f"to hand them over to this cluster, restart the agent with --join-cluster {ours}"
    )
