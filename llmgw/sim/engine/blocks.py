"""The simulated GPU KV cache: vLLM's v1 block pool, without the tensors.

A fixed number of blocks, each holding ``block_size`` tokens of one or more requests
(shared prefixes are shared blocks, with a reference count). A full block gets its prefix
hash and stays findable by it after its requests finish, until the block is needed again:
free blocks queue in LRU order (a finished request's blocks go to the tail in reverse, so
its last block is evicted first, as vLLM does) and a cached block taken from the head is
evicted. The pool records the KV events vLLM's ``BlockPool`` would: one `BlockStored` per
`cache_full_blocks` call, one `BlockRemoved` per evicted hash, `AllBlocksCleared` on reset.

With events on, the pool also keeps each cached hash's llmgw block key
(``llmgw.kvcache.mirror.block_key``, chained from the parent's key as a mirror of these
events computes it), so `cached_keys` says what a gateway's KV index should hold for this
engine, from the cache itself rather than from the events (the sim's ``/debug/kv_cache``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from llmgw.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, Event, event_hash
from llmgw.kvcache.mirror import ROOT_KEY, block_key

MEDIUM_GPU = "GPU"
SPEC_KIND = "full_attention"


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """What a `BlockStored` says besides the hashes: the request's tokens and annotations."""

    token_ids: tuple[int, ...]
    extra_keys: tuple[tuple[object, ...] | None, ...]
    lora_id: int | None = None
    lora_name: str | None = None
    session_id: str | None = None


class BlockPool:
    """Blocks, their reference counts, the hash → blocks map and the LRU free queue."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        record_events: bool = False,
        int_hashes: bool = True,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._record = record_events
        self._int_hashes = int_hashes
        self._refs = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, dict[int, None]] = {}
        self._events: list[Event] = []
        self._keys: dict[bytes, int] = {}  # cached hash → llmgw block key (events on only)

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: the share of blocks held by requests (0..1)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._cached.values())

    @property
    def records_events(self) -> bool:
        return self._record

    def cached_keys(self) -> list[int]:
        """The llmgw block keys of every cached hash, ascending (empty with events off)."""
        return sorted(self._keys.values())

    def is_cached(self, block_hash: bytes) -> bool:
        return block_hash in self._cached

    def longest_hit(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """Cached blocks for the leading ``hashes``, stopping at the first miss."""
        hit: list[int] = []
        for block_hash in hashes[:max_blocks]:
            blocks = self._cached.get(block_hash)
            if not blocks:
                break
            hit.append(next(iter(blocks)))
        return hit

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` sit in the free queue (touching them takes them out)."""
        return sum(1 for b in block_ids if self._refs[b] == 0)

    def touch(self, block_ids: Sequence[int]) -> None:
        """A request reuses these cached blocks: take a reference, leave the free queue."""
        for block in block_ids:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the head of the free queue, evicting cached ones."""
        if count > len(self._free):
            raise ValueError(f"asked for {count} blocks, {len(self._free)} free")
        blocks: list[int] = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        """A request lets go of its blocks; unreferenced ones join the tail, last first."""
        for block in reversed(block_ids):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[bytes],
        num_cached: int,
        num_full: int,
        stored: StoredBlocks,
    ) -> None:
        """Register blocks ``[num_cached, num_full)`` of a request under their hashes."""
        if num_full <= num_cached:
            return
        for index in range(num_cached, num_full):
            block, block_hash = block_ids[index], hashes[index]
            self._hashes[block] = block_hash
            self._cached.setdefault(block_hash, {})[block] = None
        if self._record:
            parent = hashes[num_cached - 1] if num_cached else None
            self._events.append(self._stored_event(hashes[num_cached:num_full], parent, stored))
            self._remember_keys(hashes[num_cached:num_full], parent, stored)

    def reset(self) -> bool:
        """Forget every hash (vLLM's ``reset_prefix_cache``); refused while blocks are held."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._keys.clear()
        self._hashes = [None] * self.num_blocks
        if self._record:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[Event]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def _evict(self, block: int) -> None:
        block_hash = self._hashes[block]
        if block_hash is None:
            return
        self._hashes[block] = None
        blocks = self._cached[block_hash]
        del blocks[block]
        if not blocks:
            del self._cached[block_hash]
            self._keys.pop(block_hash, None)
        if self._record:
            self._events.append(
                BlockRemoved(
                    block_hashes=(self._external(block_hash),), medium=MEDIUM_GPU, group_idx=0
                )
            )

    def _remember_keys(
        self, hashes: Sequence[bytes], parent: bytes | None, stored: StoredBlocks
    ) -> None:
        """Each new block's key from its parent's (the parent is cached: a request holds it)."""
        key = ROOT_KEY if parent is None else self._keys.get(parent)
        size = self.block_size
        for i, block_hash in enumerate(hashes):
            if key is None:
                return
            extra = stored.extra_keys[i] if i < len(stored.extra_keys) else None
            key = block_key(key, stored.token_ids[i * size : (i + 1) * size], extra)
            self._keys[block_hash] = key

    def _external(self, digest: bytes) -> int | bytes:
        return event_hash(digest, use_int=self._int_hashes)

    def _stored_event(
        self, hashes: Sequence[bytes], parent: bytes | None, stored: StoredBlocks
    ) -> BlockStored:
        return BlockStored(
            block_hashes=tuple(self._external(h) for h in hashes),
            parent_block_hash=None if parent is None else self._external(parent),
            token_ids=stored.token_ids,
            block_size=self.block_size,
            lora_id=stored.lora_id,
            medium=MEDIUM_GPU,
            lora_name=stored.lora_name,
            extra_keys=stored.extra_keys,
            group_idx=0,
            kv_cache_spec_kind=SPEC_KIND,
            session_id=stored.session_id,
        )
