"""``GET /debug/kv_cache``: the simulated engine's prefix cache as llmgw block keys.

What it says must be what a perfect consumer of the engine's KV events would index (a
`BlockMirror` fed every batch from seq 0) and what a gateway computes from the prompt's
tokens (`block_keys`), so bench/chaos.py can hold a gateway's index against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq.asyncio
from simhelpers import golden, sim_client, sim_config
from test_sim_kvevents import HASH_CASES, PROMPT, golden_case_request, kv_flags, replay, zctx

from llmgw.kvcache import EventBatch, decode_batch
from llmgw.kvcache.mirror import UNKNOWN_KEY, BlockMirror, block_keys
from llmgw.sim.engine.blocks import BlockPool, StoredBlocks

__all__ = ["zctx"]  # the fixture, imported for the tests below


def _hex(keys: list[int] | set[int]) -> list[str]:
    return [f"{key:016x}" for key in sorted(keys)]


async def _debug(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/debug/kv_cache")
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


async def _mirrored_keys(ctx: zmq.asyncio.Context, tmp_path: Path) -> set[int]:
    """The keys a mirror of every batch the engine published holds."""
    mirror = BlockMirror()
    for frames in (await replay(ctx, f"ipc://{tmp_path}/replay", 0))[:-1]:
        mirror.apply(decode_batch(frames[-1]))
    keys = set(mirror.blocks().values())
    assert UNKNOWN_KEY not in keys
    return keys


async def test_a_prompts_blocks_have_the_keys_a_gateway_computes_from_its_tokens(
    tmp_path: Path,
) -> None:
    async with sim_client(sim_config(*kv_flags(tmp_path))) as (_, client):
        tokens = (await client.post("/tokenize", json={"prompt": PROMPT})).json()["tokens"]
        body = {"prompt": tokens, "max_tokens": 1}  # nothing generated is computed
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        found = await _debug(client)
    assert len(tokens) == 80
    assert found == {
        "kv_events": True,
        "block_size": 16,
        "cached_blocks": 5,
        "keys": _hex(block_keys(tokens, 16)),
    }


@pytest.mark.parametrize("case", HASH_CASES, ids=lambda c: c["id"])
async def test_keys_equal_a_mirror_of_the_events_for_the_golden_cases(
    case: dict[str, Any], tmp_path: Path, zctx: zmq.asyncio.Context
) -> None:
    config, body = golden_case_request(case, tmp_path, max_tokens=4)
    async with sim_client(config) as (_, client):
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        found = await _debug(client)
        mirrored = await _mirrored_keys(zctx, tmp_path)
    assert found["cached_blocks"] == len(found["keys"]) >= len(case["expected"]["blocks"]) > 0
    assert found["keys"] == _hex(mirrored)
    plain = case["lora"] is None and not case["cache_salt"]  # else extra keys make them differ
    prompt_keys = set(_hex(block_keys(case["token_ids"], case["block_size"])))
    assert (prompt_keys <= set(found["keys"])) == plain


async def test_evicted_and_reset_blocks_leave_the_keys(
    tmp_path: Path, zctx: zmq.asyncio.Context
) -> None:
    config = sim_config(*kv_flags(tmp_path), "--sim-kv-blocks", "8", "--max-model-len", "128")
    async with sim_client(config) as (_, client):
        for text in (PROMPT, PROMPT.upper()):  # 5 blocks each: the second evicts 2 of the first
            tokens = (await client.post("/tokenize", json={"prompt": text})).json()["tokens"]
            body = {"prompt": tokens, "max_tokens": 1}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        found = await _debug(client)
        assert found["keys"] == _hex(await _mirrored_keys(zctx, tmp_path))
        assert found["cached_blocks"] == len(found["keys"]) == 8
        assert set(_hex(block_keys(tokens, 16))) <= set(found["keys"])
        assert (await client.post("/reset_prefix_cache")).status_code == 200
        assert (await _debug(client))["keys"] == []


async def test_without_kv_events_the_cache_is_counted_but_has_no_keys() -> None:
    async with sim_client(sim_config()) as (_, client):
        await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        found = await _debug(client)
    assert found == {"kv_events": False, "block_size": 16, "cached_blocks": 5, "keys": []}
    assert golden()  # the same golden file the cases above come from is present


def test_a_hash_cached_in_two_blocks_stays_indexed_until_both_are_evicted() -> None:
    pool = BlockPool(4, 2, record_events=True)
    twins = pool.allocate(2)  # two requests computed the same first block side by side
    h = b"\x01" * 32
    for block in twins:
        pool.cache_full_blocks([block], [h], 0, 1, StoredBlocks((5, 6), (None,)))
    pool.free(twins[:1])
    pool.free(twins[1:])
    pool.allocate(3)  # evicts one of the two: the engine still holds the hash in the other
    assert pool.is_cached(h)
    mirror = BlockMirror()
    mirror.apply(EventBatch(ts=0.0, events=tuple(pool.take_events())))
    assert sorted(k for k in mirror.blocks().values() if k) == pool.cached_keys()
