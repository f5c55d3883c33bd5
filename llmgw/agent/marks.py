"""The mark an agent gives every engine it spawns, and finding marked engines again.

Each engine starts with ``LLMGW_SHARD=NODE/SHARD`` and ``LLMGW_CLUSTER=CLUSTER_ID`` in its
environment (added at spawn, not part of the command fingerprint). An agent whose state
directory was lost (wiped, a new disk) has no records of the engines it left running; it
reads ``/proc/PID/environ`` of every session leader it may read (the same user, or root)
and finds those of its node *and its cluster* by the mark, instead of leaving them running
unknown on their ports. Children of an engine inherit the mark; only the leader of its
session (the engine itself, spawned with ``setsid``) counts.

The cluster is part of the mark because node names repeat: two clusters on one host (a
test run beside a real one, a staging cluster beside production) may both have a
``node-a``, and an agent that found engines by node alone stopped the other cluster's. An
agent marks with the cluster its server named when it accepted it (``Registered.cluster_id``;
it spawns nothing before), and finds only engines with exactly that cluster: one from a
server that sends no id finds only unmarked-cluster engines, and an engine of an older agent
(no ``LLMGW_CLUSTER``) is found only by an agent whose cluster is unknown too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from llmgw.agent.process import PROC, ProcessIdentity, boot_id, read_stat

__all__ = ["CLUSTER_ENV", "MARK_ENV", "EngineMarks", "MarkedEngine", "marked_engines", "shard_mark"]

log = logging.getLogger(__name__)

MARK_ENV = "LLMGW_SHARD"
CLUSTER_ENV = "LLMGW_CLUSTER"
_GONE = frozenset("ZXx")


@dataclass(frozen=True, slots=True)
class MarkedEngine:
    """An engine process found by its mark."""

    shard_id: str
    identity: ProcessIdentity


@dataclass(slots=True)
class EngineMarks:
    """The marks one agent gives its engines: its node, and its cluster once a server
    accepted the agent (:meth:`joined`)."""

    node_id: str
    cluster_id: str = ""

    def joined(self, cluster_id: str) -> None:
        self.cluster_id = cluster_id

    def of(self, shard_id: str) -> dict[str, str]:
        return shard_mark(self.node_id, shard_id, self.cluster_id)

    def find(self, proc: Path = PROC) -> list[MarkedEngine]:
        return marked_engines(self.node_id, self.cluster_id, proc)


def shard_mark(node_id: str, shard_id: str, cluster_id: str) -> dict[str, str]:
    """The environment entries that mark an engine of ``shard_id`` on ``node_id`` of
    ``cluster_id`` ({} without a node id; no cluster entry without a cluster id)."""
    if not node_id:
        return {}
    mark = {MARK_ENV: f"{node_id}/{shard_id}"}
    return {**mark, CLUSTER_ENV: cluster_id} if cluster_id else mark


def marked_engines(node_id: str, cluster_id: str, proc: Path = PROC) -> list[MarkedEngine]:
    """The running session leaders marked as engines of ``node_id`` in ``cluster_id``
    ("": marked with no cluster), by pid."""
    if not node_id:
        return []
    prefix = f"{MARK_ENV}={node_id}/".encode()
    cluster = f"{CLUSTER_ENV}={cluster_id}".encode() if cluster_id else None
    boot = boot_id(proc)
    found = []
    for entry in sorted(proc.iterdir(), key=lambda p: p.name):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        stat = read_stat(pid, proc)
        if stat is None or stat.session != pid or stat.state in _GONE:
            continue
        shard_id = _mark_of(entry / "environ", prefix, cluster)
        if shard_id:
            found.append(MarkedEngine(shard_id, ProcessIdentity(pid, stat.start_ticks, boot)))
    return found


def _mark_of(path: Path, prefix: bytes, cluster: bytes | None) -> str:
    """The shard id the environment at ``path`` marks with ``prefix``, when its cluster entry
    is exactly ``cluster`` (None: it has none); "" otherwise."""
    try:
        environ = path.read_bytes()
    except OSError:  # another user's process, or gone meanwhile
        return ""
    items = environ.split(b"\0")
    clusters = [item for item in items if item.startswith(CLUSTER_ENV.encode() + b"=")]
    if clusters != ([cluster] if cluster is not None else []):
        return ""  # another cluster's engine, or one of an agent that knew no cluster
    for item in items:
        if item.startswith(prefix):
            return item[len(prefix) :].decode("utf-8", "replace")
    return ""
