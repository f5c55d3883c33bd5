"""``llmgw agent``: its flags; the agent itself (``llmgw.cli.serve``) is imported when the
command runs, so that every other command starts without it."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmgw.agent.logfiles import DEFAULT_MAX_BYTES, DEFAULT_RETENTION_S
from llmgw.cli.tls import add_ca_flag

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``agent`` and its flags."""
    p = sub.add_parser(
        "agent",
        help="run a node agent",
        description="Run the node agent: discover this node's GPUs and keep "
        "one stream to the control server, reconnecting by itself.",
    )
    _add_identity_flags(p)
    _add_inventory_flags(p)
    _add_engine_flags(p)
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
    add_ca_flag(p, "the control server")
    p.set_defaults(command=_run)


def _run(args: argparse.Namespace) -> int:
    from llmgw.cli.serve import run_agent_command

    return run_agent_command(args)


def _add_identity_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--server",
        default="127.0.0.1:50051",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the control server's gRPC address, or a comma list of every server sharing one "
        "database: the agent follows a follower's redirect to the leader when that address "
        "is in the list, else tries the next one (default: 127.0.0.1:50051)",
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
        help="where the agent keeps its node id, cluster id, leader epoch and engine records "
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


def _add_inventory_flags(p: argparse.ArgumentParser) -> None:
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


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
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
        "--log-max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        metavar="BYTES",
        help="an engine's log (STATE_DIR/logs/SHARD.log) past this size is moved to "
        "SHARD.log.1, one older file kept; the run before the last restart is kept as "
        f"SHARD.previous.log (default: {DEFAULT_MAX_BYTES}, 10 MiB)",
    )
    p.add_argument(
        "--log-retention",
        type=float,
        default=DEFAULT_RETENTION_S,
        metavar="SECONDS",
        help="the logs of a shard this agent no longer runs are removed this long after "
        f"their last write (default: {DEFAULT_RETENTION_S:g}, 24 h)",
    )
    p.add_argument(
        "--drain-settle",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="a draining engine keeps serving at least this long, so routers that still "
        "send to it stop first (default: 2)",
    )
