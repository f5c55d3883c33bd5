"""``--sim-test-hooks``: KV event batches dropped on demand, kept for replay; off by default."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.asyncio
from simhelpers import sim_client, sim_config
from test_sim_kvevents import kv_flags, replay

from llmgw.kvcache import BlockStored, decode_batch, decode_replay_message

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8  # 80 tokens: 5 blocks


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


async def test_without_the_flag_there_are_no_hooks(tmp_path: Path) -> None:
    config = sim_config(*kv_flags(tmp_path))
    assert not config.sim.test_hooks
    async with sim_client(config) as (_, client):
        assert (await client.get("/sim/kv_events")).status_code == 404
        assert (await client.post("/sim/kv_events/drop", json={"batches": 1})).status_code == 404


async def test_bad_requests_and_engines_without_events_are_refused(tmp_path: Path) -> None:
    async with sim_client(sim_config("--sim-test-hooks")) as (_, client):
        off = await client.post("/sim/kv_events/drop")
        assert off.status_code == 409 and "KV events are off" in off.json()["error"]["message"]
    async with sim_client(sim_config("--sim-test-hooks", *kv_flags(tmp_path))) as (_, client):
        for bad in ({"batches": 0}, {"batches": "2"}, {"batches": True}):
            reply = await client.post("/sim/kv_events/drop", json=bad)
            assert reply.status_code == 400, bad
        state = (await client.get("/sim/kv_events")).json()
        assert state == {"next_seq": 0, "dropping": 0, "dropped": [], "replayed_from": []}


async def test_a_dropped_batch_leaves_a_gap_that_replay_fills(
    tmp_path: Path, zctx: zmq.asyncio.Context
) -> None:
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    config = sim_config("--sim-test-hooks", *kv_flags(tmp_path))
    try:
        async with sim_client(config) as (_, client):
            sub.connect(f"ipc://{tmp_path}/pub")
            first = await _joined(client, sub)
            armed = await client.post("/sim/kv_events/drop", json={"batches": 1})
            assert armed.status_code == 200 and armed.json()["dropping"] == 1
            await client.post("/reset_prefix_cache")  # AllBlocksCleared: batch first + 1, lost
            await _complete(client)  # its BlockStored: batch first + 2, sent
            topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            assert int.from_bytes(seq, "big") == first + 2  # the SUB sees the gap
            state = (await client.get("/sim/kv_events")).json()
            assert state["dropped"] == [first + 1] and state["dropping"] == 0
            replayed = await replay(zctx, f"ipc://{tmp_path}/replay", first + 1)
            state = (await client.get("/sim/kv_events")).json()
    finally:
        sub.close(linger=0)
    messages = [decode_replay_message(frames) for frames in replayed]
    assert [m.seq for m in messages if not m.is_end] == [first + 1, first + 2]
    lost = decode_batch(messages[0].payload)
    assert [type(e).__name__ for e in lost.events] == ["AllBlocksCleared"]
    assert state["replayed_from"] == [first + 1] and state["next_seq"] == first + 3


async def _complete(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    assert reply.status_code == 200, reply.text


async def _joined(client: httpx.AsyncClient, sub: zmq.asyncio.Socket) -> int:
    """The seq of the first batch the SUB receives (a new SUB misses what came before it)."""
    for attempt in range(50):
        await client.post("/reset_prefix_cache")
        await _complete(client)
        try:
            while True:
                frames = await asyncio.wait_for(sub.recv_multipart(), 0.1 + attempt * 0.02)
                if any(isinstance(e, BlockStored) for e in decode_batch(frames[2]).events):
                    return int.from_bytes(frames[1], "big")
        except TimeoutError:
            continue
    raise AssertionError("no KV event batch reached the SUB")


def test_the_flag_sets_the_behaviour() -> None:
    assert sim_config("--sim-test-hooks").sim.test_hooks
