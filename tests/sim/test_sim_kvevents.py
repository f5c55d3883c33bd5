"""KV events as a vLLM consumer sees them: a SUB on the engine's ipc:// PUB, a DEALER replay."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from simhelpers import golden, sim_client, sim_config

from llmgw.kvcache import (
    REPLAY_END_SEQ,
    BlockStored,
    block_hashes,
    decode_batch,
    decode_replay_message,
    event_hash,
    parse_vllm_version,
)
from llmgw.sim.engine import SimEngineConfig
from llmgw.sim.engine.kvpublisher import binds

PROMPT = ("The quick brown fox jumps over the lazy dog. " * 8).strip()  # 80 tokens


def kv_flags(tmp_path: Path, topic: str = "kv-events") -> tuple[str, ...]:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{tmp_path}/pub",
        "replay_endpoint": f"ipc://{tmp_path}/replay",
        "topic": topic,
    }
    return ("--kv-events-config", json.dumps(config))


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """Every message a DEALER gets for ``start``, the end marker included."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        messages: list[list[bytes]] = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
            messages.append(frames)
            if frames[-2] == REPLAY_END_SEQ:
                return messages
    finally:
        dealer.close(linger=0)


def raw_events(payload: bytes) -> list[Any]:
    return list(msgpack.unpackb(payload, raw=False)[1])


async def test_a_sub_receives_each_steps_events_with_vllms_frames_and_hashes(
    tmp_path: Path, zctx: zmq.asyncio.Context
) -> None:
    config = sim_config(
        *kv_flags(tmp_path),
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        env={"PYTHONHASHSEED": "0"},
    )
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    try:
        async with sim_client(config) as (_, client):
            sub.connect(f"ipc://{tmp_path}/pub")
            frames = await _first_live_batch(client, sub)
            tokens = (await client.post("/tokenize", json={"prompt": PROMPT})).json()["tokens"]
    finally:
        sub.close(linger=0)
    topic, seq, payload = frames
    assert topic == b"kv-events" and len(seq) == 8
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 0
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    expected = block_hashes(tokens, 16, algo="sha256_cbor", seed="0", vllm_version="0.32.0")
    assert stored.block_hashes == tuple(event_hash(h) for h in expected[:5])
    assert stored.parent_block_hash is None and stored.token_ids == tuple(tokens[:80])
    assert (stored.block_size, stored.medium, stored.group_idx) == (16, "GPU", 0)
    assert stored.kv_cache_spec_kind == "full_attention" and stored.extra_keys == (None,) * 5


async def _first_live_batch(client: Any, sub: zmq.asyncio.Socket) -> list[bytes]:
    """Send the prompt until a batch arrives (a new SUB misses what was sent before it joined)."""
    for attempt in range(50):
        await client.post("/reset_prefix_cache")
        await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        try:
            while True:
                frames = await asyncio.wait_for(sub.recv_multipart(), 0.1 + attempt * 0.02)
                if any(isinstance(e, BlockStored) for e in decode_batch(frames[2]).events):
                    return frames
        except TimeoutError:
            continue
    raise AssertionError("no KV event batch reached the SUB")


async def test_map_events_have_the_field_names_of_vllm_0_3x(
    tmp_path: Path, zctx: zmq.asyncio.Context
) -> None:
    config = sim_config(*kv_flags(tmp_path), "--block-size", "4")
    async with sim_client(config) as (_, client):
        await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        await client.post("/reset_prefix_cache")
        messages = await replay(zctx, f"ipc://{tmp_path}/replay", 0)
    golden_case = _golden_case("e-0.33-map-int-basic")
    golden_events = [e for b in golden_case["expected"]["batches"] for e in b["decoded"][1]]
    by_type = {e["type"]: set(e) for e in golden_events}
    ours = [e for m in messages[:-1] for e in raw_events(m[-1])]
    assert {e["type"] for e in ours} == {"BlockStored", "AllBlocksCleared"}
    for event in ours:
        assert list(event)[0] == "type"
        assert set(event) == by_type[event["type"]]


async def test_replay_returns_buffered_batches_from_the_asked_seq_then_the_end_marker(
    tmp_path: Path, zctx: zmq.asyncio.Context
) -> None:
    config = sim_config(*kv_flags(tmp_path, topic="kv@sim"))
    endpoint = f"ipc://{tmp_path}/replay"
    async with sim_client(config) as (_, client):
        for i in range(3):
            await client.post("/v1/completions", json={"prompt": f"{i} {PROMPT}", "max_tokens": 1})
        everything = await replay(zctx, endpoint, 0)
        later = await replay(zctx, endpoint, 2)
        bad = zctx.socket(zmq.DEALER)
        bad.connect(endpoint)
        await bad.send_multipart([b"one frame only"])  # logged and ignored, like vLLM
        bad.close(linger=0)
        after_bad = await replay(zctx, endpoint, 0)
    replies = [decode_replay_message(m) for m in everything]
    assert [r.seq for r in replies[:-1]] == [0, 1, 2]
    assert all(len(m) == 4 and m[1] == b"kv@sim" for m in everything[:-1])
    assert everything[-1] == [b"", b"", REPLAY_END_SEQ, b""] and replies[-1].is_end
    assert [decode_replay_message(m).seq for m in later[:-1]] == [2]
    assert len(after_bad) == len(everything)


async def test_bytes_hashes_when_int_hashes_are_turned_off(
    tmp_path: Path, zctx: zmq.asyncio.Context
) -> None:
    env = {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0", "PYTHONHASHSEED": "42"}
    config = sim_config(*kv_flags(tmp_path), env=env)
    async with sim_client(config) as (_, client):
        await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        tokens = (await client.post("/tokenize", json={"prompt": PROMPT})).json()["tokens"]
        messages = await replay(zctx, f"ipc://{tmp_path}/replay", 0)
    stored = decode_batch(messages[0][-1]).events[0]
    assert isinstance(stored, BlockStored)
    expected = block_hashes(tokens, 16, algo="sha256", seed="42", vllm_version="0.32.0")
    assert stored.block_hashes == tuple(expected[:5])
    assert all(len(h) == 32 for h in stored.block_hashes if isinstance(h, bytes))


async def test_an_old_version_sends_array_events_and_topicless_replays(
    tmp_path: Path, zctx: zmq.asyncio.Context
) -> None:
    config = sim_config(*kv_flags(tmp_path), "--sim-vllm-version", "0.23.0")
    assert config.kv_event_encoding == "array"
    async with sim_client(config) as (_, client):
        await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        messages = await replay(zctx, f"ipc://{tmp_path}/replay", 0)
    golden_event = _golden_case("e-0.23-last-array-speckind")["expected"]["batches"][0]
    want = golden_event["decoded"][1][0]
    event = raw_events(messages[0][-1])[0]
    assert isinstance(event, list) and len(event) == len(want) == 12
    assert event[0] == "BlockStored" and event[4:] == [
        16,
        None,
        "GPU",
        None,
        [None] * 5,
        0,
        "full_attention",
        None,
    ]
    assert len(messages[0]) == 3 and messages[-1] == [b"", REPLAY_END_SEQ, b""]


async def test_events_stop_when_prefix_caching_is_off(tmp_path: Path) -> None:
    config = sim_config(*kv_flags(tmp_path), "--no-enable-prefix-caching")
    async with sim_client(config) as (server, client):
        await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert server.engine.pool.take_events() == []
    assert not (tmp_path / "pub").exists()


# -- the golden event cases, end to end through the engine ----------------------------------


def _golden_case(case_id: str) -> dict[str, Any]:
    return next(c for c in golden()["event_batch_cases"] if c["id"] == case_id)


def _engine_for(case: dict[str, Any], tmp_path: Path) -> tuple[SimEngineConfig, dict[str, Any]]:
    request = case["requests"]["A"]
    flags = [*kv_flags(tmp_path, case["topic"]), "--block-size", str(case["block_size"])]
    flags += ["--prefix-caching-hash-algo", case["algo"], "--sim-vllm-version", case["version"]]
    body: dict[str, Any] = {"prompt": request["token_ids"], "max_tokens": 1}
    if lora := request.get("lora"):
        flags += ["--enable-lora", "--lora-modules", f"{lora['name']}={lora['path']}"]
        body["model"] = lora["name"]
    for field in ("cache_salt", "session_id"):
        if field in request:
            body[field] = request[field]
    env = {"PYTHONHASHSEED": case["seed"]}
    env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if case["int_hashes"] else "0"
    return sim_config(*flags, env=env), body


@pytest.mark.parametrize("case", golden()["event_batch_cases"], ids=lambda c: c["id"])
async def test_the_engine_stores_blocks_as_the_golden_cases_do(
    case: dict[str, Any], tmp_path: Path, zctx: zmq.asyncio.Context
) -> None:
    config, body = _engine_for(case, tmp_path)
    async with sim_client(config) as (_, client):
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        messages = await replay(zctx, f"ipc://{tmp_path}/replay", 0)
    ours = decode_batch(messages[0][-1]).events[0]
    want = decode_batch(bytes.fromhex(case["expected"]["batches"][0]["payload_hex"])).events[0]
    assert isinstance(ours, BlockStored) and isinstance(want, BlockStored)
    hexes = case["expected"]["block_hashes_by_request"]["A"]
    expected = tuple(event_hash(bytes.fromhex(h), use_int=case["int_hashes"]) for h in hexes)
    assert ours.block_hashes == expected  # all three full blocks in one prefill step
    assert ours.block_hashes[:2] == want.block_hashes
    assert ours.extra_keys is not None or want.extra_keys is None
    if want.extra_keys is not None:
        assert ours.extra_keys is not None and ours.extra_keys[:2] == want.extra_keys
    same = ("parent_block_hash", "block_size", "lora_id", "medium", "lora_name", "group_idx")
    for name in (*same, "kv_cache_spec_kind", "session_id"):
        assert getattr(ours, name) == getattr(want, name), name
    ours_raw = raw_events(messages[0][-1])[0]
    want_raw = case["expected"]["batches"][0]["decoded"][1][0]
    if isinstance(want_raw, dict):
        assert list(ours_raw) == list(want_raw)
    else:
        assert len(ours_raw) == len(want_raw)


HASH_CASES = [c for c in golden()["hash_cases"] if not c["mm"] and not c["lookahead"]]


def golden_case_request(
    case: dict[str, Any], tmp_path: Path, max_tokens: int
) -> tuple[SimEngineConfig, dict[str, Any]]:
    """A sim engine set up as the golden hash ``case`` says (block size, algorithm, vLLM
    version, LoRA, seed), and the completion that caches the case's tokens on it."""
    flags = [*kv_flags(tmp_path), "--block-size", str(case["block_size"])]
    flags += ["--prefix-caching-hash-algo", case["algo"], "--sim-vllm-version", case["version"]]
    body: dict[str, Any] = {"prompt": case["token_ids"], "max_tokens": max_tokens}
    if lora := case["lora"]:
        flags += ["--enable-lora", "--lora-modules", f"{lora['name']}={lora['path']}"]
        body["model"] = lora["name"]
    if case["cache_salt"]:
        body["cache_salt"] = case["cache_salt"]
    env = {} if case["seed"] is None else {"PYTHONHASHSEED": case["seed"]}
    return sim_config(*flags, env=env), body


@pytest.mark.parametrize("case", HASH_CASES, ids=lambda c: c["id"])
async def test_the_engine_hashes_blocks_as_vllm_does(
    case: dict[str, Any], tmp_path: Path, zctx: zmq.asyncio.Context
) -> None:
    config, body = golden_case_request(case, tmp_path, max_tokens=1)
    async with sim_client(config) as (_, client):
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        messages = await replay(zctx, f"ipc://{tmp_path}/replay", 0)
    stored = decode_batch(messages[0][-1]).events[0]
    assert isinstance(stored, BlockStored)
    blocks = case["expected"]["blocks"]
    assert stored.block_hashes == tuple(b["event_hash_int"] for b in blocks)
    if parse_vllm_version(case["version"]) >= (0, 17, 0):
        want_keys = case["expected"]["event_extra_keys"]
        assert _lists(stored.extra_keys) == want_keys


def _lists(value: object) -> object:
    if isinstance(value, tuple | list):
        return [_lists(v) for v in value]
    return value


@pytest.mark.parametrize(
    ("endpoint", "bound"),
    [
        ("ipc:///run/kv.sock", True),
        ("inproc://kv", True),
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://node-1:5557", False),
    ],
)
def test_the_pub_endpoint_is_bound_or_connected_by_vllms_rule(endpoint: str, bound: bool) -> None:
    assert binds(endpoint) is bound


async def test_kv_event_sources_reports_the_resolved_endpoints(tmp_path: Path) -> None:
    async with sim_client(sim_config(*kv_flags(tmp_path))) as (_, client):
        sources = (await client.get("/kv_event_sources")).json()
    assert list(sources) == ["0"]
    assert sources["0"]["endpoint"] == f"ipc://{tmp_path}/pub"
    assert sources["0"]["replay_endpoint"] == f"ipc://{tmp_path}/replay"
    assert (sources["0"]["publisher"], sources["0"]["topic"]) == ("zmq", "kv-events")
    async with sim_client(sim_config("--sim-vllm-version", "0.30.0")) as (_, client):
        assert (await client.get("/kv_event_sources")).status_code == 404
