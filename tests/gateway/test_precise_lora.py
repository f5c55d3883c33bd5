"""LoRA requests in the precise tier: their block keys carry the adapter's extra key.

vLLM hashes a LoRA request's blocks with the adapter in every block's extra keys, and its
events publish that as ``extra_keys[i] = [lora_name]`` (0.17+; ``lora_name`` alone before),
so the agents' mirrors key those blocks apart from the base model's. The gateway must reach
the same keys from the tokens and the adapter's name, or a LoRA request finds nothing and
the approximate tier decides it. Checked against vLLM's own golden event batches and hash
cases (tests/data/vllm_kv_golden.json), and against the simulated engine's real events over
ZMQ, read by the agent's own subscriber.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import tempfile
from array import array
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from simserve import NO_TIME, sim_engine

from llmgw.agent.engines.base import KvEventEndpoints
from llmgw.agent.engines.vllm import kv_events_config
from llmgw.agent.kvevents import KvFollowConfig
from llmgw.agent.kvhub import KvEventHub
from llmgw.gateway.precise import (
    BlockKeyCache,
    PreciseRequest,
    PreciseTier,
    extra_keys_fn,
    lora_adapter,
)
from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.gateway.routing.load import LoadTracker
from llmgw.gateway.routing.policy import PrefixPolicy
from llmgw.gateway.routing.table import Target
from llmgw.gateway.tokenize import TokenizeClient, TokenizeConfig
from llmgw.gateway.upstream import UpstreamPool
from llmgw.kvcache import BlockStored, EventBatch, decode_batch, decode_frames
from llmgw.kvcache.keys import unpack_keys
from llmgw.kvcache.mirror import BlockMirror, block_keys, normalize_hash

GOLDEN = json.loads((Path(__file__).parent.parent / "data" / "vllm_kv_golden.json").read_text())
BASE, ADAPTER = "chat", "sql-lora"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def golden(section: str, case_id: str) -> dict[str, Any]:
    return next(case for case in GOLDEN[section] if case["id"] == case_id)


def mirrored(frames_hex: list[list[str]]) -> BlockMirror:
    """A mirror fed golden frames, as the agent feeds one from the engine's socket."""
    mirror = BlockMirror()
    for frames in frames_hex:
        _, _, payload = decode_frames([bytes.fromhex(part) for part in frames])
        mirror.apply(decode_batch(payload))
    return mirror


def targets(*ids: str, model: str = BASE) -> tuple[Target, ...]:
    return tuple(
        Target(rid, model, f"http://127.0.0.1:{9000 + i}", kv_events=True)
        for i, rid in enumerate(ids)
    )


def tier(index: KvIndex) -> PreciseTier:
    return PreciseTier(index, PrefixPolicy(), None)


async def prepared(precise: PreciseTier, document: dict[str, Any]) -> PreciseRequest:
    """A completions request of token ids through `PreciseTier.prepare` (no /tokenize)."""
    body = json.dumps(document).encode()
    out = await precise.prepare(
        COMPLETIONS, body, document["model"], 0, targets("a"), LoadTracker()
    )
    assert isinstance(out, PreciseRequest), out
    return out


# -- against vLLM's golden vectors ---------------------------------------------------------


@pytest.mark.parametrize("case_id", ["e-0.33-map-bytes-lora-session", "e-0.14-array-lora-name"])
async def test_lora_keys_are_those_the_mirror_makes_of_vllms_own_events(case_id: str) -> None:
    # 0.33 publishes extra_keys [["sql-lora"], …] (bytes hashes); 0.14 only lora_name.
    case = golden("event_batch_cases", case_id)
    stored = case["expected"]["batches"][:2]  # the two BlockStored batches of request A
    mirror = mirrored([batch["frames_hex"] for batch in stored])
    tokens = case["requests"]["A"]["token_ids"]
    lora = case["requests"]["A"]["lora"]["name"]
    published = [mirror.key_of(normalize_hash(h)) for h in mirror.blocks()]
    assert len(published) == len(tokens) // case["block_size"] == 3

    index = KvIndex()
    index.apply("a", False, published, block_size=case["block_size"])  # type: ignore[arg-type]
    precise = tier(index)
    request = await prepared(precise, {"model": lora, "prompt": tokens})
    assert request.lora == lora
    assert precise.keys(request, case["block_size"]) == published
    assert precise.matched_tokens(request, targets("a"))[0] == {"a": 12}
    base = await prepared(precise, {"model": BASE, "prompt": tokens})
    assert base.lora is None  # the base model's request: plain keys, which the replica lacks
    assert precise.matched_tokens(base, targets("a"))[0] == {"a": 0}


def test_lora_and_salt_keys_follow_vllms_event_extra_keys() -> None:
    # 0.30: hash keys ("sql-lora", "tenant-a") on block 0, ("sql-lora",) on the rest; the
    # events carry them as they are (0.31+ untags to the same values).
    case = golden("hash_cases", "h-legacy-0.30-lora-salt-untagged")
    size, tokens = case["block_size"], case["token_ids"]
    extra = case["expected"]["event_extra_keys"]
    assert extra == [["sql-lora", "tenant-a"], ["sql-lora"], ["sql-lora"]]
    full = len(tokens) // size * size
    event = BlockStored(
        block_hashes=tuple(b["event_hash_int"] for b in case["expected"]["blocks"]),
        parent_block_hash=None,
        token_ids=tuple(tokens[:full]),
        block_size=size,
        lora_name="sql-lora",
        extra_keys=tuple(tuple(keys) for keys in extra),
    )
    mirror = BlockMirror()
    mirror.apply(EventBatch(ts=1.0, events=(event,)))
    published = list(mirror.blocks().values())
    cache = BlockKeyCache(size)
    assert cache.keys(array("Q", tokens), "tenant-a", "sql-lora") == published
    assert cache.keys(array("Q", tokens), None, "sql-lora") != published  # salt matters
    assert cache.keys(array("Q", tokens), "tenant-a") != published  # ... and so does LoRA


# -- keys and the memo -----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),
            st.integers(0, 400),
            st.sampled_from([None, "s1"]),
            st.sampled_from([None, "sql-lora", "chat-lora"]),
        ),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([4, 16]),
)
def test_any_order_of_adapters_salts_and_prefixes_gives_block_keys(
    steps: list[tuple[int, int, str | None, str | None]], block_size: int
) -> None:
    rng = random.Random(1)
    bases = [[rng.randrange(49_152) for _ in range(500)] for _ in range(3)]
    cache = BlockKeyCache(block_size, max_groups=30)
    for base, cut, salt, lora in steps:
        tokens = bases[base][: cut + 50]
        want = block_keys(tokens, block_size, extra_keys_fn=extra_keys_fn(lora, salt))
        assert cache.keys(array("Q", tokens), salt, lora) == want


def test_a_continued_lora_chat_keeps_the_adapter_on_every_new_block() -> None:
    rng = random.Random(5)
    first = [rng.randrange(49_152) for _ in range(300)]
    longer = first + [rng.randrange(49_152) for _ in range(200)]
    cache = BlockKeyCache(16)
    cache.keys(array("Q", first), None, ADAPTER)
    extra = extra_keys_fn(ADAPTER, None)
    assert cache.keys(array("Q", longer), None, ADAPTER) == block_keys(
        longer, 16, extra_keys_fn=extra
    )
    assert cache.hashed == 300 // 16 + (500 // 16 - 300 // 16)  # the memo served the rest


def test_which_requests_run_on_an_adapter() -> None:
    assert lora_adapter(ADAPTER, targets("a", "b")) == ADAPTER
    assert lora_adapter(BASE, targets("a", "b")) is None
    assert lora_adapter(ADAPTER, ()) is None
    mixed = (*targets("a"), *targets("b", model=ADAPTER))  # a deployment named like it
    assert lora_adapter(ADAPTER, mixed) is None
    assert extra_keys_fn(None, None) is None
    both = extra_keys_fn(ADAPTER, "t")
    assert both is not None and (both(0, 16), both(16, 32)) == ((ADAPTER, "t"), (ADAPTER,))


# -- against the simulated engine's events ------------------------------------------------------


@contextlib.contextmanager
def short_folder() -> Iterator[Path]:
    """A folder with a short path: ``ipc://`` paths must fit in 107 bytes."""
    folder = Path(tempfile.mkdtemp(prefix="lora", dir="/tmp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.asynccontextmanager
async def followed(endpoints: KvEventEndpoints) -> AsyncIterator[KvEventHub]:
    hub = KvEventHub(KvFollowConfig(flush_interval_s=0.005, replay_timeout_s=1.0))
    hub.follow("s1", endpoints)
    try:
        yield hub
    finally:
        await hub.aclose()


async def settled(hub: KvEventHub, blocks: int) -> list[int]:
    """The block keys the agent would send upstream, once it mirrors ``blocks`` blocks."""
    for _ in range(500):
        if hub.counters()["s1"].blocks >= blocks:
            await asyncio.sleep(0.05)  # anything still in flight
            return [key for delta in hub.full_copy() for key in unpack_keys(delta.stored_keys)]
        await asyncio.sleep(0.01)
    raise AssertionError(f"the agent mirrored {hub.counters()['s1'].blocks} blocks")


async def test_a_lora_chat_finds_the_blocks_the_simulated_engine_published() -> None:
    messages = [
        {"role": "system", "content": "You write SQL. " + "Use ANSI joins only. " * 30},
        {"role": "user", "content": "List the ten largest orders of last month."},
    ]
    with short_folder() as folder:
        endpoints = KvEventEndpoints(f"ipc://{folder}/pub", f"ipc://{folder}/replay", "kv")
        flags: tuple[str, ...] = ("--served-model-name", BASE, "--enable-lora")
        flags += ("--lora-modules",)
        flags += (f"{ADAPTER}=/adapters/{ADAPTER}", "--kv-events-config")
        flags += (kv_events_config(endpoints), *NO_TIME)
        async with (
            sim_engine("/models/chat", *flags) as url,
            followed(endpoints) as hub,
            httpx.AsyncClient(base_url=url, timeout=10) as direct,
        ):
            await asyncio.sleep(0.2)  # the agent's SUB connects before the engine publishes
            reply = await direct.post(
                CHAT, json={"model": ADAPTER, "messages": messages, "max_tokens": 1}
            )
            assert reply.status_code == 200, reply.text
            prompt = reply.json()["usage"]["prompt_tokens"]
            blocks = await settled(hub, prompt // 16)
            index = KvIndex()
            index.apply("r1", False, blocks, block_size=16)
            pool = UpstreamPool(connect_timeout_s=2.0, idle_timeout_s=4.0)
            try:
                tokenizer = TokenizeClient(pool, TokenizeConfig(timeout_s=5.0))
                precise = PreciseTier(index, PrefixPolicy(), tokenizer)
                candidates = (Target("r1", BASE, url, kv_events=True),)
                matched = {}
                for model in (ADAPTER, BASE):
                    body = json.dumps({"model": model, "messages": messages}).encode()
                    request = await precise.prepare(CHAT, body, model, 0, candidates, LoadTracker())
                    assert isinstance(request, PreciseRequest), request
                    assert len(request.tokens) == prompt
                    matched[model] = precise.matched_tokens(request, candidates)[0]["r1"]
            finally:
                await pool.close()
    # every full block of the LoRA prompt is found; the base model's keys are other blocks
    assert matched == {ADAPTER: prompt // 16 * 16, BASE: 0}
