"""Fake control servers on loopback for the agent's leader-following tests (issue #17).

`FakeControl` answers ``AgentService.Connect`` as a follower (one ``not_leader``, then
UNAVAILABLE naming the leader; with ``linger`` only once the client has ended the stream,
so that grpclib's client sees the message rather than the reset that follows it) or as a
leader of some epoch (``Registered``, then its scripted commands, then heartbeat acks), as
the real servers will.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpclib.server
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError

from llmgw.api.llmgw.v1 import (
    AgentMessage,
    ControlMessage,
    HeartbeatAck,
    NotLeader,
    Registered,
)
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server.wire.codec import CheckedProtoCodec

CONNECT = "/llmgw.v1.AgentService/Connect"


@dataclass
class FakeControl:
    """A follower when ``leader_address`` is set (or ``follower``), else a leader of
    ``epoch`` that sends ``commands`` after registering."""

    epoch: int = 0
    follower: bool = False
    leader_address: str = ""
    leader_epoch: int = 0
    commands: list[ControlMessage] = field(default_factory=list)
    read_first: bool = False  # a follower reads the Register before answering
    linger: bool = False  # a follower waits for the client to end the stream before UNAVAILABLE
    connects: int = 0
    registers: int = 0

    def __mapping__(self) -> dict[str, Handler]:
        return {
            CONNECT: Handler(self.connect, Cardinality.STREAM_STREAM, AgentMessage, ControlMessage)
        }

    async def connect(self, stream: Any) -> None:
        self.connects += 1
        if self.follower and self.read_first:
            await stream.recv_message()
        if self.follower:
            answer = NotLeader(self.leader_address, self.leader_epoch, "leader", "follower")
            await stream.send_message(ControlMessage(not_leader=answer))
            if self.linger:  # the client reads not_leader before the reset can drop it
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(2.0):
                        async for _ in stream:
                            pass
            raise GRPCError(
                Status.UNAVAILABLE,
                f"server f does not lead: the leader is l at {self.leader_address} (epoch 2)",
            )
        message = await stream.recv_message()
        assert message is not None and message.register is not None
        self.registers += 1
        registered = Registered(protocol_version=PROTOCOL_VERSION, heartbeat_interval_ms=50)
        await stream.send_message(ControlMessage(registered=registered, leader_epoch=self.epoch))
        for command in self.commands:
            await stream.send_message(command)
        async for message in stream:
            if message.heartbeat is not None:
                ack = HeartbeatAck(
                    seq=message.heartbeat.seq, sent_at_ms=message.heartbeat.sent_at_ms
                )
                await stream.send_message(
                    ControlMessage(heartbeat_ack=ack, leader_epoch=self.epoch)
                )


@contextlib.asynccontextmanager
async def serving(fake: FakeControl) -> AsyncIterator[int]:
    """Serve ``fake`` on 127.0.0.1; yields its port."""
    server = grpclib.server.Server([fake], codec=CheckedProtoCodec())
    await server.start("127.0.0.1", 0)
    port: int = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield port
    finally:
        server.close()
        await server.wait_closed()
