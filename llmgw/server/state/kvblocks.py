"""The control server's store of KV cache blocks per replica, fed by agents, read by gateways.

Agents send ``KvDelta`` messages up their stream (protos/llmgw/v1/agent.proto): per engine
(shard) and data-parallel rank, a reset, removed blocks and stored blocks, each block as a
vLLM hash and an llmgw block key (``llmgw.kvcache.mirror.block_key``; 0 when unknown).
:func:`decode_kv_delta` checks one and keeps the keys; a malformed one raises
:class:`KvDeltaRefused` and changes nothing (the stream goes on). :class:`KvBlocks` keeps,
per replica and rank, the set of keys held (a :class:`~llmgw.kvcache.keys.KeySet`:
~8.7 bytes a key); the vLLM hashes are not kept, a key names a block's content as the hash
does.

**Whose blocks.** Only a replica's leader shard (rank 0 of its plan) serves HTTP, so only
its engine's blocks are the replica's, and only from the node the plan puts it on
(:func:`leader_replica`). A delta of any other shard, of a RETIRED replica, of a shard
reported STOPPED or FAILED, or from a stream that no longer owns its node is ignored and
counted. A replica's blocks are dropped when its leader is reported STOPPED, FAILED,
PENDING or STARTING (a stopped or freshly started engine holds nothing we know of), when it
is RETIRED, and when its node's stream ends or it registers again (its new stream starts
with a full copy of every engine); a node NOT_READY only for want of heartbeats keeps them,
as its stream carries every change since, in order, once it speaks again. Every rank of a
replica counts as the replica: a gateway sees the union.

**Feed.** Each gateway's feed holds a :class:`KvWatcher`. A change marks, per watcher and
replica, the keys it touched (8 bytes each); a reset or a drop marks the replica for a full
copy instead. When the feed is ready to send, :meth:`KvWatcher.take` turns the marks into
``KvBlocks`` events: a full copy (reset first, in chunks) or the touched keys split into
held (stored) and not held (removed), so changes within one window coalesce. A watcher
that falls ``touched_limit`` keys behind on a replica gets a full copy of it instead of an
ever longer list: its memory stays bounded, as the watch hub's resync bounds it for the
rest of the feed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from llmgw.api.llmgw.v1 import KvBlocks as KvBlocksEvent
from llmgw.api.llmgw.v1 import KvDelta, Shard, ShardState
from llmgw.kvcache.keys import KeySet, pack_keys, unpack_keys
from llmgw.protocol import read_shard_state
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord
from llmgw.server.errors import ServerError

log = logging.getLogger(__name__)

__all__ = [
    "DROP_STATES",
    "MAX_DATA_PARALLEL_RANK",
    "UNIQUE_SAMPLE_KEYS",
    "DecodedKvDelta",
    "KvBlocks",
    "KvBlocksStats",
    "KvDeltaRefused",
    "KvWatcher",
    "decode_kv_delta",
    "leader_replica",
]

MAX_DATA_PARALLEL_RANK = 4095
"""The highest data-parallel rank accepted (each rank costs a set)."""

UNIQUE_SAMPLE_KEYS = 65_536
"""`KvBlocks.unique_blocks` counts exactly up to this many keys in all, then samples."""

DROP_STATES = frozenset(
    {ShardState.STOPPED, ShardState.FAILED, ShardState.PENDING, ShardState.STARTING}
)
"""Leader states in which a replica's blocks are dropped."""

_REFUSE_STATES = frozenset({ShardState.STOPPED, ShardState.FAILED})
"""Leader states in which deltas are ignored (an engine that is not running)."""

_WARN_EVERY_S = 10.0  # at most one malformed-delta warning per node per interval


class KvDeltaRefused(ServerError):
    """A ``KvDelta`` that is malformed; the message says what was wrong."""


@dataclass(frozen=True, slots=True)
class DecodedKvDelta:
    """One checked ``KvDelta``: apply ``reset``, then ``removed_keys``, then ``stored_keys``
    (block keys; 0 where unknown)."""

    shard_id: str
    rank: int
    reset: bool
    stored_keys: array[int]
    removed_keys: array[int]
    block_size: int = 0
    oldest_event_ts: float = 0.0  # engine's unix time of the oldest event reflected; 0: none


def _packed(delta: KvDelta, name: str) -> int:
    """How many 8-byte words a packed field holds; KvDeltaRefused when it is not whole."""
    size = len(getattr(delta, name))
    if size % 8:
        raise KvDeltaRefused(f"KvDelta.{name}: {size} bytes is not a multiple of 8")
    return size // 8


def _keys(delta: KvDelta, name: str, hashes: int) -> array[int]:
    count = _packed(delta, name)
    if count not in (0, hashes):
        raise KvDeltaRefused(
            f"KvDelta.{name}: {count} keys for {hashes} block hashes (must match, or be empty)"
        )
    return unpack_keys(getattr(delta, name))


def decode_kv_delta(delta: KvDelta) -> DecodedKvDelta:
    """Check one agent's ``KvDelta``; raises KvDeltaRefused naming the fault."""
    if not delta.shard_id:
        raise KvDeltaRefused("KvDelta.shard_id is empty")
    if delta.data_parallel_rank > MAX_DATA_PARALLEL_RANK:
        raise KvDeltaRefused(
            f"KvDelta.data_parallel_rank {delta.data_parallel_rank} is above "
            f"{MAX_DATA_PARALLEL_RANK}"
        )
    ts = delta.oldest_event_ts
    if not math.isfinite(ts) or ts < 0:
        raise KvDeltaRefused(f"KvDelta.oldest_event_ts {ts!r} is not a time")
    stored = _keys(delta, "stored_keys", _packed(delta, "stored"))
    removed = _keys(delta, "removed_keys", _packed(delta, "removed"))
    return DecodedKvDelta(
        delta.shard_id,
        delta.data_parallel_rank,
        delta.reset,
        stored,
        removed,
        delta.block_size,
        ts,
    )


def leader_replica(
    shard_id: str,
    node_id: str,
    shards: Mapping[str, Shard],
    replicas: Mapping[str, ReplicaRecord],
) -> str | None:
    """The replica whose blocks ``shard_id``'s engine on ``node_id`` publishes, or None:
    the shard must be reported from that node, not STOPPED or FAILED, and be the planned
    leader, on that node, of a replica that is not RETIRED."""
    shard = shards.get(shard_id)
    if shard is None or shard.node_id != node_id:
        return None
    state = read_shard_state(shard.status.state) if shard.status is not None else None
    if state in _REFUSE_STATES:
        return None
    record = replicas.get(shard.replica_id)
    if record is None or record.lifecycle is Lifecycle.RETIRED:
        return None
    leader = record.plan.leader
    if leader.shard_id != shard_id or leader.node_id != node_id:
        return None
    return record.plan.replica_id


@dataclass(frozen=True, slots=True)
class KvBlocksStats:
    """The store's size and what it has seen (for metrics and tests)."""

    replicas: int  # replicas holding at least one block
    blocks: int  # (replica, rank, block) entries held
    deltas: int  # deltas applied
    stored: int  # keys added, ever
    removed: int  # keys removed, ever
    resets: int  # deltas with reset applied
    malformed: int  # deltas refused as malformed
    ignored: int  # deltas not applied: not a leader, a stopped engine, an old stream
    drops: int  # replicas whose blocks were dropped
    watchers: int  # feeds following the store


@dataclass(slots=True)
class _Replica:
    """The blocks one replica holds, per rank, and who feeds them."""

    node_id: str
    shard_id: str
    ranks: dict[int, KeySet] = field(default_factory=dict)
    block_size: int = 0

    def holds(self, key: int) -> bool:
        return any(key in keys for keys in self.ranks.values())

    def keys(self) -> array[int]:
        """Every key of every rank, ascending."""
        if len(self.ranks) == 1:
            return next(iter(self.ranks.values())).to_array()
        union: set[int] = set()
        for keys in self.ranks.values():
            union.update(keys)
        return array("Q", sorted(union))


class KvBlocks:
    """Every replica's blocks, as its leader's agent reports them (one event loop)."""

    def __init__(self, *, touched_limit: int = 32_768, chunk: int = 32_768) -> None:
        self.touched_limit = touched_limit
        self.chunk = chunk
        self._replicas: dict[str, _Replica] = {}
        self._watchers: set[KvWatcher] = set()
        self._counts = Counter[str]()
        self._warned: dict[str, float] = {}  # node → when its last malformed delta was logged

    # -- reading ------------------------------------------------------------------------------

    def replica_ids(self) -> list[str]:
        """Replicas the store holds anything of, sorted."""
        return sorted(self._replicas)

    def keys(self, replica_id: str) -> array[int]:
        """Every key ``replica_id`` holds (all ranks), ascending."""
        replica = self._replicas.get(replica_id)
        return replica.keys() if replica is not None else array("Q")

    def holds(self, replica_id: str, key: int) -> bool:
        replica = self._replicas.get(replica_id)
        return replica is not None and replica.holds(key)

    def ranks(self, replica_id: str) -> int:
        """How many data-parallel ranks of ``replica_id`` reported blocks."""
        replica = self._replicas.get(replica_id)
        return len(replica.ranks) if replica is not None else 0

    def block_size(self, replica_id: str) -> int:
        replica = self._replicas.get(replica_id)
        return replica.block_size if replica is not None else 0

    def unique_blocks(self, replica_ids: Iterable[str]) -> dict[str, int]:
        """For each of ``replica_ids``, how many of its keys (all ranks) no other of them
        holds: what the group's prefix caches would lose with it alone.

        Exact while they hold at most `UNIQUE_SAMPLE_KEYS` keys in all; beyond that it is
        estimated from the keys in the lowest 1/2**k of the key space (block keys are
        hashes, so that share is a uniform sample of every replica's blocks), scaled up:
        the work stays bounded (a deployment of 8 replicas of 100,000 blocks each is
        counted on about 50,000 keys)."""
        ids = list(dict.fromkeys(replica_ids))
        arrays = {replica_id: self.keys(replica_id) for replica_id in ids}
        share = 1
        while sum(len(keys) for keys in arrays.values()) > UNIQUE_SAMPLE_KEYS * share:
            share *= 2
        below = (1 << 64) // share
        held = {r: set(keys[: bisect_left(keys, below)]) for r, keys in arrays.items()}
        seen: set[int] = set()
        shared: set[int] = set()  # keys two or more of them hold
        for keys in held.values():
            shared |= seen & keys
            seen |= keys
        return {replica_id: len(keys - shared) * share for replica_id, keys in held.items()}

    def stats(self) -> KvBlocksStats:
        counts = self._counts
        sizes = [sum(len(k) for k in r.ranks.values()) for r in self._replicas.values()]
        return KvBlocksStats(
            replicas=sum(1 for n in sizes if n),
            blocks=sum(sizes),
            deltas=counts["deltas"],
            stored=counts["stored"],
            removed=counts["removed"],
            resets=counts["resets"],
            malformed=counts["malformed"],
            ignored=counts["ignored"],
            drops=counts["drops"],
            watchers=len(self._watchers),
        )

    # -- writing ------------------------------------------------------------------------------

    def apply(self, node_id: str, replica_id: str | None, delta: DecodedKvDelta) -> None:
        """Apply one delta of ``replica_id``'s leader on ``node_id`` (None: not a leader's,
        counted as ignored)."""
        if replica_id is None:
            self.ignore()
            return
        replica = self._replicas.get(replica_id)
        if replica is None or (replica.node_id, replica.shard_id) != (node_id, delta.shard_id):
            if replica is not None:  # fed by another engine from now on: start afresh
                self.drop(replica_id, f"now fed by {delta.shard_id} on {node_id}")
            replica = self._replicas[replica_id] = _Replica(node_id, delta.shard_id)
        self._apply(replica_id, replica, delta)

    def _apply(self, replica_id: str, replica: _Replica, delta: DecodedKvDelta) -> None:
        keys = replica.ranks.get(delta.rank)
        if keys is None or delta.reset:
            keys = replica.ranks[delta.rank] = KeySet()
        if delta.block_size:
            replica.block_size = delta.block_size
        removed = keys.difference_update(delta.removed_keys) if delta.removed_keys else 0
        stored = keys.update(delta.stored_keys) if delta.stored_keys else 0
        counts = self._counts
        counts["deltas"] += 1
        counts["resets"] += delta.reset
        counts["stored"] += stored
        counts["removed"] += removed
        for watcher in self._watchers:
            watcher.changed(replica_id, delta)

    def ignore(self) -> None:
        """Count a delta that is not applied (not a leader's, or from an old stream)."""
        self._counts["ignored"] += 1

    def refused(self, node_id: str, error: KvDeltaRefused) -> None:
        """Count a malformed delta from ``node_id``; logged at most every 10 s per node."""
        self._counts["malformed"] += 1
        now = time.monotonic()
        if now - self._warned.get(node_id, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self._warned[node_id] = now
            log.warning("node %s: KV delta refused (%s)", node_id, error)
        else:
            log.debug("node %s: KV delta refused (%s)", node_id, error)

    def drop(self, replica_id: str, reason: str) -> None:
        """Forget every block of ``replica_id``; gateways are told."""
        replica = self._replicas.pop(replica_id, None)
        if replica is None:
            return
        self._counts["drops"] += 1
        held = sum(len(keys) for keys in replica.ranks.values())
        log.info("replica %s: %d KV blocks dropped (%s)", replica_id, held, reason)
        for watcher in self._watchers:
            watcher.mark_full((replica_id,))

    def drop_node(self, node_id: str, reason: str) -> None:
        """Drop the blocks of every replica fed from ``node_id``."""
        for replica_id in [r for r, rep in self._replicas.items() if rep.node_id == node_id]:
            self.drop(replica_id, reason)

    def drop_shard(self, shard_id: str, reason: str) -> None:
        """Drop the blocks of every replica fed by ``shard_id``'s engine."""
        for replica_id in [r for r, rep in self._replicas.items() if rep.shard_id == shard_id]:
            self.drop(replica_id, reason)

    def shard_state(self, shard_id: str, state: ShardState) -> None:
        """A shard's reported state: a leader in one of `DROP_STATES` loses its blocks."""
        if state in DROP_STATES:
            self.drop_shard(shard_id, f"its leader shard {shard_id} is {state.name}")

    # -- feeds --------------------------------------------------------------------------------

    def watch(self) -> KvWatcher:
        """A new feed's watcher (a context manager: it stops watching on exit). It notes
        changes from now on; it owes full copies only once told (`KvWatcher.mark_full`,
        which the feed calls after its snapshot) or when a replica resets or is dropped."""
        watcher = KvWatcher(self)
        self._watchers.add(watcher)
        return watcher

    def _unwatch(self, watcher: KvWatcher) -> None:
        self._watchers.discard(watcher)


@dataclass(slots=True)
class _Touched:
    """Keys a watcher owes, in the order they changed, and whether each was stored (1) or
    removed (0) then: about 9 bytes a change."""

    keys: array[int] = field(default_factory=lambda: array("Q"))
    stored: bytearray = field(default_factory=bytearray)

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, removed: array[int], stored: array[int]) -> None:
        self.keys += removed
        self.stored += bytes(len(removed))
        self.keys += stored
        self.stored += b"\x01" * len(stored)

    def last(self) -> dict[int, int]:
        """Each key's last change (1: stored, 0: removed); 0 (unknown) left out."""
        changes = dict(zip(self.keys, self.stored, strict=True))
        changes.pop(0, None)
        return changes


class KvWatcher:
    """What one feed still owes a gateway, per replica: a full copy or touched keys."""

    def __init__(self, blocks: KvBlocks) -> None:
        self._blocks = blocks
        self._full: set[str] = set()
        self._touched: dict[str, _Touched] = {}
        self._ts: dict[str, float] = {}
        self.wakeup = asyncio.Event()

    def __enter__(self) -> KvWatcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._blocks._unwatch(self)
        self._full.clear()
        self._touched.clear()

    @property
    def pending(self) -> bool:
        return bool(self._full or self._touched)

    def mark_full(self, replica_ids: Iterable[str]) -> None:
        """Owe a full copy of each replica (after a snapshot; a reset; a drop)."""
        for replica_id in replica_ids:
            self._full.add(replica_id)
            self._touched.pop(replica_id, None)
        self.wakeup.set()

    def changed(self, replica_id: str, delta: DecodedKvDelta) -> None:
        if delta.oldest_event_ts:
            ts = self._ts.get(replica_id, 0.0)
            self._ts[replica_id] = min(ts, delta.oldest_event_ts) if ts else delta.oldest_event_ts
        if replica_id in self._full:
            return
        if delta.reset:
            self.mark_full((replica_id,))
            return
        touched = self._touched.get(replica_id)
        if touched is None:
            touched = self._touched[replica_id] = _Touched()
        touched.add(delta.removed_keys, delta.stored_keys)
        if len(touched) > self._blocks.touched_limit:
            self.mark_full((replica_id,))
        self.wakeup.set()

    def take(self, max_keys: int) -> list[KvBlocksEvent]:
        """Events for what is owed, replica by replica, until about ``max_keys`` keys are
        in them (at least one replica's worth); the rest stays owed."""
        out: list[KvBlocksEvent] = []
        sent = 0
        while self.pending and sent < max_keys:
            if self._full:
                replica_id = min(self._full)
                self._full.discard(replica_id)
                events = self._full_copy(replica_id)
            else:
                replica_id = min(self._touched)
                events = self._changes(replica_id, self._touched.pop(replica_id))
            sent += sum(len(e.stored_keys) + len(e.removed_keys) for e in events) // 8 + 1
            out += events
        if not self.pending:
            self.wakeup.clear()
        return out

    def _full_copy(self, replica_id: str) -> list[KvBlocksEvent]:
        keys = self._blocks.keys(replica_id)
        chunk = max(1, self._blocks.chunk)
        parts = [keys[i : i + chunk] for i in range(0, len(keys), chunk)] or [array("Q")]
        return [self._event(replica_id, i == 0, part, ()) for i, part in enumerate(parts)]

    def _changes(self, replica_id: str, touched: _Touched) -> list[KvBlocksEvent]:
        """Net changes: a key's last change says whether the replica holds it now (with
        several ranks, a key one rank removed may still be held by another)."""
        blocks = self._blocks
        last = touched.last()
        stored = sorted(key for key, held in last.items() if held)
        removed = sorted(key for key, held in last.items() if not held)
        if blocks.ranks(replica_id) > 1:
            still = {key for key in removed if blocks.holds(replica_id, key)}
            removed = [key for key in removed if key not in still]
            stored = sorted(still.union(stored))
        chunk = max(1, blocks.chunk)
        events = [self._event(replica_id, False, (), removed[i : i + chunk])
                  for i in range(0, len(removed), chunk)]  # fmt: skip
        events += [self._event(replica_id, False, stored[i : i + chunk], ())
                   for i in range(0, len(stored), chunk)]  # fmt: skip
        return events

    def _event(
        self, replica_id: str, reset: bool, stored: Iterable[int], removed: Iterable[int]
    ) -> KvBlocksEvent:
        return KvBlocksEvent(
            replica_id=replica_id,
            reset=reset,
            stored_keys=pack_keys(stored),
            removed_keys=pack_keys(removed),
            block_size=self._blocks.block_size(replica_id),
            oldest_event_ts=self._ts.pop(replica_id, 0.0),
        )
