"""The gateway as a process of its own (``llmgw gateway``): a `Gateway` that learns its
replicas from a control server's router feed and reports its figures there.

`run_gateway` serves until SIGINT/SIGTERM (or a given event): it starts the `Gateway`
(``llmgw.gateway.app``), follows the feed (``llmgw.gateway.feed``; while the control server is
away it keeps routing with the last replicas it knew and reconnects by itself) and, every
``report_interval_s``, reports through ``RouterService.Report`` (``llmgw.gateway.reporter``).
The command line's flags and checks live in ``llmgw.cli.gateway``; the in-server gateway is
the same `Gateway`, fed by the server directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpclib.client
import grpclib.events

from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.feed import Address, ServerList, feed_channel, follow
from llmgw.gateway.reporter import DEFAULT_INTERVAL_S, ReportConfig, instance_id, report_forever
from llmgw.gateway.routing.table import RoutingTable
from llmgw.signals import stop_on_signals

__all__ = ["run_gateway", "with_bearer"]

log = logging.getLogger(__name__)


def with_bearer(channel: grpclib.client.Channel, token: str | None) -> grpclib.client.Channel:
    """``channel``, sending ``authorization: Bearer TOKEN`` on every call when given one."""
    if token:
        value = f"Bearer {token}"

        async def _authorize(event: grpclib.events.SendRequest) -> None:
            event.metadata["authorization"] = value

        grpclib.events.listen(channel, grpclib.events.SendRequest, _authorize)
    return channel


async def run_gateway(  # noqa: PLR0913 (each by keyword but the servers and the config)
    servers: Sequence[Address],
    config: GatewayConfig,
    stop: asyncio.Event | None = None,
    *,
    token: str | None = None,
    feed_tls: ssl.SSLContext | None = None,
    gateway_id: str | None = None,
    report_interval_s: float = DEFAULT_INTERVAL_S,
    embedded: bool = False,
) -> None:
    """Serve until SIGINT/SIGTERM (or ``stop`` is set), following the feed of the leader
    among ``servers`` (over TLS with ``feed_tls``, a client context) and reporting its
    figures to the server the feed follows every ``report_interval_s`` (0: never) as
    ``gateway_id`` (None: this host's name and port).

    ``embedded``: a follower control server's own gateway (``llmgw server``): the process's
    signals are the server's, not this gateway's, and it follows whichever leader its
    server names, in ``servers`` or not (``ServerList(follow_any_leader=True)``)."""
    stop = stop or asyncio.Event()
    started_ms = int(time.time() * 1000)
    table = RoutingTable()
    gateway = Gateway(table, config)
    host, port = await gateway.start()
    followed = ServerList(servers, follow_any_leader=embedded)

    def channel() -> grpclib.client.Channel:
        return with_bearer(feed_channel(*followed.current, ssl=feed_tls), token)

    try:
        log.info(
            "llmgw gateway: OpenAI API on %s://%s:%d (policy %s), following %s over %s",
            "http" if config.tls is None else "https",
            host,
            port,
            config.policy,
            ",".join(ServerList([server]).name() for server in followed.servers),
            "plaintext" if feed_tls is None else "TLS",
        )
        name = gateway_id or f"{socket.gethostname()}:{port}"
        reporting = _reporting(
            _FollowedChannel(followed, channel), gateway, name, started_ms, report_interval_s
        )
        async with reporting:
            with contextlib.nullcontext() if embedded else stop_on_signals(stop):
                await follow(channel, table, stop=stop, index=gateway.kv_index, servers=followed)
    finally:
        await gateway.stop()
    log.info("llmgw gateway stopped")


class _FollowedChannel:
    """The reporter's channel: to the server the feed follows now, replaced (the old one
    closed) when the feed moves to another."""

    def __init__(self, servers: ServerList, make: Callable[[], grpclib.client.Channel]) -> None:
        self._servers = servers
        self._make = make
        self._address: Address | None = None
        self._channel: grpclib.client.Channel | None = None

    def __call__(self) -> grpclib.client.Channel:
        if self._channel is None or self._address != self._servers.current:
            self.close()
            self._address = self._servers.current
            self._channel = self._make()
        return self._channel

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


@contextlib.asynccontextmanager
async def _reporting(
    channel: _FollowedChannel,
    gateway: Gateway,
    name: str,
    started_ms: int,
    interval_s: float,
) -> AsyncIterator[None]:
    """Report ``gateway``'s figures while the block runs (nothing with ``interval_s`` 0)."""
    if interval_s <= 0:
        log.info("llmgw gateway: reporting routing figures is off (--report-interval 0)")
        yield
        return
    report = ReportConfig(
        gateway_id=instance_id(name),
        started_at_unix_ms=started_ms,
        interval_s=interval_s,
        timeout_s=min(5.0, max(1.0, interval_s)),
    )
    task = asyncio.create_task(report_forever(channel, gateway, report), name="router-report")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        channel.close()
