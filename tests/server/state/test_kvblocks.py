"""The control server's KV block store (llmgw/server/state/kvblocks.py): checked deltas, whose
blocks they are, when blocks are dropped, the watchers that feed gateways, and the whole
path from an agent's stream to the store and a gateway's index."""

from __future__ import annotations

import asyncio
import math
import random
from array import array
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import grpclib.client
import grpclib.server
import pytest
from grpclib.const import Cardinality
from hypothesis import example, given, settings
from hypothesis import strategies as st

from llmgw.agent.link import CONNECT_PATH
from llmgw.api.llmgw.v1 import (
    AgentMessage,
    ControlMessage,
    EngineProfile,
    Gpu,
    KvDelta,
    NodeInfo,
    Register,
    RouterFeedEvent,
    Shard,
    ShardState,
    ShardStatus,
)
from llmgw.gateway.feed import apply_feed_event
from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.gateway.routing.table import RoutingTable
from llmgw.kvcache.keys import pack_keys, unpack_keys
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server.core.plan import ReplicaPlan, ShardPlan
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord
from llmgw.server.state.inventory import InventoryConfig
from llmgw.server.state.kvblocks import (
    DecodedKvDelta,
    KvBlocks,
    KvDeltaRefused,
    decode_kv_delta,
    leader_replica,
)
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.agentsvc import AgentService
from llmgw.server.wire.codec import CheckedProtoCodec, install_message_limit
from llmgw.server.wire.routersvc import route_events

PROFILE = EngineProfile(
    name="chat-p", engine="sim", gpu_class="H100", tp=1, model_path="/m/chat",
    served_model_name="chat", kv_events=True,
)  # fmt: skip
_RNG = random.Random(66)
KEYS = [_RNG.getrandbits(64) | 1 for _ in range(3000)]


def _delta(
    shard_id: str = "chat-1.0",
    stored: list[int] | None = None,
    removed: list[int] | None = None,
    *,
    reset: bool = False,
    rank: int = 0,
) -> KvDelta:
    """A KvDelta as an agent packs it (its hashes are the keys + 1: only lengths matter)."""
    stored, removed = stored or [], removed or []
    return KvDelta(
        shard_id=shard_id,
        data_parallel_rank=rank,
        reset=reset,
        stored=pack_keys([k ^ 1 for k in stored]),
        stored_keys=pack_keys(stored),
        removed=pack_keys([k ^ 1 for k in removed]),
        removed_keys=pack_keys(removed),
        block_size=16,
        oldest_event_ts=1_700_000_000.5,
    )


def _decoded(stored: list[int] = [], removed: list[int] = [], **kw: object) -> DecodedKvDelta:  # noqa: B006
    return decode_kv_delta(_delta(stored=stored, removed=removed, **kw))  # type: ignore[arg-type]


# --- decoding ------------------------------------------------------------------------------


def test_decode_keeps_keys_in_order_and_the_rest() -> None:
    decoded = decode_kv_delta(_delta(stored=[5, 6, 0], removed=[7], reset=True, rank=2))
    assert list(decoded.stored_keys) == [5, 6, 0] and list(decoded.removed_keys) == [7]
    assert (decoded.shard_id, decoded.rank, decoded.reset) == ("chat-1.0", 2, True)
    assert (decoded.block_size, decoded.oldest_event_ts) == (16, 1_700_000_000.5)
    # hashes without keys (an agent that computes none): nothing to index, still valid
    bare = decode_kv_delta(KvDelta(shard_id="s", stored=pack_keys([1, 2])))
    assert list(bare.stored_keys) == [] and not bare.reset


@pytest.mark.parametrize(
    ("change", "fault"),
    [
        ({"stored": b"\x00" * 7}, "KvDelta.stored: 7 bytes"),
        ({"removed": b"\x00" * 9}, "KvDelta.removed: 9 bytes"),
        ({"stored_keys": b"\x00" * 12}, "KvDelta.stored_keys: 12 bytes"),
        ({"stored_keys": pack_keys([1])}, "KvDelta.stored_keys: 1 keys for 2 block hashes"),
        ({"removed_keys": pack_keys([1, 2])}, "KvDelta.removed_keys: 2 keys for 1 block"),
        ({"shard_id": ""}, "shard_id is empty"),
        ({"data_parallel_rank": 5000}, "data_parallel_rank 5000 is above 4095"),
        ({"oldest_event_ts": math.nan}, "oldest_event_ts nan is not a time"),
        ({"oldest_event_ts": -1.0}, "oldest_event_ts -1.0 is not a time"),
    ],
)
def test_malformed_deltas_are_refused_naming_the_fault(
    change: dict[str, object], fault: str
) -> None:
    delta = _delta(stored=[10, 11], removed=[12])
    for name, value in change.items():
        setattr(delta, name, value)
    with pytest.raises(KvDeltaRefused, match=fault.replace("(", r"\(")):
        decode_kv_delta(delta)


# --- whose blocks --------------------------------------------------------------------------


def _record(
    replica_id: str, nodes: tuple[str, ...] = ("n1",), lifecycle: Lifecycle = Lifecycle.ACTIVE
) -> ReplicaRecord:
    shards = tuple(
        ShardPlan(f"{replica_id}.{rank}", node, rank, (f"GPU-{rank}",), 9000 + rank)
        for rank, node in enumerate(nodes)
    )
    plan = ReplicaPlan(replica_id, "chat", "chat-p", "fp", shards)
    return ReplicaRecord(plan, PROFILE, lifecycle, serial=1, api_key="k" * 40)


def _shard(shard_id: str, node_id: str, state: ShardState = ShardState.READY) -> Shard:
    replica_id = shard_id.rpartition(".")[0]
    status = ShardStatus(shard_id=shard_id, replica_id=replica_id, state=state)
    return Shard(shard_id=shard_id, replica_id=replica_id, node_id=node_id, status=status)


def test_only_a_live_leader_on_its_planned_node_feeds_its_replica() -> None:
    replicas = {
        "chat-1": _record("chat-1", ("n1", "n2")),
        "chat-9": _record("chat-9", lifecycle=Lifecycle.RETIRED),
    }
    shards = {s.shard_id: s for s in (_shard("chat-1.0", "n1"), _shard("chat-1.1", "n2"))}
    shards["chat-9.0"] = _shard("chat-9.0", "n1")
    assert leader_replica("chat-1.0", "n1", shards, replicas) == "chat-1"
    assert leader_replica("chat-1.1", "n2", shards, replicas) is None  # not the leader
    assert leader_replica("chat-1.0", "n2", shards, replicas) is None  # not from its node
    assert leader_replica("chat-9.0", "n1", shards, replicas) is None  # retired
    assert leader_replica("nope.0", "n1", shards, replicas) is None  # never reported
    for state in (ShardState.STOPPED, ShardState.FAILED):
        shards["chat-1.0"] = _shard("chat-1.0", "n1", state)
        assert leader_replica("chat-1.0", "n1", shards, replicas) is None
    shards["chat-1.0"] = _shard("chat-1.0", "n1", ShardState.LOADING)
    assert leader_replica("chat-1.0", "n1", shards, replicas) == "chat-1"


# --- the store -----------------------------------------------------------------------------


def test_a_reset_replaces_and_ranks_add_up() -> None:
    blocks = KvBlocks()
    blocks.apply("n1", "chat-1", _decoded(KEYS[:10], reset=True))
    blocks.apply("n1", "chat-1", _decoded(KEYS[10:12], KEYS[:2]))
    assert list(blocks.keys("chat-1")) == sorted(KEYS[2:12])
    blocks.apply("n1", "chat-1", _decoded(KEYS[20:23], reset=True))  # the engine restarted
    assert list(blocks.keys("chat-1")) == sorted(KEYS[20:23])
    blocks.apply("n1", "chat-1", _decoded(KEYS[21:25], rank=1))  # another DP rank
    assert list(blocks.keys("chat-1")) == sorted(KEYS[20:25])  # the union
    assert blocks.holds("chat-1", KEYS[24]) and not blocks.holds("chat-1", KEYS[0])
    assert blocks.block_size("chat-1") == 16
    blocks.apply("n1", None, _decoded(KEYS[:5]))  # not a leader's
    stats = blocks.stats()
    assert (stats.replicas, stats.blocks, stats.deltas, stats.resets) == (1, 7, 4, 2)
    assert (stats.stored, stats.removed, stats.ignored) == (19, 2, 1)


def test_drops_by_replica_node_shard_and_state() -> None:
    blocks = KvBlocks()
    for replica_id, node in (("a", "n1"), ("b", "n1"), ("c", "n2")):
        delta = replace(_decoded(KEYS[:3], reset=True), shard_id=f"{replica_id}.0")
        blocks.apply(node, replica_id, delta)
    blocks.drop_node("n1", "gone")
    assert blocks.replica_ids() == ["c"]
    for state in (ShardState.READY, ShardState.LOADING, ShardState.DRAINING):
        blocks.shard_state("c.0", state)
    assert blocks.replica_ids() == ["c"]
    blocks.shard_state("c.0", ShardState.STARTING)
    assert blocks.replica_ids() == [] and blocks.stats().drops == 3
    blocks.apply("n2", "c", replace(_decoded(KEYS[:3]), shard_id="c.0"))
    blocks.apply("n3", "c", replace(_decoded(KEYS[5:6]), shard_id="c.0"))  # moved: afresh
    assert list(blocks.keys("c")) == [KEYS[5]]


def test_a_watcher_sends_full_copies_in_chunks_then_coalesced_changes() -> None:
    blocks = KvBlocks(chunk=4, touched_limit=50)
    with blocks.watch() as watcher:
        blocks.apply("n1", "chat-1", _decoded(KEYS[:10], reset=True))
        watcher.mark_full(["chat-1", "chat-2"])
        events = watcher.take(10**9)
        assert [(e.replica_id, e.reset, len(e.stored_keys) // 8) for e in events] == [
            ("chat-1", True, 4), ("chat-1", False, 4), ("chat-1", False, 2), ("chat-2", True, 0),
        ]  # fmt: skip
        assert events[0].block_size == 16 and not watcher.pending

        blocks.apply("n1", "chat-1", _decoded(KEYS[10:11]))
        blocks.apply("n1", "chat-1", _decoded([], KEYS[10:11] + KEYS[:1]))  # stored, removed
        blocks.apply("n1", "chat-1", _decoded(KEYS[12:13]))
        (removed, stored) = watcher.take(10**9)
        assert sorted(unpack_keys(removed.removed_keys)) == sorted([KEYS[0], KEYS[10]])
        assert list(unpack_keys(stored.stored_keys)) == [KEYS[12]]
        assert not removed.reset and stored.oldest_event_ts == 0.0  # sent with the first
        assert removed.oldest_event_ts == 1_700_000_000.5

        blocks.apply("n1", "chat-1", _decoded(KEYS[100:160]))  # more than touched_limit
        (full, *_) = watcher.take(10**9)
        assert full.reset and len(full.stored_keys) == 4 * 8  # a full copy again
        blocks.drop("chat-1", "test")
        (gone,) = watcher.take(10**9)
        assert gone.reset and gone.stored_keys == b""
    assert blocks.stats().watchers == 0


def test_take_stops_after_about_max_keys() -> None:
    blocks = KvBlocks()
    with blocks.watch() as watcher:
        for replica_id in ("a", "b", "c"):
            blocks.apply("n1", replica_id, replace(_decoded(KEYS[:100]), shard_id=replica_id))
        watcher.mark_full(["a", "b", "c"])
        assert [e.replica_id for e in watcher.take(150)] == ["a", "b"]
        assert watcher.pending and watcher.wakeup.is_set()
        assert [e.replica_id for e in watcher.take(150)] == ["c"]
        assert not watcher.pending and not watcher.wakeup.is_set()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(("a", "b")),
            st.sampled_from(("delta", "delta", "delta", "reset", "drop", "take", "rank1")),
            st.integers(0, len(KEYS) - 1),
            st.integers(0, 40),
            st.lists(st.integers(0, len(KEYS) - 1), max_size=20),
        ),
        max_size=30,
    ),
    st.sampled_from((20, 100, 10**6)),  # touched_limit: how far behind is too far
)
@example(  # a block one rank removes while another rank still holds it stays
    [("a", "delta", 0, 5, []), ("a", "rank1", 0, 3, []), ("a", "take", 0, 9, []),
     ("a", "delta", 0, 0, [0]), ("a", "take", 0, 9, [])],
    10**6,
)  # fmt: skip
@example(  # a reset after the gateway got blocks: the ones not stored again must go
    [("a", "delta", 0, 5, []), ("a", "take", 0, 9, []), ("a", "reset", 7, 1, []),
     ("a", "take", 0, 9, [])],
    10**6,
)  # fmt: skip
def test_a_gateway_index_fed_by_a_watcher_equals_the_store(
    ops: list[tuple[str, str, int, int, list[int]]], touched_limit: int
) -> None:
    blocks, index = KvBlocks(chunk=37, touched_limit=touched_limit), KvIndex()
    with blocks.watch() as watcher:
        watcher.mark_full([])
        for replica_id, op, start, length, picks in ops:
            stored = KEYS[start : start + length]
            removed = [KEYS[i] for i in picks]
            if op == "drop":
                blocks.drop(replica_id, "test")
            elif op == "take":
                for event in watcher.take(length + 1):
                    apply_feed_event(RoutingTable(), RouterFeedEvent(kv_blocks=event), index)
            else:
                rank = 1 if op == "rank1" else 0
                delta = _decoded(stored, removed, reset=op == "reset", rank=rank)
                blocks.apply("n1", replica_id, replace(delta, shard_id=replica_id))
        while watcher.pending:
            for event in watcher.take(50):
                apply_feed_event(RoutingTable(), RouterFeedEvent(kv_blocks=event), index)
    for replica_id in ("a", "b"):
        assert index.keys_of(replica_id) == list(blocks.keys(replica_id))


# --- the plane's hooks ---------------------------------------------------------------------


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store, InventoryConfig(grace_s=1.0))
        await plane.load()
        yield plane


def _node(node_id: str = "n1") -> NodeInfo:
    return NodeInfo(node_id=node_id, gpus=[Gpu(index=0, uuid="GPU-0")])


def _status(state: ShardState) -> ShardStatus:
    return ShardStatus(shard_id="chat-1.0", replica_id="chat-1", state=state)


def _register_message() -> Register:
    shards = [_status(ShardState.READY)]
    return Register(protocol_version=PROTOCOL_VERSION, node=_node(), shards=shards)


async def _registered(plane: ControlPlane) -> int:
    await plane.save_replicas({"chat-1": _record("chat-1")})
    message = _register_message()
    assert message.node is not None
    return await plane.register(message.node, message, peer="127.0.0.1:1")


async def test_the_plane_applies_a_leaders_deltas_and_drops_its_blocks(
    plane: ControlPlane,
) -> None:
    connection = await _registered(plane)
    plane.kv_delta("n1", connection, _decoded(KEYS[:5], reset=True))
    plane.kv_delta("n1", connection + 1, _decoded(KEYS[5:9]))  # an older/other stream
    assert list(plane.kv_blocks.keys("chat-1")) == sorted(KEYS[:5])
    assert plane.kv_blocks.stats().ignored == 1

    plane.shard_status("n1", _status(ShardState.FAILED))
    assert plane.kv_blocks.replica_ids() == []  # FAILED: dropped, and refused from now on
    plane.kv_delta("n1", connection, _decoded(KEYS[:5]))
    assert plane.kv_blocks.replica_ids() == []

    plane.shard_status("n1", _status(ShardState.READY))
    plane.kv_delta("n1", connection, _decoded(KEYS[:5]))
    assert plane.kv_blocks.replica_ids() == ["chat-1"]
    plane.disconnect("n1", connection, "stream closed")
    assert plane.kv_blocks.replica_ids() == []  # its stream ended: dropped

    connection = await _registered(plane)
    plane.kv_delta("n1", connection, _decoded(KEYS[:5]))
    await plane.save_replicas({"chat-1": _record("chat-1", lifecycle=Lifecycle.RETIRED)})
    assert plane.kv_blocks.replica_ids() == []  # RETIRED: dropped


async def test_a_new_registration_and_a_disconnect_drop_the_nodes_blocks(
    plane: ControlPlane,
) -> None:
    connection = await _registered(plane)
    plane.kv_delta("n1", connection, _decoded(KEYS[:5], reset=True))
    connection = await _registered(plane)  # the agent came back: a full copy follows
    assert plane.kv_blocks.replica_ids() == []
    plane.kv_delta("n1", connection, _decoded(KEYS[:5], reset=True))
    plane.disconnect("n1", connection, "stream closed")
    assert plane.kv_blocks.replica_ids() == []


# --- from an agent's stream to a gateway's index -------------------------------------------


async def _until(check: Callable[[], object], what: str) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class _Gateway:
    """A gateway's table and index, following ``route_events`` in a task."""

    def __init__(self, plane: ControlPlane) -> None:
        self.table, self.index = RoutingTable(), KvIndex()
        self.events: list[RouterFeedEvent] = []
        self._task = asyncio.create_task(self._follow(plane))

    async def _follow(self, plane: ControlPlane) -> None:
        async for event in route_events(plane):
            self.events.append(event)
            apply_feed_event(self.table, event, self.index)

    async def aclose(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def test_an_agents_deltas_reach_the_store_and_a_gateways_index(plane: ControlPlane) -> None:
    install_message_limit()
    await plane.save_replicas({"chat-1": _record("chat-1")})
    service = AgentService(plane, heartbeat_interval_ms=60_000)
    server = grpclib.server.Server([service], codec=CheckedProtoCodec())
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    gateway = _Gateway(plane)
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        async with channel.request(
            CONNECT_PATH, Cardinality.STREAM_STREAM, AgentMessage, ControlMessage
        ) as stream:
            await stream.send_message(AgentMessage(register=_register_message()))
            assert (await stream.recv_message()) is not None  # Registered

            for message in (
                _delta(stored=KEYS[:40], reset=True),
                KvDelta(shard_id="chat-1.0", stored=b"\x00" * 7),  # malformed: skipped
                _delta("other.0", stored=KEYS[40:50]),  # not a leader's: ignored
                _delta(stored=KEYS[40:45], removed=KEYS[:10]),
            ):
                await stream.send_message(AgentMessage(kv_delta=message))
            expected = sorted(KEYS[10:45])
            await _until(lambda: gateway.index.keys_of("chat-1") == expected, "the index")
            assert list(plane.kv_blocks.keys("chat-1")) == expected
            stats = plane.kv_blocks.stats()
            assert (stats.deltas, stats.malformed, stats.ignored) == (2, 1, 1)
            first_kv = next(i for i, e in enumerate(gateway.events) if e.kv_blocks)
            assert gateway.events[0].snapshot is not None and first_kv > 0
            assert gateway.index.stats().event_lags >= 1

            stopped = _status(ShardState.STOPPED)
            await stream.send_message(AgentMessage(shard_status=stopped))
            await _until(lambda: not gateway.index.blocks_of("chat-1"), "the drop")
            await stream.end()
    finally:
        channel.close()
        await gateway.aclose()
        server.close()
        await server.wait_closed()
    assert plane.kv_blocks.stats().watchers == 0 and plane.hub.watchers == 0


async def test_a_closed_stream_clears_its_nodes_blocks_from_the_index(
    plane: ControlPlane,
) -> None:
    install_message_limit()
    await plane.save_replicas({"chat-1": _record("chat-1")})
    service = AgentService(plane, heartbeat_interval_ms=60_000)
    server = grpclib.server.Server([service], codec=CheckedProtoCodec())
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    gateway = _Gateway(plane)
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        async with channel.request(
            CONNECT_PATH, Cardinality.STREAM_STREAM, AgentMessage, ControlMessage
        ) as stream:
            await stream.send_message(AgentMessage(register=_register_message()))
            await stream.recv_message()
            await stream.send_message(AgentMessage(kv_delta=_delta(stored=KEYS[:8], reset=True)))
            await _until(lambda: gateway.index.blocks_of("chat-1") == 8, "the full copy")
            await stream.end()
            assert [m async for m in stream] == []
        await _until(lambda: not gateway.index.blocks_of("chat-1"), "the node's drop")
        assert plane.kv_blocks.replica_ids() == []
    finally:
        channel.close()
        await gateway.aclose()
        server.close()
        await server.wait_closed()


def test_keys_arrays_are_what_the_store_returns() -> None:
    blocks = KvBlocks()
    assert blocks.keys("none") == array("Q") and not blocks.holds("none", 1)
    assert blocks.block_size("none") == 0
