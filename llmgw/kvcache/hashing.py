"""vLLM's prefix-cache block hashing (v1 engine, 0.10.2 to 0.33), reproduced byte for byte.

A block hash is ``hash_fn((parent, tuple(block_tokens), extra_keys))`` where ``parent`` is the
previous block's digest (``NONE_HASH`` for block 0) and ``extra_keys`` is None or a tuple
(LoRA, multimodal items, cache salt, prompt embeddings; see `extra_keys_for_block`). Only full
blocks are hashed. ``hash_fn`` serialises with pickle protocol 5 (``sha256``, ``xxhash``) or
canonical CBOR (``sha256_cbor``, ``xxhash_cbor``) and digests with SHA-256 (32 bytes) or
xxh3-128 (16 bytes). Events carry the last 8 bytes of a digest as a big-endian uint64
(`external_hash`) or the digest itself. See spec/vllm-kv-events.md §3.

The pickle variants depend on Python object identity (pickle memoises repeated objects), so
they are only reproducible when the inputs are built the way vLLM builds them: tokens as
Python ints, extra keys as tuples. The helpers here do that.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

import cbor2

from llmgw.kvcache.errors import (
    HashAlgorithmUnavailableError,
    UnsupportedHashAlgorithmError,
    UnsupportedVllmVersionError,
)

__all__ = [
    "HASH_ALGOS",
    "NONE_HASH_DEFAULT_SEED",
    "ExtraKeysFn",
    "MultimodalItem",
    "PrefixHashes",
    "RequestExtraKeys",
    "block_hashes",
    "event_extra_keys",
    "event_hash",
    "external_hash",
    "extra_keys_for_block",
    "hash_block",
    "hash_function",
    "hash_prefix",
    "none_hash",
    "parse_vllm_version",
]

logger = logging.getLogger(__name__)

HASH_ALGOS: Final = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
NONE_HASH_DEFAULT_SEED: Final = "vllm-none-hash"
"""The root seed of sha256 variants in vLLM 0.29+ when PYTHONHASHSEED is unset."""

ExtraKeysFn = Callable[[int, int], tuple[object, ...] | None]
"""Extra keys of the block spanning tokens ``[start, end)``: ``fn(start, end)``."""

HashFn = Callable[[object], bytes]

_PICKLE_PROTOCOL: Final = 5  # pickle.HIGHEST_PROTOCOL on every Python vLLM supports
_UINT64_MASK: Final = (1 << 64) - 1
_V0_10_2: Final = (0, 10, 2)
_V0_11_1: Final = (0, 11, 1)
_V0_13: Final = (0, 13, 0)
_V0_19: Final = (0, 19, 0)
_V0_29: Final = (0, 29, 0)
_V0_31: Final = (0, 31, 0)
_VERSION_RE: Final = re.compile(r"v?(\d+(?:\.\d+)*)")

_hash_fns: dict[str, HashFn] = {}
_process_roots: dict[tuple[str, bool], bytes] = {}
_process_roots_lock = threading.Lock()


def parse_vllm_version(version: str) -> tuple[int, ...]:
    """``"0.33.0"`` → ``(0, 33, 0)``; suffixes (``rc1``, ``+cpu``) are dropped."""
    match = _VERSION_RE.match(version.strip())
    if match is None:
        raise UnsupportedVllmVersionError(f"not a vLLM version: {version!r}")
    parts = tuple(int(p) for p in match.group(1).split("."))
    return parts + (0,) * (3 - len(parts))


# -- hash functions -------------------------------------------------------------------------


def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


def _sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash_fns() -> tuple[HashFn, HashFn]:
    try:
        import xxhash  # optional dependency, imported on first use
    except ImportError as exc:
        raise HashAlgorithmUnavailableError(
            "the xxhash and xxhash_cbor algorithms need the 'xxhash' package (pip install xxhash)"
        ) from exc
    digest = xxhash.xxh3_128_digest

    def xxh_pickle(obj: object) -> bytes:
        return digest(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL))

    def xxh_cbor(obj: object) -> bytes:
        return digest(cbor2.dumps(obj, canonical=True))

    return xxh_pickle, xxh_cbor


def hash_function(algo: str) -> HashFn:
    """vLLM's ``get_hash_fn_by_name(algo)``: object → digest bytes."""
    fn = _hash_fns.get(algo)
    if fn is not None:
        return fn
    if algo == "sha256":
        fn = _sha256_pickle
    elif algo == "sha256_cbor":
        fn = _sha256_cbor
    elif algo in ("xxhash", "xxhash_cbor"):
        xxh_pickle, xxh_cbor = _xxhash_fns()
        fn = xxh_pickle if algo == "xxhash" else xxh_cbor
    else:
        raise UnsupportedHashAlgorithmError(
            f"unknown prefix-caching hash algorithm {algo!r}; expected one of {HASH_ALGOS}"
        )
    _hash_fns[algo] = fn
    return fn


def _hash_function_for(algo: str, version: tuple[int, ...]) -> HashFn:
    if version < _V0_10_2:
        raise UnsupportedVllmVersionError(
            f"vLLM {'.'.join(map(str, version))} hashed blocks to Python ints; "
            "only 0.10.2 and later are reproduced"
        )
    if algo in ("xxhash", "xxhash_cbor") and version < _V0_13:
        raise UnsupportedHashAlgorithmError(f"{algo!r} exists from vLLM 0.13.0 on")
    return hash_function(algo)


# -- roots and block hashes -----------------------------------------------------------------


def _process_root(algo: str, seed_string_era: bool) -> bytes:
    """The per-process random root vLLM uses when no seed is configured."""
    with _process_roots_lock:
        key = (algo, seed_string_era)
        root = _process_roots.get(key)
        if root is None:
            if seed_string_era:
                logger.warning(
                    "PYTHONHASHSEED is not set: %s block hashes are random per process", algo
                )
                root = hash_function(algo)(os.urandom(32).hex())
            else:
                root = os.urandom(32)
            _process_roots[key] = root
        return root


def none_hash(algo: str, seed: str | None, vllm_version: str = "0.33.0") -> bytes:
    """The root hash (``NONE_HASH``) that block 0 uses as its parent.

    ``seed`` is the engine's ``PYTHONHASHSEED`` string, or None when unset. From 0.29 the
    root is ``hash_fn(seed)``, with seed ``"vllm-none-hash"`` for sha256 variants when unset
    and a random string (fixed for this process) for xxhash variants. In 0.10.2–0.28 it is
    ``hash_fn(seed)`` when set and ``os.urandom(32)`` (fixed for this process) otherwise.
    """
    version = parse_vllm_version(vllm_version)
    fn = _hash_function_for(algo, version)
    if seed is not None:
        return fn(seed)
    if version >= _V0_29 and algo in ("sha256", "sha256_cbor"):
        return fn(NONE_HASH_DEFAULT_SEED)
    return _process_root(algo, seed_string_era=version >= _V0_29)


def hash_block(
    parent: bytes,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None,
    algo: str,
) -> bytes:
    """vLLM's ``hash_block_tokens``: the digest of one full block."""
    return hash_function(algo)((parent, tuple(token_ids), extra_keys))


def external_hash(digest: bytes) -> int:
    """The uint64 an event carries for ``digest``: its last 8 bytes, big-endian."""
    return int.from_bytes(digest, "big") & _UINT64_MASK


def event_hash(digest: bytes, *, use_int: bool = True) -> int | bytes:
    """vLLM's ``maybe_convert_block_hash`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    return external_hash(digest) if use_int else digest


# -- extra keys -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MultimodalItem:
    """A multimodal input's placeholder span in the prompt (vLLM ``PlaceholderRange``)."""

    identifier: str
    offset: int
    length: int


def _lora_keys(
    version: tuple[int, ...], name: str | None, path: str | None, int_id: int | None
) -> list[object]:
    if version < _V0_11_1:
        return [] if int_id is None else [int_id]
    if name is None:
        return []
    if version < _V0_31:
        return [name]
    return [("lora", name, path)]


def _mm_keys(
    version: tuple[int, ...], start: int, end: int, items: Sequence[MultimodalItem]
) -> list[object]:
    # Items are sorted and disjoint (as vLLM assumes); for those, vLLM's walk with a carried
    # item index includes exactly the items overlapping [start, end). This is how the prompt's
    # blocks are hashed when a request arrives. A block completed later by generated tokens
    # is walked from the last item only (``curr_mm_idx = -1``), which can differ; not modelled.
    keys: list[object] = []
    for item in items:
        if item.offset >= end:
            break
        if item.offset + item.length <= start:
            continue
        if version < _V0_19:
            keys.append(item.identifier)
        elif version < _V0_31:
            keys.append((item.identifier, item.offset - start))
        else:
            keys.append(("mm", item.identifier, item.offset - start))
    return keys


def _block_extra_keys(
    version: tuple[int, ...],
    start: int,
    end: int,
    keys: RequestExtraKeys,
    prompt_embeds_key: bytes | None,
) -> tuple[object, ...] | None:
    out = _lora_keys(version, keys.lora_name, keys.lora_path, keys.lora_int_id)
    out += _mm_keys(version, start, end, keys.mm_items)
    if start == 0 and keys.cache_salt:
        out.append(keys.cache_salt if version < _V0_31 else ("cache_salt", keys.cache_salt))
    if prompt_embeds_key is not None:
        out.append(prompt_embeds_key if version < _V0_31 else ("prompt_embeds", prompt_embeds_key))
    return tuple(out) if out else None


@dataclass(frozen=True, slots=True)
class RequestExtraKeys:
    """What of a request goes into its block hashes besides tokens; an `ExtraKeysFn`.

    ``lora_int_id`` is used before 0.11.1, ``lora_name`` from 0.11.1, and ``lora_name`` with
    ``lora_path`` from 0.31. ``prompt_embeds_keys[i]`` is block i's prompt-embedding key as
    vLLM computes it (raw tensor bytes before 0.17, their SHA-256 digest from 0.17).
    """

    lora_name: str | None = None
    lora_path: str | None = None
    lora_int_id: int | None = None
    mm_items: tuple[MultimodalItem, ...] = ()
    cache_salt: str | None = None
    prompt_embeds_keys: tuple[bytes, ...] = ()
    vllm_version: str = "0.33.0"
    _version: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # Without multimodal items or embeddings the keys only differ between block 0 and the
    # rest; both are computed once (the gateway hashes hundreds of blocks per request).
    _constant: bool = field(init=False, repr=False, compare=False)
    _first: tuple[object, ...] | None = field(init=False, repr=False, compare=False)
    _later: tuple[object, ...] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        version = parse_vllm_version(self.vllm_version)
        object.__setattr__(self, "_version", version)
        if version >= _V0_31 and self.lora_name is not None and self.lora_path is None:
            raise ValueError("vLLM 0.31+ hashes the LoRA path too: give lora_path")
        offsets = [item.offset for item in self.mm_items]
        if offsets != sorted(offsets):
            raise ValueError("mm_items must be sorted by offset, as vLLM requires")
        constant = not self.mm_items and not self.prompt_embeds_keys
        object.__setattr__(self, "_constant", constant)
        object.__setattr__(self, "_first", _block_extra_keys(version, 0, 1, self, None))
        object.__setattr__(self, "_later", _block_extra_keys(version, 1, 2, self, None))

    def __call__(self, start: int, end: int) -> tuple[object, ...] | None:
        if self._constant:
            return self._first if start == 0 else self._later
        embeds: bytes | None = None
        if self.prompt_embeds_keys:
            index = start // (end - start)
            if index < len(self.prompt_embeds_keys):
                embeds = self.prompt_embeds_keys[index]
        return _block_extra_keys(self._version, start, end, self, embeds)


def extra_keys_for_block(  # noqa: PLR0913 (RequestExtraKeys' fields, for one block)
    block_start: int,
    block_end: int,
    *,
    lora_name: str | None = None,
    lora_path: str | None = None,
    lora_int_id: int | None = None,
    mm_items: Sequence[MultimodalItem] = (),
    cache_salt: str | None = None,
    prompt_embeds_key: bytes | None = None,
    vllm_version: str = "0.33.0",
) -> tuple[object, ...] | None:
    """The hash-input extra keys of the block ``[block_start, block_end)``, or None.

    Order: LoRA, multimodal items, cache salt (block 0 only), prompt embeddings; tagged
    (``("lora", name, path)``, ``("mm", id, offset)``, ``("cache_salt", salt)``,
    ``("prompt_embeds", key)``) from 0.31, untagged before (spec §3.4).
    """
    keys = RequestExtraKeys(
        lora_name=lora_name,
        lora_path=lora_path,
        lora_int_id=lora_int_id,
        mm_items=tuple(mm_items),
        cache_salt=cache_salt,
        vllm_version=vllm_version,
    )
    return _block_extra_keys(keys._version, block_start, block_end, keys, prompt_embeds_key)


def _untag(key: object) -> object:
    if isinstance(key, tuple) and key and isinstance(key[0], str):
        tag = key[0]
        if tag == "mm" and len(key) == 3:
            return (key[1], key[2])
        if tag in ("lora", "cache_salt", "prompt_embeds") and len(key) >= 2:
            return key[1]
    return key


def event_extra_keys(
    hash_extra_keys: tuple[object, ...] | None, vllm_version: str = "0.33.0"
) -> tuple[object, ...] | None:
    """What a `BlockStored` event carries in ``extra_keys`` for a block with these keys.

    Verbatim before 0.31; from 0.31 untagged (``to_event_extra_keys``): the LoRA name,
    ``(mm_id, offset)``, the salt string, the prompt-embedding digest.
    """
    if hash_extra_keys is None or parse_vllm_version(vllm_version) < _V0_31:
        return hash_extra_keys
    return tuple(_untag(key) for key in hash_extra_keys)


# -- whole prompts and incremental hashing --------------------------------------------------


def _hash_blocks(
    fn: HashFn,
    parent: bytes,
    tokens: tuple[int, ...],
    first_block: int,
    num_blocks: int,
    block_size: int,
    extra_keys_fn: ExtraKeysFn | None,
) -> list[bytes]:
    out: list[bytes] = []
    for start in range(first_block * block_size, num_blocks * block_size, block_size):
        end = start + block_size
        keys = None if extra_keys_fn is None else extra_keys_fn(start, end)
        parent = fn((parent, tokens[start:end], keys))
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class PrefixHashes:
    """The block hashes of a token prefix, to extend cheaply when the prompt grows.

    ``token_ids`` holds exactly the tokens of the hashed (full) blocks. `extend` reuses the
    hashes of leading blocks whose tokens are unchanged and hashes only the rest; the extra
    keys function is kept, so a request with other extra keys needs a new `hash_prefix`.
    """

    algo: str
    block_size: int
    root: bytes
    token_ids: tuple[int, ...] = ()
    hashes: tuple[bytes, ...] = ()
    extra_keys_fn: ExtraKeysFn | None = None

    def extend(self, token_ids: Sequence[int]) -> PrefixHashes:
        """The hashes of ``token_ids`` (full blocks), reusing the common leading blocks."""
        tokens = tuple(token_ids)
        size = self.block_size
        num_blocks = len(tokens) // size
        reuse = self._reusable_blocks(tokens, num_blocks)
        parent = self.hashes[reuse - 1] if reuse else self.root
        fn = hash_function(self.algo)
        new = _hash_blocks(fn, parent, tokens, reuse, num_blocks, size, self.extra_keys_fn)
        return replace(
            self, token_ids=tokens[: num_blocks * size], hashes=self.hashes[:reuse] + tuple(new)
        )

    def _reusable_blocks(self, tokens: tuple[int, ...], num_blocks: int) -> int:
        common = min(num_blocks, len(self.hashes))
        size = self.block_size
        if tokens[: common * size] == self.token_ids[: common * size]:
            return common
        for block in range(common):
            span = slice(block * size, (block + 1) * size)
            if tokens[span] != self.token_ids[span]:
                return block
        return common


def hash_prefix(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: str,
    seed: str | None,
    extra_keys_fn: ExtraKeysFn | None = None,
    vllm_version: str = "0.33.0",
    root: bytes | None = None,
) -> PrefixHashes:
    """Hash the full blocks of ``token_ids``; the result can be `PrefixHashes.extend`-ed.

    ``root`` overrides `none_hash` (for an engine whose root is random per process).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if root is None:
        root = none_hash(algo, seed, vllm_version)
    else:
        _hash_function_for(algo, parse_vllm_version(vllm_version))
    empty = PrefixHashes(algo=algo, block_size=block_size, root=root, extra_keys_fn=extra_keys_fn)
    return empty.extend(token_ids)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: str,
    seed: str | None,
    extra_keys_fn: ExtraKeysFn | None = None,
    vllm_version: str = "0.33.0",
) -> list[bytes]:
    """The block hashes vLLM computes for a prompt (full blocks only)."""
    prefix = hash_prefix(
        token_ids,
        block_size,
        algo=algo,
        seed=seed,
        extra_keys_fn=extra_keys_fn,
        vllm_version=vllm_version,
    )
    return list(prefix.hashes)
