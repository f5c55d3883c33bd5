"""``llmgw server``: its flags; the server itself (``llmgw.cli.serve``) is imported when the
command runs, so that every other command starts without it."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmgw.cli.apikeys import add_explain_key_file_flag, add_key_file_flag
from llmgw.cli.browsers import add_browser_flags
from llmgw.cli.flags import GATEWAY_POLICIES, add_hold_flags, add_tokenize_timeout_flag
from llmgw.cli.httplimits import add_http_limit_flags
from llmgw.cli.tls import add_listen_flags

__all__ = ["register"]

PORTS = "the gRPC-web and gateway ports"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``server`` and its flags."""
    p = sub.add_parser(
        "server",
        help="run the control server",
        description="Run the control server: native gRPC for agents and "
        "operators, gRPC-web, /healthz and /metrics for the console, browsers and "
        "Prometheus, and the OpenAI-compatible gateway (`llmgw gateway` runs more of "
        "them beside it).",
    )
    _add_listen_flags(p)
    _add_gateway_flags(p)
    _add_state_flags(p)
    _add_fleet_flags(p)
    _add_autoscale_flags(p)
    _add_leader_flags(p)
    _add_grpc_limits(p)
    add_listen_flags(p, "the gRPC, gRPC-web and gateway ports")
    add_browser_flags(p, PORTS)
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="listen beyond loopback even while no token exists (anyone who reaches a port "
        "may then act); without it such a server refuses to start until `llmgw token "
        "create --role admin` has made a token",
    )
    p.set_defaults(command=_run)


def _run(args: argparse.Namespace) -> int:
    from llmgw.cli.serve import run_server_command

    return run_server_command(args)


def _add_listen_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--grpc-listen",
        default="127.0.0.1:50051",
        metavar="HOST:PORT",
        help="native gRPC (HTTP/2) address (default: 127.0.0.1:50051)",
    )
    p.add_argument(
        "--http-listen",
        default="127.0.0.1:8080",
        metavar="HOST:PORT",
        help="gRPC-web, /healthz and /metrics (HTTP/1.1) address (default: 127.0.0.1:8080)",
    )
    p.add_argument(
        "--gateway-listen",
        default="127.0.0.1:8000",
        metavar="HOST:PORT|off",
        help="the OpenAI-compatible gateway's address, or off (default: 127.0.0.1:8000)",
    )


def _add_gateway_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gateway-policy",
        default="prefix",
        metavar="NAME",
        help=f"the gateway's routing policy: {GATEWAY_POLICIES} (default: prefix)",
    )
    add_tokenize_timeout_flag(p, "--gateway-tokenize-timeout")
    add_hold_flags(p, "gateway-")
    add_key_file_flag(p, "--gateway-api-key-file")
    add_explain_key_file_flag(p, "--gateway-explain-key-file")
    add_http_limit_flags(p, PORTS)


def _add_state_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--db",
        default=None,
        metavar="FILE|URL",
        help="SQLite state file (default: $XDG_STATE_HOME/llmgw/server.db), created on "
        "the first start; a file that is not an llmgw state database is refused untouched. "
        "The server holds FILE.lock while it runs: a second server on FILE refuses. Or a "
        "PostgreSQL database, postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE (empty or "
        "llmgw's; the password is never logged)",
    )
    p.add_argument(
        "--node-grace",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="a node with no heartbeat for this long is NOT_READY (default: 5)",
    )
    p.add_argument(
        "--prune-never-ready",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="forget a node that registered but never sent a heartbeat, has no shards and "
        "is gone, this long after it was first seen (default: 300)",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how often agents are asked to heartbeat (default: 1)",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=4 << 20,
        metavar="N",
        help="largest message accepted on either port (default: 4 MiB)",
    )


def _add_fleet_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--test-hooks",
        action="store_true",
        help="serve POST /debug/agents/NODE/command on the gRPC-web port, sending a "
        "ControlMessage (proto3 JSON) to that agent, and turn the reconciler off; for "
        "tests that drive agents by hand; unauthenticated, never on a reachable address",
    )
    p.add_argument(
        "--join-token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="agents must present the token in FILE to join (turns authentication on)",
    )
    p.add_argument(
        "--engine-ports",
        default="20000-29999",
        metavar="LO-HI",
        help="the ports new engines are given, the lowest free first (default: "
        "20000-29999); running replicas keep theirs when it changes",
    )
    p.add_argument(
        "--gpu-budget",
        action="append",
        default=[],
        metavar="POOL=N",
        help="the most GPUs the autoscaler may give the deployments of pool POOL together "
        "(repeat for each pool); a higher [deployments.NAME] priority gets them first and "
        "may take them from a lower one. Default: no budget",
    )


def _add_leader_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--server-id",
        default=None,
        metavar="ID",
        help="this server's name among the servers of one PostgreSQL database (default: "
        "its --advertise address)",
    )
    p.add_argument(
        "--advertise",
        default=None,
        metavar="HOST:PORT",
        help="where agents and gateways reach this server's native gRPC port, told to them "
        "by the other servers while this one leads (default: --grpc-listen)",
    )
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=1.5,
        metavar="SECONDS",
        help="the leader lease's time to live with --db postgresql://… (default 1.5): "
        "several servers may share one database, exactly one leads (runs the reconciler "
        "and the autoscaler, serves agents and gateways); the others relay operators' "
        "calls to it, feed their gateway from it and tell agents where it is; a leader gone "
        "is replaced within about this long",
    )
    p.add_argument(
        "--ca-file",
        dest="peer_ca_file",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --tls-cert: trust the CA certificates (PEM) in FILE in the leader's "
        "certificate when this server follows (it relays calls and feeds its gateway over "
        "TLS; default: --tls-cert's own file, so servers sharing one certificate or CA chain "
        "trust each other)",
    )


def _add_autoscale_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--autoscale-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how often the autoscaler decides the count of each deployment with an "
        "[autoscale] policy (default: 5; at most 600)",
    )
    p.add_argument(
        "--autoscale-window",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="the window of the gateways' figures it decides on: p90 TTFT and ITL, "
        "arrival rate (default: 30; at most 3600)",
    )


def _add_grpc_limits(p: argparse.ArgumentParser) -> None:
    """The native port's connection limits (``llmgw.server.wire.grpcport.ConnectionLimits``)."""
    p.add_argument(
        "--grpc-handshake-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a native gRPC connection that has not finished its TLS handshake and sent "
        "the HTTP/2 preface this long after it was accepted is dropped (default: 10)",
    )
    p.add_argument(
        "--grpc-idle-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a native gRPC connection with no open call this long is closed (GOAWAY); an "
        "agent's or gateway's stream keeps its connection (default: 300)",
    )
    p.add_argument(
        "--grpc-max-connections",
        type=int,
        default=16384,
        metavar="N",
        help="native gRPC connections open at once; more are closed at once (default: 16384)",
    )
    p.add_argument(
        "--grpc-max-connections-per-peer",
        type=int,
        default=1024,
        metavar="N",
        help="native gRPC connections open at once from one IP address; agents behind one "
        "NAT address count together (default: 1024)",
    )
