"""The agent protocol's version and the rules for reading values from other peers.

Both the agent and the server import this module (it is part of the contract, beside
``llmgw.api``). The version travels in ``Register.protocol_version``; a server refuses an
agent outside ``[MIN_PROTOCOL_VERSION, PROTOCOL_VERSION]`` with FAILED_PRECONDITION and a
message naming both ranges.
"""

from __future__ import annotations

import re

from llmgw.api.llmgw.v1 import ShardState

PROTOCOL_VERSION = 1
"""The protocol this build speaks."""

MIN_PROTOCOL_VERSION = 1
"""The oldest agent protocol this build still accepts."""


def read_shard_state(state: ShardState | int) -> ShardState:
    """A shard state as this build understands it: unknown values read as FAILED, never READY."""
    try:
        known = ShardState(int(state))
    except ValueError:
        return ShardState.FAILED
    if not known.name or known is ShardState.UNSPECIFIED:
        return ShardState.FAILED
    return known


NODE_ID_RULE = "letters, digits, '.', '_', '-'; starting with a letter or digit; at most 253"
"""What a node id may be, in words, for error messages."""

_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


def valid_node_id(node_id: str) -> bool:
    """Whether ``node_id`` may name a node (it becomes a file name and a label value)."""
    return _NODE_ID.fullmatch(node_id) is not None


def protocol_supported(version: int) -> bool:
    """Whether an agent speaking ``version`` may register."""
    return MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION


__all__ = [
    "MIN_PROTOCOL_VERSION",
    "NODE_ID_RULE",
    "PROTOCOL_VERSION",
    "protocol_supported",
    "read_shard_state",
    "valid_node_id",
]
