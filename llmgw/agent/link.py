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

Several control servers may share one database (issue #17); ``LinkConfig.servers`` lists
them all, and a session goes to one at a time. A follower answers with ``not_leader``
naming the leader: when that address is in the list (compared as parsed HOST:PORT) the
next session goes there at once, else to the next server of the list; a failed session
(unreachable, UNAVAILABLE, the idle watchdog, a fenced leader) moves to the next server at
once too. Only a whole round of the list without a session that stays up waits for the
backoff. TLS verifies each server's certificate against the host being dialled. With an
``epoch`` (``llmgw.agent.epoch``), every message's ``leader_epoch`` is checked before it is
handled: one older than the newest the agent has seen (a deposed leader's) is never
carried out; the session is dropped and the next server tried.
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
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from llmgw.addresses import AddressError, bracketed, parse_host_port
from llmgw.agent.backoff import Backoff, BackoffPolicy
from llmgw.agent.cluster import ClusterMembership
from llmgw.agent.epoch import LeaderEpoch
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
    NotLeader,
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


Address = tuple[str, int]  # (host, port), the host without brackets


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """Where the servers are and how patient to be with them: ``host``/``port`` is the first
    server of the list, ``more_servers`` the others (``--server a,b,c``)."""

    host: str
    port: int
    more_servers: tuple[Address, ...] = ()
    register_timeout_s: float = 10.0
    idle_timeout_s: float = 15.0
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)
    token: str | None = field(default=None, repr=False)  # sent as a bearer token; never logged
    tls: ssl.SSLContext | None = field(default=None, repr=False, compare=False)  # None: plaintext
    instance_id: str = ""  # this agent's id, kept in its state dir (llmgw.agent.daemon)
    machine_id: str = ""  # /etc/machine-id; "" when unknown

    @property
    def servers(self) -> tuple[Address, ...]:
        """Every server to try, in order, the first one first."""
        return ((self.host, self.port), *self.more_servers)


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


class NotLeaderRedirect(SessionEnded):
    """A follower named the leader; ``index`` is its place in the server list (None: not
    in it, or no leader, or a leader of an epoch older than the remembered one)."""

    def __init__(self, why: str, index: int | None) -> None:
        super().__init__(why)
        self.index = index


class Fenced(SessionEnded):
    """The server sent a message of an older leader epoch than the agent has seen."""


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
    redirects: int = 0  # not_leader answers followed to the leader they named
    fenced: int = 0  # sessions dropped for a message of an older leader epoch
    server: str = ""  # HOST:PORT of the server of the current (or last) session


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
        epoch: LeaderEpoch | None = None,
    ) -> None:
        self.config = config
        self._epoch = epoch
        self._cluster = ""  # the current session's cluster id (its Registered's)
        self._index = 0  # the server list's entry the next session goes to
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
        names = ",".join(_address(server) for server in config.servers)
        self.backoff = Backoff(config.backoff, what=f"control server(s) {names}")
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
            why, hint = await self._round()
            self.backoff.failed(why, retry_after_s=hint)

    async def _round(self) -> tuple[str, float | None]:
        """Sessions with one server after another until as many as the list is long have
        failed (following a named leader is free, up to the list's length per round); why
        the last one ended and the last refusal's retry hint (the backoff waits after it)."""
        servers = self.config.servers
        why, hint = "", None
        failures = redirects = 0
        while failures < len(servers):
            target = servers[self._index]
            try:
                await self._session(target)
            except asyncio.CancelledError:
                raise
            except _SESSION_ENDS as caught:
                exc = self._unavailable_redirect(caught)
                why = f"{_address(target)}: {self._why(exc)}"
                if isinstance(exc, RegisterRefused) and exc.retry_after_s is not None:
                    hint = exc.retry_after_s
                leader = exc.index if isinstance(exc, NotLeaderRedirect) else None
                if leader is not None and redirects < len(servers):
                    redirects += 1
                    self.stats.redirects += 1
                    self._index = leader
                    log.info("control server %s; following it", why)
                    continue
                failures += 1
                self.stats.fenced += isinstance(exc, Fenced)
                self._index = (self._index + 1) % len(servers)
                if failures < len(servers):
                    log.info("control server %s; trying %s", why, _address(servers[self._index]))
            finally:
                self.stats.connected = False
        return why, hint

    def _unavailable_redirect(self, exc: BaseException) -> BaseException:
        """A follower's UNAVAILABLE before registering, as a redirect to the leader its
        message names (when that address is in the list): the ``not_leader`` message
        before it is lost when the stream's reset arrives with it (grpclib drops what a
        reset stream had buffered)."""
        if self.stats.connected or not isinstance(exc, GRPCError):
            return exc
        if exc.status is not Status.UNAVAILABLE:
            return exc
        for word in (exc.message or "").split():
            index = _index_of(word.strip(".,;:()'\"").rstrip("."), self.config.servers)
            if index is not None:
                return NotLeaderRedirect(_describe(exc), index)
        return exc

    def _why(self, exc: BaseException) -> str:
        """Why a session ended; a plaintext stream cut before registering may be a TLS port."""
        why = _describe(exc)
        cut = isinstance(exc, StreamTerminatedError | ConnectionResetError)
        if cut and self.config.tls is None and not self.stats.connected:
            why += " before registering (if the server serves TLS, give the agent --ca-file)"
        return why

    async def _session(self, target: Address) -> None:
        self.stats.server = _address(target)
        channel = grpclib.client.Channel(target[0], target[1], ssl=self.config.tls)
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
        if reply is not None and reply.not_leader is not None:
            raise self._redirect(reply.not_leader)
        if reply is not None:  # a Registered names its cluster: epochs compare within one
            self._cluster = reply.registered.cluster_id if reply.registered is not None else ""
            self._fence(reply)
        if reply is None or reply.registered is None:
            await stream.recv_trailing_metadata()  # raises the server's GRPCError if any
            raise SessionEnded("the server did not acknowledge the registration")
        interval_ms = reply.registered.heartbeat_interval_ms or 1000
        if membership is not None:
            membership.registered(reply.registered.cluster_id, engines=len(register.shards))
        log.info(
            "registered with %s over %s (heartbeat every %d ms, leader epoch %d)",
            self.stats.server,
            "plaintext" if self.config.tls is None else "TLS",
            interval_ms,
            reply.leader_epoch,
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
            if message.not_leader is not None:
                raise self._redirect(message.not_leader)
            self._fence(message)
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

    def _fence(self, message: ControlMessage) -> None:
        """Fenced unless the message's leader epoch is at least the newest one seen."""
        if self._epoch is None:
            return
        what, server = _kind(message), self.stats.server
        epoch = message.leader_epoch
        if not self._epoch.admit(epoch, what=what, server=server, cluster=self._cluster):
            raise Fenced(
                f"{what} of leader epoch {message.leader_epoch} refused (this agent has seen "
                f"epoch {self._epoch.remembered}): a deposed leader; the session is dropped"
            )

    def _redirect(self, answer: NotLeader) -> NotLeaderRedirect:
        """Where a follower's ``not_leader`` sends the next session, and why."""
        named = answer.leader_address
        index = _index_of(named, self.config.servers)
        remembered = self._epoch.remembered if self._epoch is not None else 0
        if not named:
            why = "a follower, and no server leads now"
        elif index is None:
            why = f"a follower; the leader {named!r} is not in the --server list"
        elif answer.leader_epoch < remembered:
            why = f"a follower naming {named} of leader epoch {answer.leader_epoch} < {remembered}"
            index = None
        else:
            why = f"a follower; the leader is {named} (epoch {answer.leader_epoch})"
        return NotLeaderRedirect(why, index)


_Stream = grpclib.client.Stream[AgentMessage, ControlMessage]
_SESSION_ENDS = (
    SessionEnded,
    GRPCError,
    ProtocolError,
    StreamTerminatedError,
    OSError,
    TimeoutError,
)


def _address(server: Address) -> str:
    return f"{bracketed(server[0])}:{server[1]}"


def _index_of(text: str, servers: Sequence[Address]) -> int | None:
    """Where HOST:PORT ``text`` is in ``servers`` (None: not there, or malformed)."""
    try:
        address = parse_host_port(text, port_zero=False)
    except AddressError:
        return None
    return servers.index(address) if address in servers else None


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
    names = ("start_shard", "stop_shard", "drain_shard", "registered", "log_request")
    for name in (*names, "log_cancel", "heartbeat_ack"):
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
