"""Node registrations that encode to wire bytes computed once.

betterproto2 spends milliseconds encoding one registered node (a DGX H100's ``NodeInfo``
is ~8 KB of nested GPUs, NVLinks and NIC paths), and every ``GetCluster``, Watch
snapshot and node delta carries whole nodes, so encoding them anew each time would cost
seconds per snapshot of a thousand-node fleet. A registration does not change until the
agent registers again (live values travel apart, in ``Node.telemetry``), so its bytes are
computed once and reused: for the store, for snapshots, for deltas.

The cached message stays a full ``NodeInfo`` (fields readable, ``to_dict`` works); it must
not be mutated, since its bytes would no longer match.
"""

from __future__ import annotations

from copy import copy

from llmgw.api.llmgw.v1 import NodeInfo


class EncodedNodeInfo(NodeInfo):
    """A ``NodeInfo`` whose encoding is fixed at creation (see :func:`freeze_node_info`)."""

    _wire: bytes
    _gpu_uuids: frozenset[str] | None = None

    @property
    def gpu_uuids(self) -> frozenset[str]:
        """The UUIDs of every GPU and MIG device of the node."""
        if self._gpu_uuids is None:
            self._gpu_uuids = frozenset(gpu.uuid for gpu in self.gpus)
        return self._gpu_uuids

    def __bytes__(self) -> bytes:
        return self._wire

    def SerializeToString(self) -> bytes:
        return self._wire


# betterproto2 resolves field annotations in the class's module: keep the generated one.
EncodedNodeInfo.__module__ = NodeInfo.__module__


def freeze_node_info(node: NodeInfo, wire: bytes | None = None) -> EncodedNodeInfo:
    """A read-only copy of ``node`` that encodes to ``wire``: the bytes ``node`` was parsed
    from, when the caller has them, else its encoding computed now, once."""
    if isinstance(node, EncodedNodeInfo):
        return node
    frozen = copy(node)
    frozen.__class__ = EncodedNodeInfo
    assert isinstance(frozen, EncodedNodeInfo)
    frozen._wire = bytes(node) if wire is None else wire
    return frozen


__all__ = ["EncodedNodeInfo", "freeze_node_info"]
