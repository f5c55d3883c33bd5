"""The agents' KV event counters on the server (llmgw.server.state.kvfollow), and how the agent's
link sends them: from a real AgentLink through a real AgentService into the plane."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpclib.server
import pytest

from llmgw.agent.backoff import BackoffPolicy
from llmgw.agent.kvevents import KvEventCounters
from llmgw.agent.link import AgentLink, LinkConfig
from llmgw.api.llmgw.v1 import (
    AgentMessage,
    Heartbeat,
    KvDelta,
    KvFollowStats,
    NodeInfo,
    ShardState,
    ShardStatus,
)
from llmgw.server.state.kvfollow import MAX_SHARD_ID, KvFollowBoard
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.agentsvc import AgentService
from llmgw.server.wire.codec import CheckedProtoCodec, decode_message, install_message_limit

FAST = BackoffPolicy(base_s=0.05, cap_s=0.2)


# -- the board ------------------------------------------------------------------------------


def test_each_report_replaces_the_last_of_its_engine_only() -> None:
    board = KvFollowBoard()
    board.update("n1", [KvFollowStats(shard_id="s1", gaps=1), KvFollowStats(shard_id="s2")])
    board.update("n2", [KvFollowStats(shard_id="s1", replays=7)])  # same shard id, other node
    board.update("n1", [KvFollowStats(shard_id="s1", gaps=2, last_seq=0)])
    s1 = board.get("n1", "s1")
    assert s1 is not None and (s1.gaps, s1.last_seq) == (2, 0)
    s2 = board.get("n1", "s2")
    assert s2 is not None and s2.last_seq is None  # unchanged: absent from the report
    other = board.get("n2", "s1")
    assert other is not None and other.replays == 7 and other.gaps == 0
    assert [(e.node_id, e.shard_id) for e in board.engines()] == [
        ("n1", "s1"),
        ("n1", "s2"),
        ("n2", "s1"),
    ]


def test_bad_reports_are_refused_and_counted_and_the_rest_kept() -> None:
    board = KvFollowBoard(max_engines_per_node=2)
    board.update(
        "n1",
        [
            KvFollowStats(shard_id=""),
            KvFollowStats(shard_id="x" * (MAX_SHARD_ID + 1)),
            KvFollowStats(shard_id="s1", batches=1),
            KvFollowStats(shard_id="s2"),
            KvFollowStats(shard_id="s3"),  # one engine too many on n1
        ],
    )
    assert board.refused == 3
    assert [e.shard_id for e in board.engines()] == ["s1", "s2"]
    board.update("n1", [KvFollowStats(shard_id="s1", batches=2)])  # a known one still updates
    s1 = board.get("n1", "s1")
    assert s1 is not None and s1.batches == 2 and board.refused == 3


@pytest.mark.parametrize(
    ("state", "kept"),
    [
        (ShardState.LOADING, True),
        (ShardState.READY, True),
        (ShardState.DRAINING, True),
        (ShardState.STOPPED, False),
        (ShardState.FAILED, False),
        (ShardState.STARTING, False),
        (ShardState.PENDING, False),
    ],
)
def test_an_engine_the_agent_no_longer_follows_goes(state: ShardState, kept: bool) -> None:
    board = KvFollowBoard()
    board.update("n1", [KvFollowStats(shard_id="s1"), KvFollowStats(shard_id="s2")])
    board.shard_state("n1", "s1", state)
    board.shard_state("n2", "s2", ShardState.STOPPED)  # another node's shard: not n1's
    assert (board.get("n1", "s1") is not None) is kept
    assert board.get("n1", "s2") is not None
    board.drop_node("n1")
    assert board.engines() == []


def test_the_servers_codec_accepts_a_heartbeat_with_counters() -> None:
    beat = Heartbeat(seq=3, kv_follow=[KvFollowStats(shard_id="s1", gaps=2, last_seq=1 << 63)])
    decoded = decode_message(bytes(AgentMessage(heartbeat=beat)), AgentMessage)
    assert decoded.heartbeat is not None and decoded.heartbeat.kv_follow == beat.kv_follow


# -- through the link and the service ---------------------------------------------------------


class FakeKv:
    """A KV source whose counters the test sets (no blocks, no deltas)."""

    def __init__(self) -> None:
        self.values: dict[str, KvEventCounters] = {}

    def full_copy(self) -> list[KvDelta]:
        return []

    async def next_deltas(self) -> list[KvDelta]:
        await asyncio.Event().wait()  # never: this source has no blocks
        return []

    def counters(self) -> Mapping[str, KvEventCounters]:
        return dict(self.values)


@dataclass
class Running:
    plane: ControlPlane
    service: AgentService
    port: int
    beats: list[list[KvFollowStats]]  # each heartbeat's kv_follow, as the plane got it


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    install_message_limit()
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        beats: list[list[KvFollowStats]] = []
        apply = plane.heartbeat

        def recording(node_id: str, connection: int, beat: Heartbeat) -> bool:
            beats.append(list(beat.kv_follow))
            return apply(node_id, connection, beat)

        plane.heartbeat = recording  # type: ignore[method-assign]
        service = AgentService(plane, heartbeat_interval_ms=30)
        server = grpclib.server.Server([service], codec=CheckedProtoCodec())
        await server.start("127.0.0.1", 0)
        port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            yield Running(plane, service, port, beats)
        finally:
            server.close()
            await server.wait_closed()


async def _until(predicate: Callable[[], object], limit_s: float = 5.0) -> None:
    async with asyncio.timeout(limit_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


def _shards() -> list[ShardStatus]:
    return [
        ShardStatus(shard_id=s, replica_id=f"r-{s}", state=ShardState.READY) for s in ("s1", "s2")
    ]


async def test_heartbeats_carry_every_engine_first_then_only_changes(running: Running) -> None:
    kv = FakeKv()
    kv.values = {"s1": KvEventCounters(batches=4, last_seq=3), "s2": KvEventCounters()}
    link = AgentLink(
        LinkConfig("127.0.0.1", running.port, backoff=FAST),
        node=lambda: NodeInfo(node_id="n1"),
        telemetry=list,
        shards=_shards,
        kv=kv,
    )
    board = running.plane.kv_follow
    task = asyncio.create_task(link.run())
    try:
        await _until(lambda: len(running.beats) >= 4)
        first, *rest = running.beats
        assert [s.shard_id for s in first] == ["s1", "s2"]  # a new stream: every engine
        assert not any(rest)  # nothing changed: nothing sent
        s1 = board.get("n1", "s1")
        assert s1 is not None and (s1.batches, s1.last_seq) == (4, 3)

        kv.values["s2"] = KvEventCounters(gaps=1, replays=2, blocks=9)
        await _until(lambda: (e := board.get("n1", "s2")) is not None and e.gaps == 1)
        sent = [beat for beat in running.beats if beat]
        assert [[s.shard_id for s in beat] for beat in sent] == [["s1", "s2"], ["s2"]]

        # the plane drops a stopped shard's counters; a new stream sends every engine again
        running.plane.shard_status("n1", ShardStatus(shard_id="s1", state=ShardState.STOPPED))
        assert board.get("n1", "s1") is None
        count = len(running.beats)
        running.service.shutdown()
        await _until(lambda: link.stats.sessions == 2 and len(running.beats) > count + 1)
        assert {s.shard_id for beat in running.beats[count:] for s in beat} == {"s1", "s2"}
        s1 = board.get("n1", "s1")
        assert s1 is not None and s1.batches == 4  # back, from the new stream's first beat
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await _until(lambda: board.get("n1", "s2") is None)  # the stream ended: its node's go
