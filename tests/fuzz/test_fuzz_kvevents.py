"""Fuzzing KV events past their payload decoder (tests/kvcache/test_events.py already throws
bytes and structured garbage at ``decode_batch``): ZMQ frame lists and replay messages, the
mirror fed adversarial batches that *do* decode, what the agent then sends the server, and
the agent's subscriber on a real ``ipc://`` socket fed malformed multipart messages.

What must hold: frames decode or raise ``KvEventDecodeError``; a decoded batch of any
content applies to a ``BlockMirror`` without an exception, the mirror's net deltas rebuild
it exactly, and every ``KvDelta`` the agent builds from them is one the server's
``decode_kv_delta`` accepts; the subscriber counts each malformed message once, applies the
next good batch, never falls back to reopening its sockets, and keeps no memory per bad
message or per bogus data-parallel rank.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from fuzzkit import async_growth, examples, growth
from hypothesis import example, given
from hypothesis import strategies as st

from llmgw.agent.engines.base import KvEventEndpoints
from llmgw.agent.kvevents import (
    MAX_DATA_PARALLEL_RANK,
    EngineSubscriber,
    KvFollowConfig,
)
from llmgw.agent.kvhub import KvEventHub
from llmgw.api.llmgw.v1 import KvDelta
from llmgw.kvcache import (
    KvEventDecodeError,
    decode_batch,
    decode_frames,
    decode_replay_message,
    decode_replay_request,
    encode_frames,
    encode_replay_message,
)
from llmgw.kvcache.keys import pack_keys
from llmgw.kvcache.mirror import BlockMirror, apply_delta
from llmgw.server.state.kvblocks import decode_kv_delta
from llmgw.server.wire.codec import decode_message

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(120)]

TOPIC = "kv-events"

# --- frames and replay messages ----------------------------------------------------------

_frame = st.binary(max_size=10) | st.sampled_from([b"", TOPIC.encode(), b"\xff\xfe", b"\x00" * 8])
_frame_lists = st.lists(_frame | st.binary(min_size=7, max_size=9), max_size=5)


@examples(500)
@given(_frame_lists)
@example([TOPIC.encode(), b"\x00" * 8, b"\x90"])
@example([b"", b"", b"\xff" * 8, b""])
def test_any_frame_list_decodes_or_is_refused(frames: list[bytes]) -> None:
    try:
        topic, seq, payload = decode_frames(frames)
    except KvEventDecodeError:
        pass
    else:
        assert encode_frames(topic, seq, payload) == frames
    try:
        message = decode_replay_message(frames)
    except KvEventDecodeError:
        pass
    else:
        assert 0 <= message.seq < 1 << 64 and message.payload == frames[-1]
        if message.topic is not None:
            assert encode_replay_message(message.topic, message.seq, message.payload) == frames
    try:
        identity, start = decode_replay_request(frames)
    except KvEventDecodeError:
        assert len(frames) != 3
    else:
        assert identity == frames[0] and start >= 0


# --- adversarial batches that decode -----------------------------------------------------

_ints = st.integers(-(2**63), 2**64 - 1) | st.integers(-3, 300)
_hash = _ints | st.binary(max_size=40)
_strs = st.none() | st.text(max_size=6) | st.sampled_from(["GPU", "CPU", "STORAGE"])
_scalars = (
    st.none() | st.booleans() | _ints | st.floats() | st.text(max_size=4) | st.binary(max_size=4)
)
_extra = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3), max_leaves=6)


@st.composite
def _stored(draw: st.DrawFn) -> dict[str, Any]:
    hashes = draw(st.lists(_hash, min_size=0, max_size=4))
    size = draw(st.sampled_from([0, 1, 2, 4, -1]) | _ints)
    tokens_per = size if 0 < size <= 4 and draw(st.booleans()) else draw(st.integers(0, 9))
    tokens = draw(st.lists(_ints, min_size=tokens_per * len(hashes), max_size=40))
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": draw(st.none() | _hash),
        "token_ids": tokens[: max(tokens_per * len(hashes), draw(st.integers(0, 40)))],
        "block_size": size,
    }
    optional = {
        "lora_id": st.none() | _ints, "medium": _strs, "lora_name": _strs,
        "extra_keys": st.none() | st.lists(st.none() | st.lists(_extra, max_size=3), max_size=5),
        "group_idx": st.none() | _ints, "locality": _strs, "ownership": _strs,
    }  # fmt: skip
    for name, values in optional.items():
        if draw(st.booleans()):
            event[name] = draw(values)
    return event


_removed = st.fixed_dictionaries(
    {"type": st.just("BlockRemoved"), "block_hashes": st.lists(_hash, max_size=4)},
    optional={"medium": _strs, "group_idx": st.none() | _ints, "locality": _strs},
)
_events = st.lists(
    _stored() | _removed | st.just({"type": "AllBlocksCleared"}), min_size=1, max_size=4
)
_batches = st.tuples(
    st.floats() | st.integers(-5, 2**40), _events, st.none() | st.integers(-3, 5000)
).map(lambda t: msgpack.packb(list(t), use_bin_type=True))
_engine_history = st.lists(_batches, min_size=1, max_size=8)


def _subscriber(ctx: zmq.asyncio.Context, compute_keys: bool = True) -> EngineSubscriber:
    """A subscriber whose sockets are never opened: ``_apply`` is its decode-and-mirror step."""
    endpoints = KvEventEndpoints("ipc:///nonexistent/pub", "", TOPIC)
    config = KvFollowConfig(compute_keys=compute_keys, full_copy_chunk=3)
    return EngineSubscriber("s1", endpoints, ctx=ctx, config=config, on_change=lambda: None)


@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


def _server_accepts(messages: Sequence[KvDelta]) -> None:
    """Each message, through the server's codec and checks, as an agent stream delivers it."""
    for message in messages:
        decode_kv_delta(decode_message(bytes(message), KvDelta))


@examples(200, shared_fixture=True)
@given(_engine_history, st.booleans())
@example([msgpack.packb([float("nan"), [{"type": "BlockStored", "block_hashes": [1],
          "parent_block_hash": None, "token_ids": [1], "block_size": 1}], 0])], True)  # fmt: skip
@example([msgpack.packb([1.0, [{"type": "AllBlocksCleared"}], 2**40])], True)
def test_any_decodable_history_mirrors_exactly_and_the_server_accepts_every_delta(
    ctx: zmq.asyncio.Context, payloads: list[bytes], compute_keys: bool
) -> None:
    """Found by this suite: a batch with a NaN or negative ts made the next KvDelta carry
    it, which the server refuses whole (the engine's stored blocks never reached it); a
    batch naming a new data-parallel rank each time grew one mirror per rank."""
    sub, hub = _subscriber(ctx, compute_keys), KvEventHub()
    index: dict[int, dict[int, int]] = {}
    for seq, payload in enumerate(payloads):
        sub._apply(seq, payload)
        for rank, mirror in sorted(sub.mirrors.items()):
            delta = mirror.take_delta()
            apply_delta(index.setdefault(rank, {}), delta)
            assert index[rank] == mirror.blocks()
            pack_keys(list(mirror.blocks()) + list(mirror.blocks().values()))
            _server_accepts(hub._wire(sub, rank, mirror, delta))
    assert set(sub.mirrors) <= set(range(MAX_DATA_PARALLEL_RANK + 1))
    refused = 0
    for payload in payloads:
        try:
            rank = decode_batch(payload).data_parallel_rank or 0
        except KvEventDecodeError:
            refused += 1
        else:
            refused += not 0 <= rank <= MAX_DATA_PARALLEL_RANK
    assert sub.counters().decode_errors == refused


def test_regression_a_flood_of_ranks_costs_no_memory(ctx: zmq.asyncio.Context) -> None:
    """2,000 batches, each naming a rank no engine has: refused, counted, nothing kept."""
    sub = _subscriber(ctx)
    for seq in range(2000):
        sub._apply(seq, msgpack.packb([1.0, [], MAX_DATA_PARALLEL_RANK + 1 + seq * 7919]))
    assert sub.mirrors == {} and sub.counters().decode_errors == 2000
    sub._apply(2000, msgpack.packb([1.0, [], MAX_DATA_PARALLEL_RANK]))
    assert list(sub.mirrors) == [MAX_DATA_PARALLEL_RANK]


def test_a_long_lived_mirror_does_not_grow_with_places_or_refused_events() -> None:
    """Rounds of a thousand batches, each naming a medium never seen before and removing a
    block nobody holds: the mirror's bookkeeping of places stays at its cap."""
    mirror = BlockMirror()
    rounds = iter(range(100))

    def apply_round() -> None:
        r = next(rounds)
        for i in range(1000):
            mirror.apply(decode_batch(msgpack.packb([1.0, [
                {"type": "BlockStored", "block_hashes": [i], "parent_block_hash": None,
                 "token_ids": [i, i], "block_size": 2, "medium": f"m{r}-{i}"},
                {"type": "BlockRemoved", "block_hashes": [i], "medium": f"m{r}-{i}"},
                {"type": "BlockRemoved", "block_hashes": [10**6 + i]},
            ], 0])))  # fmt: skip
        mirror.take_delta()

    assert growth(apply_round) < 16 * 1024
    assert len(mirror) <= 1000


# --- the subscriber on a real socket -----------------------------------------------------


@dataclass
class Live:
    hub: KvEventHub
    pub: zmq.Socket[bytes]  # a raw PUB bound where an engine would bind
    seq: int = 0

    @property
    def counters(self) -> Any:
        return self.hub.counters()["s1"]

    def publish(self, frames: Sequence[bytes]) -> None:
        self.pub.send_multipart(list(frames))

    async def good_batch(self) -> None:
        """Publish a good batch with a fresh seq; wait until the subscriber applied it."""
        self.seq += 1000
        seq, before = self.seq, self.counters.batches
        payload = msgpack.packb([1.0, [{"type": "AllBlocksCleared"}], 0])
        async with asyncio.timeout(10):
            while self.counters.batches == before:
                self.publish(encode_frames(TOPIC, seq, payload))
                await asyncio.sleep(0.01)
        assert self.counters.last_seq == seq


@pytest.fixture
async def live() -> AsyncIterator[Live]:
    folder = Path(tempfile.mkdtemp(prefix="llmgw-fz-", dir="/tmp"))
    sync_ctx = zmq.Context()
    pub = sync_ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"ipc://{folder}/pub")
    hub = KvEventHub(KvFollowConfig(flush_interval_s=0.01, error_log_interval_s=3600))
    hub.follow("s1", KvEventEndpoints(f"ipc://{folder}/pub", "", TOPIC))
    try:
        state = Live(hub, pub)
        await state.good_batch()  # the SUB has joined
        yield state
    finally:
        await hub.aclose()
        pub.close(linger=0)
        sync_ctx.term()
        shutil.rmtree(folder, ignore_errors=True)


def _counted_as_malformed(frames: Sequence[bytes]) -> bool:
    """Whether the subscriber counts this message (once it passes the SUB's topic filter)."""
    try:
        topic, _, payload = decode_frames(frames)
    except KvEventDecodeError:
        return True
    if topic != TOPIC:
        return False  # another topic sharing our prefix: not ours, not an error
    try:
        rank = decode_batch(payload).data_parallel_rank or 0
    except KvEventDecodeError:
        return True
    return not 0 <= rank <= MAX_DATA_PARALLEL_RANK


_topic_frame = st.sampled_from([TOPIC.encode(), (TOPIC + "x").encode(), TOPIC.encode() + b"\xff"])
_messages = st.lists(
    st.tuples(_topic_frame, st.lists(_frame | st.binary(min_size=8, max_size=8), max_size=4)).map(
        lambda t: [t[0], *t[1]]
    )
    | st.tuples(_topic_frame, st.integers(0, 2**64 - 1), _batches | st.binary(max_size=12)).map(
        lambda t: [t[0], t[1].to_bytes(8, "big"), t[2]]
    ),
    min_size=1,
    max_size=6,
)


@examples(40, shared_fixture=True)
@given(messages=_messages)
async def test_malformed_multipart_messages_are_counted_and_the_next_batch_applies(
    live: Live, messages: list[list[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    errors = live.counters.decode_errors
    for frames in messages:
        live.publish(frames)
    await live.good_batch()
    expected = sum(_counted_as_malformed(frames) for frames in messages)
    assert live.counters.decode_errors - errors == expected, messages
    assert "subscriber failed" not in caplog.text


async def test_a_thousand_malformed_messages_leave_no_memory_behind(live: Live) -> None:
    rng = random.Random(8)
    bad = [
        [TOPIC.encode(), rng.randbytes(rng.choice([0, 7, 9])), rng.randbytes(8)]
        for _ in range(1000)
    ]

    async def send_all() -> None:
        errors = live.counters.decode_errors
        for start in range(0, len(bad), 100):  # in bursts, within ZMQ's high-water marks
            for frames in bad[start : start + 100]:
                live.publish(frames)
            async with asyncio.timeout(10):
                while live.counters.decode_errors < errors + start + 100:  # noqa: ASYNC110
                    await asyncio.sleep(0.001)
        await live.good_batch()
        assert live.counters.decode_errors - errors == 1000

    assert await async_growth(send_all) < 64 * 1024


async def test_garbage_on_the_replay_socket_is_counted_and_live_batches_still_apply(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine's ROUTER that answers a replay with malformed messages, then the end."""
    folder = Path(tempfile.mkdtemp(prefix="llmgw-fz-", dir="/tmp"))
    ctx = zmq.asyncio.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(f"ipc://{folder}/pub")
    router.bind(f"ipc://{folder}/replay")
    garbage = [[b""], [b"x", b"\x00" * 8, b""], [b"", b"\x00" * 7, b""], [b"", b"\xff", b"\x00" * 8,
               b"p"], [b"", b"", b"\x00" * 8, b"\xc1"], [b"", b"", b"", b"", b""]]  # fmt: skip
    hub = KvEventHub(KvFollowConfig(replay_timeout_s=0.5, error_log_interval_s=3600))
    hub.follow("s1", KvEventEndpoints(f"ipc://{folder}/pub", f"ipc://{folder}/replay", TOPIC))
    good = msgpack.packb([1.0, [{"type": "AllBlocksCleared"}], 0])
    try:
        async with asyncio.timeout(20):
            ask = asyncio.ensure_future(router.recv_multipart())
            seq = 0
            while not ask.done():  # publish until the subscriber joins and asks for a replay
                seq += 1
                await pub.send_multipart(encode_frames(TOPIC, seq, good))
                await asyncio.sleep(0.02)
            identity = ask.result()[0]
            for frames in garbage:
                await router.send_multipart([identity, *frames])
            await router.send_multipart([identity, b"", b"", b"\xff" * 8, b""])  # the end
            while hub.counters()["s1"].batches == 0:  # live batches go on arriving
                seq += 1
                await pub.send_multipart(encode_frames(TOPIC, seq, good))
                await asyncio.sleep(0.02)
        # the fifth is a well-formed replay of seq 0 whose payload is not msgpack: counted
        # when applied, so six in all
        assert hub.counters()["s1"].decode_errors == len(garbage)
        assert "subscriber failed" not in caplog.text
    finally:
        await hub.aclose()
        pub.close(linger=0)
        router.close(linger=0)
        ctx.destroy(linger=0)
        shutil.rmtree(folder, ignore_errors=True)
