"""``AgentService.Connect``: one bidirectional stream per agent.

The first message must be ``Register`` with a protocol version this server speaks; a
registration that is missing, malformed or of another version, or whose node facts hold a
control character in any string (hostname, a label, a GPU name …: ``llmgw.printable``), is
refused with a gRPC status that says what was wrong and names the field, and nothing is
stored. Then each heartbeat is answered
with an acknowledgement (the agent measures its round trip from it) and shard reports
update the inventory. KV deltas are checked (``llmgw.server.state.kvblocks.decode_kv_delta``) and
handed to the plane's block store; a malformed one is counted and logged, and the stream
goes on. Commands (StartShard, StopShard, DrainShard) go down the same
stream through :meth:`AgentService.send`, and so do log requests, whose ``LogChunk``
replies go to the ``LogRelay`` (``llmgw.server.wire.logrelay``), which also ends a node's
log streams when its stream ends.

**One agent per node.** The established live session wins: a Register for a node whose
stream is open and heartbeated within the node grace (``Inventory.live``) is refused with
ALREADY_EXISTS naming the holder (its instance id, machine id and peer address) and a
retry hint (trailing metadata ``retry-after-ms``), and nothing changes for the holder. The
same agent process reconnecting (the same ``run_id``: its old stream died on its side) and
any agent of a node whose holder is silent past the grace take the node over; the older
stream is then cancelled.

Before that, every Connect is counted against the registration rate limits
(``llmgw.server.wire.admission``: per peer host and overall; over them RESOURCE_EXHAUSTED with
``retry-after-ms``), and a Register made with an agent token bound to node ids
(``llmgw token create --role agent --node ID``) for another node id is refused with
PERMISSION_DENIED.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import grpclib.const
import grpclib.server
from grpclib.const import Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from llmgw.api.llmgw.v1 import (
    AgentMessage,
    AgentServiceBase,
    ControlMessage,
    HeartbeatAck,
    KvDelta,
    NodeInfo,
    Register,
    Registered,
)
from llmgw.printable import text_problems
from llmgw.protocol import (
    MIN_PROTOCOL_VERSION,
    NODE_ID_RULE,
    PROTOCOL_VERSION,
    protocol_supported,
    valid_node_id,
)
from llmgw.server.errors import quoted
from llmgw.server.state.encoded import freeze_node_info
from llmgw.server.state.kvblocks import KvDeltaRefused, decode_kv_delta
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.statefile import CLUSTER_ID_RULE, valid_cluster_id
from llmgw.server.wire.admission import RegisterLimiter, RegisterLimits
from llmgw.server.wire.auth import current_principal
from llmgw.server.wire.codec import field_bytes, wire_of
from llmgw.server.wire.logrelay import LogRelay
from llmgw.server.wire.metrics import AgentStreamStats

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 10.0
DUPLICATE_WARN_S = 60.0
"""A refused duplicate agent of a node is logged at WARNING at most this often."""
RETRY_AFTER_KEY = "retry-after-ms"
"""Trailing metadata of a refused Connect: milliseconds until asking again is worth it."""


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    """Who an agent says it is (``Register``), and where it connects from."""

    instance_id: str
    machine_id: str
    run_id: str
    peer: str

    @classmethod
    def of(cls, register: Register, peer: str) -> AgentIdentity:
        return cls(
            instance_id=register.instance_id[:64],
            machine_id=register.machine_id[:64],
            run_id=register.run_id[:64],
            peer=peer,
        )

    def describe(self) -> str:
        return (
            f"instance {quoted(self.instance_id or '?')}, machine {quoted(self.machine_id or '?')}"
            f", peer {self.peer or '?'}"
        )


class AgentConnection:
    """The server's end of one agent stream: sends are serialized by a lock."""

    def __init__(
        self,
        node_id: str,
        stream: grpclib.server.Stream[Any, Any],
        identity: AgentIdentity | None = None,
        leadership: LeaderGate | None = None,
    ) -> None:
        self.node_id = node_id
        self.leadership = leadership
        self.identity = identity or AgentIdentity("", "", "", "")
        self.number = 0
        self._stream = stream
        self._lock = asyncio.Lock()
        self.task = asyncio.current_task()
        self.closed_because = ""  # set when the server ends this stream on purpose

    def close(self, status_message: str) -> None:
        """End this stream from the server side; the agent sees UNAVAILABLE and the reason
        (the first reason: a stream closed twice is cancelled once)."""
        if self.closed_because:
            return
        self.closed_because = status_message
        if self.task is not None:
            self.task.cancel()

    async def send(self, message: ControlMessage) -> None:
        """Send ``message`` stamped with the leader's epoch; NotLeading (UNAVAILABLE, the
        stream ends) once this server's lease has run out: a deposed leader sends nothing."""
        lead = self.leadership
        if lead is not None:
            if not lead.leading():
                raise NotLeading(Status.UNAVAILABLE, lead.refusal())
            message.leader_epoch = lead.epoch
        async with self._lock:
            await self._stream.send_message(message)


class LeaderGate(Protocol):
    """What an agent stream asks of the server's leadership
    (``llmgw.server.state.leadership.Leadership``)."""

    epoch: int

    def leading(self) -> bool: ...

    def refusal(self) -> str: ...


class NotLeading(GRPCError):
    """A send of a server whose leader lease has run out (its stream ends UNAVAILABLE)."""


class AgentService(AgentServiceBase):
    """The agents' side of the control server."""

    def __init__(
        self,
        plane: ControlPlane,
        *,
        heartbeat_interval_ms: int = 1000,
        limits: RegisterLimits | None = None,
        logs: LogRelay | None = None,
        leadership: LeaderGate | None = None,
    ) -> None:
        self.plane = plane
        self.leadership = leadership  # None: unfenced (tests); else every message is stamped
        self.logs = logs if logs is not None else LogRelay()
        if self.logs.send is None:
            self.logs.send = self.send
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.connections: dict[str, AgentConnection] = {}  # registered streams, by node
        self._claims: dict[str, AgentConnection] = {}  # the newest accepted stream, by node
        self.limiter = RegisterLimiter(limits)
        self.refused_duplicates = 0  # Registers refused because another agent holds the node
        self._duplicate_warned: dict[str, float] = {}  # node id → monotonic time of a WARNING
        self.sessions = 0  # agent streams accepted (registered) since the start

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            "/llmgw.v1.AgentService/Connect": grpclib.const.Handler(
                self._connect,
                grpclib.const.Cardinality.STREAM_STREAM,
                AgentMessage,
                ControlMessage,
            ),
        }

    def stats(self) -> AgentStreamStats:
        """Streams registered and Connects refused since the start (for ``/metrics``)."""
        return AgentStreamStats(self.sessions, self.refused_duplicates, self.limiter.refused)

    async def send(self, node_id: str, message: ControlMessage) -> bool:
        """Send a command to a node's agent; False when it is not connected or this server
        no longer leads."""
        connection = self.connections.get(node_id)
        if connection is None:
            return False
        try:
            await connection.send(message)
        except NotLeading as exc:
            log.warning("command for %s not sent: %s", node_id, exc.message)
            connection.close(exc.message or "not the leader")
            return False
        return True

    async def _connect(self, stream: grpclib.server.Stream[AgentMessage, ControlMessage]) -> None:
        peer = _peer(stream)
        why, wait_s = self.limiter.admit(peer.rpartition(":")[0], time.monotonic())
        if why:
            log.debug("agent registration from %s refused: %s", peer, why)
            await _refuse(stream, Status.RESOURCE_EXHAUSTED, f"{why}; retry in {wait_s:.1f}s",
                          wait_s)  # fmt: skip
            return
        register, node = await _receive_register(stream)
        node_id = node.node_id
        _check_bound(node_id)
        connection = AgentConnection(
            node_id, stream, AgentIdentity.of(register, peer), self.leadership
        )
        if refusal := self._holder_refusal(connection):
            self.refused_duplicates += 1
            self._log_duplicate(node_id, refusal)
            await _refuse(stream, Status.ALREADY_EXISTS, refusal, self._retry_after_s())
            return
        self._claim(connection)  # before any await: a second newcomer sees this holder
        reason = "agent stream closed"
        try:
            connection.number = await self.plane.register(node, register, peer=peer)
            self.connections[node_id] = connection
            self.sessions += 1
            await connection.send(
                ControlMessage(
                    registered=Registered(
                        protocol_version=PROTOCOL_VERSION,
                        heartbeat_interval_ms=self.heartbeat_interval_ms,
                        cluster_id=self.plane.cluster_id,
                    )
                )
            )
            reason = await self._serve(connection, stream)
        except asyncio.CancelledError:
            if not connection.closed_because or _reset_by_peer(stream):
                # grpclib cancelled it too (the agent reset the stream): the cancellation
                # must go on, else grpclib logs "Failed to handle cancellation"
                reason = connection.closed_because or "agent stream cancelled"
                raise
            reason = connection.closed_because
            await _end_quietly(stream, Status.UNAVAILABLE, reason)
        except GRPCError as exc:
            reason = f"agent stream failed: {exc.message}"
            raise
        finally:
            if self.connections.get(node_id) is connection:
                del self.connections[node_id]
                self.logs.node_gone(node_id, reason)
            if self._claims.get(node_id) is connection:
                del self._claims[node_id]
            if connection.number:
                self.plane.disconnect(node_id, connection.number, reason)

    def _holder_refusal(self, newcomer: AgentConnection) -> str:
        """Why ``newcomer`` may not take its node ('' when it may): another agent's live
        session holds it."""
        holder = self._claims.get(newcomer.node_id)
        if holder is None:
            return ""
        same_process = bool(newcomer.identity.run_id) and (
            newcomer.identity.run_id == holder.identity.run_id
        )
        if same_process:
            return ""  # its own reconnect: the old stream died on its side
        registering = holder.number == 0  # its Register is being stored right now
        if not registering and not self.plane.inventory.live(
            holder.node_id, holder.number, time.monotonic()
        ):
            return ""  # silent past the grace: it is gone, whatever its socket says
        grace = self.plane.inventory.config.grace_s
        return (
            f"node {newcomer.node_id} is held by a live agent ({holder.identity.describe()}); "
            f"this agent ({newcomer.identity.describe()}) is refused. Two agents with one "
            f"node id (a copied state dir?): give this one its own --node-id and --state-dir. "
            f"It takes over only once the holder has been silent for {grace:g}s"
        )

    def _log_duplicate(self, node_id: str, refusal: str) -> None:
        """WARNING for a node's first refused duplicate, then at most once a minute (a
        duplicate asks again every few seconds); DEBUG in between."""
        now = time.monotonic()
        last = self._duplicate_warned.get(node_id)
        if last is None or now - last >= DUPLICATE_WARN_S:
            self._duplicate_warned[node_id] = now
            log.warning("agent for node %s refused: %s", node_id, refusal)
        else:
            log.debug("agent for node %s refused: %s", node_id, refusal)

    def _retry_after_s(self) -> float:
        """When a refused duplicate should ask again: often enough to take over within
        about the grace once the holder is gone, rarely enough not to be a load."""
        return max(1.0, self.plane.inventory.config.grace_s / 2)

    def _claim(self, connection: AgentConnection) -> None:
        old = self._claims.get(connection.node_id)
        self._claims[connection.node_id] = connection
        if old is not None:
            log.info(
                "node %s: agent (%s) takes over from its older stream (%s)",
                connection.node_id,
                connection.identity.describe(),
                old.identity.describe(),
            )
            old.close("superseded by a newer connection of the same node")

    def shutdown(self, reason: str = "the control server is shutting down") -> None:
        """End every agent stream with UNAVAILABLE and ``reason``, so agents reconnect at
        once."""
        for connection in {*self.connections.values(), *self._claims.values()}:
            connection.close(reason)

    async def _serve(
        self, connection: AgentConnection, stream: grpclib.server.Stream[AgentMessage, Any]
    ) -> str:
        node_id = connection.node_id
        async for message in stream:
            if message.heartbeat is not None:
                beat = message.heartbeat
                if not self.plane.heartbeat(node_id, connection.number, beat):
                    return "superseded by a newer connection"
                ack = HeartbeatAck(seq=beat.seq, sent_at_ms=beat.sent_at_ms)
                await connection.send(ControlMessage(heartbeat_ack=ack))
            elif message.shard_status is not None:
                self.plane.shard_status(node_id, message.shard_status)
            elif message.kv_delta is not None:
                self._kv_delta(connection, message.kv_delta)
            elif message.log_chunk is not None:
                self.logs.deliver(node_id, message.log_chunk)
            elif message.register is not None:
                raise GRPCError(Status.FAILED_PRECONDITION, "Register may only be sent once")
            else:
                raise GRPCError(Status.INVALID_ARGUMENT, "empty AgentMessage (no 'msg' field set)")
        return "agent closed its stream"

    def _kv_delta(self, connection: AgentConnection, delta: KvDelta) -> None:
        try:
            decoded = decode_kv_delta(delta)
        except KvDeltaRefused as exc:
            self.plane.kv_blocks.refused(connection.node_id, exc)
            return
        self.plane.kv_delta(connection.node_id, connection.number, decoded)


async def _receive_register(
    stream: grpclib.server.Stream[AgentMessage, Any],
) -> tuple[Register, NodeInfo]:
    try:
        async with asyncio.timeout(REGISTER_TIMEOUT_S):
            first = await stream.recv_message()
    except TimeoutError as exc:
        raise GRPCError(
            Status.DEADLINE_EXCEEDED, f"no Register within {REGISTER_TIMEOUT_S:g}s"
        ) from exc
    if first is None or first.register is None:
        raise GRPCError(Status.INVALID_ARGUMENT, "the first message on the stream must be Register")
    register = first.register
    # Register is field 1 of AgentMessage and NodeInfo field 2 of Register: keep its bytes.
    wire = wire_of(first)
    node_wire = field_bytes(wire, (1, 2)) if wire is not None else None
    if not protocol_supported(register.protocol_version):
        raise GRPCError(
            Status.FAILED_PRECONDITION,
            f"agent speaks protocol version {register.protocol_version}; this server speaks "
            f"{MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}: upgrade the "
            f"{'agent' if register.protocol_version < MIN_PROTOCOL_VERSION else 'server'}",
        )
    if register.cluster_id and not valid_cluster_id(register.cluster_id):
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"Register.cluster_id {quoted(register.cluster_id)} is not a cluster id "
            f"({CLUSTER_ID_RULE})",
        )
    node = register.node
    if node is None or not valid_node_id(node.node_id):
        node_id = node.node_id if node is not None else ""
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"Register.node.node_id {quoted(node_id)} is not a valid node id ({NODE_ID_RULE})",
        )
    if problems := text_problems(node, "Register.node"):  # they would forge printed rows
        raise GRPCError(Status.INVALID_ARGUMENT, "registration refused: " + "; ".join(problems))
    return register, freeze_node_info(node, wire=node_wire)


async def _refuse(
    stream: grpclib.server.Stream[Any, Any], status: Status, message: str, retry_after_s: float
) -> None:
    """End the call with ``status`` and a ``retry-after-ms`` hint in the trailers."""
    await stream.send_trailing_metadata(
        status=status,
        status_message=message,
        metadata={RETRY_AFTER_KEY: str(max(1, round(retry_after_s * 1000)))},
    )


def _reset_by_peer(stream: grpclib.server.Stream[Any, Any]) -> bool:
    """Whether grpclib itself cancelled this call's handler (the peer reset the stream, or
    its deadline passed): grpclib's wrapper of the call says so (``Wrapper.cancelled``)."""
    wrapper = getattr(getattr(stream, "_stream", None), "wrapper", None)
    return bool(getattr(wrapper, "cancelled", False))


async def _end_quietly(
    stream: grpclib.server.Stream[Any, Any], status: Status, message: str
) -> None:
    """End the call with ``status`` when the server closes it on purpose (a shutdown, a
    newer connection). The agent may be hanging up at the same moment: a stream it has
    already reset has nobody to tell, and is not an error worth a traceback."""
    try:
        await stream.send_trailing_metadata(status=status, status_message=message)
    except (StreamTerminatedError, ProtocolError, OSError):
        log.debug("agent stream already gone when ending it: %s", message)


def _check_bound(node_id: str) -> None:
    """PERMISSION_DENIED when the caller's agent token is bound to other node ids."""
    principal = current_principal()
    if principal is None or not principal.nodes or node_id in principal.nodes:
        return
    bound = ", ".join(sorted(principal.nodes))
    raise GRPCError(
        Status.PERMISSION_DENIED,
        f"this agent token ({principal.actor}) is bound to node {bound}; it may not register "
        f"node {quoted(node_id)}",
    )


def _peer(stream: grpclib.server.Stream[Any, Any]) -> str:
    addr = stream.peer.addr() if stream.peer is not None else None
    if not addr:
        return ""
    return f"{addr[0]}:{addr[1]}"
