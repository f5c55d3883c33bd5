"""``ControlService.StreamLogs`` relayed to a node's agent over its stream.

The engine logs stay on the nodes (``llmgw.agent.logfiles``). For each StreamLogs call the
server picks a stream id, sends the shard's node a ``LogRequest`` on its agent stream
(``AgentService.Connect``) and passes the agent's ``LogChunk`` replies on to the caller as
``LogLines``, until the agent ends the stream (a chunk with ``end``: its status is the
call's) or the caller goes away (then the agent is sent ``LogCancel``).

Which shard a name means (:func:`log_targets`): a replica id means its rank-0 shard (the
leader, which serves the API and writes most of the output), or with ``all_shards`` every
shard, rank 0 first, their messages interleaved as they come (:func:`merged`: each
``LogLines`` names its shard; the first shard's stream to fail ends the call), as
``kubectl logs --all-containers`` does; a shard id means that shard; a replica retired but
still on record works too (its node keeps the logs for a while). Anything else is NOT_FOUND
naming it.

Bounded: at most ``MAX_STREAMS_PER_NODE`` streams per node at once (more: RESOURCE_EXHAUSTED);
an agent that does not answer within ``FIRST_REPLY_S`` ends the call with UNAVAILABLE (an
agent older than this server ignores the request); a chunk over ``CHUNK_LIMIT`` bytes ends it
with INTERNAL; a caller that falls ``BEHIND_LIMIT`` bytes behind is cut off with
RESOURCE_EXHAUSTED (the agent's stream is never made to wait for one reader); a node
whose agent disconnects ends its streams with UNAVAILABLE saying so.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from llmgw.api.llmgw.v1 import (
    ControlMessage,
    LogCancel,
    LogChunk,
    LogLines,
    LogRequest,
    LogsRequest,
)
from llmgw.server.errors import quoted
from llmgw.server.state.plane import ControlPlane

log = logging.getLogger(__name__)

MAX_STREAMS_PER_NODE = 8
FIRST_REPLY_S = 10.0
CHUNK_LIMIT = 96 << 10  # the agent sends at most 64 KiB of lines per chunk
BEHIND_LIMIT = 8 << 20

AgentSender = Callable[[str, ControlMessage], Awaitable[bool]]
"""Sends a message to a node's agent; False when it is not connected."""


@dataclass(frozen=True, slots=True)
class LogTarget:
    """The shard a StreamLogs name means, and the node that keeps its logs."""

    shard_id: str
    node_id: str


def log_targets(plane: ControlPlane, name: str, *, all_shards: bool = False) -> list[LogTarget]:
    """The shards ``name`` means (see the module doc); NOT_FOUND naming it otherwise."""
    record = plane.replicas.get(name)
    if record is not None:
        shards = sorted(record.plan.shards, key=lambda s: s.rank)
        return [LogTarget(s.shard_id, s.node_id) for s in (shards if all_shards else shards[:1])]
    shard = plane.inventory.shards.get(name)
    if shard is not None:
        return [LogTarget(shard.shard_id, shard.node_id)]
    for record in plane.replicas.values():
        for planned in record.plan.shards:
            if planned.shard_id == name:
                return [LogTarget(planned.shard_id, planned.node_id)]
    raise GRPCError(Status.NOT_FOUND, f"no replica or shard named {quoted(name[:128])}")


async def merged(streams: Sequence[AsyncIterator[LogLines]]) -> AsyncIterator[LogLines]:
    """The messages of ``streams`` as they come; the first failure ends it (and the rest)."""
    if len(streams) == 1:
        async for lines in streams[0]:
            yield lines
        return
    queue: asyncio.Queue[LogLines | GRPCError | None] = asyncio.Queue(maxsize=16)

    async def pump(stream: AsyncIterator[LogLines]) -> None:
        try:
            async for lines in stream:
                await queue.put(lines)
            await queue.put(None)
        except GRPCError as exc:
            await queue.put(exc)

    pumps = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        left = len(pumps)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, GRPCError):
                raise item
            else:
                yield item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


@dataclass(slots=True)
class _Stream:
    """One StreamLogs call waiting for its agent's chunks."""

    target: LogTarget
    chunks: asyncio.Queue[LogChunk] = field(default_factory=asyncio.Queue)
    queued_bytes: int = 0
    failure: GRPCError | None = None  # set by the relay: the call ends with it
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    ended: bool = False  # the agent sent its last chunk


class LogRelay:
    """Every StreamLogs call in flight, by stream id."""

    def __init__(self, send: AgentSender | None = None) -> None:
        self.send: AgentSender | None = send  # set by llmgw.server.app (the AgentService)
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count(1)

    def open_on(self, node_id: str) -> int:
        """How many log streams are open on a node now."""
        return sum(1 for s in self._streams.values() if s.target.node_id == node_id)

    async def stream(self, target: LogTarget, request: LogsRequest) -> AsyncIterator[LogLines]:
        """Relay one call (see the module doc)."""
        node = target.node_id
        if self.open_on(node) >= MAX_STREAMS_PER_NODE:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"node {node} already serves {MAX_STREAMS_PER_NODE} log streams; try again later",
            )
        stream_id = next(self._ids)
        stream = _Stream(target)
        self._streams[stream_id] = stream
        try:
            ask = LogRequest(
                stream_id=stream_id,
                shard_id=target.shard_id,
                tail_lines=request.tail_lines,
                follow=request.follow,
                previous=request.previous,
            )
            if not await self._ask(node, ControlMessage(log_request=ask)):
                raise GRPCError(
                    Status.UNAVAILABLE,
                    f"node {node} is not connected: the logs of shard {target.shard_id} stay "
                    "on it until its agent is back",
                )
            async for lines in self._relay(stream, stream_id):
                yield lines
        finally:
            del self._streams[stream_id]
            if not stream.ended:
                await self._cancel(node, stream_id)

    async def _ask(self, node_id: str, message: ControlMessage) -> bool:
        """Send ``message`` to the node's agent; False when it is not connected (or its
        stream is failing: its end is about to be noticed)."""
        if self.send is None:
            return False
        try:
            return await self.send(node_id, message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the agent's stream broke under the send
            log.debug("log message to node %s not sent: %s", node_id, exc)
            return False

    async def _relay(self, stream: _Stream, stream_id: int) -> AsyncIterator[LogLines]:
        first = True
        while True:
            chunk = await self._next(stream, first)
            first = False
            if chunk.lines:
                yield LogLines(shard_id=stream.target.shard_id, lines=chunk.lines)
            if chunk.end:
                stream.ended = True
                if chunk.status:
                    raise GRPCError(_status(chunk.status), chunk.message[:1024])
                return

    async def _next(self, stream: _Stream, first: bool) -> LogChunk:
        while stream.chunks.empty() and stream.failure is None:
            stream.wake.clear()
            try:
                async with asyncio.timeout(FIRST_REPLY_S if first else None):
                    await stream.wake.wait()
            except TimeoutError:
                raise GRPCError(
                    Status.UNAVAILABLE,
                    f"the agent of node {stream.target.node_id} did not answer the log "
                    f"request within {FIRST_REPLY_S:g} s (is it older than this server?)",
                ) from None
        if stream.failure is not None:
            raise stream.failure
        chunk = stream.chunks.get_nowait()
        stream.queued_bytes -= _size(chunk)
        return chunk

    def deliver(self, node_id: str, chunk: LogChunk) -> None:
        """A chunk from ``node_id``'s agent (one for a stream no longer open is dropped)."""
        stream = self._streams.get(chunk.stream_id)
        if stream is None or stream.target.node_id != node_id or stream.failure is not None:
            return
        size = _size(chunk)
        if size > CHUNK_LIMIT:
            self._fail(
                stream,
                Status.INTERNAL,
                f"the agent of node {node_id} sent a log chunk of {size} bytes "
                f"(at most {CHUNK_LIMIT})",
            )
            return
        if stream.queued_bytes + size > BEHIND_LIMIT:
            self._fail(
                stream,
                Status.RESOURCE_EXHAUSTED,
                f"the reader fell {BEHIND_LIMIT / (1 << 20):g} MiB behind the log of shard "
                f"{stream.target.shard_id}; read it with --tail",
            )
            return
        stream.queued_bytes += size
        stream.chunks.put_nowait(chunk)
        stream.wake.set()

    def node_gone(self, node_id: str, reason: str) -> None:
        """The node's agent stream ended: its log streams end with UNAVAILABLE."""
        for stream in self._streams.values():
            if stream.target.node_id == node_id and not stream.ended:
                self._fail(
                    stream,
                    Status.UNAVAILABLE,
                    f"node {node_id} disconnected ({reason}); its log stream ended",
                )
                stream.ended = True  # nothing to cancel there

    def _fail(self, stream: _Stream, status: Status, why: str) -> None:
        stream.failure = GRPCError(status, why)
        while not stream.chunks.empty():
            stream.chunks.get_nowait()
        stream.queued_bytes = 0
        stream.wake.set()

    async def _cancel(self, node_id: str, stream_id: int) -> None:
        """Tell the agent to stop a stream whose reader went away (best effort)."""
        await self._ask(node_id, ControlMessage(log_cancel=LogCancel(stream_id=stream_id)))


def _size(chunk: LogChunk) -> int:
    return sum(len(line) for line in chunk.lines)


def _status(code: int) -> Status:
    try:
        return Status(code)
    except ValueError:
        return Status.UNKNOWN
