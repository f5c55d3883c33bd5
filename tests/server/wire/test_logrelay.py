"""The server's log relay: requests out, chunks back in, and every way a stream ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from llmgw.api.llmgw.v1 import ControlMessage, LogChunk, LogLines, LogsRequest
from llmgw.server.wire import logrelay
from llmgw.server.wire.logrelay import LogRelay, LogTarget, merged

TARGET = LogTarget("chat-1.0", "n1")


class Agents:
    """The AgentService's ``send``: what each node was sent; nodes in ``down`` are not
    connected."""

    def __init__(self, *down: str) -> None:
        self.sent: list[tuple[str, ControlMessage]] = []
        self.down = set(down)
        self.arrived = asyncio.Event()

    async def __call__(self, node_id: str, message: ControlMessage) -> bool:
        if node_id in self.down:
            return False
        self.sent.append((node_id, message))
        self.arrived.set()
        return True

    async def request_id(self) -> int:
        async with asyncio.timeout(5):
            while not any(m.log_request for _, m in self.sent):
                self.arrived.clear()
                await self.arrived.wait()
        return next(m.log_request.stream_id for _, m in self.sent if m.log_request)

    def cancels(self) -> list[int]:
        return [m.log_cancel.stream_id for _, m in self.sent if m.log_cancel]


async def _first(stream: AsyncIterator[LogLines]) -> LogLines:
    return await anext(stream)


def _why(error: GRPCError) -> str:
    return error.message or ""


async def _read(stream: AsyncIterator[LogLines]) -> list[str]:
    return [line async for chunk in stream for line in chunk.lines]


async def test_lines_pass_through_and_the_agent_end_closes_the_call() -> None:
    agents = Agents()
    relay = LogRelay(agents)
    reading = asyncio.create_task(_read(relay.stream(TARGET, LogsRequest(tail_lines=2))))
    stream_id = await agents.request_id()
    ((node, message),) = agents.sent
    assert node == "n1" and message.log_request is not None
    assert (message.log_request.shard_id, message.log_request.tail_lines) == ("chat-1.0", 2)
    relay.deliver("n1", LogChunk(stream_id=stream_id, lines=["a", "b"]))
    relay.deliver("n2", LogChunk(stream_id=stream_id, lines=["forged"]))  # another node's
    relay.deliver("n1", LogChunk(stream_id=stream_id + 9, lines=["stale"]))  # no such stream
    relay.deliver("n1", LogChunk(stream_id=stream_id, lines=["c"], end=True))
    assert await reading == ["a", "b", "c"]
    assert agents.cancels() == []  # the agent ended it: nothing to cancel
    assert relay.open_on("n1") == 0


async def test_a_reader_that_leaves_cancels_the_agent_stream() -> None:
    agents = Agents()
    relay = LogRelay(agents)
    stream = relay.stream(TARGET, LogsRequest(follow=True))
    first = asyncio.create_task(_first(stream))
    stream_id = await agents.request_id()
    relay.deliver("n1", LogChunk(stream_id=stream_id, lines=["x"]))
    assert (await first).lines == ["x"]
    await stream.aclose()  # type: ignore[attr-defined]
    assert agents.cancels() == [stream_id] and relay.open_on("n1") == 0


async def test_an_agent_error_becomes_the_call_status() -> None:
    agents = Agents()
    relay = LogRelay(agents)
    reading = asyncio.create_task(_read(relay.stream(TARGET, LogsRequest(previous=True))))
    stream_id = await agents.request_id()
    relay.deliver("n1", LogChunk(stream_id=stream_id, end=True, status=5, message="no run"))
    with pytest.raises(GRPCError) as raised:
        await reading
    assert (raised.value.status, raised.value.message) == (Status.NOT_FOUND, "no run")


async def test_a_node_that_disconnects_ends_its_streams() -> None:
    agents = Agents()
    relay = LogRelay(agents)
    reading = asyncio.create_task(_read(relay.stream(TARGET, LogsRequest(follow=True))))
    await agents.request_id()
    relay.node_gone("n1", "agent stream closed")
    with pytest.raises(GRPCError) as raised:
        await reading
    assert raised.value.status is Status.UNAVAILABLE
    assert (
        raised.value.message == "node n1 disconnected (agent stream closed); its log stream ended"
    )
    assert agents.cancels() == []


async def test_refusals_before_anything_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(GRPCError) as raised:
        await _read(LogRelay(Agents("n1")).stream(TARGET, LogsRequest()))
    assert raised.value.status is Status.UNAVAILABLE
    assert _why(raised.value).startswith("node n1 is not connected")

    monkeypatch.setattr(logrelay, "MAX_STREAMS_PER_NODE", 1)
    agents = Agents()
    relay = LogRelay(agents)
    held = asyncio.create_task(_read(relay.stream(TARGET, LogsRequest(follow=True))))
    await agents.request_id()
    with pytest.raises(GRPCError) as raised:
        await _read(relay.stream(TARGET, LogsRequest()))
    assert raised.value.status is Status.RESOURCE_EXHAUSTED
    assert "node n1 already serves 1 log streams" in _why(raised.value)
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)


async def test_a_silent_agent_a_huge_chunk_and_a_slow_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(logrelay, "FIRST_REPLY_S", 0.05)
    with pytest.raises(GRPCError) as raised:
        await _read(LogRelay(Agents()).stream(TARGET, LogsRequest()))
    assert raised.value.status is Status.UNAVAILABLE and "did not answer" in _why(raised.value)

    agents = Agents()
    relay = LogRelay(agents)
    reading = asyncio.create_task(_read(relay.stream(TARGET, LogsRequest())))
    stream_id = await agents.request_id()
    relay.deliver("n1", LogChunk(stream_id=stream_id, lines=["z" * (logrelay.CHUNK_LIMIT + 1)]))
    with pytest.raises(GRPCError) as raised:
        await reading
    assert raised.value.status is Status.INTERNAL

    monkeypatch.setattr(logrelay, "BEHIND_LIMIT", 1000)
    agents = Agents()
    relay = LogRelay(agents)
    stream = relay.stream(TARGET, LogsRequest(follow=True))
    first = asyncio.create_task(_first(stream))
    stream_id = await agents.request_id()
    relay.deliver("n1", LogChunk(stream_id=stream_id, lines=["y" * 400]))
    assert (await first).lines == ["y" * 400]
    for _ in range(3):  # nobody reads them: they pile up past the limit
        relay.deliver("n1", LogChunk(stream_id=stream_id, lines=["y" * 400]))
    with pytest.raises(GRPCError) as raised:
        await anext(stream)
    assert raised.value.status is Status.RESOURCE_EXHAUSTED and "fell" in _why(raised.value)
    await stream.aclose()  # type: ignore[attr-defined]
    assert agents.cancels() == [stream_id]


async def test_every_shard_merged_and_the_first_failure_ends_them_all() -> None:
    agents = Agents()
    relay = LogRelay(agents)
    targets = [LogTarget("big-1.0", "n1"), LogTarget("big-1.1", "n2")]
    request = LogsRequest(follow=True, all_shards=True)
    stream = merged([relay.stream(target, request) for target in targets])
    first = asyncio.create_task(_first(stream))
    async with asyncio.timeout(5):
        while len(agents.sent) < 2:
            agents.arrived.clear()
            await agents.arrived.wait()
    ids = {node: m.log_request.stream_id for node, m in agents.sent if m.log_request}
    relay.deliver("n2", LogChunk(stream_id=ids["n2"], lines=["from rank 1"]))
    got = await first
    assert (got.shard_id, got.lines) == ("big-1.1", ["from rank 1"])
    relay.deliver("n1", LogChunk(stream_id=ids["n1"], lines=["from rank 0"]))
    got = await _first(stream)
    assert (got.shard_id, got.lines) == ("big-1.0", ["from rank 0"])
    relay.node_gone("n2", "agent stream closed")
    with pytest.raises(GRPCError) as raised:
        await _first(stream)
    assert raised.value.status is Status.UNAVAILABLE and "node n2" in _why(raised.value)
    await stream.aclose()  # type: ignore[attr-defined]
    assert agents.cancels() == [ids["n1"]]  # the other shard's agent stops sending
    assert relay.open_on("n1") == relay.open_on("n2") == 0
