"""The mark an agent gives every engine it spawns, and finding marked engines again.

Each engine starts with ``LLMGW_SHARD=NODE/SHARD`` in its environment (added at spawn, not
part of the command fingerprint). An agent whose state directory was lost (wiped, a new
disk) has no records of the engines it left running; it reads ``/proc/PID/environ`` of every
session leader it may read (the same user, or root) and finds those of its node by the
mark, instead of leaving them running unknown on their ports. Children of an engine inherit
the mark; only the leader of its session (the engine itself, spawned with ``setsid``) counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from llmgw.agent.process import PROC, ProcessIdentity, boot_id, read_stat

__all__ = ["MARK_ENV", "MarkedEngine", "marked_engines", "shard_mark"]

log = logging.getLogger(__name__)

MARK_ENV = "LLMGW_SHARD"
_GONE = frozenset("ZXx")


@dataclass(frozen=True, slots=True)
class MarkedEngine:
    """An engine process found by its mark."""

    shard_id: str
    identity: ProcessIdentity


def shard_mark(node_id: str, shard_id: str) -> dict[str, str]:
    """The environment entry that marks an engine of ``shard_id`` on ``node_id`` ({} without
    a node id)."""
    return {MARK_ENV: f"{node_id}/{shard_id}"} if node_id else {}


def marked_engines(node_id: str, proc: Path = PROC) -> list[MarkedEngine]:
    """The running session leaders marked as engines of ``node_id``, by pid."""
    if not node_id:
        return []
    prefix = f"{MARK_ENV}={node_id}/".encode()
    boot = boot_id(proc)
    found = []
    for entry in sorted(proc.iterdir(), key=lambda p: p.name):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        stat = read_stat(pid, proc)
        if stat is None or stat.session != pid or stat.state in _GONE:
            continue
        shard_id = _mark_of(entry / "environ", prefix)
        if shard_id:
            found.append(MarkedEngine(shard_id, ProcessIdentity(pid, stat.start_ticks, boot)))
    return found


def _mark_of(path: Path, prefix: bytes) -> str:
    try:
        environ = path.read_bytes()
    except OSError:  # another user's process, or gone meanwhile
        return ""
    for item in environ.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode("utf-8", "replace")
    return ""
