"""A separate gateway's figures, sent to the control server every few seconds.

``llmgw gateway`` runs :func:`report_forever` beside the router feed: every
``interval_s`` it builds its ``RouterStats`` with the function the server uses for its own
gateway (``llmgw.gateway.stats.router_stats``) and sends them in a unary
``RouterService.Report`` under its ``gateway_id`` (see :func:`instance_id`), so
``GetRouterStats`` answers for every gateway of the fleet; with them go its signals per
model (``llmgw.gateway.modelsignals``), which the server's autoscaler reads, and its
metering per tenant key and model (``RouterReport.usage``, cumulative: tenantmeter.py) and
its use of each limited key's budget (``windows``); the answer sets its part of those
budgets (``RouterReportAck.allowances``: tenants.py).

Reporting never disturbs routing: a failed report is logged and the next interval sends
fresh figures (counters are cumulative, so nothing is lost by a missed report). A control
server that is away is said at DEBUG only (the router feed already says it at WARNING); a
refusal (a token without the gateway role, an older server without ``Report``, a report
refused as malformed or one gateway too many) is said at WARNING once per streak, then at
DEBUG.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpclib.client
from grpclib.const import Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from llmgw.api.llmgw.v1 import RouterReport, RouterServiceStub
from llmgw.gateway.app import Gateway
from llmgw.gateway.modelsignals import LATENCY_BOUNDS_MS
from llmgw.gateway.stats import model_signals, router_stats, tenant_usage

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 2.0
MAX_INTERVAL_S = 300.0
"""The longest interval a control server accepts (``ReportLimits.max_interval_ms``)."""

_AWAY = (StreamTerminatedError, ProtocolError, OSError, EOFError)
"""What a control server that is away or restarting looks like from here."""
_AWAY_STATUSES = frozenset({Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED, Status.CANCELLED})


@dataclass(frozen=True, slots=True)
class ReportConfig:
    """Who reports and how often; ``timeout_s`` bounds each call."""

    gateway_id: str
    started_at_unix_ms: int
    interval_s: float = DEFAULT_INTERVAL_S
    timeout_s: float = 5.0


def instance_id(name: str) -> str:
    """This gateway process's id: ``name`` (``--gateway-id``, or the host's name and the
    port it serves on) and a random suffix drawn per process start, so a restarted gateway
    is a new instance."""
    return f"{name}#{secrets.token_hex(4)}"


class _Streak:
    """Says a streak of failed reports once, and when it ends."""

    def __init__(self) -> None:
        self.failures = 0

    def failed(self, why: str, refused: bool) -> None:
        self.failures += 1
        if self.failures == 1 and refused:
            log.warning("router report refused (%s); reporting again every interval", why)
        else:
            log.debug("router report failed (%s; failure #%d)", why, self.failures)

    def sent(self) -> None:
        if self.failures:
            log.info("router reports go through again after %d failures", self.failures)
        self.failures = 0


async def report_once(stub: RouterServiceStub, gateway: Gateway, config: ReportConfig) -> None:
    """Send ``gateway``'s figures now; GRPCError or a connection error when it fails."""
    report = RouterReport(
        gateway_id=config.gateway_id,
        started_at_unix_ms=config.started_at_unix_ms,
        stats=router_stats(gateway, int(time.time() * 1000)),
        interval_ms=round(config.interval_s * 1000),
        models=model_signals(gateway),
        latency_bounds_ms=list(LATENCY_BOUNDS_MS),
        usage=tenant_usage(gateway),
        windows=gateway.tenants.windows(),
    )
    ack = await stub.report(report, timeout=config.timeout_s)
    gateway.tenants.apply_allowances(ack.allowances)  # its part of the fleet-wide limits


async def _attempt(
    stub: RouterServiceStub, gateway: Gateway, config: ReportConfig, streak: _Streak
) -> None:
    try:
        await report_once(stub, gateway, config)
    except asyncio.CancelledError:
        raise
    except GRPCError as exc:
        streak.failed(f"{exc.status.name}: {exc.message}", exc.status not in _AWAY_STATUSES)
    except _AWAY as exc:
        streak.failed(f"{type(exc).__name__}: {exc}", refused=False)
    except Exception as exc:  # our bug: say it, but never stop reporting or routing
        log.debug("router report: unexpected error", exc_info=True)
        streak.failed(f"unexpected {type(exc).__name__}: {exc}", refused=True)
    else:
        streak.sent()


async def report_forever(
    channel: grpclib.client.Channel | Callable[[], grpclib.client.Channel],
    gateway: Gateway,
    config: ReportConfig,
) -> None:
    """Report ``gateway``'s figures over ``channel`` at once, then every ``interval_s``,
    until cancelled. ``channel`` may be a callable asked before each report (the channel
    to the server the feed follows now, ``llmgw.gateway.standalone``). The caller owns (and
    closes) every channel."""
    streak = _Streak()
    log.info("reporting routing figures as %s every %.1f s", config.gateway_id, config.interval_s)
    while True:
        began = time.monotonic()
        current = channel if isinstance(channel, grpclib.client.Channel) else channel()
        await _attempt(RouterServiceStub(current), gateway, config, streak)
        await asyncio.sleep(max(0.0, config.interval_s - (time.monotonic() - began)))


__all__ = [
    "DEFAULT_INTERVAL_S",
    "MAX_INTERVAL_S",
    "ReportConfig",
    "instance_id",
    "report_forever",
    "report_once",
]
