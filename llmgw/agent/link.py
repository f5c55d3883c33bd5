"""The agent's one stream to the control server (``AgentService.Connect``).

A session registers (everything the node is, plus the shards it already runs), then
heartbeats at the interval the server asks for, each carrying only the telemetry that
changed, and hands every command the server sends to ``on_command``. Shard statuses
(``send_status``) wait in an outbound queue that the session drains; the queue is emptied
when a session starts, because its ``Register`` carries every shard's current state (a
status raised while disconnected is not lost, and an old one never follows a newer
Register). Messages on one stream are sent one at a time. The stream has no
read timeout but an idle watchdog: no message from the server for ``idle_timeout_s``
ends the session. Sessions repeat with jittered, capped backoff for as long as the agent
runs; a refused registration (an unsupported protocol version, say) is retried the same
way, because the server may be upgraded meanwhile. With a ``token`` every session presents
it (``authorization: Bearer``); a refusal (UNAUTHENTICATED) is logged and retried the same way.
With a ``tls`` context (``llmgw.tls.client_context``, from ``--ca-file``) the stream runs over
TLS and the server's certificate is verified, its name against ``host``; a certificate that
does not verify is logged and retried the same way (it may be replaced meanwhile).

Every Register says who this agent is: ``instance_id`` (kept in its state dir),
``machine_id`` and ``run_id`` (random per process, so that its own reconnect replaces its
old stream). A server that already holds the node for another live agent refuses with
ALREADY_EXISTS naming that holder; a refusal's ``retry-after-ms`` trailer (that one, and
RESOURCE_EXHAUSTED from the registration limits) sets the delay before the next attempt,
so a duplicate agent asks again every few seconds, logs why, and takes the node over once
the holder is gone.

KV deltas do not go through the outbound queue: with a ``kv`` source (the agent's
`~llmgw.agent.kvhub.KvEventHub`), every session sends a full copy of every engine's
blocks right after registering, then the net changes as the source batches them. While no
session runs nothing is taken from the source, so nothing piles up: the next full copy
covers whatever changed meanwhile. Heartbeats also carry the source's KV event counters
(``Heartbeat.kv_follow``, `llmgw.agent.kvstats`): each engine's when they changed, every
engine's on the first heartbeat of a session.

With ``logs`` (``llmgw.agent.logserve.LogStreams``) the server's ``LogRequest`` and
``LogCancel`` go there, and its ``LogChunk`` replies wait in a small queue of their own
(``send_log`` awaits room), so a log being read never crowds out statuses or heartbeats;
each session starts with no log stream (the server forgot the old ones).

With a ``membership`` (``llmgw.agent.cluster``) every ``Register`` carries the cluster id
the agent remembers, and the server's answer decides whether the engines are handed over;
while they are held from a server of another cluster, the session sends no shard status,
no KV blocks or counters, and carries out no command.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import grpclib.client
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from llmgw.agent.backoff import Backoff, BackoffPolicy
from llmgw.agent.cluster import ClusterMembership
from llmgw.agent.kvstats import follow_stats, follow_stats_delta
from llmgw.agent.telemetry import telemetry_delta
from llmgw.api.llmgw.v1 import (
    AgentMessage,
    ControlMessage,
    GpuTelemetry,
    Heartbeat,
    KvDelta,
    KvFollowStats,
    LogChunk,
    NodeInfo,
    Register,
    ShardStatus,
)
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.tls import describe_tls_error

if TYPE_CHECKING:
    from llmgw.agent.kvevents import KvEventCounters

log = logging.getLogger(__name__)

CONNECT_PATH = "/llmgw.v1.AgentService/Connect"
RETRY_AFTER_KEY = "retry-after-ms"  # a refusal's trailer: when asking again is worth it
RETRY_AFTER_MAX_MS = 300_000  # a server's hint is followed up to five minutes

CommandHandler = Callable[[ControlMessage], Awaitable[None]]
OUTBOX_LIMIT = 10_000  # queued messages; beyond it the oldest is dropped (Register resyncs)
LOG_QUEUE = 16  # log chunks waiting to be sent; a log stream waits for room


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """Where the server is and how patient to be with it."""

    host: str
    port: int
    register_timeout_s: float = 10.0
    idle_timeout_s: float = 15.0
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)
    token: str | None = field(default=None, repr=False)  # sent as a bearer token; never logged
    tls: ssl.SSLContext | None = field(default=None, repr=False, compare=False)  # None: plaintext
    instance_id: str = ""  # this agent's id, kept in its state dir (llmgw.agent.daemon)
    machine_id: str = ""  # /etc/machine-id; "" when unknown


class KvSource(Protocol):
    """What the link sends about KV blocks (``llmgw.agent.kvhub.KvEventHub``)."""

    def full_copy(self) -> list[KvDelta]:
        """Every engine's blocks; later deltas are relative to this copy."""
        ...

    async def next_deltas(self) -> list[KvDelta]:
        """The next batch of net changes (waits until there are some)."""
        ...

    def counters(self) -> Mapping[str, KvEventCounters]:
        """Each followed engine's KV event counters, by shard id (for heartbeats)."""
        ...


class LogHandler(Protocol):
    """Where the server's log requests go (``llmgw.agent.logserve.LogStreams``)."""

    def handle(self, message: ControlMessage) -> bool:
        """Carry out a LogRequest or LogCancel; False for any other message."""
        ...

    async def reset(self) -> None:
        """End every log stream."""
        ...


class SessionEnded(Exception):
    """A session with the server ended; the message says why."""


class RegisterRefused(SessionEnded):
    """The server refused the registration; ``retry_after_s`` is its hint (None: none)."""

    def __init__(self, why: str, retry_after_s: float | None) -> None:
        super().__init__(why)
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class LinkStats:
    """What the link has seen, for logs, tests and benchmarks."""

    sessions: int = 0
    heartbeats: int = 0
    rtt_ms: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    connected: bool = False
    kv_deltas: int = 0  # KvDelta messages sent, full copies included


class AgentLink:
    """Keeps one registered stream open to the control server."""

    def __init__(  # noqa: PLR0913 (the agent's sources and callbacks, each by keyword)
        self,
        config: LinkConfig,
        *,
        node: Callable[[], NodeInfo],
        telemetry: Callable[[], Sequence[GpuTelemetry]],
        shards: Callable[[], Sequence[ShardStatus]] = list,
        on_command: CommandHandler | None = None,
        kv: KvSource | None = None,
        membership: ClusterMembership | None = None,
        on_registered: Callable[[str], None] | None = None,
        logs: LogHandler | None = None,
    ) -> None:
        self.config = config
        self._logs = logs
        self._log_out: asyncio.Queue[LogChunk] = asyncio.Queue(maxsize=LOG_QUEUE)
        self._membership = membership
        self._on_registered = on_registered  # each accepted registration (Supervisor.licence)
        self._kv = kv
        self._node = node
        self._telemetry = telemetry
        self._shards = shards
        self._on_command = on_command
        self.stats = LinkStats()
        self._outbox: asyncio.Queue[AgentMessage] = asyncio.Queue(maxsize=OUTBOX_LIMIT)
        self._send_lock = asyncio.Lock()
        self.backoff = Backoff(config.backoff, what=f"control server {config.host}:{config.port}")
        self.run_id = uuid.uuid4().hex  # this process: its reconnects replace its old stream

    def send_status(self, status: ShardStatus) -> None:
        """Queue a shard status for the current (or next) session's stream; none while
        the engines are held from the server (the next Register carries every shard)."""
        if not self._holding:
            self.enqueue(AgentMessage(shard_status=status))

    async def send_log(self, chunk: LogChunk) -> None:
        """Queue a log chunk for the current session, waiting while the queue is full."""
        await self._log_out.put(chunk)

    @property
    def _holding(self) -> bool:
        """Whether this session's server is of another cluster than the engines'."""
        return self._membership is not None and self._membership.holding

    def enqueue(self, message: AgentMessage) -> None:
        """Queue a message for the stream; the oldest queued one gives way when it is full."""
        if self._outbox.full():
            self._outbox.get_nowait()
            log.debug("outbound queue full; the oldest message was dropped")
        self._outbox.put_nowait(message)

    async def run(self) -> None:
        """Run sessions forever; returns only when cancelled."""
        async for _ in self.backoff:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except (
                SessionEnded,
                GRPCError,
                ProtocolError,
                StreamTerminatedError,
                OSError,
                TimeoutError,
            ) as exc:
                hint = exc.retry_after_s if isinstance(exc, RegisterRefused) else None
                self.backoff.failed(self._why(exc), retry_after_s=hint)
            finally:
                self.stats.connected = False

    def _why(self, exc: BaseException) -> str:
        """Why a session ended; a plaintext stream cut before registering may be a TLS port."""
        why = _describe(exc)
        cut = isinstance(exc, StreamTerminatedError | ConnectionResetError)
        if cut and self.config.tls is None and not self.stats.connected:
            why += " before registering (if the server serves TLS, give the agent --ca-file)"
        return why

    async def _session(self) -> None:
        channel = grpclib.client.Channel(self.config.host, self.config.port, ssl=self.config.tls)
        try:
            async with channel.request(
                CONNECT_PATH,
                Cardinality.STREAM_STREAM,
                AgentMessage,
                ControlMessage,
                metadata=self._metadata(),
            ) as stream:
                _drain(self._outbox)  # Register carries the current state of every shard
                if self._logs is not None:
                    await self._logs.reset()
                _drain(self._log_out)
                interval_s, cluster_id = await self._register(stream)
                self.backoff.succeeded()
                if self._on_registered is not None and not self._holding:
                    self._on_registered(cluster_id)  # engines held for another cluster stay
                self.stats.sessions += 1
                self.stats.connected = True
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(self._heartbeats(stream, interval_s))
                    tasks.create_task(self._send_queued(stream))
                    tasks.create_task(self._send_logs(stream))
                    if self._kv is not None and not self._holding:
                        tasks.create_task(self._send_kv(stream, self._kv))
                    await self._receive(stream)
                    raise SessionEnded("the server closed the stream")
        except* Exception as group:
            raise _first_leaf(group) from None
        finally:
            channel.close()

    def _metadata(self) -> dict[str, str] | None:
        token = self.config.token
        return {"authorization": f"Bearer {token}"} if token else None

    async def _register(self, stream: _Stream) -> tuple[float, str]:
        """Register; the heartbeat interval and the cluster id the server named."""
        membership = self._membership
        register = Register(
            protocol_version=PROTOCOL_VERSION,
            node=self._node(),
            shards=list(self._shards()),
            cluster_id=membership.remembered if membership is not None else "",
            instance_id=self.config.instance_id,
            machine_id=self.config.machine_id,
            run_id=self.run_id,
        )
        async with asyncio.timeout(self.config.register_timeout_s):
            await stream.send_message(AgentMessage(register=register))
            try:
                reply = await stream.recv_message()
            except GRPCError as exc:
                raise RegisterRefused(_describe(exc), _retry_after_s(stream)) from exc
        if reply is None or reply.registered is None:
            await stream.recv_trailing_metadata()  # raises the server's GRPCError if any
            raise SessionEnded("the server did not acknowledge the registration")
        interval_ms = reply.registered.heartbeat_interval_ms or 1000
        if membership is not None:
            membership.registered(reply.registered.cluster_id, engines=len(register.shards))
        log.info(
            "registered with %s:%d over %s (heartbeat every %d ms)",
            self.config.host,
            self.config.port,
            "plaintext" if self.config.tls is None else "TLS",
            interval_ms,
        )
        return interval_ms / 1000, reply.registered.cluster_id

    async def _heartbeats(self, stream: _Stream, interval_s: float) -> None:
        previous: dict[str, GpuTelemetry] = {}
        kv_seen: dict[str, KvFollowStats] = {}  # this stream's baseline: new streams get all
        seq = 0
        while True:
            seq += 1
            current = self._telemetry()
            changed = telemetry_delta(previous, current)
            previous.update((gpu.uuid, gpu) for gpu in changed)
            beat = Heartbeat(seq=seq, sent_at_ms=_mono_ms(), gpus=changed)
            beat.kv_follow, kv_seen = self._kv_follow(kv_seen)
            await self._send(stream, AgentMessage(heartbeat=beat))
            self.stats.heartbeats += 1
            await asyncio.sleep(interval_s)

    def _kv_follow(
        self, seen: Mapping[str, KvFollowStats]
    ) -> tuple[list[KvFollowStats], dict[str, KvFollowStats]]:
        """The engines' KV event counters that changed since ``seen``, and the new baseline."""
        if self._kv is None or self._holding:
            return [], {}
        current = follow_stats(self._kv.counters())
        return follow_stats_delta(seen, current), {s.shard_id: s for s in current}

    async def _send_queued(self, stream: _Stream) -> None:
        while True:
            message = await self._outbox.get()
            await self._send(stream, message)

    async def _send_logs(self, stream: _Stream) -> None:
        while True:
            chunk = await self._log_out.get()
            await self._send(stream, AgentMessage(log_chunk=chunk))

    async def _send_kv(self, stream: _Stream, kv: KvSource) -> None:
        """A full copy of every engine's blocks first, then the net changes as they come."""
        deltas = kv.full_copy()
        while True:
            for delta in deltas:
                await self._send(stream, AgentMessage(kv_delta=delta))
                self.stats.kv_deltas += 1
            deltas = await kv.next_deltas()

    async def _send(self, stream: _Stream, message: AgentMessage) -> None:
        """One message at a time: concurrent sends could interleave their frames."""
        async with self._send_lock:
            await stream.send_message(message)

    async def _receive(self, stream: _Stream) -> None:
        while True:
            async with asyncio.timeout(self.config.idle_timeout_s):
                message = await stream.recv_message()
            if message is None:
                await stream.recv_trailing_metadata()
                return
            if message.heartbeat_ack is not None:
                self.stats.rtt_ms.append(_mono_ms() - message.heartbeat_ack.sent_at_ms)
            elif self._holding:
                log.warning(
                    "command %s ignored: this agent's engines are not handed over to this "
                    "server's cluster",
                    _kind(message),
                )
            elif self._logs is not None and self._logs.handle(message):
                continue
            elif self._on_command is not None:
                await self._on_command(message)
            else:
                log.warning("command %s received but this agent runs no engines", _kind(message))


_Stream = grpclib.client.Stream[AgentMessage, ControlMessage]


def _drain(queue: asyncio.Queue[Any]) -> None:
    while not queue.empty():
        queue.get_nowait()


def _mono_ms() -> int:
    """Monotonic milliseconds: heartbeats echo it back, so only this process reads it."""
    return time.monotonic_ns() // 1_000_000


def _first_leaf(group: BaseExceptionGroup[Exception]) -> Exception:
    """The first real exception of a task group's failure (why the session ended)."""
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _kind(message: ControlMessage) -> str:
    for name in ("start_shard", "stop_shard", "drain_shard", "registered", "log_request"):
        if getattr(message, name) is not None:
            return name
    return "unknown"


def _retry_after_s(stream: _Stream) -> float | None:
    """The server's ``retry-after-ms`` trailer in seconds; None when absent or malformed."""
    metadata = stream.trailing_metadata
    value = metadata.get(RETRY_AFTER_KEY) if metadata is not None else None
    if not isinstance(value, str) or not value.isdigit():
        return None
    return min(int(value), RETRY_AFTER_MAX_MS) / 1000


def _describe(exc: BaseException) -> str:
    if isinstance(exc, GRPCError):
        return f"refused: {exc.status.name}: {exc.message}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return describe_tls_error(exc) or str(exc) or type(exc).__name__
