"""The ``llmgw`` command line: parse flags, run one subcommand, exit with its status.

Errors a user can fix (a malformed flag, a server that does not answer) print one line on
stderr and exit non-zero; they never show a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from llmgw import __version__

DEFAULT_WEB_URL = "http://127.0.0.1:8080"
GATEWAY_POLICIES = "prefix, round_robin, least_load or session"
"""The gateway's policies in words (llmgw.gateway.routing.policy.POLICIES, tested to agree)."""

Command = Callable[[argparse.Namespace], int]

LOGGER_FLOORS: dict[str, int] = {
    # At DEBUG these log what passes through them: aiosqlite every statement with its
    # parameters (replica rows with their API keys, profiles with their env values), hpack
    # and h2 every header they code (``authorization`` too), grpclib and asyncio the
    # messages and callbacks they handle. They stay at INFO (or WARNING) whatever
    # --log-level says, so a debug log holds no secret.
    "aiosqlite": logging.INFO,
    "asyncio": logging.INFO,
    "grpclib": logging.INFO,
    "h2": logging.INFO,
    "hpack": logging.WARNING,
    "httptools": logging.INFO,
    "uvicorn": logging.INFO,
    "websockets": logging.INFO,
    "zmq": logging.INFO,
    # httpx logs every request at INFO: the CLI's own output is the answer, not its requests.
    "httpx": logging.WARNING,
    "httpcore": logging.WARNING,
}
"""The lowest level of each third-party logger (and its children), whatever --log-level."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``llmgw`` with ``argv`` (default: the process's arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
    command: Command = args.command
    try:
        _use_client_token(args)
        _use_client_tls(args)
        return command(args)
    except KeyboardInterrupt:
        return 130
    except CliError as exc:
        print(f"llmgw: {exc}", file=sys.stderr)
        return exc.exit_code


class CliError(Exception):
    """An error to print as one line, with the exit code to leave with."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgw", description="Run a fleet of GPU nodes as one LLM service."
    )
    parser.add_argument("--version", action="version", version=f"llmgw {__version__}")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity on stderr (default: info)",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_server(sub)
    _add_agent(sub)
    _add_get(sub)
    _add_node_actions(sub)
    _add_operator_actions(sub)
    _add_desired(sub)
    _add_demo(sub)
    _add_sim_engine(sub)
    _add_gateway(sub)
    _add_console(sub)
    _add_token(sub)
    return parser


def _add_server(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "server",
        help="run the control server",
        description="Run the control server: native gRPC for agents and "
        "operators, gRPC-web, /healthz and /metrics for the console, browsers and "
        "Prometheus, and the OpenAI-compatible gateway (`llmgw gateway` runs more of "
        "them beside it).",
    )
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
    p.add_argument(
        "--gateway-policy",
        default="prefix",
        metavar="NAME",
        help=f"the gateway's routing policy: {GATEWAY_POLICIES} (default: prefix)",
    )
    add_tokenize_timeout_flag(p, "--gateway-tokenize-timeout")
    _add_gateway_keys(p)
    _add_http_limits(p, "the gRPC-web and gateway ports")
    p.add_argument(
        "--db",
        type=Path,
        default=None,
        metavar="FILE",
        help="SQLite state file (default: $XDG_STATE_HOME/llmgw/server.db), created on "
        "the first start; a file that is not an llmgw state database is refused untouched. "
        "The server holds FILE.lock while it runs: a second server on FILE refuses",
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
    _add_grpc_limits(p)
    _add_listen_tls(p, "the gRPC, gRPC-web and gateway ports")
    _add_browser_flags(p, "the gRPC-web and gateway ports")
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="listen beyond loopback even while no token exists (anyone who reaches a port "
        "may then act); without it such a server refuses to start until `llmgw token "
        "create --role admin` has made a token",
    )
    p.set_defaults(command=_run_server)


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


def _add_agent(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "agent",
        help="run a node agent",
        description="Run the node agent: discover this node's GPUs and keep "
        "one stream to the control server, reconnecting by itself.",
    )
    p.add_argument(
        "--server",
        default="127.0.0.1:50051",
        metavar="HOST:PORT",
        help="the control server's gRPC address (default: 127.0.0.1:50051)",
    )
    p.add_argument(
        "--node-id",
        default=None,
        help="this node's id (default: kept in the state directory, else "
        "HOSTNAME-RANDOM chosen once)",
    )
    p.add_argument("--labels", default="", metavar="K=V,...", help="labels for placement")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the agent keeps its node id, cluster id and engine records "
        "(default: $XDG_STATE_HOME/llmgw/agent)",
    )
    p.add_argument(
        "--join-cluster",
        default=None,
        metavar="ID",
        help="hand this node's engines to the cluster ID (the server's cluster id, as "
        "`llmgw get nodes` shows it): needed when the engines belong to another cluster "
        "(the server was started on another --db); that server then adopts the engines it "
        "knows and stops the others. Without it such engines keep running, unadopted",
    )
    p.add_argument(
        "--simulate",
        default=None,
        metavar="NAME|FILE.json",
        help="simulated GPUs from a shipped fixture (dgx-h100, a100-mig, "
        "gb200-nvl4, l4-pcie, cpu-only) or a fixture file",
    )
    p.add_argument("--hostname", default=None, help="hostname to report (default: this host's)")
    p.add_argument(
        "--model-dir",
        action="append",
        type=Path,
        default=[],
        metavar="DIR",
        help="a directory whose subdirectories hold model weights to report; repeatable",
    )
    p.add_argument(
        "--storage-path",
        action="append",
        type=Path,
        default=[],
        metavar="PATH",
        help="a path whose filesystem size and free space to report; repeatable "
        "(the model directories are reported too; with neither, the state directory)",
    )
    p.add_argument(
        "--engine-bin",
        action="append",
        default=[],
        metavar="ENGINE=CMD",
        help="the command that runs ENGINE (vllm, sglang, llamacpp, sim), split as a shell "
        'would; repeatable (e.g. vllm="python -m vllm.entrypoints.openai.api_server")',
    )
    p.add_argument(
        "--restart-backoff",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="wait before restarting a failed engine, doubling per failure in a row (default: 10)",
    )
    p.add_argument(
        "--restart-backoff-max",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="the longest wait before restarting a failed engine (default: 300)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        metavar="SECONDS",
        help="an engine not ready this long after it started is FAILED (default: 900)",
    )
    p.add_argument(
        "--drain-settle",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="a draining engine keeps serving at least this long, so routers that still "
        "send to it stop first (default: 2)",
    )
    p.add_argument(
        "--discover", action="store_true", help="print what the agent would register and exit"
    )
    p.add_argument(
        "-o",
        "--output",
        choices=["json"],
        default="json",
        help="format for --discover: the proto3 JSON of NodeInfo",
    )
    p.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="the join token (or an agent token) to present to the control server",
    )
    _add_ca(p, "the control server")
    p.set_defaults(command=_run_agent)


def _add_get(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "get",
        help="list nodes, GPUs, replicas, shards, deployments or profiles",
        description="List what the control server knows, over gRPC-web.",
    )
    p.add_argument(
        "kind", choices=["nodes", "gpus", "replicas", "shards", "deployments", "profiles"]
    )
    p.add_argument(
        "-o",
        "--output",
        choices=["table", "json"],
        default="table",
        help="table (default) or the proto3 JSON of the messages",
    )
    _add_server_url(p)
    p.set_defaults(command=_run_get)


def _add_node_actions(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for verb, text in (
        ("cordon", "place nothing new on a node"),
        ("uncordon", "let placement use a node again"),
    ):
        p = sub.add_parser(verb, help=text, description=f"{text[0].upper()}{text[1:]}.")
        p.add_argument("node_id", metavar="NODE")
        _add_server_url(p)
        p.set_defaults(command=_run_node_action, verb=verb)


def _add_operator_actions(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from llmgw.cli.actions import add_parsers

    add_parsers(sub, _add_server_url)


def _add_desired(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "apply",
        help="apply profiles and deployments from a TOML file",
        description="Check a profiles/deployments TOML file and apply it; a bad file is "
        "refused whole, naming every problem by its key path.",
    )
    p.add_argument("-f", "--file", type=Path, required=True, metavar="FILE")
    p.add_argument(
        "--dry-run", action="store_true", help="print the placement plan; change nothing"
    )
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    _add_server_url(p)
    p.set_defaults(command=_run_apply)
    p = sub.add_parser(
        "delete",
        help="delete a deployment, or a node that is gone",
        description="Delete a deployment, or forget a node that is gone. A node is refused "
        "while its agent is connected, and while the server thinks replicas run on it "
        "unless --force (they are then placed elsewhere).",
    )
    p.add_argument("kind", choices=["deployment", "node"])
    p.add_argument("name", metavar="NAME")
    p.add_argument(
        "--force",
        action="store_true",
        help="(node) forget it even with replicas the server thinks run there; they are "
        "placed elsewhere",
    )
    _add_server_url(p)
    p.set_defaults(command=_run_delete)
    p = sub.add_parser(
        "events",
        help="show the audit log of operator actions",
        description="Show who did what to which target, when, and how it ended.",
    )
    p.add_argument("--follow", action="store_true", help="keep printing new ones until Ctrl-C")
    _add_server_url(p)
    p.set_defaults(command=_run_events)


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run the whole system on loopback with simulated GPUs, and open the console",
        description="Start a control server with its gateway and three simulated GPU nodes "
        "on loopback, deploy simulated engines with KV events on, send a light workload "
        "through the gateway, and open the console on it; quitting the console stops "
        "everything and prints a summary. --headless runs the same without the console "
        "for --duration seconds (default 30).",
    )
    p.add_argument(
        "--headless",
        action="store_true",
        help="no console: run for --duration seconds, then print a summary",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --headless or without a terminal: stop after this long "
        "(default: 30 with --headless, else until Ctrl-C)",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=3.0,
        metavar="PER_SECOND",
        help="workload requests per second through the gateway (default: 3)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the demo's database and agent state here (default: a temp dir)",
    )
    p.add_argument(
        "--engine-ports",
        default=None,
        metavar="LO-HI",
        help="the engines' ports (default: 20000-29999 when its bottom is free, "
        "else a free window of 200 ports)",
    )
    p.set_defaults(command=_run_demo)


def _add_sim_engine(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from llmgw.cli.simengine import add_parser

    add_parser(sub)


def add_tokenize_timeout_flag(p: argparse.ArgumentParser, flag: str) -> None:
    """The precise tier's bound on a replica's ``/tokenize`` (None: ``GatewayConfig``'s)."""
    p.add_argument(
        flag,
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long the precise tier waits for a replica's /tokenize before the request "
        "is routed by the approximate prefix tree instead (default: 0.05); raise it for "
        "long chats or slow chat templates",
    )


def tokenize_timeout(value: float | None, flag: str) -> float:
    """The flag's value, checked; the gateway's default when it was not given."""
    from llmgw.gateway.app import TOKENIZE_TIMEOUT_S

    if value is None:
        return TOKENIZE_TIMEOUT_S
    if not 0 < value < float("inf"):  # NaN too
        raise CliError(f"{flag} must be a positive number of seconds, not {value}")
    return value


def _add_http_limits(p: argparse.ArgumentParser, ports: str) -> None:
    from llmgw.cli.httplimits import add_http_limit_flags

    add_http_limit_flags(p, ports)


def _add_gateway_keys(p: argparse.ArgumentParser) -> None:
    from llmgw.cli.apikeys import add_key_file_flag

    add_key_file_flag(p, "--gateway-api-key-file")


def _add_gateway(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from llmgw.cli.gateway import add_parser

    add_parser(sub)


def _add_console(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from llmgw.cli.console import add_parser

    add_parser(sub)


def _add_token(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from llmgw.cli.token import add_parser

    add_parser(sub)


def _add_server_url(p: argparse.ArgumentParser) -> None:
    from llmgw.cli.tls import add_client_ca_flag
    from llmgw.cli.token import add_client_flags

    p.add_argument(
        "--server",
        default=DEFAULT_WEB_URL,
        metavar="URL",
        help=f"the control server's gRPC-web URL (default: {DEFAULT_WEB_URL})",
    )
    add_client_flags(p)
    add_client_ca_flag(p)


def _add_listen_tls(p: argparse.ArgumentParser, ports: str) -> None:
    from llmgw.cli.tls import add_listen_flags

    add_listen_flags(p, ports)


def _add_browser_flags(p: argparse.ArgumentParser, ports: str) -> None:
    from llmgw.cli.browsers import add_browser_flags

    add_browser_flags(p, ports)


def _add_ca(p: argparse.ArgumentParser, what: str) -> None:
    from llmgw.cli.tls import add_ca_flag

    add_ca_flag(p, what)


def _use_client_token(args: argparse.Namespace) -> None:
    """Give every gRPC-web channel this command opens the token it was told (if any)."""
    if not hasattr(args, "token"):  # commands without --token do not call over gRPC-web
        return
    from llmgw.cli.token import client_token
    from llmgw.client.channel import bearer_token

    bearer_token.set(client_token(args))


def _use_client_tls(args: argparse.Namespace) -> None:
    """Give every gRPC-web channel this command opens the CA it was told (if any)."""
    if not hasattr(args, "client_ca_file"):  # only gRPC-web clients have it
        return
    from llmgw.cli.tls import client_ca
    from llmgw.client.channel import trusted_ca

    trusted_ca.set(client_ca(args))


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for name, floor in LOGGER_FLOORS.items():
        logging.getLogger(name).setLevel(max(floor, logging.root.level))


def _run_server(args: argparse.Namespace) -> int:
    from llmgw.cli.serve import run_server_command

    return run_server_command(args)


def _run_agent(args: argparse.Namespace) -> int:
    from llmgw.cli.serve import run_agent_command

    return run_agent_command(args)


def _run_get(args: argparse.Namespace) -> int:
    from llmgw.cli.get import run_get

    if args.kind in ("deployments", "profiles"):
        from llmgw.cli.apply import run_get_desired

        return asyncio.run(run_get_desired(args.server, args.kind, args.output))

    return asyncio.run(run_get(args.server, args.kind, args.output))


def _run_node_action(args: argparse.Namespace) -> int:
    from llmgw.cli.get import run_node_action

    return asyncio.run(run_node_action(args.server, args.verb, args.node_id))


def _run_apply(args: argparse.Namespace) -> int:
    from llmgw.cli.apply import run_apply

    return run_apply(args.server, args.file, dry_run=args.dry_run, output=args.output)


def _run_delete(args: argparse.Namespace) -> int:
    from llmgw.cli.apply import run_delete

    return asyncio.run(run_delete(args.server, args.kind, args.name, force=args.force))


def _run_events(args: argparse.Namespace) -> int:
    from llmgw.cli.apply import run_events

    return asyncio.run(run_events(args.server, follow=args.follow))


def _run_demo(args: argparse.Namespace) -> int:
    from llmgw.cli.demo import DemoOptions, run_demo

    if args.rate <= 0:
        raise CliError(f"--rate must be positive, got {args.rate:g}")
    ports = engine_ports_flag(args.engine_ports)
    options = DemoOptions(args.headless, args.duration, args.state_dir, args.rate, ports)
    return run_demo(options)


def engine_ports_flag(text: str | None) -> tuple[int, int] | None:
    """``--engine-ports LO-HI`` (``llmgw server``, ``llmgw demo``); None when not given."""
    from llmgw.engineports import PortRangeError, parse_port_range

    try:
        return None if text is None else parse_port_range(text)
    except PortRangeError as exc:
        raise CliError(f"--engine-ports {exc}") from exc
