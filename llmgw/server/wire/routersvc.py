"""``RouterService``: the router feed that gateways follow, and the in-server gateway.

SECRETS: every ``RouteTarget`` carries its replica's API key (the key only gateways may
know). So this service is served on the native gRPC port only, never over gRPC-web, and
while authentication is on ``Feed`` is refused to every caller but the gateway role
(``llmgw.server.wire.auth``). Do not add it to ``GrpcWebApp`` or log its messages.

The feed is the plane's watch stream (``plane.hub``) seen through a gateway's eyes: one
snapshot of every replica that is not RETIRED, then a target for each one that changed
and a removal for each one that went away. Each subscriber remembers what it last sent,
so a shard report that does not change what a gateway routes on sends nothing. A
subscriber that falls behind gets a fresh snapshot (the hub's resync).

KV blocks come from the plane's block store (``plane.kv_blocks``) through a
watcher per subscriber: after each snapshot, a full copy of the blocks of every replica
the store holds any of (the snapshot's ``kv_replicas``), then each replica's net changes,
coalesced while the subscriber is busy; one that falls far behind on a replica gets a full
copy of it again (``llmgw.server.state.kvblocks``). Target events always go first: between two
chunks of blocks the feed looks at the watch hub again.

What a target says: the endpoint and state are the operator API's view of the replica
(``ControlPlane.replica_view``: READY only when every shard is READY, DRAINING once it
retires); the API key, whether it publishes KV events and its LoRA adapters come from the
replica's record and the profile it was placed with.

After each snapshot, and whenever a deployment changes so that they do, the feed sends the
**scalable models** (``ScalableModels``, :func:`scalable_models`): those of deployments the
autoscaler owns (mode "act"). A gateway holds a request for one while none of its replicas
is READY (``llmgw.gateway.holding``), rather than answering 404 or 503.

After each snapshot, and whenever a key is made or revoked, it sends **every tenant key**
(``TenantKeys``, :func:`tenant_keys`: each live key with its SHA-256, expired ones too; the
gateway refuses those by their expiry). Each subscriber compares the plane's key book's
``generation`` with the one it last sent, at every hub event; the audit record that the
operator API publishes right after a create or revoke (``llmgw.server.wire.tenantkeys``) is
the event that wakes it, so a revoked key leaves every gateway's set at once.

``Report`` goes the other way: a separate ``llmgw gateway`` sends its
routing figures every few seconds (the gateway role), kept in ``reports``
(``llmgw.server.wire.routerreports``, shared with ``ControlService``, whose ``GetRouterStats``
adds them up). A malformed report answers INVALID_ARGUMENT naming the field, one gateway
too many RESOURCE_EXHAUSTED naming the limit; either way nothing kept changes.

:func:`serve_gateway` runs the OpenAI gateway inside the server, fed from the same events
without a gRPC hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, cast

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from llmgw.api.llmgw.v1 import (
    RouterFeedEvent,
    RouterFeedRequest,
    RouterReport,
    RouterReportAck,
    RouterServiceBase,
    RouterSnapshot,
    RouteTarget,
    ScalableModels,
    TenantKeys,
    WatchEvent,
)
from llmgw.gateway import (
    Gateway,
    GatewayConfig,
    KvIndex,
    RoutingTable,
    apply_feed_event,
    targets_from_snapshot,
)
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord
from llmgw.server.core.tenantsplit import FleetSplit
from llmgw.server.state.kvblocks import KvWatcher
from llmgw.server.state.plane import ControlPlane
from llmgw.server.wire.reportsignals import IN_SERVER_GATEWAY
from llmgw.server.wire.routerreports import ReportRefused, RouterReports
from llmgw.server.wire.tenantkeys import key_message
from llmgw.server.wire.usage import FLUSH_S, flush, take_usage

log = logging.getLogger(__name__)

SPLIT_INTERVAL_S = 2.0
"""How often the in-server gateway's part of the tenant keys' budgets is computed again."""
KV_KEYS_PER_TURN = 65_536
"""About how many block keys the feed sends before it looks at the watch hub again."""


def route_target(plane: ControlPlane, record: ReplicaRecord) -> RouteTarget:
    """One replica as a gateway routes to it (with its API key: a secret)."""
    view = plane.replica_view(record)
    return RouteTarget(
        replica_id=view.replica_id,
        deployment=view.deployment,
        model=view.model,
        endpoint=view.endpoint,
        api_key=record.api_key,
        state=view.state,
        kv_events=record.profile.kv_events,
        adapters=[adapter.name for adapter in record.profile.adapters],
    )


def scalable_models(plane: ControlPlane) -> list[str]:
    """The models a gateway holds requests for while none of their replicas is READY:
    those of deployments whose autoscale policy is in mode "act" (the planner starts a
    replica of one scaled to zero), by served model name and LoRA adapter, sorted."""
    models: set[str] = set()
    for deployment in plane.desired.deployments.values():
        policy = deployment.autoscale
        if policy is None or policy.mode not in ("act", ""):  # "": the file's default, act
            continue
        profile = plane.desired.profiles.get(deployment.profile)
        if profile is None:
            continue
        served = profile.served_model_name or profile.model_path.rstrip("/").rsplit("/", 1)[-1]
        models.update(name for name in (served, *(a.name for a in profile.adapters)) if name)
    return sorted(models)


def tenant_keys(plane: ControlPlane) -> TenantKeys:
    """Every live tenant key, with its digest (for gateways only), oldest first."""
    keys = [key_message(key, with_digest=True) for key in plane.tenant_keys.keys]
    return TenantKeys(keys=keys)


def route_targets(plane: ControlPlane) -> dict[str, RouteTarget]:
    """Every replica that is not RETIRED, by replica id."""
    return {
        replica_id: route_target(plane, record)
        for replica_id, record in sorted(plane.replicas.items())
        if record.lifecycle is not Lifecycle.RETIRED
    }


class _FeedView:
    """What one subscriber was last told, and the feed events that bring it up to date."""

    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane
        self._sent: dict[str, RouteTarget] = {}
        self._scalable: list[str] | None = None  # as last sent
        self._keys_sent: int | None = None  # the key book's generation last sent

    def events(self, event: WatchEvent) -> list[RouterFeedEvent]:
        """The feed events one watch event calls for (often none): those of the event,
        then the tenant keys when they changed since this subscriber was last told."""
        out = self._event(event)
        generation = self._plane.tenant_keys.generation
        if generation != self._keys_sent:
            self._keys_sent = generation
            out.append(
                RouterFeedEvent(revision=event.revision, tenant_keys=tenant_keys(self._plane))
            )
        return out

    def _event(self, event: WatchEvent) -> list[RouterFeedEvent]:
        if event.snapshot is not None:
            self._scalable = None  # sent again after every snapshot, and so are the keys
            self._keys_sent = None
            return [self._snapshot(event.revision), *self._scalable_changed(event.revision)]
        if event.deployment is not None or event.deployment_removed is not None:
            return self._scalable_changed(event.revision)
        if event.replica is not None:  # a profile applied alone may rename a model:
            # its replicas' events follow, and with them the scalable models
            changes = self._changes(event.revision, {event.replica.replica_id})
            return changes + self._scalable_changed(event.revision)
        if event.replica_removed is not None:
            return self._changes(event.revision, {event.replica_removed})
        if event.node is not None or event.node_removed is not None:
            # a node's address may have changed, and with it the endpoints of its replicas
            # (a replica that becomes live always has its own event)
            return self._changes(event.revision, set(self._sent))
        return []  # telemetry, shards (their replica's event follows), desired state, audit

    def _snapshot(self, revision: int) -> RouterFeedEvent:
        self._sent = route_targets(self._plane)
        snapshot = RouterSnapshot(
            targets=list(self._sent.values()),
            revision=revision,
            kv_replicas=self._plane.kv_blocks.replica_ids(),
        )
        return RouterFeedEvent(revision=revision, snapshot=snapshot)

    def _scalable_changed(self, revision: int) -> list[RouterFeedEvent]:
        """``ScalableModels`` when they differ from what this subscriber was last told."""
        models = scalable_models(self._plane)
        if models == self._scalable:
            return []
        self._scalable = models
        return [RouterFeedEvent(revision=revision, scalable=ScalableModels(models=models))]

    def _changes(self, revision: int, replica_ids: set[str]) -> list[RouterFeedEvent]:
        out: list[RouterFeedEvent] = []
        for replica_id in sorted(replica_ids):
            record = self._plane.replicas.get(replica_id)
            target = None
            if record is not None and record.lifecycle is not Lifecycle.RETIRED:
                target = route_target(self._plane, record)
            before = self._sent.get(replica_id)
            if target is None and before is not None:
                del self._sent[replica_id]
                out.append(RouterFeedEvent(revision=revision, target_removed=replica_id))
            elif target is not None and target != before:
                self._sent[replica_id] = target
                out.append(RouterFeedEvent(revision=revision, target=target))
        return out


class _Sources:
    """The watch hub's next event, or word that KV blocks are owed, whichever comes first."""

    def __init__(self, events: AsyncGenerator[WatchEvent, None], kv: KvWatcher) -> None:
        self._events = events
        self._kv = kv
        self._hub: asyncio.Future[WatchEvent] | None = None
        self.synced = False  # a snapshot went out: KV blocks may follow

    async def next(self) -> WatchEvent | None:
        """The hub's next event; None when KV blocks are owed and no hub event is ready."""
        if self._hub is None:
            self._hub = asyncio.ensure_future(anext(self._events))
            await asyncio.sleep(0)  # it takes an event the hub already holds at once
        while not self._hub.done() and not (self.synced and self._kv.pending):
            waiting: set[asyncio.Future[Any]] = {self._hub}
            if self.synced:
                # nothing is owed (the loop's condition): a wakeup still set is stale, and
                # waiting on it would return at once, forever (a busy loop at 100 % CPU)
                self._kv.wakeup.clear()
                waiting.add(asyncio.ensure_future(self._kv.wakeup.wait()))
            try:
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiting - {self._hub}:
                    waiter.cancel()
        if not self._hub.done():
            return None
        hub, self._hub = self._hub, None
        return hub.result()

    async def aclose(self) -> None:
        if self._hub is not None:
            self._hub.cancel()
            await asyncio.gather(self._hub, return_exceptions=True)


async def route_events(plane: ControlPlane) -> AsyncGenerator[RouterFeedEvent, None]:
    """A snapshot of every route target and a full copy of every replica's KV blocks,
    then each change, forever (a fresh snapshot after falling behind). Right after the
    server starts, the snapshot waits for the agents it remembers (`ControlPlane.agents_back`):
    a gateway keeps routing with what it had rather than learn that their replicas are down."""
    await plane.agents_back()
    view = _FeedView(plane)
    # WatchHub.subscribe is an async generator (typed as an iterator): close it with us,
    # so the hub forgets this watcher as soon as the feed ends
    subscription = cast(AsyncGenerator[WatchEvent, None], plane.hub.subscribe())
    with plane.kv_blocks.watch() as kv:
        async with contextlib.aclosing(subscription) as events:
            sources = _Sources(events, kv)
            try:
                while True:
                    event = await sources.next()
                    if event is None:
                        for blocks in kv.take(KV_KEYS_PER_TURN):
                            yield RouterFeedEvent(revision=plane.hub.revision, kv_blocks=blocks)
                        await asyncio.sleep(0)  # a big copy must not hold the event loop
                        continue
                    for out in view.events(event):
                        if out.snapshot is not None:  # the full copies it announces follow
                            sources.synced = True
                            kv.mark_full(out.snapshot.kv_replicas)
                        yield out
            finally:
                await sources.aclose()


class RouterService(RouterServiceBase):
    """The router feed over gRPC, and the reports of separate gateways. Carries API keys:
    native gRPC only, the gateway role only (``llmgw.server.wire.auth``)."""

    def __init__(self, plane: ControlPlane, reports: RouterReports | None = None) -> None:
        self.plane = plane
        self.reports = reports if reports is not None else RouterReports()
        self.split = FleetSplit()  # tenant keys' limits between the gateways (tenantsplit.py)
        self._feeds: set[asyncio.Task[Any]] = set()
        self._closing = ""

    async def feed(self, message: RouterFeedRequest) -> AsyncIterator[RouterFeedEvent]:
        task = asyncio.current_task()
        assert task is not None
        self._feeds.add(task)
        log.info("a gateway follows the router feed (%d now)", len(self._feeds))
        try:
            async with contextlib.aclosing(route_events(self.plane)) as events:
                async for event in events:
                    yield event
        except asyncio.CancelledError:
            if not self._closing:
                raise
            raise GRPCError(Status.UNAVAILABLE, self._closing) from None
        finally:
            self._feeds.discard(task)
            log.info("a gateway stopped following the router feed")

    async def report(self, message: RouterReport) -> RouterReportAck:
        """Keep a separate gateway's figures for ``GetRouterStats``; answer its part of every
        limited tenant key's fleet-wide budget."""
        try:
            self.reports.take(message)
        except ReportRefused as exc:
            raise GRPCError(exc.status, exc.why) from exc
        take_usage(self.plane.usage, message.gateway_id, message.started_at_unix_ms, message.usage)
        interval_s = (message.interval_ms or 10_000) / 1000
        keys = self.plane.tenant_keys.keys
        allowances = self.split.take(message.gateway_id, message.windows, interval_s, keys)
        return RouterReportAck(at_unix_ms=int(time.time() * 1000), allowances=allowances)

    async def tenants_in_server(
        self, gateway: Callable[[], Gateway | None], interval_s: float = SPLIT_INTERVAL_S
    ) -> None:
        """Every ``interval_s`` until cancelled: the in-server gateway's part of the tenant
        keys' budgets and its usage, as a separate gateway's report would give them, and
        every ``usage.FLUSH_S`` the pending usage into the store (llmgw.server.wire.usage)."""
        started_at_ms = int(time.time() * 1000)
        flushed = time.monotonic()
        try:
            while True:
                served = gateway()
                if served is not None:
                    keys = self.plane.tenant_keys.keys
                    windows = served.tenants.windows()
                    parts = self.split.take(IN_SERVER_GATEWAY, windows, interval_s, keys)
                    served.tenants.apply_allowances(parts)
                    usage = served.tenants.meter.usage()
                    take_usage(self.plane.usage, IN_SERVER_GATEWAY, started_at_ms, usage)
                if time.monotonic() - flushed >= FLUSH_S:
                    flushed = time.monotonic()
                    await flush(self.plane)
                await asyncio.sleep(interval_s)
        finally:
            await asyncio.shield(flush(self.plane))  # the term ends: what is counted is kept

    def shutdown(self) -> None:
        """End every feed with UNAVAILABLE, so gateways know at once (and keep routing
        with what they have) instead of waiting for the connection to drop."""
        self._closing = "the control server is shutting down"
        for task in list(self._feeds):
            task.cancel()


RESUBSCRIBE_S = 1.0
"""How long the in-server gateway's feed waits before subscribing again after a failure."""


async def feed_table(
    plane: ControlPlane, table: RoutingTable, index: KvIndex | None = None
) -> None:
    """Keep ``table`` (and ``index``: each replica's KV blocks) in step with the plane, in
    process (the in-server gateway), until cancelled. A failure (our bug) is logged and the
    feed starts again from a snapshot: the gateway never silently stops following."""
    while True:
        try:
            async with contextlib.aclosing(route_events(plane)) as events:
                async for event in events:
                    apply_feed_event(table, event, index)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the in-server gateway's feed failed; subscribing again")
        await asyncio.sleep(RESUBSCRIBE_S)


@dataclass(frozen=True, slots=True)
class ServedGateway:
    """The in-server gateway and the address it listens on."""

    gateway: Gateway
    host: str
    port: int


@contextlib.asynccontextmanager
async def serve_gateway(plane: ControlPlane, config: GatewayConfig) -> AsyncIterator[ServedGateway]:
    """The OpenAI gateway on ``config``'s address, routing to the plane's replicas; its
    table holds every target before the first request is accepted."""
    snapshot = RouterSnapshot(targets=list(route_targets(plane).values()))
    table = RoutingTable(targets_from_snapshot(snapshot))
    table.set_scalable(scalable_models(plane))
    gateway = Gateway(table, config)
    # the tenants' keys too, before the first request: a table with targets and no keys
    # yet would let a request in without one
    apply_feed_event(table, RouterFeedEvent(tenant_keys=tenant_keys(plane)))
    feed = asyncio.create_task(feed_table(plane, table, gateway.kv_index), name="gateway-feed")
    try:
        host, port = await gateway.start()
        yield ServedGateway(gateway, host, port)
    finally:
        feed.cancel()
        await asyncio.gather(feed, return_exceptions=True)
        await gateway.stop()


__all__ = [
    "KV_KEYS_PER_TURN",
    "RESUBSCRIBE_S",
    "RouterService",
    "ServedGateway",
    "feed_table",
    "route_events",
    "route_target",
    "route_targets",
    "scalable_models",
    "serve_gateway",
    "tenant_keys",
]
