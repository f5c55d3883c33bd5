"""``llmgw gateway``: the OpenAI gateway as its own process, following a control server.

It serves what the in-server gateway serves (``llmgw.gateway.app``) and learns
the replicas from the control server's router feed (``llmgw.gateway.feed``), so
gateways scale out beside one control server; ``llmgw.gateway.standalone`` runs it, this
module reads and checks the flags. While the control server is away it keeps
routing with the last replicas it knew and reconnects by itself. SIGINT and SIGTERM stop
it: the listener closes, requests in flight are cancelled, the feed's channel is closed.
With ``--token-file`` the feed presents a gateway-role token; with ``--ca-file`` the feed
runs over TLS, verifying the control server's certificate; with ``--tls-cert`` and
``--tls-key`` the OpenAI port serves TLS. The event loop is uvloop's.

Every ``--report-interval`` seconds it reports its routing figures to the control server
(``RouterService.Report``, ``llmgw.gateway.reporter``) under ``--gateway-id`` (default:
this host's name and the port it serves on) plus a random suffix per process start, so the
console's router figures count every gateway; a failed report never disturbs routing.

This module imports only the standard library at import time; the gateway is imported when
the command runs.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmgw.addresses import AddressError, parse_host_port
from llmgw.cli.apikeys import (
    add_explain_key_file_flag,
    add_key_file_flag,
    explain_keys,
    gateway_api_keys,
)
from llmgw.cli.browsers import add_browser_flags, browser_access
from llmgw.cli.errors import CliError
from llmgw.cli.flags import (
    GATEWAY_POLICIES,
    add_hold_flags,
    add_tokenize_timeout_flag,
    hold_config,
    read_token_file,
    tokenize_timeout,
)
from llmgw.cli.httplimits import add_http_limit_flags, http_limits
from llmgw.cli.tls import add_ca_flag, add_listen_flags, connect_context, listen_files

if TYPE_CHECKING:
    import ssl

    from llmgw.gateway.app import GatewayConfig

DEFAULT_SERVER = "127.0.0.1:50051"
DEFAULT_LISTEN = "127.0.0.1:8000"
DEFAULT_REPORT_INTERVAL_S = 2.0  # llmgw.gateway.reporter.DEFAULT_INTERVAL_S
MAX_REPORT_INTERVAL_S = 300.0  # llmgw.gateway.reporter.MAX_INTERVAL_S
MAX_GATEWAY_ID = 200


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``gateway`` and its flags."""
    p = sub.add_parser(
        "gateway",
        help="run an OpenAI-compatible gateway that follows a control server",
        description="Serve /v1/models, /v1/completions and /v1/chat/completions (and "
        "/metrics, /healthz), routing each request by its model to the READY replicas "
        "that the control server's router feed names. While the control server is away "
        "it keeps routing with the replicas it last knew and reconnects by itself. It "
        "reports its routing figures to the control server (GetRouterStats, the console's "
        "router view) every --report-interval, with what the autoscaler reads per model. "
        "A request for an autoscaled model (mode act) with no READY replica is held until "
        "one is (--hold-queue, --hold-timeout). SIGINT or SIGTERM stops it.",
    )
    p.add_argument(
        "--server",
        default=DEFAULT_SERVER,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the control server's native gRPC address, or a comma list of every server "
        "sharing one database: the gateway follows a follower's redirect to the leader when "
        f"that address is in the list, else tries the next one (default: {DEFAULT_SERVER})",
    )
    p.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"the address to serve the OpenAI API on (default: {DEFAULT_LISTEN})",
    )
    p.add_argument(
        "--policy",
        default="prefix",
        metavar="NAME",
        help=f"routing policy: {GATEWAY_POLICIES} (default: prefix)",
    )
    add_tokenize_timeout_flag(p, "--tokenize-timeout")
    add_hold_flags(p, "")
    p.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="a gateway-role token to present to the control server (router feed, reports)",
    )
    add_ca_flag(p, "the control server's router feed")
    add_listen_flags(p, "the OpenAI port")
    add_browser_flags(p, "the OpenAI port")
    p.add_argument(
        "--debug-kv-index",
        action="store_true",
        help="serve GET /debug/kv_index: every replica's indexed KV block keys, for tests "
        "and bench/chaos.py; unauthenticated, never on a reachable address",
    )
    add_key_file_flag(p, "--api-key-file")
    add_explain_key_file_flag(p, "--explain-key-file")
    add_http_limit_flags(p, "the OpenAI port")
    _add_report_flags(p)
    p.set_defaults(command=run_gateway_command)


def _add_report_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gateway-id",
        default=None,
        metavar="NAME",
        help="the name this gateway reports its routing figures under (a random suffix is "
        "added per process start; default: this host's name and the port it serves on)",
    )
    p.add_argument(
        "--report-interval",
        type=float,
        default=DEFAULT_REPORT_INTERVAL_S,
        metavar="SECONDS",
        help="report routing figures to the control server this often, for its "
        "GetRouterStats and the console; 0 turns reporting off "
        f"(default: {DEFAULT_REPORT_INTERVAL_S:g})",
    )


def _report_flags(args: argparse.Namespace) -> tuple[str | None, float]:
    """``--gateway-id`` and ``--report-interval``, checked."""
    name, interval = args.gateway_id, args.report_interval
    if name is not None and (not name or len(name) > MAX_GATEWAY_ID or not name.isprintable()):
        raise CliError(f"--gateway-id must be 1 to {MAX_GATEWAY_ID} printable characters")
    if not 0 <= interval <= MAX_REPORT_INTERVAL_S or (0 < interval < 0.1):
        raise CliError(
            f"--report-interval {interval:g} is not 0 (off) or 0.1 to {MAX_REPORT_INTERVAL_S:g}"
        )
    return name, interval


def host_port(text: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT``; a malformed value (a URL too) names the flag."""
    if "://" in text:
        bare = text.split("://", 1)[1].split("/", 1)[0]
        raise CliError(f"{flag} {text!r} is a URL; it takes HOST:PORT: try {flag} {bare}")
    try:
        return parse_host_port(text, port_zero=True)
    except AddressError as exc:
        raise CliError(
            f"{flag} {text!r} is not HOST:PORT (for example 127.0.0.1:8000): {exc}"
        ) from None


def server_list(text: str) -> list[tuple[str, int]]:
    """``--server HOST:PORT[,HOST:PORT...]`` in order, a repeated address kept once; a
    malformed or empty entry names itself."""
    servers: list[tuple[str, int]] = []
    for entry in text.split(","):
        if not entry.strip():
            raise CliError(f"--server {text!r} has an empty entry (HOST:PORT,HOST:PORT)")
        server = host_port(entry.strip(), "--server")
        if server[1] == 0:
            raise CliError(f"--server {entry.strip()!r}: port 0 is not a server's port")
        if server not in servers:
            servers.append(server)
    return servers


def run_gateway_command(args: argparse.Namespace) -> int:
    from llmgw.gateway.app import GatewayConfig
    from llmgw.gateway.routing.policy import POLICIES
    from llmgw.tls import ALPN_GRPC

    servers = server_list(args.server)
    host, port = host_port(args.listen, "--listen")
    if args.policy not in POLICIES:
        raise CliError(f"--policy {args.policy!r} is not one of {', '.join(POLICIES)}")
    gateway_id, report_interval_s = _report_flags(args)
    config = GatewayConfig(
        host=host,
        port=port,
        policy=args.policy,
        api_keys=gateway_api_keys(args.api_key_file, "--api-key-file"),
        explain_keys=explain_keys(args.explain_key_file, "--explain-key-file"),
        debug_kv_index=args.debug_kv_index,
        tls=_listen_context(args),
        tokenize_timeout_s=tokenize_timeout(args.tokenize_timeout, "--tokenize-timeout"),
        browsers=browser_access(args),
        limits=http_limits(args),
        hold=hold_config(args.hold_queue, args.hold_timeout, ""),
    )
    feed_tls = connect_context(args.ca_file, ALPN_GRPC)
    token = None
    if args.token_file is not None:
        token = read_token_file(args.token_file, "--token-file")
    report = _Reporting(gateway_id, report_interval_s)
    try:
        _run_on_uvloop(servers, config, token, feed_tls, report)
    except OSError as exc:
        raise CliError(f"cannot serve: {exc}") from exc
    return 0


def _listen_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    from llmgw.tls import ALPN_HTTP1, TlsFileError, server_context

    files = listen_files(args)
    try:
        return None if files is None else server_context(files, ALPN_HTTP1)
    except TlsFileError as exc:
        raise CliError(str(exc)) from exc


def _run_on_uvloop(
    servers: list[tuple[str, int]],
    config: GatewayConfig,
    token: str | None,
    feed_tls: ssl.SSLContext | None,
    report: _Reporting,
) -> None:
    import uvloop

    from llmgw.fdlimit import within_fd_limits
    from llmgw.gateway.standalone import run_gateway

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        main = run_gateway(
            servers,
            config,
            token=token,
            feed_tls=feed_tls,
            gateway_id=report.gateway_id,
            report_interval_s=report.interval_s,
        )
        runner.run(within_fd_limits(main))


@dataclass(frozen=True, slots=True)
class _Reporting:
    gateway_id: str | None  # --gateway-id; None: HOST:PORT
    interval_s: float  # 0: off
