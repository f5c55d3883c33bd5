"""The gateway's routing table, kept in step with the control server's router feed.

``RouterService.Feed`` (protos/llmgw/v1/router.proto) streams one snapshot of every replica
a gateway may route to, then each change. :func:`apply_feed_event` folds one event into a
:class:`RoutingTable` (and the KV blocks each replica holds into a
:class:`~llmgw.gateway.routing.kvindex.KvIndex`, when given one); the in-server gateway calls
it on the plane's events directly, and :func:`follow` does it over grpclib for a separate
``llmgw gateway`` process::

    stop = asyncio.Event()
    await follow(lambda: feed_channel("10.0.0.1", 50051), table, stop=stop, index=index)

The feed's tenant keys (``TenantKeys``: every live key) replace the set of the tenant
registry bound to the table (``llmgw.gateway.tenants``); a snapshot leaves them as they
are, and so does an outage: a gateway cut off from the server keeps its last keys.

A snapshot makes the index forget every replica but those in its ``kv_replicas``, whose
full copies follow it, each replacing what the index had for that replica when it arrives.

:func:`follow` never gives up: when the control server is away it reconnects with
jittered, capped backoff and the gateway keeps routing with the last table it had (said
once at WARNING per outage). A reconnection starts with a fresh snapshot, which replaces
the table whole, so nothing missed while away lingers.

With a :class:`ServerList` (``llmgw gateway --server a,b,c``: every server sharing one
database, issue #17) the channel factory dials ``servers.current``, and :func:`follow`
moves it: a follower's ``not_leader`` (or its UNAVAILABLE naming the leader, when the
event was lost to the stream's reset) sends the next attempt to the leader at once when
that address is in the list, else to the next server; a failed stream moves on to the next
server at once too. Only a whole round of the list without a stream backs off.

This module imports only ``llmgw.api``, ``llmgw.protocol``, ``llmgw.addresses`` and the
gateway's own modules: the separate gateway process runs without a control plane.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl as _ssl
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpclib.client
import grpclib.config
from grpclib.const import Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from llmgw.addresses import AddressError, bracketed, parse_host_port
from llmgw.api.llmgw.v1 import (
    KvBlocks,
    RouterFeedEvent,
    RouterFeedRequest,
    RouterServiceStub,
    RouterSnapshot,
    RouteTarget,
    ShardState,
)
from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.gateway.tenants import TenantRegistry, registry_of
from llmgw.kvcache.keys import unpack_keys
from llmgw.protocol import read_shard_state

log = logging.getLogger(__name__)

ChannelFactory = Callable[[], grpclib.client.Channel]
Address = tuple[str, int]  # (host, port), the host without brackets

_EXPECTED = (GRPCError, StreamTerminatedError, ProtocolError, OSError, EOFError)
"""What a control server that is away, restarting or refusing looks like from here."""


def target_from_route(route: RouteTarget) -> Target:
    """The table's view of one feed target: routable only when READY (an unknown state
    from a newer server reads as FAILED, never READY)."""
    return Target(
        replica_id=route.replica_id,
        model=route.model,
        url=route.endpoint.rstrip("/"),
        api_key=route.api_key,
        ready=read_shard_state(route.state) is ShardState.READY,
        deployment=route.deployment,
        kv_events=route.kv_events,
        adapters=tuple(route.adapters),
    )


def targets_from_snapshot(snapshot: RouterSnapshot) -> tuple[Target, ...]:
    """Every target of a feed snapshot."""
    return tuple(target_from_route(route) for route in snapshot.targets)


def apply_feed_event(
    table: RoutingTable,
    event: RouterFeedEvent,
    index: KvIndex | None = None,
    tenants: TenantRegistry | None = None,
) -> None:
    """Fold one feed event into ``table``: a snapshot replaces it, a target is upserted,
    a removal drops its replica, scalable models replace the table's; KV blocks go to
    ``index`` (dropped without one); tenant keys replace the set of ``tenants``, or of the
    registry bound to ``table`` (``tenants.bind_registry``: a Gateway binds its own), and
    are dropped without either. An event with none of them (from a newer server) is
    ignored."""
    if event.snapshot is not None:
        table.replace_all(targets_from_snapshot(event.snapshot))
        if index is not None:
            index.retain(event.snapshot.kv_replicas)
    elif event.target is not None:
        table.upsert(target_from_route(event.target))
    elif event.target_removed is not None:
        table.remove(event.target_removed)
        if index is not None:
            index.forget(event.target_removed)
    elif event.kv_blocks is not None and index is not None:
        apply_kv_blocks(index, event.kv_blocks)
    elif event.scalable is not None:
        table.set_scalable(event.scalable.models)
    elif event.tenant_keys is not None:
        registry = tenants if tenants is not None else registry_of(table)
        if registry is not None:
            registry.replace(event.tenant_keys.keys)


def apply_kv_blocks(index: KvIndex, blocks: KvBlocks) -> None:
    """Fold one replica's KV block change into ``index``. A malformed one (packed keys
    that are not whole 8-byte words) is counted, logged and changes nothing."""
    try:
        stored = unpack_keys(blocks.stored_keys)
        removed = unpack_keys(blocks.removed_keys)
    except ValueError as exc:
        index.note_refused()
        log.warning("router feed: KV blocks of %s refused (%s)", blocks.replica_id, exc)
        return
    index.apply(blocks.replica_id, blocks.reset, stored, removed, block_size=blocks.block_size)
    if blocks.oldest_event_ts > 0:
        index.note_event_lag(max(0.0, time.time() - blocks.oldest_event_ts))


# --- following the feed over grpclib ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class FollowConfig:
    """How :func:`follow` reconnects and notices a silent server.

    ``base_s`` doubles per failure in a row up to ``cap_s`` (full jitter in the upper
    half). The feed is quiet while nothing changes, so the channel pings the server every
    ``keepalive_s`` and drops the connection when a ping is not answered within
    ``keepalive_timeout_s``: a server that vanished without a reset is noticed too.
    """

    base_s: float = 0.5
    cap_s: float = 10.0
    factor: float = 2.0
    keepalive_s: float = 10.0
    keepalive_timeout_s: float = 10.0

    def delay(self, failures: int, rng: random.Random) -> float:
        """The sleep before the next attempt after ``failures`` consecutive failures."""
        if failures <= 0:
            return 0.0
        ceiling = min(self.cap_s, self.base_s * self.factor ** (failures - 1))
        return rng.uniform(ceiling / 2, ceiling)


def feed_channel(
    host: str,
    port: int,
    config: FollowConfig = FollowConfig(),
    *,
    ssl: _ssl.SSLContext | None = None,
) -> grpclib.client.Channel:
    """A grpclib channel to the control server's native gRPC port, with keepalive pings
    so that a quiet feed on a dead connection is noticed; over TLS with ``ssl`` (a client
    context, ``llmgw.tls.client_context``: the certificate is checked against ``host``)."""
    options = grpclib.config.Configuration(
        _keepalive_time=config.keepalive_s,
        _keepalive_timeout=config.keepalive_timeout_s,
        _keepalive_permit_without_calls=True,
        _http2_max_pings_without_data=0,  # the feed is quiet for long stretches: keep pinging
        _http2_min_sent_ping_interval_without_data=config.keepalive_s,
    )
    return grpclib.client.Channel(host, port, config=options, ssl=ssl)


class ServerList:
    """The control servers a gateway may follow, in order, and the one it follows now."""

    def __init__(self, servers: Sequence[Address], *, follow_any_leader: bool = False) -> None:
        if not servers:
            raise ValueError("a gateway needs at least one control server")
        self.servers = tuple(servers)
        self._index = 0
        # a control server's own gateway while it follows: it starts from its own server,
        # which always names the leader, and goes to whichever leader is named
        self._open = follow_any_leader
        self._given = len(self.servers)

    @property
    def current(self) -> Address:
        """The server the next (or current) feed stream and report go to."""
        return self.servers[self._index]

    def name(self) -> str:
        """``HOST:PORT`` of the current server."""
        host, port = self.current
        return f"{bracketed(host)}:{port}"

    def index_of(self, text: str) -> int | None:
        """Where HOST:PORT ``text`` is in the list (None: not there, or not HOST:PORT)."""
        try:
            address = parse_host_port(text, port_zero=False)
        except AddressError:
            return None
        return self.servers.index(address) if address in self.servers else None

    def named_in(self, message: str) -> int | None:
        """The first server of the list that ``message`` (a status message) names."""
        for word in message.split():
            index = self.index_of(word.strip(".,;:()'\""))
            if index is not None:
                return index
        return None

    def leader_index(self, text: str) -> int | None:
        """Where the leader a follower named (HOST:PORT ``text``) is in the list; a list
        that follows any leader takes in one it did not hold (in one slot after the servers
        it was given, so that no sequence of answers grows it)."""
        index = self.index_of(text)
        if index is not None or not self._open:
            return index
        try:
            address = parse_host_port(text, port_zero=False)
        except AddressError:
            return None
        self.servers = (*self.servers[: self._given], address)
        return self._given

    def move_to(self, index: int) -> None:
        """Follow server ``index`` from now on."""
        self._index = index

    def advance(self) -> None:
        """Follow the next server of the list (round and round)."""
        self._index = (self._index + 1) % len(self.servers)


class _NotLeader(Exception):
    """A follower answered the feed; the message says which leader it named."""

    def __init__(self, address: str) -> None:
        super().__init__(f"a follower; the leader is {address or 'none now'}")
        self.address = address


class _Outage:
    """Says once per outage that the gateway serves from its last table, and when it ends."""

    def __init__(self, table: RoutingTable) -> None:
        self._table = table
        self.failures = 0
        self._since = 0.0

    def failed(self, why: object) -> None:
        self.failures += 1
        if self.failures == 1:
            self._since = time.monotonic()
            log.warning(
                "router feed lost (%s): routing with the last table (%d targets) "
                "until the control server is back; reconnecting with backoff",
                why,
                len(self._table.targets()),
            )
        else:
            log.debug("router feed: still away (%s; failure #%d)", why, self.failures)

    def snapshot(self) -> None:
        if self.failures:
            log.info(
                "router feed back after %.1f s (%d failures): table replaced by a snapshot "
                "of %d targets",
                time.monotonic() - self._since,
                self.failures,
                len(self._table.targets()),
            )
        self.failures = 0


async def _attempts(
    config: FollowConfig, outage: _Outage, rng: random.Random
) -> AsyncIterator[int]:
    attempt = 0
    while True:
        await asyncio.sleep(config.delay(outage.failures, rng))
        attempt += 1
        yield attempt


async def _session(
    channel_factory: ChannelFactory, table: RoutingTable, index: KvIndex | None, outage: _Outage
) -> None:
    """One feed stream, applied to ``table`` (and ``index``) until it ends."""
    channel = channel_factory()
    try:
        async for event in RouterServiceStub(channel).feed(RouterFeedRequest()):
            if event.not_leader is not None:
                raise _NotLeader(event.not_leader.leader_address)
            apply_feed_event(table, event, index)
            if event.snapshot is not None:
                outage.snapshot()
    finally:
        channel.close()


async def _follow_forever(
    channel_factory: ChannelFactory,
    table: RoutingTable,
    config: FollowConfig,
    index: KvIndex | None,
    servers: ServerList | None,
) -> None:
    outage = _Outage(table)
    async for _ in _attempts(config, outage, random.Random()):
        outage.failed(await _round(channel_factory, table, index, outage, servers))


async def _round(
    channel_factory: ChannelFactory,
    table: RoutingTable,
    index: KvIndex | None,
    outage: _Outage,
    servers: ServerList | None,
) -> str:
    """Streams from one server after another until as many as the list is long have
    failed (following a named leader is free, up to the list's length); why the last
    ended."""
    count = len(servers.servers) if servers is not None else 1
    failures = redirects = 0
    while True:
        name = servers.name() if servers is not None else "the control server"
        leader: int | None = None
        try:
            await _session(channel_factory, table, index, outage)
        except asyncio.CancelledError:
            raise
        except _NotLeader as exc:
            why = str(exc)
            leader = servers.leader_index(exc.address) if servers is not None else None
        except _EXPECTED as exc:
            why = f"{type(exc).__name__}: {exc}"
            leader = _named_leader(exc, servers)
        except Exception as exc:  # our bug or a surprise: log it, but never stop following
            log.exception("router feed: unexpected error; reconnecting")
            why = str(exc)
        else:
            why = "the control server ended the stream"
        if servers is not None and leader is not None and redirects < count:
            redirects += 1
            servers.move_to(leader)
            log.info("router feed: %s: %s; following it to %s", name, why, servers.name())
            continue
        failures += 1
        if servers is not None:
            servers.advance()
        if failures >= count or servers is None:
            return f"{name}: {why}"
        log.info("router feed: %s: %s; trying %s", name, why, servers.name())


def _named_leader(exc: BaseException, servers: ServerList | None) -> int | None:
    """The leader a follower's UNAVAILABLE names (its not_leader event may be lost to the
    stream's reset: grpclib drops what a reset stream had buffered)."""
    if servers is None or not isinstance(exc, GRPCError) or exc.status is not Status.UNAVAILABLE:
        return None
    return servers.named_in(exc.message or "")


async def follow(
    channel_factory: ChannelFactory,
    table: RoutingTable,
    *,
    stop: asyncio.Event,
    config: FollowConfig = FollowConfig(),
    index: KvIndex | None = None,
    servers: ServerList | None = None,
) -> None:
    """Keep ``table`` (and ``index``: each replica's KV blocks) in step with the control
    server's router feed until ``stop`` is set.

    ``channel_factory`` makes a fresh channel per attempt (:func:`feed_channel`); each is
    closed when its stream ends. While the server is away the table and the index are left
    as they were. With ``servers`` (the list the factory dials ``current`` of), a follower's
    redirect and a failure move ``servers`` on (see the module docstring).
    """
    follower = asyncio.create_task(
        _follow_forever(channel_factory, table, config, index, servers), name="feed"
    )
    stopped = asyncio.create_task(stop.wait(), name="feed-stop")
    try:
        await asyncio.wait({follower, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (follower, stopped):
            task.cancel()
        await asyncio.gather(follower, stopped, return_exceptions=True)
    error = None if follower.cancelled() else follower.exception()
    if error is not None:  # only a bug ends the follower by itself
        raise error


__all__ = [
    "ChannelFactory",
    "ServerList",
    "FollowConfig",
    "apply_feed_event",
    "apply_kv_blocks",
    "feed_channel",
    "follow",
    "target_from_route",
    "targets_from_snapshot",
]
