"""``AgentService.Connect``: one bidirectional stream per agent.

The first message must be ``Register`` with a protocol version this server speaks; a
registration that is missing, malformed or of another version, or whose node facts hold a
control character in any string (hostname, a label, a GPU name …: ``llmgw.printable``), is
refused with a gRPC status that says what was wrong and names the field, and nothing is
stored. Then each heartbeat is answered
with an acknowledgement (the agent measures its round trip from it) and shard reports
update the inventory. KV deltas are checked (``llmgw.server.kvblocks.decode_kv_delta``) and
handed to the plane's block store; a malformed one is counted and logged, and the stream
goes on. Commands (StartShard, StopShard, DrainShard) go down the same
stream through :meth:`AgentService.send`.

A node that reconnects while its old stream still looks alive is owned by the newer
connection; the older stream is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpclib.const
import grpclib.server
from grpclib.const import Status
from grpclib.exceptions import GRPCError

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
from llmgw.server.codec import field_bytes, wire_of
from llmgw.server.encoded import freeze_node_info
from llmgw.server.errors import quoted
from llmgw.server.kvblocks import KvDeltaRefused, decode_kv_delta
from llmgw.server.plane import ControlPlane
from llmgw.server.statefile import CLUSTER_ID_RULE, valid_cluster_id

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 10.0


class AgentConnection:
    """The server's end of one agent stream: sends are serialized by a lock."""

    def __init__(self, node_id: str, stream: grpclib.server.Stream[Any, Any]) -> None:
        self.node_id = node_id
        self.number = 0
        self._stream = stream
        self._lock = asyncio.Lock()
        self.task = asyncio.current_task()
        self.closed_because = ""  # set when the server ends this stream on purpose

    def close(self, status_message: str) -> None:
        """End this stream from the server side; the agent sees UNAVAILABLE and the reason."""
        self.closed_because = status_message
        if self.task is not None:
            self.task.cancel()

    async def send(self, message: ControlMessage) -> None:
        async with self._lock:
            await self._stream.send_message(message)


class AgentService(AgentServiceBase):
    """The agents' side of the control server."""

    def __init__(self, plane: ControlPlane, *, heartbeat_interval_ms: int = 1000) -> None:
        self.plane = plane
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.connections: dict[str, AgentConnection] = {}

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            "/llmgw.v1.AgentService/Connect": grpclib.const.Handler(
                self._connect,
                grpclib.const.Cardinality.STREAM_STREAM,
                AgentMessage,
                ControlMessage,
            ),
        }

    async def send(self, node_id: str, message: ControlMessage) -> bool:
        """Send a command to a node's agent; False when it is not connected."""
        connection = self.connections.get(node_id)
        if connection is None:
            return False
        await connection.send(message)
        return True

    async def _connect(self, stream: grpclib.server.Stream[AgentMessage, ControlMessage]) -> None:
        register, node = await _receive_register(stream)
        node_id = node.node_id
        connection = AgentConnection(node_id, stream)
        connection.number = await self.plane.register(node, register, peer=_peer(stream))
        self._replace(connection)
        reason = "agent stream closed"
        try:
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
            if not connection.closed_because:
                reason = "agent stream cancelled"
                raise
            reason = connection.closed_because
            raise GRPCError(Status.UNAVAILABLE, connection.closed_because) from None
        except GRPCError as exc:
            reason = f"agent stream failed: {exc.message}"
            raise
        finally:
            if self.connections.get(node_id) is connection:
                del self.connections[node_id]
            self.plane.disconnect(node_id, connection.number, reason)

    def _replace(self, connection: AgentConnection) -> None:
        old = self.connections.get(connection.node_id)
        self.connections[connection.node_id] = connection
        if old is not None:
            log.info("node %s reconnected; closing its older stream", connection.node_id)
            old.close("superseded by a newer connection of the same node")

    def shutdown(self) -> None:
        """End every agent stream with UNAVAILABLE, so agents reconnect at once."""
        for connection in list(self.connections.values()):
            connection.close("the control server is shutting down")

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


def _peer(stream: grpclib.server.Stream[Any, Any]) -> str:
    addr = stream.peer.addr() if stream.peer is not None else None
    if not addr:
        return ""
    return f"{addr[0]}:{addr[1]}"
