"""A mirror of one engine's prefix-cache blocks, built from its KV events, and its net changes.

One `BlockMirror` per engine and data-parallel rank (each rank has its own publisher). It
applies `EventBatch`es: ``BlockStored`` adds blocks, ``BlockRemoved`` removes them,
``AllBlocksCleared`` empties the mirror. Between two `BlockMirror.take_delta` calls (one
flush window) it remembers only what each touched block was at the start of the window, so
a delta holds NET changes: a block stored and removed again within one window is no change,
and memory stays bounded by the blocks themselves however long nobody takes a delta. After
`BlockMirror.reset` (and for a new mirror) the next delta is a full copy with ``reset``
set: the receiver forgets the engine's blocks, then adds the ones listed.

**Hashes** are normalized to the unsigned 64-bit value vLLM's events carry by default
(spec/vllm-kv-events.md §3.6): an int as sent (a negative legacy int taken modulo 2**64),
a bytes digest through `external_hash` (its last 8 bytes, big-endian).

**Where a block lives.** A hash may be held in several places at once: KV-cache groups of a
hybrid model (``group_idx``) and KV-connector tiers (``medium`` CPU/STORAGE, ``locality``,
``ownership``). A block leaves the mirror only when the last place holding it removes it.

**Our own keys.** Beside each vLLM hash the mirror keeps a *block key*: `block_key` of the
parent block's key, the block's token ids and its extra keys as the event publishes them
(``extra_keys[i]``; before vLLM 0.17, which publishes none, ``(lora_name,)`` for a LoRA
block). A gateway computes the same keys from ``/tokenize`` tokens with `block_keys`, with no
knowledge of the engine's hash algorithm, ``PYTHONHASHSEED`` or vLLM version, so a seed or
hashing mismatch cannot silently zero every match. A key is 0 ("unknown") when the event
does not allow it: a parent the mirror never saw (blocks cached before the agent
subscribed and outside the replay buffer), or ``token_ids`` that are not exactly one
``block_size`` per hash (partial blocks of hybrid models). Keys need the parent's key only,
so no parent links are kept.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from array import array
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Final

import cbor2

from llmgw.kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
)
from llmgw.kvcache.hashing import external_hash

__all__ = [
    "ROOT_KEY",
    "UNKNOWN_KEY",
    "BlockMirror",
    "MirrorDelta",
    "apply_delta",
    "block_key",
    "block_keys",
    "normalize_hash",
    "pack_hashes",
    "unpack_hashes",
]

ROOT_KEY: Final = 0
"""The parent key of a request's first block."""
UNKNOWN_KEY: Final = 0
"""A block whose key cannot be computed from its event; `block_key` never returns it."""

_MASK: Final = (1 << 64) - 1
_ABSENT: Final = -1  # in the window: the block was not in the mirror when the window began
_MAX_LOCATIONS: Final = 64  # distinct places; more share one bit that removals never clear
_PERSON: Final = b"llmgw-block-v1"  # blake2b personalization: keys of other schemes differ
_BIG_ENDIAN: Final = sys.byteorder == "big"

Location = tuple[str | None, int | None, str | None, str | None]  # medium, group, locality, owner
ExtraKeysFn = Callable[[int, int], tuple[object, ...] | None]


# -- hashes and keys ------------------------------------------------------------------------


def normalize_hash(value: ExternalBlockHash) -> int:
    """The unsigned 64-bit value of an event's block hash (int or digest bytes)."""
    if type(value) is bytes:
        return external_hash(value)
    return int(value) & _MASK


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    packed = array("Q", token_ids)  # OverflowError for a negative or > 64-bit token id
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def block_key(
    parent_key: int, token_ids: Sequence[int], extra_keys: tuple[object, ...] | None = None
) -> int:
    """Our key of one block: blake2b-64 of the parent's key, the extra keys and the tokens.

    ``extra_keys`` is the block's entry in the event's ``extra_keys`` (None or a tuple of
    scalars and tuples, as `llmgw.kvcache.event_extra_keys` gives it); an empty tuple counts as
    None. Never returns `UNKNOWN_KEY`. Raises ValueError for a token id outside 0..2**64-1.
    """
    try:
        tokens = _token_bytes(token_ids)
    except OverflowError as exc:
        raise ValueError(f"a token id does not fit in 64 unsigned bits: {exc}") from exc
    return _key(parent_key, tokens, extra_keys)


def _key(parent_key: int, tokens: bytes, extra_keys: tuple[object, ...] | None) -> int:
    """`block_key` of tokens already packed by `_token_bytes`."""
    digest = hashlib.blake2b(parent_key.to_bytes(8, "big"), digest_size=8, person=_PERSON)
    if extra_keys:
        blob = cbor2.dumps(extra_keys, canonical=True)
        digest.update(b"\x01" + len(blob).to_bytes(4, "big") + blob)
    else:
        digest.update(b"\x00")
    digest.update(tokens)
    return int.from_bytes(digest.digest(), "big") or 1


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    extra_keys_fn: ExtraKeysFn | None = None,
    parent: int = ROOT_KEY,
    first_block: int = 0,
) -> list[int]:
    """The keys of the full blocks of ``token_ids`` from block ``first_block`` on.

    ``parent`` is the key of block ``first_block - 1`` (`ROOT_KEY` for block 0), so the keys
    of a longer prompt extend those of an earlier one: ``block_keys(tokens, bs,
    parent=keys[-1], first_block=len(keys))``. ``extra_keys_fn(start, end)`` gives a block's
    extra keys in the form events publish them (None for a plain prompt).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    first = first_block * block_size
    full = first + (len(token_ids) - first) // block_size * block_size
    try:
        packed = _token_bytes(token_ids[first:full])  # once: packing costs ~1/4 of a key
    except OverflowError as exc:
        raise ValueError(f"a token id does not fit in 64 unsigned bits: {exc}") from exc
    keys: list[int] = []
    step = block_size * 8
    for offset, start in enumerate(range(first, full, block_size)):
        extra = extra_keys_fn(start, start + block_size) if extra_keys_fn is not None else None
        parent = _key(parent, packed[offset * step : (offset + 1) * step], extra)
        keys.append(parent)
    return keys


# -- deltas and the wire packing ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MirrorDelta:
    """Net changes of one mirror: apply ``reset``, then ``removed``, then ``stored``.

    ``stored_keys[i]`` is the block key of ``stored[i]`` (`UNKNOWN_KEY` when unknown), and
    ``removed_keys[i]`` the key ``removed[i]`` had. A hash in both lists changed its key.
    ``oldest_event_ts`` is the engine's timestamp of the oldest batch applied since the last
    delta (0.0 when none was, or none carried a finite, non-negative one), for measuring the
    time from an event to an index.
    """

    reset: bool
    stored: tuple[int, ...] = ()
    stored_keys: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    removed_keys: tuple[int, ...] = ()
    oldest_event_ts: float = 0.0

    @property
    def empty(self) -> bool:
        """True when applying it changes nothing."""
        return not (self.reset or self.stored or self.removed)


def apply_delta(index: MutableMapping[int, int], delta: MirrorDelta) -> None:
    """Apply ``delta`` to a receiver's ``hash → key`` map of one engine."""
    if delta.reset:
        index.clear()
    for block in delta.removed:
        index.pop(block, None)
    index.update(zip(delta.stored, delta.stored_keys, strict=True))


def pack_hashes(values: Sequence[int]) -> bytes:
    """64-bit values as 8-byte big-endian words, concatenated (the KvDelta wire form)."""
    return struct.pack(f">{len(values)}Q", *values)


def unpack_hashes(data: bytes) -> tuple[int, ...]:
    """The inverse of `pack_hashes`; ValueError when the length is not a multiple of 8."""
    if len(data) % 8:
        raise ValueError(f"packed hashes: {len(data)} bytes is not a multiple of 8")
    return struct.unpack(f">{len(data) // 8}Q", data)


# -- the mirror -----------------------------------------------------------------------------


class BlockMirror:
    """The blocks one engine (one data-parallel rank) holds, from its KV events."""

    def __init__(self, *, compute_keys: bool = True) -> None:
        self.compute_keys = compute_keys
        self.block_size = 0  # of the last BlockStored of group 0 (or no group); 0 = none yet
        self.batches = 0  # batches applied, ever
        self.events = 0  # events applied, ever
        self.clears = 0  # AllBlocksCleared applied, ever
        self._blocks: dict[int, int] = {}  # hash → our key
        self._where: dict[int, int] = {}  # hash → location bits, only when not exactly bit 1
        self._locations: dict[Location, int] = {}  # place → its bit
        self._before: dict[int, int] = {}  # window: hash → key at its start, or _ABSENT
        self._reset_pending = True  # the next delta is a full copy
        self._oldest_ts: float | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def key_of(self, block_hash: int) -> int | None:
        """The block key of a held block (`UNKNOWN_KEY` when unknown), None when not held."""
        return self._blocks.get(block_hash)

    def blocks(self) -> dict[int, int]:
        """A copy of every held block: ``hash → key``."""
        return dict(self._blocks)

    @property
    def pending(self) -> bool:
        """Whether a delta is due: a reset, or blocks touched since the last one (their
        changes may still cancel out, making the delta empty)."""
        return self._reset_pending or bool(self._before)

    # -- events -----------------------------------------------------------------------------

    def apply(self, batch: EventBatch) -> None:
        """Apply every event of ``batch`` in order."""
        for event in batch.events:
            if type(event) is BlockStored:
                self._stored(event)
            elif type(event) is BlockRemoved:
                self._removed(event)
            elif type(event) is AllBlocksCleared:
                self.clears += 1
                self.reset()
        self.batches += 1
        self.events += len(batch.events)
        ts = batch.ts  # a NaN, infinite or negative one would make receivers refuse the delta
        if batch.events and math.isfinite(ts) and ts >= 0:
            if self._oldest_ts is None or ts < self._oldest_ts:
                self._oldest_ts = ts

    def reset(self) -> None:
        """Forget every block; the next delta tells the receiver to do the same."""
        self._blocks.clear()
        self._where.clear()
        self._before.clear()
        self._reset_pending = True

    def _stored(self, event: BlockStored) -> None:
        if event.group_idx in (None, 0):
            self.block_size = event.block_size
        bit = self._bit(_location(event.medium, event.group_idx, event.locality, event.ownership))
        hashes = [normalize_hash(h) for h in event.block_hashes]
        keys = self._event_keys(event, hashes) if self.compute_keys else None
        for i, block in enumerate(hashes):
            self._store(block, keys[i] if keys is not None else UNKNOWN_KEY, bit)

    def _removed(self, event: BlockRemoved) -> None:
        bit = self._bit(_location(event.medium, event.group_idx, event.locality, event.ownership))
        for value in event.block_hashes:
            self._remove(normalize_hash(value), bit)

    def _event_keys(self, event: BlockStored, hashes: list[int]) -> list[int] | None:
        size, tokens = event.block_size, event.token_ids
        if size <= 0 or len(tokens) != size * len(hashes):
            return None  # partial blocks (hybrid models): no key
        if event.parent_block_hash is None:
            parent = ROOT_KEY
        else:
            parent = self._blocks.get(normalize_hash(event.parent_block_hash), UNKNOWN_KEY)
            if parent == UNKNOWN_KEY:
                return None
        try:
            packed = _token_bytes(tokens)
        except OverflowError:  # a token id beyond 64 bits
            return None
        step = size * 8
        keys: list[int] = []
        for i in range(len(hashes)):
            try:
                parent = _key(parent, packed[i * step : (i + 1) * step], _extra(event, i))
            except (ValueError, TypeError, cbor2.CBOREncodeError):  # keys cbor2 cannot encode
                return None
            keys.append(parent)
        return keys

    def _store(self, block: int, key: int, bit: int) -> None:
        old = self._blocks.get(block)
        if old is None:
            self._note(block, _ABSENT)
            self._blocks[block] = key
            if bit != 1:
                self._where[block] = bit
            return
        if key != UNKNOWN_KEY and key != old:
            self._note(block, old)
            self._blocks[block] = key
        mask = self._where.get(block, 1) | bit
        if mask != 1:
            self._where[block] = mask

    def _remove(self, block: int, bit: int) -> None:
        old = self._blocks.get(block)
        if old is None:
            return
        mask = self._where.get(block, 1)
        if bit != self._overflow_bit():
            mask &= ~bit
        if mask:
            if mask == 1:
                self._where.pop(block, None)
            else:
                self._where[block] = mask
            return
        self._note(block, old)
        del self._blocks[block]
        self._where.pop(block, None)
        if self._before.get(block) == _ABSENT:  # stored within this window: no change
            del self._before[block]

    def _note(self, block: int, old: int) -> None:
        """Remember what ``block`` was when the window began (not needed for a full copy)."""
        if not self._reset_pending and block not in self._before:
            self._before[block] = old

    def _bit(self, where: Location) -> int:
        bit = self._locations.get(where)
        if bit is None:
            if len(self._locations) >= _MAX_LOCATIONS:
                return self._overflow_bit()
            bit = 1 << len(self._locations)
            self._locations[where] = bit
        return bit

    @staticmethod
    def _overflow_bit() -> int:
        return 1 << _MAX_LOCATIONS

    # -- deltas -----------------------------------------------------------------------------

    def take_delta(self) -> MirrorDelta:
        """The net changes since the last delta (a full copy after a reset); starts a window."""
        if self._reset_pending:
            return self.take_snapshot()
        stored: list[int] = []
        stored_keys: list[int] = []
        removed: list[int] = []
        removed_keys: list[int] = []
        for block, old in self._before.items():
            new = self._blocks.get(block)
            if new is not None and old == _ABSENT:
                stored.append(block)
                stored_keys.append(new)
            elif new is None and old != _ABSENT:
                removed.append(block)
                removed_keys.append(old)
            elif new is not None and new != old:  # its key became known (or changed)
                removed.append(block)
                removed_keys.append(old)
                stored.append(block)
                stored_keys.append(new)
        self._before.clear()
        return MirrorDelta(
            False, tuple(stored), tuple(stored_keys), tuple(removed), tuple(removed_keys),
            self._take_ts(),
        )  # fmt: skip

    def take_snapshot(self) -> MirrorDelta:
        """A full copy (`snapshot`) that also starts a new window (for a new receiver)."""
        snapshot = self.snapshot()
        self._reset_pending = False
        self._before.clear()
        self._take_ts()
        return snapshot

    def snapshot(self) -> MirrorDelta:
        """Every block, as a delta that replaces whatever a receiver had (changes nothing)."""
        return MirrorDelta(
            True,
            tuple(self._blocks),
            tuple(self._blocks.values()),
            oldest_event_ts=self._oldest_ts or 0.0,
        )

    def _take_ts(self) -> float:
        ts, self._oldest_ts = self._oldest_ts, None
        return ts or 0.0


def _location(
    medium: str | None, group: int | None, locality: str | None, owner: str | None
) -> Location:
    return (medium, group or 0, locality, owner)


def _extra(event: BlockStored, i: int) -> tuple[object, ...] | None:
    """Block ``i``'s extra keys as published; ``(lora_name,)`` before vLLM 0.17 sent any."""
    if event.extra_keys is not None:
        return event.extra_keys[i] if i < len(event.extra_keys) else None
    return (event.lora_name,) if event.lora_name is not None else None
