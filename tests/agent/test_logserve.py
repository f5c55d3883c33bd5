"""The agent's log streams: what it sends for a LogRequest, its bounds and its refusals."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from grpclib.const import Status

from llmgw.agent import logserve
from llmgw.agent.logfiles import LogFiles
from llmgw.agent.logserve import LINE_BYTES, LogStreams, chunks, line_text
from llmgw.api.llmgw.v1 import ControlMessage, LogCancel, LogChunk, LogRequest


class Sink:
    """The link's ``send_log``: every chunk, by stream id."""

    def __init__(self) -> None:
        self.chunks: list[LogChunk] = []
        self.arrived = asyncio.Event()

    async def __call__(self, chunk: LogChunk) -> None:
        self.chunks.append(chunk)
        self.arrived.set()

    def lines(self, stream_id: int) -> list[str]:
        return [line for c in self.chunks if c.stream_id == stream_id for line in c.lines]

    def end(self, stream_id: int) -> LogChunk | None:
        return next((c for c in self.chunks if c.stream_id == stream_id and c.end), None)

    async def until(self, check: object, within_s: float = 5.0) -> None:
        async with asyncio.timeout(within_s):
            while not callable(check) or not check():
                self.arrived.clear()
                await self.arrived.wait()


def _streams(tmp_path: Path, sink: Sink, max_streams: int = 8, runs: bool = True) -> LogStreams:
    return LogStreams(
        tmp_path,
        sink,
        node_id="n1",
        poll_s=0.01,
        max_streams=max_streams,
        running=lambda shard_id: runs,
    )


async def test_a_tail_then_the_end(tmp_path: Path) -> None:
    files = LogFiles(tmp_path, "r-1.0")
    files.rotated.write_bytes(b"one\ntwo\n")
    files.current.write_bytes(b"three\nfour\r\nfive")
    sink = Sink()
    streams = _streams(tmp_path, sink)
    assert streams.handle(
        ControlMessage(log_request=LogRequest(stream_id=7, shard_id="r-1.0", tail_lines=3))
    )
    await sink.until(lambda: sink.end(7) is not None)
    assert sink.lines(7) == ["three", "four", "five"]
    assert sink.end(7) == LogChunk(stream_id=7, end=True)
    streams.handle(ControlMessage(log_request=LogRequest(stream_id=8, shard_id="r-1.0")))
    await sink.until(lambda: sink.end(8) is not None)
    assert sink.lines(8) == ["one", "two", "three", "four", "five"]
    await asyncio.sleep(0.01)  # the tasks' done callbacks
    assert len(streams) == 0


async def test_follow_sends_new_lines_until_cancelled(tmp_path: Path) -> None:
    files = LogFiles(tmp_path, "s")
    files.current.write_bytes(b"old\n")
    sink = Sink()
    streams = _streams(tmp_path, sink)
    streams.open(LogRequest(stream_id=1, shard_id="s", tail_lines=0, follow=True))
    await sink.until(lambda: len(sink.chunks) == 1)  # at once, empty: the stream is served
    assert sink.chunks == [LogChunk(stream_id=1)]
    with files.current.open("ab") as out:
        out.write(b"new\npart")
    await sink.until(lambda: sink.lines(1) == ["new"])
    with files.current.open("ab") as out:
        out.write(b"ial\n")
    await sink.until(lambda: sink.lines(1) == ["new", "partial"])
    assert streams.handle(ControlMessage(log_cancel=LogCancel(stream_id=1)))
    await asyncio.sleep(0.05)
    assert len(streams) == 0 and sink.end(1) is None  # the server stopped reading: no end
    assert not streams.handle(ControlMessage())


async def test_refusals_name_what_was_wrong(tmp_path: Path) -> None:
    LogFiles(tmp_path, "s").current.write_bytes(b"x\n")
    sink = Sink()
    streams = _streams(tmp_path, sink)
    asks = {
        1: LogRequest(stream_id=1, shard_id="nope"),
        2: LogRequest(stream_id=2, shard_id="s", previous=True),
        3: LogRequest(stream_id=3, shard_id="../etc/passwd"),
        4: LogRequest(stream_id=4, shard_id="s", previous=True, follow=True),
    }
    for ask in asks.values():
        streams.open(ask)
    await sink.until(lambda: all(sink.end(i) is not None for i in asks))
    ends = {i: sink.end(i) for i in asks}
    assert {i: (Status(e.status), e.message) for i, e in ends.items() if e is not None} == {
        1: (Status.NOT_FOUND, "node n1 keeps no log of shard nope"),
        2: (
            Status.NOT_FOUND,
            "shard s has no previous run on node n1 (its engine has not been restarted)",
        ),
        3: (Status.INVALID_ARGUMENT, "'../etc/passwd' is not a shard id"),
        4: (Status.INVALID_ARGUMENT, "the previous run has ended: no follow"),
    }


async def test_streams_past_the_limit_are_refused(tmp_path: Path) -> None:
    LogFiles(tmp_path, "s").current.write_bytes(b"x\n")
    sink = Sink()
    streams = _streams(tmp_path, sink, max_streams=2)
    for stream_id in (1, 2, 3):
        streams.open(LogRequest(stream_id=stream_id, shard_id="s", follow=True))
    await sink.until(lambda: sink.end(3) is not None)
    end = sink.end(3)
    assert end is not None and Status(end.status) is Status.RESOURCE_EXHAUSTED
    assert "already serves 2 log streams" in end.message
    assert len(streams) == 2
    await streams.reset()
    assert len(streams) == 0


def test_chunks_and_lines_are_bounded() -> None:
    long = b"y" * (LINE_BYTES * 2)
    assert len(line_text(long).encode()) <= LINE_BYTES and line_text(long).endswith("…")
    assert line_text("é".encode() * LINE_BYTES).endswith("…")  # never half a character
    assert line_text(b"\xff ok\r") == "\ufffd ok"
    batches = list(chunks([b"z" * 1000] * 200))
    assert sum(len(b) for b in batches) == 200
    assert all(sum(len(line) + 2 for line in b) <= logserve.CHUNK_BYTES for b in batches)


@pytest.mark.parametrize("count", [0, 1])
async def test_an_empty_tail_still_answers_at_once(tmp_path: Path, count: int) -> None:
    LogFiles(tmp_path, "s").current.write_bytes(b"" if count else b"only\n")
    sink = Sink()
    streams = _streams(tmp_path, sink)
    streams.open(LogRequest(stream_id=5, shard_id="s", tail_lines=0))
    await sink.until(lambda: sink.end(5) is not None)
    assert sink.chunks == [LogChunk(stream_id=5), LogChunk(stream_id=5, end=True)]


async def test_a_follow_of_a_shard_no_longer_running_here_ends_after_its_tail(
    tmp_path: Path,
) -> None:
    LogFiles(tmp_path, "s").current.write_bytes(b"last words\nunfinished")
    sink = Sink()
    streams = _streams(tmp_path, sink, runs=False)
    streams.open(LogRequest(stream_id=3, shard_id="s", follow=True))
    await sink.until(lambda: sink.end(3) is not None)
    assert sink.lines(3) == ["last words", "unfinished"]
    assert sink.end(3) == LogChunk(stream_id=3, end=True)
