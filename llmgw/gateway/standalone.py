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
from collections.abc import AsyncIterator, Callable

import grpclib.client
import grpclib.events

from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.feed import feed_channel, follow
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


async def run_gateway(
    server: tuple[str, int],
    config: GatewayConfig,
    stop: asyncio.Event | None = None,
    *,
    token: str | None = None,
    feed_tls: ssl.SSLContext | None = None,
    gateway_id: str | None = None,
    report_interval_s: float = DEFAULT_INTERVAL_S,
) -> None:
    """Serve until SIGINT/SIGTERM (or ``stop`` is set), following ``server``'s feed (over
    TLS with ``feed_tls``, a client context) and reporting its figures there every
    ``report_interval_s`` (0: never) as ``gateway_id`` (None: this host's name and port)."""
    stop = stop or asyncio.Event()
    started_ms = int(time.time() * 1000)
    table = RoutingTable()
    gateway = Gateway(table, config)
    host, port = await gateway.start()
    channel = lambda: with_bearer(feed_channel(*server, ssl=feed_tls), token)  # noqa: E731
    try:
        log.info(
            "llmgw gateway: OpenAI API on %s://%s:%d (policy %s), following %s:%d over %s",
            "http" if config.tls is None else "https",
            host,
            port,
            config.policy,
            *server,
            "plaintext" if feed_tls is None else "TLS",
        )
        name = gateway_id or f"{socket.gethostname()}:{port}"
        reporting = _reporting(channel, gateway, name, started_ms, report_interval_s)
        async with reporting:
            with stop_on_signals(stop):
                await follow(channel, table, stop=stop, index=gateway.kv_index)
    finally:
        await gateway.stop()
    log.info("llmgw gateway stopped")


@contextlib.asynccontextmanager
async def _reporting(
    channel_factory: Callable[[], grpclib.client.Channel],
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
    channel = channel_factory()
    task = asyncio.create_task(report_forever(channel, gateway, report), name="router-report")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        channel.close()
