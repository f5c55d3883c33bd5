"""Which replica holds which KV cache block: the gateway's precise index.

Keys are llmgw block keys (``llmgw.kvcache.mirror.block_key``): 64-bit blake2b values, 0
meaning "unknown" (never indexed). The feed (``KvBlocks`` in protos/llmgw/v1/router.proto)
tells :class:`KvIndex` what each replica stores and removes; the precise routing tier asks
:meth:`KvIndex.match` how many leading blocks of a request each candidate holds.

**Layout.** :class:`KvIndex` keeps its keys in the sorted buckets of
``llmgw.kvcache.keys.KeySet`` (one replica's keys, the control server's store): ``2**bits``
``array('Q')``, a key living in bucket ``key >> (64 - bits)``, found with ``bisect`` (C),
64 to 512 keys a bucket on average. It keeps one index entry per distinct
key, shared by every replica holding it: beside each key (a parallel ``array('I')``) the
id of an interned *holder mask*, one bit per replica; 13.1 bytes per distinct key at 100
replicas × 100,000 blocks, less per (replica, block) when replicas share prefixes.
``match`` therefore costs one lookup per request block whatever the number of candidates.
The masks of keys it found lately are kept in a small dict (``_HOT_LIMIT`` keys, one dict
lookup each), so the next turn of a conversation, or a popular system prompt, costs less; every
store or removal of a key drops it from there, and the whole dict goes when a sweep ends
(a mask it holds may carry dead bits, harmless until they are reused).

**Resets without a pause.** A replica that resets (or is forgotten) gets a fresh bit at
once; its old bit is *dead*: lookups mask it out, and an incremental *sweep*, paid for in
small steps by later calls, strips dead bits bucket by bucket and drops entries left
without holders. A dead bit is reused only after a sweep that began after its death has
passed every bucket, so a stale entry can never be read as a new replica's block.

Everything runs on one event loop: no locks. Standard library and ``llmgw.kvcache`` only
(part of the routing core: no I/O). Figures: ``python -m bench.kvindex`` (BENCHMARKS.md).
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from llmgw.kvcache.keys import MAX_FILL, MIN_FILL, merge_buckets, split_buckets

__all__ = ["EVENT_LAG_BUCKETS", "KvIndex", "KvIndexStats"]

_SWEEP_PER_KEY: Final = 8  # index entries swept per key applied, while a sweep runs
_SWEEP_MIN: Final = 256  # ... and at least this many per call
_HOT_LIMIT: Final = 65_536  # keys whose holder masks `match` keeps at hand (then cleared)
_U64: Final = 1 << 64


EVENT_LAG_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
"""Upper bounds (seconds) of the event → index lag histogram."""


@dataclass(frozen=True, slots=True)
class KvIndexStats:
    """The index's size and what it has done (for metrics)."""

    replicas: int  # replicas holding at least one block
    keys: int  # distinct block keys indexed (entries)
    blocks: int  # (replica, block) pairs
    masks: int  # distinct holder sets interned
    resets: int  # resets that dropped a replica's blocks
    forgets: int  # replicas forgotten while holding blocks
    stored: int  # (replica, block) pairs added, ever
    removed: int  # (replica, block) pairs removed, ever
    sweeps: int  # sweeps completed
    sweeping: bool  # a sweep is under way (dead bits still in some entries)
    refused: int  # feed changes refused as malformed (`KvIndex.note_refused`)
    event_lags: int  # event → index lags observed (`KvIndex.note_event_lag`)
    event_lag_sum_s: float
    event_lag_max_s: float
    # lags per bucket of EVENT_LAG_BUCKETS (at most that bound, above the one before), and
    # the last one above every bound: a histogram's counts, not yet cumulative
    event_lag_counts: tuple[int, ...] = ()


class _Masks:
    """Interned holder masks: id ↔ mask, with a count of entries per id (id 0 = none)."""

    __slots__ = ("free", "ids", "masks", "refs")

    def __init__(self) -> None:
        self.masks: list[int] = [0]
        self.refs: list[int] = [0]
        self.ids: dict[int, int] = {0: 0}
        self.free: list[int] = []

    def intern(self, mask: int, count: int = 1) -> int:
        """The id of ``mask``, counted ``count`` more times (``mask`` is not 0)."""
        mid = self.ids.get(mask)
        if mid is None:
            if self.free:
                mid = self.free.pop()
                self.masks[mid] = mask
            else:
                mid = len(self.masks)
                self.masks.append(mask)
                self.refs.append(0)
            self.ids[mask] = mid
        self.refs[mid] += count
        return mid

    def release(self, mid: int, count: int = 1) -> None:
        refs = self.refs[mid] - count
        self.refs[mid] = refs
        if not refs:
            del self.ids[self.masks[mid]]
            self.masks[mid] = 0
            self.free.append(mid)

    def __len__(self) -> int:
        return len(self.ids) - 1


class KvIndex:
    """Block keys → the replicas holding them, for the precise routing tier.

    ``apply`` folds one feed change of one replica in; ``match`` counts, per candidate,
    the request's leading blocks it holds. ``forget`` and resets cost O(1) at once (the
    sweep finishes the job in small steps later). Keys outside 1..2**64-1 are ignored
    (``match`` counts them as misses).
    """

    def __init__(self) -> None:
        self._bits = 0
        self._keys: list[array[int]] = [array("Q")]
        self._vals: list[array[int]] = [array("I")]
        self._len = 0
        self._masks = _Masks()
        self._bit: dict[str, int] = {}  # replica → its bit (a power of two)
        self._blocks: dict[str, int] = {}  # replica → how many entries carry its bit
        self._block_size: dict[str, int] = {}  # replica → tokens per block, as last told
        self._live = 0  # every replica's bit
        self._free_bits: list[int] = []  # bit numbers free for reuse (a heap)
        self._next_bit = 0
        self._dead = 0  # bits that died since the running sweep began
        self._sweeping = 0  # bits the running sweep strips
        self._sweep_at = -1  # the running sweep's next bucket; -1: none runs
        self._hot: dict[int, int] = {}  # key → holder mask, of keys `match` found lately
        self._counts = Counter[str]()
        self._lag_max = 0.0
        self._lag_sum = 0.0
        self._lag_counts = [0] * (len(EVENT_LAG_BUCKETS) + 1)

    # -- reading ------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Distinct keys indexed."""
        return self._len

    def replicas(self) -> list[str]:
        """Replicas holding at least one block, sorted."""
        return sorted(r for r, n in self._blocks.items() if n)

    def block_size(self, replica_id: str) -> int:
        """Tokens per block in ``replica_id``'s events, as the feed last said (0: unknown)."""
        return self._block_size.get(replica_id, 0)

    def blocks_of(self, replica_id: str) -> int:
        """How many blocks ``replica_id`` holds."""
        return self._blocks.get(replica_id, 0)

    def holds(self, replica_id: str, key: int) -> bool:
        bit = self._bit.get(replica_id, 0)
        return bool(bit and self._mask_of(key) & bit)

    def keys_of(self, replica_id: str) -> list[int]:
        """Every key ``replica_id`` holds, ascending (a full scan: tests and tools)."""
        bit = self._bit.get(replica_id, 0)
        masks = self._masks.masks
        return [k for ks, vs in zip(self._keys, self._vals, strict=True)
                for k, v in zip(ks, vs, strict=True) if masks[v] & bit]  # fmt: skip

    def match(self, keys: Sequence[int], candidates: Iterable[str]) -> dict[str, int]:
        """For each candidate replica id, how many of ``keys`` (a request's block keys, in
        order) it holds from the first on, stopping at its first miss."""
        found = dict.fromkeys(candidates, 0)
        owner: dict[int, str] = {}  # bit → candidate holding any block
        for replica_id in found:
            if self._blocks.get(replica_id):
                owner[self._bit[replica_id]] = replica_id
        alive = sum(owner)  # distinct bits: the sum is their union
        depth, hot = 0, self._hot
        shift, buckets, vals, masks = 64 - self._bits, self._keys, self._vals, self._masks.masks
        for key in keys:
            if not alive:
                return found
            mask = hot.get(key)
            if mask is None:  # `_mask_of`, inlined: this loop is the precise tier's cost
                mask = 0
                if 0 < key < _U64:
                    index = key >> shift
                    bucket = buckets[index]
                    i = bisect_left(bucket, key)
                    if i < len(bucket) and bucket[i] == key:
                        mask = masks[vals[index][i]]
                        if len(hot) >= _HOT_LIMIT:
                            hot.clear()
                        hot[key] = mask
            mask &= alive
            if mask != alive:
                _settle(found, owner, alive ^ mask, depth)  # they miss this block
                alive = mask
            depth += 1
        _settle(found, owner, alive, depth)
        return found

    def stats(self) -> KvIndexStats:
        counts = self._counts
        return KvIndexStats(
            replicas=sum(1 for n in self._blocks.values() if n),
            keys=self._len,
            blocks=sum(self._blocks.values()),
            masks=len(self._masks),
            resets=counts["resets"],
            forgets=counts["forgets"],
            stored=counts["stored"],
            removed=counts["removed"],
            sweeps=counts["sweeps"],
            sweeping=self._sweep_at >= 0,
            refused=counts["refused"],
            event_lags=counts["lags"],
            event_lag_sum_s=self._lag_sum,
            event_lag_max_s=self._lag_max,
            event_lag_counts=tuple(self._lag_counts),
        )

    def note_refused(self) -> None:
        """Count a feed change that could not be applied (malformed)."""
        self._counts["refused"] += 1

    def note_event_lag(self, seconds: float) -> None:
        """Record the time from an engine's event to this index (for metrics)."""
        self._counts["lags"] += 1
        self._lag_sum += seconds
        self._lag_max = max(self._lag_max, seconds)
        self._lag_counts[bisect_left(EVENT_LAG_BUCKETS, seconds)] += 1

    # -- writing ------------------------------------------------------------------------------

    def apply(
        self,
        replica_id: str,
        reset: bool,
        stored_keys: Iterable[int] = (),
        removed_keys: Iterable[int] = (),
        *,
        block_size: int = 0,
    ) -> None:
        """Fold one change of ``replica_id`` in: ``reset`` (forget its blocks), then
        ``removed_keys``, then ``stored_keys``. Keys are 64-bit; 0 ("unknown") is skipped.
        A ``block_size`` other than 0 is remembered as the replica's (`block_size`)."""
        if block_size:
            self._block_size[replica_id] = block_size
        if reset:
            self._retire(replica_id, "resets")
        removed = removed_keys if isinstance(removed_keys, Sequence) else list(removed_keys)
        if removed and self._blocks.get(replica_id):
            self._remove(replica_id, removed)
        stored = stored_keys if isinstance(stored_keys, Sequence) else list(stored_keys)
        if stored:
            self._store(replica_id, stored)
        self.sweep(_SWEEP_MIN + _SWEEP_PER_KEY * (len(stored) + len(removed)))

    def forget(self, replica_id: str) -> None:
        """Drop every block of ``replica_id`` (it is gone)."""
        self._retire(replica_id, "forgets")
        bit = self._bit.pop(replica_id, None)
        if bit is not None:  # it held nothing: no entry carries its bit, free it at once
            self._live &= ~bit
            heapq.heappush(self._free_bits, bit.bit_length() - 1)
        self._blocks.pop(replica_id, None)
        self._block_size.pop(replica_id, None)
        self.sweep(_SWEEP_MIN)

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Forget every replica not in ``replica_ids``."""
        keep = set(replica_ids)
        for replica_id in [r for r in {*self._bit, *self._block_size} if r not in keep]:
            self.forget(replica_id)

    def sweep(self, budget: int) -> None:
        """Advance a running sweep by about ``budget`` entries (nothing when none runs)."""
        while budget > 0 and self._sweep_at >= 0:
            if self._sweep_at >= len(self._keys):
                self._end_sweep()
                continue
            budget -= 1 + self._sweep_bucket(self._sweep_at)
            self._sweep_at += 1

    # -- replicas' bits -----------------------------------------------------------------------

    def _bit_of(self, replica_id: str) -> int:
        bit = self._bit.get(replica_id)
        if bit is None:
            number = heapq.heappop(self._free_bits) if self._free_bits else self._next_bit
            self._next_bit = max(self._next_bit, number + 1)
            bit = self._bit[replica_id] = 1 << number
            self._live |= bit
            self._blocks.setdefault(replica_id, 0)
        return bit

    def _retire(self, replica_id: str, why: str) -> None:
        """``replica_id`` holds nothing from now on: its bit dies (kept when it held none)."""
        if not self._blocks.get(replica_id):
            return
        self._counts[why] += 1
        bit = self._bit.pop(replica_id)
        self._blocks[replica_id] = 0
        self._live &= ~bit
        self._dead |= bit
        if self._sweep_at < 0:
            self._start_sweep()

    def _start_sweep(self) -> None:
        self._sweeping, self._dead = self._dead, 0
        self._sweep_at = 0 if self._sweeping else -1

    def _end_sweep(self) -> None:
        bits, number = self._sweeping, 0
        while bits:
            if bits & 1:
                heapq.heappush(self._free_bits, number)
            bits >>= 1
            number += 1
        self._counts["sweeps"] += 1
        self._hot.clear()  # its masks may carry the bits freed now
        self._start_sweep()

    def _sweep_bucket(self, index: int) -> int:
        """Strip dead bits from one bucket's entries; the entries looked at."""
        vals = self._vals[index]
        live, masks = self._live, self._masks
        remap = {mid: masks.masks[mid] & live for mid in set(vals) if masks.masks[mid] & ~live}
        if not remap:
            return len(vals)
        counts = Counter(vals)
        new_ids: dict[int, int] = {}
        for mid, mask in remap.items():
            new_ids[mid] = masks.intern(mask, counts[mid]) if mask else 0
            masks.release(mid, counts[mid])
        keys = self._keys[index]
        if 0 in new_ids.values():
            kept = [(k, new_ids.get(v, v)) for k, v in zip(keys, vals, strict=True)]
            kept = [(k, v) for k, v in kept if v]
            self._len -= len(keys) - len(kept)
            self._keys[index] = array("Q", [k for k, _ in kept])
            self._vals[index] = array("I", [v for _, v in kept])
        else:
            self._vals[index] = array("I", [new_ids.get(v, v) for v in vals])
        return len(vals)

    # -- entries ------------------------------------------------------------------------------

    def _store(self, replica_id: str, stored: Sequence[int]) -> None:
        bit = self._bit_of(replica_id)
        masks, live, hot = self._masks, self._live, self._hot
        shift, added = 64 - self._bits, 0
        for key in stored:
            if not 0 < key < _U64:
                continue
            index = key >> shift
            bucket = self._keys[index]
            i = bisect_left(bucket, key)
            if i < len(bucket) and bucket[i] == key:
                vals = self._vals[index]
                old = vals[i]
                mask = masks.masks[old]
                if mask & bit:
                    continue
                vals[i] = masks.intern((mask | bit) & live)
                masks.release(old)
                hot.pop(key, None)
            else:  # (`hot` may remember it from before a sweep dropped its entry)
                bucket.insert(i, key)
                self._vals[index].insert(i, masks.intern(bit))
                hot.pop(key, None)
                self._len += 1
                if self._len > MAX_FILL << self._bits:
                    self._resize(+1)
                    shift = 64 - self._bits
            added += 1
        self._blocks[replica_id] += added
        self._counts["stored"] += added

    def _remove(self, replica_id: str, removed: Sequence[int]) -> None:
        bit = self._bit[replica_id]
        masks, live, hot = self._masks, self._live, self._hot
        gone = 0
        for key in removed:
            if not 0 < key < _U64:
                continue
            index = key >> (64 - self._bits)
            bucket = self._keys[index]
            i = bisect_left(bucket, key)
            if i == len(bucket) or bucket[i] != key:
                continue
            vals = self._vals[index]
            old = vals[i]
            mask = masks.masks[old]
            if not mask & bit:
                continue
            gone += 1
            hot.pop(key, None)
            mask &= live & ~bit
            masks.release(old)
            if mask:
                vals[i] = masks.intern(mask)
                continue
            del bucket[i]
            del vals[i]
            self._len -= 1
            if self._bits and self._len < MIN_FILL << self._bits:
                self._resize(-1)
        self._blocks[replica_id] -= gone
        self._counts["removed"] += gone

    def _resize(self, step: int) -> None:
        """Double (+1) or halve (-1) the buckets; a running sweep keeps its place."""
        if step > 0:
            self._keys = split_buckets(self._keys, self._bits)
            self._vals = [part for i, vals in enumerate(self._vals)
                          for part in _cut(vals, len(self._keys[2 * i]))]  # fmt: skip
            self._sweep_at = self._sweep_at * 2 if self._sweep_at > 0 else self._sweep_at
        else:
            self._keys, self._vals = merge_buckets(self._keys), merge_buckets(self._vals)
            self._sweep_at = self._sweep_at // 2 if self._sweep_at > 0 else self._sweep_at
        self._bits += step

    def _mask_of(self, key: int) -> int:
        if not 0 < key < _U64:
            return 0
        index = key >> (64 - self._bits)
        bucket = self._keys[index]
        i = bisect_left(bucket, key)
        if i < len(bucket) and bucket[i] == key:
            return self._masks.masks[self._vals[index][i]]
        return 0


def _settle(found: dict[str, int], owner: dict[int, str], bits: int, depth: int) -> None:
    """Set ``depth`` as the match of every candidate whose bit is in ``bits``."""
    while bits:
        low = bits & -bits
        found[owner[low]] = depth
        bits ^= low


def _cut(values: array[int], at: int) -> tuple[array[int], array[int]]:
    return values[:at], values[at:]
