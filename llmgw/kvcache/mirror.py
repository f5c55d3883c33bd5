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
``ownership``). Within one place vLLM may cache a hash in several blocks (requests that
compute the same prefix side by side) and then removes it once per block, so the mirror
counts the copies. A block leaves the mirror only when the last copy in the last place
holding it is removed. (A request with ``kv_cache_report_mode="full"`` makes vLLM store its
reused prefix again without a new block; counted as copies, those blocks outlive their
eviction in the mirror until the engine restarts or clears, a cost only that opt-in pays.)

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
import sys
from array import array
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Final

import cbor2

from llmgw.kvcache.errors import MirrorOverflowError
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
]

ROOT_KEY: Final = 0
"""The parent key of a request's first block."""
UNKNOWN_KEY: Final = 0
"""A block whose key cannot be computed from its event; `block_key` never returns it."""

_MASK: Final = (1 << 64) - 1
_ABSENT: Final = -1  # in the window: the block was not in the mirror when the window began
_MAX_LOCATIONS: Final = 64  # distinct places; more share one bit that removals never clear
_OVERFLOW_BIT: Final = 1 << _MAX_LOCATIONS
_PERSON: Final = b"llmgw-block-v1"  # blake2b personalization: keys of other schemes differ
_BIG_ENDIAN: Final = sys.byteorder == "big"
_KEY_HASH: Final = hashlib.blake2b(digest_size=8, person=_PERSON)  # copied for every key
_KEY_ONE: Final = (1).to_bytes(8, "big")
_NO_EXTRA_KEYS: Final = b"\x00"

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


def _extra_bytes(extra_keys: tuple[object, ...] | None) -> bytes:
    """The extra-keys field of a key's message: ``00``, or ``01``, a 4-byte length and CBOR.

    Raises what ``cbor2.dumps`` raises for a value CBOR cannot carry."""
    if not extra_keys:
        return _NO_EXTRA_KEYS
    blob = cbor2.dumps(extra_keys, canonical=True)
    return b"\x01" + len(blob).to_bytes(4, "big") + blob


def block_key(
    parent_key: int, token_ids: Sequence[int], extra_keys: tuple[object, ...] | None = None
) -> int:
    """Our key of one block: one blake2b-64 over the parent's key, extra keys and tokens.

    The key is ``int.from_bytes(d, "big") or 1`` where ``d`` is the 8-byte BLAKE2b digest,
    personalized ``llmgw-block-v1``, of ONE message, hashed in one pass::

        parent_key as 8 bytes big-endian
        + 00                                              no extra keys
          | 01 + len(cbor) as 4 bytes big-endian + cbor   cbor = canonical CBOR of extra_keys
        + every token id as 8 bytes little-endian (uint64)

    The fields are fixed-size or length-prefixed, so two different blocks never share a
    message. These are the values llmgw computed when it fed the same bytes to blake2b in
    three calls (a hash is a stream: the split never changed a key), so agents and gateways
    of either version agree. It is a pure function of its three arguments, the same in
    every process and on every machine; the agent (`BlockMirror`) and the gateway
    (`block_keys`) both compute it here. ``extra_keys`` is the block's entry in the event's
    ``extra_keys`` (None or a tuple of scalars and tuples, as `llmgw.kvcache.event_extra_keys`
    gives it); an empty tuple counts as None. Never returns `UNKNOWN_KEY` (a zero digest
    reads as 1). Raises ValueError for a token id outside 0..2**64-1, and what
    ``cbor2.dumps`` raises for extra keys CBOR cannot encode.
    """
    try:
        tokens = _token_bytes(token_ids)
    except OverflowError as exc:
        raise ValueError(f"a token id does not fit in 64 unsigned bits: {exc}") from exc
    return _chain(parent_key, tokens, 1, (_extra_bytes(extra_keys),))[0]


def _chain(
    parent_key: int, packed: bytes, blocks: int, extras: Sequence[bytes] | None
) -> list[int]:
    """The keys of ``blocks`` consecutive blocks, each the parent of the next: block ``i``
    has the ``i``-th of ``blocks`` equal slices of ``packed`` (tokens from `_token_bytes`)
    and the extra-keys field ``extras[i]`` (`_extra_bytes`; None: no block has any)."""
    keys: list[int] = []
    append, new_hash, from_bytes = keys.append, _KEY_HASH.copy, int.from_bytes
    parent = parent_key.to_bytes(8, "big")
    step = len(packed) // blocks if blocks else 0
    end = 0
    for i in range(blocks):
        start, end = end, end + step
        digest = new_hash()  # a copy of the personalized template: no argument parsing
        extra = _NO_EXTRA_KEYS if extras is None else extras[i]
        digest.update(parent + extra + packed[start:end])
        parent = digest.digest()  # the next block's parent bytes, without an int round trip
        key = from_bytes(parent, "big")
        if key <= 1:  # a zero digest is key 1, never UNKNOWN_KEY
            key, parent = 1, _KEY_ONE
        append(key)
    return keys


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    extra_keys_fn: ExtraKeysFn | None = None,
    parent: int = ROOT_KEY,
    first_block: int = 0,
) -> list[int]:
    """The keys (`block_key`) of the full blocks of ``token_ids`` from block ``first_block`` on.

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
    extras = None
    if extra_keys_fn is not None:
        starts = range(first, full, block_size)
        extras = [_extra_bytes(extra_keys_fn(start, start + block_size)) for start in starts]
    return _chain(parent, packed, (full - first) // block_size, extras)


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


# -- the mirror -----------------------------------------------------------------------------


class BlockMirror:
    """The blocks one engine (one data-parallel rank) holds, from its KV events."""

    def __init__(self, *, compute_keys: bool = True, max_blocks: int | None = None) -> None:
        self.compute_keys = compute_keys
        self.max_blocks = max_blocks  # more held is MirrorOverflowError; None: no bound
        self.block_size = 0  # of the last BlockStored of group 0 (or no group); 0 = none yet
        self.batches = 0  # batches applied, ever
        self.events = 0  # events applied, ever
        self.clears = 0  # AllBlocksCleared applied, ever
        self._blocks: dict[int, int] = {}  # hash → our key
        self._where: dict[int, int] = {}  # hash → location bits, only when not exactly bit 1
        self._copies: dict[tuple[int, int], int] = {}  # (hash, place bit) → blocks beyond one
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
        """Apply every event of ``batch`` in order.

        Raises MirrorOverflowError when a ``BlockStored`` leaves more than ``max_blocks``
        blocks held; the events before it are applied, the rest are not (the caller resets).
        """
        for event in batch.events:
            if type(event) is BlockStored:
                self._stored(event)
                if self.max_blocks is not None and len(self._blocks) > self.max_blocks:
                    raise MirrorOverflowError(
                        f"{len(self._blocks)} blocks stored, more than the mirror's bound "
                        f"of {self.max_blocks} (more than an engine caches)"
                    )
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
        self._copies.clear()
        self._before.clear()
        self._reset_pending = True

    def _stored(self, event: BlockStored) -> None:
        if event.group_idx in (None, 0):
            self.block_size = event.block_size
        bit = self._bit(_location(event))
        hashes = _normalized(event.block_hashes)
        keys = self._event_keys(event, hashes) if self.compute_keys else None
        self._store_all(hashes, [UNKNOWN_KEY] * len(hashes) if keys is None else keys, bit)

    def _removed(self, event: BlockRemoved) -> None:
        bit = self._bit(_location(event))
        for value in event.block_hashes:  # usually one
            self._remove(value & _MASK if type(value) is int else normalize_hash(value), bit)

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
            extras = _event_extras(event, len(hashes))
        except OverflowError:  # a token id beyond 64 bits
            return None
        except (ValueError, TypeError, cbor2.CBOREncodeError):  # keys cbor2 cannot encode
            return None
        return _chain(parent, packed, len(hashes), extras)

    def _store_all(self, hashes: list[int], keys: list[int], bit: int) -> None:
        """Store each block with its key at ``bit``; the loop of every stored block, so the
        usual case (a block not held yet) is inline."""
        blocks, before, where = self._blocks, self._before, self._where
        window = not self._reset_pending  # else a full copy is due: nothing to remember
        for block, key in zip(hashes, keys, strict=True):
            old = blocks.get(block)
            if old is not None:
                self._store_again(block, key, bit, old)
                continue
            if window and block not in before:  # `_note` inline
                before[block] = _ABSENT
            blocks[block] = key
            if bit != 1:
                where[block] = bit

    def _store_again(self, block: int, key: int, bit: int, old: int) -> None:
        """Store a block already held (with key ``old``): one more place, or one more copy
        in a place that holds it (vLLM caches a hash in several blocks when requests compute
        the same prefix side by side, and removes it once per block); maybe its key."""
        if key != UNKNOWN_KEY and key != old:
            self._note(block, old)
            self._blocks[block] = key
        held = self._where.get(block, 1)
        if held & bit and bit != _OVERFLOW_BIT:
            self._copies[(block, bit)] = self._copies.get((block, bit), 0) + 1
        mask = held | bit
        if mask != 1:
            self._where[block] = mask

    def _remove(self, block: int, bit: int) -> None:
        old = self._blocks.get(block)
        if old is None:
            return
        copies = self._copies.get((block, bit))
        if copies:  # another block of this place still holds the hash
            if copies == 1:
                del self._copies[(block, bit)]
            else:
                self._copies[(block, bit)] = copies - 1
            return
        mask = self._where.get(block, 1)
        if bit != _OVERFLOW_BIT:
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
                return _OVERFLOW_BIT
            bit = 1 << len(self._locations)
            self._locations[where] = bit
        return bit

    # -- deltas -----------------------------------------------------------------------------

    def take_delta(self) -> MirrorDelta:
        """The net changes since the last delta (a full copy after a reset); starts a window."""
        if self._reset_pending:
            return self.take_snapshot()
        stored: list[int] = []
        stored_keys: list[int] = []
        removed: list[int] = []
        removed_keys: list[int] = []
        blocks = self._blocks
        for block, old in self._before.items():
            new = blocks.get(block)
            if new == old:
                continue  # held before and now with the same key
            if old != _ABSENT:  # gone, or its key became known (or changed): out with the old
                removed.append(block)
                removed_keys.append(old)
            if new is not None:
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


def _location(event: BlockStored | BlockRemoved) -> Location:
    return (event.medium, event.group_idx or 0, event.locality, event.ownership)


def _normalized(values: Sequence[ExternalBlockHash]) -> list[int]:
    """`normalize_hash` of each value; an int (the usual case) without the function call."""
    return [v & _MASK if type(v) is int else normalize_hash(v) for v in values]


def _event_extras(event: BlockStored, blocks: int) -> list[bytes] | None:
    """The extra-keys fields (`_extra_bytes`) of an event's blocks; None when none has any."""
    if event.extra_keys is None and event.lora_name is None:
        return None
    return [_extra_bytes(_extra(event, i)) for i in range(blocks)]


def _extra(event: BlockStored, i: int) -> tuple[object, ...] | None:
    """Block ``i``'s extra keys as published; ``(lora_name,)`` before vLLM 0.17 sent any."""
    if event.extra_keys is not None:
        return event.extra_keys[i] if i < len(event.extra_keys) else None
    return (event.lora_name,) if event.lora_name is not None else None
