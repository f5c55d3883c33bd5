"""The agent's side of ``llmgw logs``: a shard's engine output sent up its stream on request.

The server sends ``LogRequest`` (a stream id of its choosing, a shard, ``tail_lines``,
``follow``, ``previous``) on the agent's stream; the agent answers with ``LogChunk``
messages of that stream id: the tail of the run asked for (every line kept when
``tail_lines`` is unset), then, with ``follow``, what the engine appends (polled every
``poll_s``, across rotations and restarts: ``llmgw.agent.logfiles.LogFollower``), until the
server sends ``LogCancel``, the session ends, or the shard no longer runs here (``running``
says so: stopped, or never ours; a failed engine being restarted still runs). The last
chunk has ``end`` set, with a gRPC status and message when the stream could not be served
(NOT_FOUND: no log of that shard, or no previous run; RESOURCE_EXHAUSTED: too many
streams; INVALID_ARGUMENT).

Bounded: at most ``MAX_STREAMS`` streams at once, a chunk at most ``CHUNK_BYTES`` of lines
(``LINE_BYTES`` each; a longer line is cut and ends with ``…``), at most ``READ_BYTES``
read per poll, and every chunk waits for room in the link's log queue (``send`` awaits), so
a slow reader slows the reading, never the heartbeats.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path

from grpclib.const import Status

from llmgw.agent.logfiles import LogFiles, LogFollower, tail_lines
from llmgw.agent.records import SHARD_ID
from llmgw.api.llmgw.v1 import ControlMessage, LogChunk, LogRequest

log = logging.getLogger(__name__)

MAX_STREAMS = 8
CHUNK_BYTES = 64 << 10
LINE_BYTES = 16 << 10
READ_BYTES = 1 << 20
POLL_S = 0.25
_CUT = "…".encode()

LogSender = Callable[[LogChunk], Awaitable[None]]


class LogRefused(Exception):
    """A log request that cannot be served: its status and why."""

    def __init__(self, status: Status, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why


class LogStreams:
    """The log streams this agent serves, by the server's stream id."""

    def __init__(
        self,
        log_dir: Path,
        send: LogSender,
        *,
        node_id: str = "",
        max_streams: int = MAX_STREAMS,
        poll_s: float = POLL_S,
        running: Callable[[str], bool] = lambda shard_id: True,
    ) -> None:
        self.log_dir = log_dir
        self._running = running
        self._send = send
        self._node = f"node {node_id}" if node_id else "this node"
        self.max_streams = max_streams
        self.poll_s = poll_s
        self._streams: dict[int, asyncio.Task[None]] = {}
        self._refusals: set[asyncio.Task[None]] = set()  # answers to streams past the limit

    def __len__(self) -> int:
        return len(self._streams)

    def handle(self, message: ControlMessage) -> bool:
        """Carry out a ``LogRequest`` or ``LogCancel``; False for any other message."""
        if message.log_request is not None:
            self.open(message.log_request)
        elif message.log_cancel is not None:
            self.cancel(message.log_cancel.stream_id)
        else:
            return False
        return True

    def open(self, request: LogRequest) -> None:
        stream_id = request.stream_id
        self.cancel(stream_id)  # a reused id: the server forgot the old one
        if len(self._streams) >= self.max_streams:
            busy = f"{self._node} already serves {self.max_streams} log streams; try again later"
            refusal = self._refuse(stream_id, LogRefused(Status.RESOURCE_EXHAUSTED, busy))
            task = asyncio.create_task(refusal, name=f"log-{stream_id}")
            self._refusals.add(task)
            task.add_done_callback(self._refusals.discard)
            return
        task = asyncio.create_task(self._serve(request), name=f"log-{stream_id}")
        self._streams[stream_id] = task
        task.add_done_callback(lambda done: self._forget(stream_id, done))

    def cancel(self, stream_id: int) -> None:
        task = self._streams.pop(stream_id, None)
        if task is not None:
            task.cancel()

    async def reset(self) -> None:
        """End every stream (a new session: the server forgot them)."""
        tasks, self._streams = [*self._streams.values(), *self._refusals], {}
        self._refusals = set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _forget(self, stream_id: int, task: asyncio.Task[None]) -> None:
        if self._streams.get(stream_id) is task:
            del self._streams[stream_id]

    async def _serve(self, request: LogRequest) -> None:
        stream_id = request.stream_id
        try:
            files = self._files(request)
            log.info(
                "log stream %d: shard %s (tail %s, follow %s, previous %s)",
                stream_id,
                files.shard_id,
                request.tail_lines,
                request.follow,
                request.previous,
            )
            await self._stream(stream_id, request, files)
        except LogRefused as refused:
            await self._refuse(stream_id, refused)
            return
        except asyncio.CancelledError:
            log.info("log stream %d cancelled", stream_id)
            raise
        log.info("log stream %d ended", stream_id)
        await self._send(LogChunk(stream_id=stream_id, end=True))

    async def _refuse(self, stream_id: int, refused: LogRefused) -> None:
        log.info("log stream %d refused: %s", stream_id, refused.why)
        status = refused.status.value
        await self._send(
            LogChunk(stream_id=stream_id, end=True, status=status, message=refused.why)
        )

    def _files(self, request: LogRequest) -> LogFiles:
        shard_id = request.shard_id
        if not SHARD_ID.match(shard_id):
            raise LogRefused(Status.INVALID_ARGUMENT, f"{shard_id[:64]!r} is not a shard id")
        if request.previous and request.follow:
            raise LogRefused(Status.INVALID_ARGUMENT, "the previous run has ended: no follow")
        files = LogFiles(self.log_dir, shard_id)
        if request.previous and not files.run(previous=True):
            raise LogRefused(
                Status.NOT_FOUND,
                f"shard {shard_id} has no previous run on {self._node} (its engine has not "
                "been restarted)",
            )
        if not request.previous and not files.run() and not request.follow:
            raise LogRefused(Status.NOT_FOUND, f"{self._node} keeps no log of shard {shard_id}")
        return files

    async def _stream(self, stream_id: int, request: LogRequest, files: LogFiles) -> None:
        follower = LogFollower(files) if request.follow else None
        try:
            paths = files.run(previous=request.previous)
            ends = [_size(path) for path in paths]
            if follower is not None and paths and paths[-1] == files.current:
                ends[-1] = follower.offset  # what follows is the follower's
            lines = await asyncio.to_thread(
                tail_lines, list(zip(paths, ends, strict=True)), request.tail_lines
            )
            await self._send_lines(stream_id, lines, always=True)
            if follower is not None:
                await self._follow(stream_id, follower, files.shard_id)
        finally:
            if follower is not None:
                follower.close()

    async def _follow(self, stream_id: int, follower: LogFollower, shard_id: str) -> None:
        partial = b""
        while True:
            data = follower.read(READ_BYTES)
            if not data:
                if not self._running(shard_id):  # nothing more will come
                    await self._send_lines(stream_id, [partial] if partial else [])
                    return
                await asyncio.sleep(self.poll_s)
                continue
            *whole, partial = (partial + data).split(b"\n")
            if len(partial) > LINE_BYTES:  # a line that never ends: send what there is
                whole.append(partial)
                partial = b""
            await self._send_lines(stream_id, whole)

    async def _send_lines(
        self, stream_id: int, lines: Iterable[bytes], *, always: bool = False
    ) -> None:
        sent = False
        for batch in chunks(lines):
            await self._send(LogChunk(stream_id=stream_id, lines=batch))
            sent = True
        if always and not sent:  # the server learns at once that the stream is served
            await self._send(LogChunk(stream_id=stream_id))


def chunks(lines: Iterable[bytes]) -> Iterator[list[str]]:
    """Lines as text in batches of at most ``CHUNK_BYTES``, each line cut to ``LINE_BYTES``."""
    batch: list[str] = []
    size = 0
    for raw in lines:
        text = line_text(raw)
        length = len(text.encode()) + 2  # the field's tag and length, near enough
        if batch and size + length > CHUNK_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(text)
        size += length
    if batch:
        yield batch


def line_text(raw: bytes) -> str:
    """One line of engine output as text: invalid UTF-8 replaced, a ``\\r`` end dropped,
    cut to ``LINE_BYTES`` (ending with ``…``)."""
    text = raw.rstrip(b"\r").decode("utf-8", "replace")
    encoded = text.encode()
    if len(encoded) <= LINE_BYTES:
        return text
    return encoded[: LINE_BYTES - len(_CUT)].decode("utf-8", "ignore") + "…"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
