"""Received bytes are kept, so a registration is not encoded a second time."""

from __future__ import annotations

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import AgentMessage, Heartbeat, NodeInfo, Register
from llmgw.server.wire.codec import CheckedProtoCodec, field_bytes, wire_of


def test_the_node_bytes_of_a_register_are_found_in_the_message() -> None:
    node = simulated_node("dgx-h100", node_id="n1", hostname="h")
    data = bytes(AgentMessage(register=Register(protocol_version=1, node=node)))
    decoded = CheckedProtoCodec().decode(data, AgentMessage)
    assert wire_of(decoded) == data
    node_bytes = field_bytes(data, (1, 2))
    assert node_bytes is not None and NodeInfo.parse(node_bytes) == node


def test_absent_fields_and_merged_occurrences() -> None:
    beat = bytes(AgentMessage(heartbeat=Heartbeat(seq=3)))
    assert field_bytes(beat, (1, 2)) is None
    first = bytes(AgentMessage(register=Register(node=NodeInfo(node_id="a"))))
    second = bytes(AgentMessage(register=Register(node=NodeInfo(hostname="h"))))
    merged = field_bytes(first + second, (1, 2))
    assert merged is not None
    assert NodeInfo.parse(merged) == NodeInfo(node_id="a", hostname="h")
    assert wire_of(NodeInfo()) is None
