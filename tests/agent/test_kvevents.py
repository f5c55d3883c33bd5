"""The agent's KV event subscriber against the simulated engine's real ZMQ publisher.

Every test runs `llmgw.sim.engine.kvpublisher.KvEventPublisher` (what ``llmgw sim-engine``
publishes with, vLLM's frames and replay) on ``ipc://`` sockets in a short temporary folder;
`FaultyPublisher` adds the faults of the real system: a batch lost on the way to the
subscriber (still buffered for replay, as a PUB past its high-water mark loses it) and a
batch vLLM never sends (its encoding failed: the seq is gone for good, spec §2.6).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import grpclib.const
import grpclib.server
import httpx
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.agent.backoff import BackoffPolicy
from llmgw.agent.daemon import Agent, AgentConfig
from llmgw.agent.engines.base import KvEventEndpoints
from llmgw.agent.kvevents import KvEventCounters, KvFollowConfig
from llmgw.agent.kvhub import KvEventHub
from llmgw.agent.link import CONNECT_PATH
from llmgw.agent.shards import RestartPolicy
from llmgw.api.llmgw.v1 import (
    AgentMessage,
    ControlMessage,
    EngineProfile,
    HeartbeatAck,
    KvDelta,
    Registered,
    ShardState,
    ShardStatus,
    StartShard,
    StopShard,
)
from llmgw.kvcache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    block_hashes,
    encode_frames,
    event_hash,
)
from llmgw.kvcache.keys import unpack_keys
from llmgw.kvcache.mirror import ROOT_KEY, block_key, block_keys
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.sim.engine.config import KvEventsConfig
from llmgw.sim.engine.kvpublisher import KvEventPublisher

pytestmark = pytest.mark.timeout(60)
TOPIC = "kv-events"
BLOCK = 4
FAST = KvFollowConfig(flush_interval_s=0.01, replay_timeout_s=1.0)


class _Lost:
    """A PUB socket whose messages never arrive."""

    def send_multipart(self, frames: Sequence[bytes], flags: int = 0) -> None:
        return None


class FaultyPublisher(KvEventPublisher):
    """The simulated engine's publisher, with the faults a subscriber must survive."""

    def publish_lost(self, events: Sequence[Event]) -> None:
        """Buffered for replay like any batch, but lost on the way to subscribers."""
        real, self._pub = self._pub, _Lost()  # type: ignore[assignment]
        try:
            self.publish(events)
        finally:
            self._pub = real

    def publish_never_sent(self) -> None:
        """A batch vLLM cannot encode (a hash beyond 64 bits): its seq is never sent."""
        self.publish([BlockRemoved(block_hashes=(1 << 64,), medium="GPU")])

    def publish_payload(self, payload: bytes) -> None:
        """Any payload, numbered and buffered as ``publish`` does with a batch."""
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        assert self._pub is not None
        self._pub.send_multipart(encode_frames(self._topic, seq, payload), flags=zmq.NOBLOCK)

    @property
    def last_seq(self) -> int:
        return self._seq - 1


class Engine:
    """An engine's prefix cache (the truth) and the batches it publishes about it."""

    def __init__(self, endpoints: KvEventEndpoints, *, seed: int = 0, buffer_steps: int = 1000,
                 rank: int = 0) -> None:  # fmt: skip
        self.endpoints = endpoints
        self.blocks: dict[int, int] = {}  # hash → our key, as the agent should compute it
        self.rng = random.Random(seed)
        self.buffer_steps = buffer_steps
        self.rank = rank
        self.publisher: FaultyPublisher | None = None

    async def start(self) -> None:
        config = KvEventsConfig(
            enable_kv_cache_events=True,
            endpoint=self.endpoints.endpoint,
            replay_endpoint=self.endpoints.replay_endpoint,
            topic=TOPIC,
            buffer_steps=self.buffer_steps,
        )
        publisher = FaultyPublisher(
            config, encoding="map", vllm_version="0.33.0", data_parallel_rank=self.rank
        )
        await publisher.__aenter__()
        self.publisher = publisher

    async def stop(self) -> None:
        """The engine process ends: its cache is gone."""
        if self.publisher is not None:
            await self.publisher.aclose()
            self.publisher = None
        self.blocks.clear()

    @property
    def pub(self) -> FaultyPublisher:
        assert self.publisher is not None
        return self.publisher

    def store(self, count: int = 2) -> BlockStored:
        """Cache ``count`` new blocks continuing a cached block (or a new prompt)."""
        parent = self.rng.choice([None, *self.blocks]) if self.blocks else None
        key = ROOT_KEY if parent is None else self.blocks[parent]
        hashes, tokens = [], []
        for _ in range(count):
            block_tokens = [self.rng.randrange(50_000) for _ in range(BLOCK)]
            key = block_key(key, block_tokens)
            block = self.rng.getrandbits(64)
            self.blocks[block] = key
            hashes.append(block)
            tokens += block_tokens
        return BlockStored(tuple(hashes), parent, tuple(tokens), BLOCK, medium="GPU", group_idx=0)

    def evict(self) -> BlockRemoved:
        block = self.rng.choice(list(self.blocks))
        del self.blocks[block]
        return BlockRemoved(block_hashes=(block,), medium="GPU", group_idx=0)

    def clear(self) -> AllBlocksCleared:
        self.blocks.clear()
        return AllBlocksCleared()


class DeltaSink(Protocol):
    """Whatever takes the agent's deltas: an `Index` here, a server and gateway in test_kvchain."""

    def apply(self, deltas: Sequence[KvDelta]) -> None: ...


class Index:
    """The receiving end: KvDelta messages applied, per engine, as a server applies them."""

    def __init__(self) -> None:
        self.engines: dict[tuple[str, int], dict[int, int]] = {}
        self.messages: list[KvDelta] = []

    def apply(self, deltas: Sequence[KvDelta]) -> None:
        for delta in deltas:
            self.messages.append(delta)
            blocks = self.engines.setdefault((delta.shard_id, delta.data_parallel_rank), {})
            if delta.reset:
                blocks.clear()
            for block in unpack_keys(delta.removed):
                blocks.pop(block, None)
            stored = unpack_keys(delta.stored)
            blocks.update(zip(stored, unpack_keys(delta.stored_keys), strict=True))

    def of(self, shard_id: str, rank: int = 0) -> dict[int, int]:
        return self.engines.get((shard_id, rank), {})


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short folder: a Unix socket path holds at most 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="llmgw-kv-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def endpoints_in(folder: Path, replay: bool = True) -> KvEventEndpoints:
    return KvEventEndpoints(
        f"ipc://{folder}/pub", f"ipc://{folder}/replay" if replay else "", TOPIC
    )


@pytest.fixture
async def hub() -> AsyncIterator[KvEventHub]:
    kv = KvEventHub(FAST)
    try:
        yield kv
    finally:
        await kv.aclose()


@pytest.fixture
async def engine(sock_dir: Path) -> AsyncIterator[Engine]:
    e = Engine(endpoints_in(sock_dir))
    await e.start()
    try:
        yield e
    finally:
        await e.stop()


async def until(predicate: Callable[[], object], within_s: float = 10.0) -> None:
    async with asyncio.timeout(within_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def synced(hub: KvEventHub, index: DeltaSink, shard: str, engine: Engine) -> KvEventCounters:
    """Wait until the subscriber applied the engine's last batch; then take the deltas."""
    await until(lambda: hub.counters()[shard].last_seq == engine.pub.last_seq)
    index.apply(hub.take_deltas())
    return hub.counters()[shard]


async def joined(hub: KvEventHub, index: DeltaSink, engine: Engine, shard: str = "s1") -> None:
    """Follow the engine and publish until a live batch arrives (the SUB has joined)."""
    hub.follow(shard, engine.endpoints)
    for _ in range(200):
        engine.pub.publish([engine.store(1)])
        await asyncio.sleep(0.02)
        if hub.counters()[shard].batches:
            break
    await synced(hub, index, shard, engine)


# -- the cases ----------------------------------------------------------------------------


async def test_stored_blocks_reach_the_sink_packed_with_our_keys(
    hub: KvEventHub, engine: Engine
) -> None:
    index = Index()
    await joined(hub, index, engine)
    engine.pub.publish([engine.store(3), engine.store(2)])
    counters = await synced(hub, index, "s1", engine)
    assert index.of("s1") == engine.blocks and len(engine.blocks) >= 6
    first, *rest = index.messages
    assert first.reset and first.block_size == BLOCK and first.oldest_event_ts > 0
    assert rest and not any(m.reset for m in rest) and rest[-1].seq == engine.pub.last_seq
    assert len(rest[-1].stored) == 5 * 8  # both events' blocks in one packed message
    assert counters.resets == counters.replay_failures == counters.decode_errors == 0


async def test_history_from_before_the_agent_subscribed_is_replayed(
    hub: KvEventHub, engine: Engine
) -> None:
    for _ in range(5):
        engine.pub.publish([engine.store(2)])
    engine.pub.publish([engine.evict()])
    hub.follow("s1", engine.endpoints)
    index = Index()
    counters = await synced(hub, index, "s1", engine)
    assert index.of("s1") == engine.blocks and len(engine.blocks) == 9
    assert counters.replays >= 1 and counters.resets == 0 and counters.batches == 6


async def test_a_lost_batch_is_replayed_while_live_ones_wait_and_nothing_resets(
    hub: KvEventHub, engine: Engine
) -> None:
    index = Index()
    await joined(hub, index, engine)
    engine.pub.publish_lost([engine.store(2)])
    engine.pub.publish_lost([engine.evict()])
    engine.pub.publish([engine.store(1)])  # reveals the gap
    engine.pub.publish([engine.store(1)])  # arrives while the replay runs: held
    counters = await synced(hub, index, "s1", engine)
    assert index.of("s1") == engine.blocks
    assert counters.gaps >= 1 and counters.replay_failures == 0 and counters.resets == 0
    assert [m.reset for m in index.messages].count(True) == 1  # only the first full copy


@pytest.mark.parametrize("fault", ["never_sent", "buffer_moved_on"])
async def test_a_hole_replay_cannot_fill_resets_the_engines_blocks(
    hub: KvEventHub, sock_dir: Path, fault: str
) -> None:
    engine = Engine(endpoints_in(sock_dir), buffer_steps=3)
    await engine.start()
    try:
        index = Index()
        await joined(hub, index, engine)
        before = set(engine.blocks)
        if fault == "never_sent":
            engine.pub.publish_never_sent()
        else:
            for _ in range(4):  # more than the buffer holds
                engine.pub.publish_lost([engine.store(1)])
        engine.pub.publish([engine.store(2)])
        counters = await synced(hub, index, "s1", engine)
        held = index.of("s1")
        assert counters.replay_failures == 1 and counters.resets == 1
        assert index.messages[-1].reset or any(m.reset for m in index.messages[1:])
        # From the reset on, the index holds only what it has seen since: never a stale block.
        assert set(held) <= set(engine.blocks) and not set(held) & before
        assert len(held) >= 2
    finally:
        await engine.stop()


async def test_an_engine_restart_resets_its_blocks_and_syncs_the_new_process(
    hub: KvEventHub, engine: Engine
) -> None:
    index = Index()
    await joined(hub, index, engine)
    engine.pub.publish([engine.store(3)])
    await synced(hub, index, "s1", engine)
    old = set(index.of("s1"))
    await engine.stop()
    await until(lambda: hub.counters()["s1"].blocks == 0)
    index.apply(hub.take_deltas())
    assert index.of("s1") == {} and index.messages[-1].reset
    await engine.start()  # seq starts at 0 again
    engine.pub.publish([engine.store(2)])
    engine.pub.publish([engine.store(1)])
    counters = await synced(hub, index, "s1", engine)
    assert index.of("s1") == engine.blocks and not old & set(engine.blocks)
    assert counters.restarts >= 1 and counters.replay_failures == 0


async def test_all_blocks_cleared_resets_upstream(hub: KvEventHub, engine: Engine) -> None:
    index = Index()
    await joined(hub, index, engine)
    engine.pub.publish([engine.store(2)])
    await synced(hub, index, "s1", engine)
    engine.pub.publish([engine.clear()])
    engine.pub.publish([engine.store(1)])
    counters = await synced(hub, index, "s1", engine)
    assert index.of("s1") == engine.blocks and len(engine.blocks) == 1
    assert index.messages[-1].reset and counters.resets == 1


async def test_malformed_messages_are_counted_and_the_subscriber_keeps_going(
    hub: KvEventHub, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    index = Index()
    await joined(hub, index, engine)
    engine.pub.publish_payload(b"\xc1 not msgpack")
    engine.pub.publish_payload(b"\x93\xcb")  # a truncated batch
    engine.pub.publish([engine.store(2)])
    counters = await synced(hub, index, "s1", engine)
    assert counters.decode_errors == 2 and index.of("s1") == engine.blocks
    warnings = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warnings) == 1  # rate-limited: one warning per interval


async def test_the_data_parallel_rank_travels_with_its_blocks(
    hub: KvEventHub, sock_dir: Path
) -> None:
    engine = Engine(endpoints_in(sock_dir), rank=3)
    await engine.start()
    try:
        index = Index()
        await joined(hub, index, engine)
        assert index.of("s1", rank=3) == engine.blocks and index.of("s1", rank=0) == {}
    finally:
        await engine.stop()


async def test_without_a_replay_endpoint_a_gap_resets(hub: KvEventHub, sock_dir: Path) -> None:
    engine = Engine(endpoints_in(sock_dir, replay=False))
    await engine.start()
    try:
        index = Index()
        await joined(hub, index, engine)
        engine.pub.publish_lost([engine.store(1)])
        engine.pub.publish([engine.store(1)])
        counters = await synced(hub, index, "s1", engine)
        assert counters.replays == 0 and counters.replay_failures == 1
        assert set(index.of("s1")) <= set(engine.blocks)
    finally:
        await engine.stop()


async def test_a_replay_nobody_answers_times_out_and_live_batches_apply(
    sock_dir: Path,
) -> None:
    silent = KvEventEndpoints(f"ipc://{sock_dir}/pub", f"ipc://{sock_dir}/nobody", TOPIC)
    engine = Engine(silent)
    await engine.start()
    hub = KvEventHub(KvFollowConfig(flush_interval_s=0.01, replay_timeout_s=0.2))
    try:
        index = Index()
        await joined(hub, index, engine)
        assert index.of("s1") and set(index.of("s1")) <= set(engine.blocks)
        assert hub.counters()["s1"].replays >= 1
    finally:
        await hub.aclose()
        await engine.stop()


async def test_forgetting_an_engine_drops_its_blocks_and_a_full_copy_has_the_rest(
    hub: KvEventHub, sock_dir: Path
) -> None:
    for name in "ab":
        (sock_dir / name).mkdir(mode=0o700)  # the agent follows only private folders
    engines = [Engine(endpoints_in(sock_dir / name), seed=i) for i, name in enumerate("ab")]
    for e in engines:
        await e.start()
    try:
        index = Index()
        await joined(hub, index, engines[0], "a")
        await joined(hub, index, engines[1], "b")
        hub.forget("a")
        index.apply(await asyncio.wait_for(hub.next_deltas(), 5))
        assert index.of("a") == {} and index.of("b") == engines[1].blocks
        fresh = Index()
        fresh.apply(hub.full_copy())
        assert fresh.engines == {("b", 0): engines[1].blocks}
        assert fresh.messages[0].reset and hub.following() == ["b"]
    finally:
        for e in engines:
            await e.stop()


async def test_a_large_full_copy_is_split_into_messages(sock_dir: Path) -> None:
    engine = Engine(endpoints_in(sock_dir))
    await engine.start()
    hub = KvEventHub(KvFollowConfig(flush_interval_s=0.01, full_copy_chunk=4))
    try:
        index = Index()
        await joined(hub, index, engine)
        engine.pub.publish([engine.store(5), engine.store(4)])
        await synced(hub, index, "s1", engine)
        copy = hub.full_copy()
        assert [m.reset for m in copy] == [True, False, False]
        fresh = Index()
        fresh.apply(copy)
        assert fresh.of("s1") == engine.blocks and len(engine.blocks) == 10
    finally:
        await hub.aclose()
        await engine.stop()


async def test_a_cap_learned_for_the_shard_makes_one_block_more_reset_the_mirror(
    hub: KvEventHub, engine: Engine
) -> None:
    hub.follow("s1", engine.endpoints)
    assert hub.max_blocks("s1") == FAST.max_blocks  # the fallback until told
    hub.cap("s1", 40)  # before the first batch: the rank's mirror is made with the cap
    index = Index()
    await joined(hub, index, engine)
    engine.pub.publish([engine.store(40 - len(engine.blocks))])
    counters = await synced(hub, index, "s1", engine)
    assert counters.blocks == 40 and hub.max_blocks("s1") == 40  # the cap, not more
    assert counters.decode_errors == counters.resets == 0 and index.of("s1") == engine.blocks

    engine.pub.publish([engine.store(1)])  # the 41st block
    engine.pub.publish([engine.store(1)])  # and the follow goes on from the next batch
    counters = await synced(hub, index, "s1", engine)
    assert counters.decode_errors == 1 and counters.resets == 1
    assert counters.blocks == 1 and len(index.of("s1")) == 1
    assert set(index.of("s1")) <= set(engine.blocks) and index.messages[-1].reset


async def test_a_cap_below_what_a_mirror_holds_resets_it_and_a_cap_has_a_ceiling(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine(endpoints_in(sock_dir))
    await engine.start()
    hub = KvEventHub(KvFollowConfig(flush_interval_s=0.01, max_blocks=100))
    try:
        index = Index()
        await joined(hub, index, engine)
        engine.pub.publish([engine.store(5)])
        held = (await synced(hub, index, "s1", engine)).blocks
        hub.cap("nobody", 1)  # a shard not followed: nothing to cap, nothing breaks
        hub.cap("s1", held - 1)
        counters = hub.counters()["s1"]
        assert counters.blocks == 0 and hub.max_blocks("s1") == held - 1
        assert counters.decode_errors == 1 and counters.resets == 1
        index.apply(hub.take_deltas())
        assert index.of("s1") == {} and index.messages[-1].reset
        assert len([r for r in caplog.records if "more than the engine's" in r.getMessage()]) == 1

        hub.cap("s1", 10**12)  # an engine cannot lift the fixed bound
        assert hub.max_blocks("s1") == 100 and hub.max_blocks("nobody") is None
    finally:
        await hub.aclose()
        await engine.stop()


# -- property: lost batches, replays, restarts → the index equals the engine's cache -------

_STEPS = st.lists(
    st.sampled_from(["store", "store", "evict", "clear", "lose", "lose", "restart"]),
    min_size=1,
    max_size=25,
)


async def _scenario(folder: Path, steps: list[str], seed: int) -> None:
    engine = Engine(endpoints_in(folder), seed=seed)
    await engine.start()
    hub = KvEventHub(KvFollowConfig(flush_interval_s=0.005, replay_timeout_s=1.0))
    index = Index()
    try:
        await joined(hub, index, engine)
        for step in steps:
            if step == "restart":
                await _restart(hub, index, engine)
            elif step == "lose" and engine.blocks:
                engine.pub.publish_lost([engine.store(1), engine.evict()])
            elif step == "evict" and engine.blocks:
                engine.pub.publish([engine.evict()])
            elif step == "clear":
                engine.pub.publish([engine.clear()])
            else:
                engine.pub.publish([engine.store(engine.rng.randint(1, 3))])
            if engine.rng.random() < 0.3:
                index.apply(hub.take_deltas())
            await asyncio.sleep(0)
        engine.pub.publish([engine.store(1)])  # a delivered batch reveals any trailing gap
        counters = await synced(hub, index, "s1", engine)
        assert index.of("s1") == engine.blocks
        assert counters.replay_failures == 0
    finally:
        await hub.aclose()
        await engine.stop()


async def _restart(hub: KvEventHub, index: DeltaSink, engine: Engine) -> None:
    """Restart the engine once the subscriber follows it, so that it sees the restart (the
    new process's seqs may equal the old one's), and publish a first batch."""
    engine.pub.publish([engine.store(1)])
    await synced(hub, index, "s1", engine)
    restarts = hub.counters()["s1"].restarts
    await engine.stop()
    await until(lambda: hub.counters()["s1"].restarts > restarts)
    await engine.start()
    engine.pub.publish([engine.store(1)])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_STEPS, st.integers(0, 2**32))
def test_after_losses_replays_and_restarts_the_index_equals_the_engines_cache(
    steps: list[str], seed: int
) -> None:
    folder = Path(tempfile.mkdtemp(prefix="llmgw-kvp-", dir="/tmp"))
    try:
        asyncio.run(_scenario(folder, steps, seed))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- the agent: a sim engine with KV events on, and the agent's stream ---------------------

PROMPT = ("The quick brown fox jumps over the lazy dog. " * 8).strip()  # 80 tokens: 5 blocks
SIM_BLOCKS = 300  # the simulated engine's KV blocks (4,800 tokens: one 4,096-token request)


class FakeControl:
    """A control server that records every stream and sends commands down the current one."""

    def __init__(self) -> None:
        self.sessions: list[list[AgentMessage]] = []
        self.commands: asyncio.Queue[ControlMessage] = asyncio.Queue()
        self.end = asyncio.Event()

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        handler = grpclib.const.Handler(
            self._connect, grpclib.const.Cardinality.STREAM_STREAM, AgentMessage, ControlMessage
        )
        return {CONNECT_PATH: handler}

    async def _connect(self, stream: grpclib.server.Stream[AgentMessage, ControlMessage]) -> None:
        messages: list[AgentMessage] = []
        self.sessions.append(messages)
        self.end.clear()
        registered = Registered(protocol_version=PROTOCOL_VERSION, heartbeat_interval_ms=50)
        async for message in stream:
            messages.append(message)
            if message.register is not None:
                await stream.send_message(ControlMessage(registered=registered))
            elif message.heartbeat is not None:
                ack = HeartbeatAck(
                    seq=message.heartbeat.seq, sent_at_ms=message.heartbeat.sent_at_ms
                )
                await stream.send_message(ControlMessage(heartbeat_ack=ack))
            while not self.commands.empty():
                await stream.send_message(self.commands.get_nowait())
            if self.end.is_set():
                return  # the stream ends; the agent opens a new one

    def kv(self, session: int) -> list[KvDelta]:
        return [m.kv_delta for m in self.sessions[session] if m.kv_delta is not None]

    def statuses(self, shard_id: str) -> list[ShardStatus]:
        return [
            m.shard_status
            for session in self.sessions
            for m in session
            if m.shard_status is not None and m.shard_status.shard_id == shard_id
        ]

    def state(self, shard_id: str) -> ShardState | None:
        seen = self.statuses(shard_id)
        return seen[-1].state if seen else None


def _start_sim_shard() -> StartShard:
    profile = EngineProfile(
        name="sim-kv",
        engine="sim",
        gpu_class="cpu",
        model_path="tiny-sim",
        kv_events=True,
        args=[
            *("--sim-prefill-ms-per-token", "0", "--sim-decode-ms-per-token", "0"),
            *("--sim-kv-blocks", str(SIM_BLOCKS)),
        ],
    )
    return StartShard(
        shard_id="kv1", replica_id="r1", profile=profile, profile_fingerprint="fp-kv", api_key="k"
    )


async def _prompt(endpoint: str) -> list[int]:
    """One completion (the engine caches the prompt's blocks); the prompt's token ids."""
    headers = {"Authorization": "Bearer k"}
    async with httpx.AsyncClient(base_url=endpoint, headers=headers, timeout=10) as client:
        body = {"model": "tiny-sim", "prompt": PROMPT, "max_tokens": 1}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        reply = await client.post("/tokenize", json={"model": "tiny-sim", "prompt": PROMPT})
        tokens: list[int] = reply.json()["tokens"]
        return tokens


def _caught_up(index: Index, received: Sequence[KvDelta]) -> Index:
    """``index`` with the messages it has not applied yet applied."""
    index.apply(received[len(index.messages) :])
    return index


@pytest.fixture
async def control() -> AsyncIterator[tuple[FakeControl, int]]:
    fake = FakeControl()
    server = grpclib.server.Server([fake])
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield fake, port
    finally:
        server.close()
        await server.wait_closed()


def _kill_engines(statuses: Sequence[ShardStatus]) -> None:
    """Engines outlive their agent on purpose: end what this test started."""
    for pid in {s.pid for s in statuses if s.pid}:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


@pytest.mark.timeout(90)
async def test_the_agent_streams_kv_deltas_and_each_new_stream_starts_with_a_full_copy(
    control: tuple[FakeControl, int], tmp_path: Path
) -> None:
    fake, port = control
    config = AgentConfig(
        "127.0.0.1",
        port,
        tmp_path / "state",
        simulate="cpu-only",
        backoff=BackoffPolicy(base_s=0.05, cap_s=0.2),
        drain_settle_s=0.0,
        restart=RestartPolicy(base_s=0.2, cap_s=1.0),
        kv_events=KvFollowConfig(flush_interval_s=0.01),
    )
    agent = Agent(config)
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run(stop))
    try:
        await until(lambda: fake.sessions)
        await fake.commands.put(ControlMessage(start_shard=_start_sim_shard()))
        await until(lambda: fake.state("kv1") is ShardState.READY, 30)
        # the engine's own block count bounds its mirror, read from its /metrics once READY
        await until(lambda: agent.kv.max_blocks("kv1") == SIM_BLOCKS)
        tokens = await _prompt(fake.statuses("kv1")[-1].endpoint)
        digests = block_hashes(tokens, 16, algo="sha256_cbor", seed="0", vllm_version="0.32.0")
        engine = dict(zip((event_hash(d) for d in digests), block_keys(tokens, 16), strict=True))
        assert len(engine) == 5

        first = Index()
        await until(lambda: engine.items() <= _caught_up(first, fake.kv(0)).of("kv1").items())
        assert first.messages[0].reset and first.messages[0].block_size == 16
        assert first.of("kv1") == engine  # only the prompt's full blocks

        fake.end.set()  # a new stream: it must start with a full copy of the engine's blocks
        await until(lambda: len(fake.sessions) == 2 and fake.kv(1))
        copy = fake.kv(1)[0]
        assert copy.reset and copy.shard_id == "kv1" and copy.seq == first.messages[-1].seq
        stored = unpack_keys(copy.stored)
        assert dict(zip(stored, unpack_keys(copy.stored_keys), strict=True)) == first.of("kv1")

        # kill -9: its blocks leave upstream within 2 s; the restarted engine's arrive
        second = Index()
        killed = fake.statuses("kv1")[-1].pid
        os.killpg(killed, signal.SIGKILL)
        await until(lambda: not _caught_up(second, fake.kv(1)).of("kv1"), 2.0)
        await until(lambda: fake.statuses("kv1")[-1].pid not in (0, killed), 30)
        await until(lambda: fake.state("kv1") is ShardState.READY, 30)
        await until(lambda: agent.kv.max_blocks("kv1") == SIM_BLOCKS)  # capped again
        await _prompt(fake.statuses("kv1")[-1].endpoint)
        await until(lambda: _caught_up(second, fake.kv(1)).of("kv1") == engine)

        await fake.commands.put(
            ControlMessage(stop_shard=StopShard(shard_id="kv1", grace_seconds=5))
        )
        await until(lambda: fake.state("kv1") is ShardState.STOPPED, 15)
        await until(lambda: fake.kv(1)[-1].reset and not fake.kv(1)[-1].stored)
        assert agent.kv.following() == [] and agent.link.stats.kv_deltas >= 2
    finally:
        stop.set()
        await running
        _kill_engines(fake.statuses("kv1"))
