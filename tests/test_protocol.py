"""Rules both the agent and the server read values by."""

from __future__ import annotations

import pytest

from llmgw.api.llmgw.v1 import ShardState
from llmgw.protocol import (
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    protocol_supported,
    read_shard_state,
    valid_node_id,
)


@pytest.mark.parametrize("node_id", ["a", "dgx-1", "node_7.rack2", "N" * 253])
def test_valid_node_ids(node_id: str) -> None:
    assert valid_node_id(node_id)


@pytest.mark.parametrize("node_id", ["", "-x", ".x", "a/b", "../etc", "a b", "x\n", "N" * 254])
def test_invalid_node_ids(node_id: str) -> None:
    assert not valid_node_id(node_id)


def test_unknown_shard_states_read_as_failed_never_ready() -> None:
    assert read_shard_state(ShardState.READY) is ShardState.READY
    assert read_shard_state(0) is ShardState.FAILED
    assert read_shard_state(99) is ShardState.FAILED


def test_protocol_range() -> None:
    assert protocol_supported(PROTOCOL_VERSION) and protocol_supported(MIN_PROTOCOL_VERSION)
    assert not protocol_supported(PROTOCOL_VERSION + 1)
    assert not protocol_supported(MIN_PROTOCOL_VERSION - 1)
