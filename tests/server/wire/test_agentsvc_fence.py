"""A leader's agent streams carry its epoch on every message, and a server whose lease ran
out sends nothing more (``llmgw.server.wire.agentsvc``, issue #17's fencing)."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.api.llmgw.v1 import ControlMessage, StopShard
from llmgw.server.wire.agentsvc import AgentConnection, NotLeading


class _Stream:
    def __init__(self) -> None:
        self.sent: list[ControlMessage] = []

    async def send_message(self, message: ControlMessage) -> None:
        self.sent.append(message)


class _Gate:
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.lead = True

    def leading(self) -> bool:
        return self.lead

    def refusal(self) -> str:
        return "server a does not lead: the leader is at b:1 (epoch 8)"


async def test_every_message_carries_the_epoch_and_a_deposed_leader_sends_nothing() -> None:
    stream, gate = _Stream(), _Gate(7)
    connection = AgentConnection("n1", stream, leadership=gate)  # type: ignore[arg-type]
    await connection.send(ControlMessage(stop_shard=StopShard(shard_id="s")))
    assert [m.leader_epoch for m in stream.sent] == [7]
    gate.lead = False
    with pytest.raises(NotLeading, match="the leader is at b:1"):
        await connection.send(ControlMessage(stop_shard=StopShard(shard_id="s2")))
    assert len(stream.sent) == 1


async def test_without_a_gate_nothing_is_stamped() -> None:
    stream: Any = _Stream()
    await AgentConnection("n1", stream).send(ControlMessage(stop_shard=StopShard(shard_id="s")))
    assert stream.sent[0].leader_epoch == 0
