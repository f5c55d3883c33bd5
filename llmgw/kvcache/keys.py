"""llmgw block keys on the wire and in memory: one codec and one compact set.

Keys are llmgw block keys (``llmgw.kvcache.mirror.block_key``): 64-bit values, 0 meaning
"unknown". On the wire (``KvDelta`` from the agent, ``KvBlocks`` on the router feed) a list
of keys is 8-byte big-endian words, concatenated: :func:`pack_keys` and :func:`unpack_keys`
are the one codec every room uses.

:class:`KeySet` is one replica's keys (the control server's KV block store) in *sorted
buckets*: ``2**bits`` ``array('Q')``, a key living in bucket ``key >> (64 - bits)``, found
with ``bisect`` (C); ``bits`` grows and shrinks so that a bucket holds :data:`MIN_FILL` to
:data:`MAX_FILL` keys on average (keys are blake2b outputs, so buckets fill evenly). A key
costs 8 bytes (plus about 6 % of array slack) instead of the ~78 a Python ``set`` of ints
spends. The gateway's ``KvIndex`` keeps its keys in the same layout
(:func:`split_buckets`, :func:`merge_buckets`).

Standard library only.
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import Final

__all__ = [
    "MAX_FILL",
    "MIN_FILL",
    "KeySet",
    "merge_buckets",
    "pack_keys",
    "split_buckets",
    "unpack_keys",
]

MAX_FILL: Final = 512  # keys per bucket on average before the buckets double
MIN_FILL: Final = 64  # ... and below which they halve
_BULK: Final = 1024  # a batch at least this big (and 1/8 of the set) rebuilds a KeySet
_LITTLE: Final = sys.byteorder == "little"
_U64: Final = 1 << 64


def pack_keys(keys: Iterable[int]) -> bytes:
    """64-bit keys as 8-byte big-endian words, concatenated (the feed's wire form).
    OverflowError for a key outside 0..2**64-1."""
    packed = keys if isinstance(keys, array) and keys.typecode == "Q" else array("Q", keys)
    if _LITTLE:
        packed = array("Q", packed)
        packed.byteswap()
    return packed.tobytes()


def unpack_keys(data: bytes) -> array[int]:
    """The inverse of `pack_keys`; ValueError when the length is not a multiple of 8."""
    if len(data) % 8:
        raise ValueError(f"packed keys: {len(data)} bytes is not a multiple of 8")
    keys = array("Q")
    keys.frombytes(data)
    if _LITTLE:
        keys.byteswap()
    return keys


def split_buckets(buckets: list[array[int]], bits: int) -> list[array[int]]:
    """Sorted buckets of ``bits`` bits as buckets of ``bits + 1`` bits (same keys)."""
    out: list[array[int]] = []
    half = 63 - bits  # the bit that picks the upper half of a bucket
    for index, keys in enumerate(buckets):
        cut = bisect_left(keys, ((index << 1) | 1) << half)
        out += (keys[:cut], keys[cut:])
    return out


def merge_buckets(buckets: list[array[int]]) -> list[array[int]]:
    """Sorted buckets as buckets of one bit less (pairs concatenated)."""
    return [buckets[i] + buckets[i + 1] for i in range(0, len(buckets), 2)]


def _bucketed(keys: Sequence[int], bits: int) -> list[array[int]]:
    """Sorted distinct ``keys`` cut into ``2**bits`` buckets."""
    out: list[array[int]] = []
    shift, start = 64 - bits, 0
    for index in range(1, (1 << bits) + 1):
        end = bisect_left(keys, index << shift) if index < (1 << bits) else len(keys)
        out.append(array("Q", keys[start:end]))
        start = end
    return out


class KeySet:
    """A set of 64-bit keys (0 ignored) in sorted buckets: about 8.7 bytes a key.

    Iteration is in ascending key order. Adding returns whether the key was new, removing
    whether it was there, so a caller can count exactly.
    """

    __slots__ = ("_bits", "_buckets", "_len")

    def __init__(self, keys: Iterable[int] = ()) -> None:
        self._bits = 0
        self._buckets: list[array[int]] = [array("Q")]
        self._len = 0
        self.update(keys)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, key: object) -> bool:
        if type(key) is not int or not 0 < key < _U64:
            return False
        keys = self._buckets[key >> (64 - self._bits)]
        i = bisect_left(keys, key)
        return i < len(keys) and keys[i] == key

    def __iter__(self) -> Iterator[int]:
        for keys in self._buckets:
            yield from keys

    def to_array(self) -> array[int]:
        """Every key, ascending, in one array."""
        out = array("Q")
        for keys in self._buckets:
            out += keys
        return out

    def add(self, key: int) -> bool:
        """Add ``key``; True when it was not there (keys outside 1..2**64-1 are ignored)."""
        return self._add_all((key,)) == 1

    def discard(self, key: int) -> bool:
        """Remove ``key``; True when it was there."""
        return self._discard_all((key,)) == 1

    def update(self, keys: Iterable[int]) -> int:
        """Add every key; how many were new. A big batch rebuilds the set in one sort."""
        batch = keys if isinstance(keys, (array, list, tuple)) else list(keys)
        if len(batch) >= _BULK and len(batch) * 8 >= self._len:
            before = self._len
            merged = {key for key in batch if 0 < key < _U64}
            merged.update(self)
            self._rebuild(sorted(merged))
            return self._len - before
        return self._add_all(batch)

    def difference_update(self, keys: Iterable[int]) -> int:
        """Remove every key; how many were there."""
        return self._discard_all(keys)

    def _add_all(self, batch: Iterable[int]) -> int:
        added, shift, buckets = 0, 64 - self._bits, self._buckets
        for key in batch:
            if not 0 < key < _U64:
                continue
            keys = buckets[key >> shift]
            i = bisect_left(keys, key)
            if i < len(keys) and keys[i] == key:
                continue
            keys.insert(i, key)
            added += 1
            if self._len + added > MAX_FILL << self._bits:
                self._buckets = buckets = split_buckets(buckets, self._bits)
                self._bits += 1
                shift -= 1
        self._len += added
        return added

    def _discard_all(self, batch: Iterable[int]) -> int:
        gone, shift, buckets = 0, 64 - self._bits, self._buckets
        for key in batch:
            if not 0 < key < _U64:
                continue
            keys = buckets[key >> shift]
            i = bisect_left(keys, key)
            if i == len(keys) or keys[i] != key:
                continue
            del keys[i]
            gone += 1
        self._len -= gone
        while self._bits and self._len < MIN_FILL << self._bits:
            self._buckets = merge_buckets(self._buckets)
            self._bits -= 1
        return gone

    def _rebuild(self, ordered: Sequence[int]) -> None:
        bits = 0
        while len(ordered) > MAX_FILL << bits:
            bits += 1
        self._bits, self._len = bits, len(ordered)
        self._buckets = _bucketed(ordered, bits)
