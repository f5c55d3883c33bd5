"""The simulated block pool: reuse, LRU eviction, and vLLM's events byte for byte."""

from __future__ import annotations

from typing import Any

import pytest
from simhelpers import golden

from llmgw.kvcache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    RequestExtraKeys,
    block_hashes,
    encode_batch,
    event_extra_keys,
)
from llmgw.sim.engine.blocks import BlockPool, StoredBlocks

H = [bytes([i]) * 32 for i in range(8)]
PLAIN = StoredBlocks(token_ids=(), extra_keys=())


def test_a_new_pool_is_empty_and_every_block_free() -> None:
    pool = BlockPool(4, 16)
    assert (pool.num_free, pool.usage, pool.num_cached_blocks) == (4, 0.0, 0)


def test_cached_blocks_are_found_by_their_leading_hashes_until_the_first_miss() -> None:
    pool = BlockPool(4, 16)
    blocks = pool.allocate(3)
    pool.cache_full_blocks(blocks, H[:3], 0, 3, PLAIN)
    assert pool.longest_hit(H[:3], 10) == blocks
    assert pool.longest_hit([H[0], H[5], H[2]], 10) == blocks[:1]
    assert pool.longest_hit(H[:3], 2) == blocks[:2]
    assert pool.usage == 0.75


def test_freed_blocks_stay_cached_and_a_reuse_takes_them_out_of_the_free_queue() -> None:
    pool = BlockPool(4, 16)
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks, H[:2], 0, 2, PLAIN)
    pool.free(blocks)
    assert (pool.num_free, pool.num_cached_blocks) == (4, 2)
    hits = pool.longest_hit(H[:2], 2)
    assert pool.num_free_among(hits) == 2
    pool.touch(hits)
    assert pool.num_free == 2
    assert pool.allocate(2) and pool.num_cached_blocks == 2  # the uncached ones went first


def test_eviction_takes_the_oldest_free_block_and_a_requests_last_block_first() -> None:
    pool = BlockPool(4, 16, record_events=True, int_hashes=False)
    first = pool.allocate(2)
    pool.cache_full_blocks(first, H[:2], 0, 2, PLAIN)
    second = pool.allocate(2)
    pool.cache_full_blocks(second, H[2:4], 0, 2, PLAIN)
    pool.free(first)
    pool.free(second)
    pool.take_events()
    pool.allocate(3)
    removed = [e.block_hashes[0] for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [H[1], H[0], H[3]]
    assert not pool.is_cached(H[1]) and pool.is_cached(H[2])


def test_allocating_more_than_free_is_refused() -> None:
    pool = BlockPool(2, 16)
    with pytest.raises(ValueError, match="2 free"):
        pool.allocate(3)


def test_reset_is_refused_while_blocks_are_held_and_clears_every_hash_after() -> None:
    pool = BlockPool(2, 16, record_events=True)
    blocks = pool.allocate(1)
    pool.cache_full_blocks(blocks, H[:1], 0, 1, PLAIN)
    assert not pool.reset()
    pool.free(blocks)
    assert pool.reset()
    assert pool.num_cached_blocks == 0 and not pool.is_cached(H[0])
    assert isinstance(pool.take_events()[-1], AllBlocksCleared)


def test_no_events_are_recorded_unless_asked() -> None:
    pool = BlockPool(2, 16)
    pool.cache_full_blocks(pool.allocate(1), H[:1], 0, 1, PLAIN)
    assert pool.take_events() == []


# -- golden event scripts -------------------------------------------------------------------


def _request_keys(case: dict[str, Any]) -> RequestExtraKeys | None:
    request = case["requests"]["A"]
    lora, salt = request.get("lora"), request.get("cache_salt")
    if lora is None and salt is None:
        return None
    return RequestExtraKeys(
        lora_name=lora and lora["name"],
        lora_path=lora and lora["path"],
        lora_int_id=lora and lora["int_id"],
        cache_salt=salt,
        vllm_version=case["version"],
    )


def _run_script(case: dict[str, Any]) -> list[tuple[float, list[Event]]]:
    """Replay a golden case's script (cache, batch, free, alloc, reset) on a BlockPool."""
    request = case["requests"]["A"]
    tokens, size, version = request["token_ids"], case["block_size"], case["version"]
    keys = _request_keys(case)
    hashes = block_hashes(
        tokens, size, algo=case["algo"], seed=case["seed"], extra_keys_fn=keys, vllm_version=version
    )
    assert [h.hex() for h in hashes] == case["expected"]["block_hashes_by_request"]["A"]
    lora = request.get("lora")
    # num_gpu_blocks counts vLLM's null block, which is never handed out.
    pool = BlockPool(
        case["num_gpu_blocks"] - 1, size, record_events=True, int_hashes=case["int_hashes"]
    )
    held = pool.allocate(len(hashes))
    other: list[int] = []
    batches: list[tuple[float, list[Event]]] = []
    for step in case["script"]:
        op = step["op"]
        if op == "cache":
            first, last = step["blocks"]
            stored = StoredBlocks(
                token_ids=tuple(tokens[first * size : last * size]),
                extra_keys=tuple(
                    event_extra_keys(keys(i * size, (i + 1) * size), version) if keys else None
                    for i in range(first, last)
                ),
                lora_id=lora and lora["int_id"],
                lora_name=lora and lora["name"],
                session_id=request.get("session_id"),
            )
            pool.cache_full_blocks(held, hashes, first, last, stored)
        elif op == "batch":
            batches.append((step["ts"], pool.take_events()))
        elif op == "free":
            pool.free(held)
        elif op == "alloc":
            other = pool.allocate(step["n"])
        elif op == "free_other":
            pool.free(other)
        elif op == "reset":
            assert pool.reset()
    return batches


@pytest.mark.parametrize("case", golden()["event_batch_cases"], ids=lambda c: c["id"])
def test_the_pool_emits_vllms_exact_batches_for_the_golden_scripts(case: dict[str, Any]) -> None:
    batches = _run_script(case)
    encoding = case["format_variant"]["event_encoding"]
    expected = case["expected"]["batches"]
    assert len(batches) == len(expected)
    for (ts, events), want in zip(batches, expected, strict=True):
        payload = encode_batch(
            ts, events, case["dp_rank"], encoding=encoding, vllm_version=case["version"]
        )
        assert payload.hex() == want["payload_hex"], want["seq"]


def test_a_stored_event_names_the_parent_of_its_first_block() -> None:
    pool = BlockPool(4, 2, record_events=True)
    blocks = pool.allocate(3)
    pool.cache_full_blocks(blocks, H[:3], 0, 1, StoredBlocks((1, 2), (None,)))
    pool.cache_full_blocks(blocks, H[:3], 1, 3, StoredBlocks((3, 4, 5, 6), (None, None)))
    first, second = pool.take_events()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.parent_block_hash is None
    assert second.parent_block_hash == first.block_hashes[0]
    assert second.token_ids == (3, 4, 5, 6) and len(second.block_hashes) == 2
