"""``llmgw demo``: its flags and their checks; the demo itself (``llmgw.cli.demo``) is
imported when the command runs, so that every other command starts without it."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmgw.cli.errors import CliError
from llmgw.cli.flags import engine_ports_flag

__all__ = ["MAX_LOAD_S", "register"]

MAX_LOAD_S = 600.0
"""The longest simulated model load ``llmgw demo --model-load-seconds`` takes."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``demo`` and its flags."""
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
        "--model-load-seconds",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long each simulated engine loads its model before its port opens, so "
        "that every start (a scale-out's too) is a cold start that long (default: 3)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the demo's database and agent state here (default: a temp dir)",
    )
    _add_db_flag(p)
    p.add_argument(
        "--engine-ports",
        default=None,
        metavar="LO-HI",
        help="the engines' ports (default: 20000-29999 when its bottom is free, "
        "else a free window of 200 ports)",
    )
    p.set_defaults(command=_run)


def _add_db_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--db",
        default=None,
        metavar="URL",
        help="keep the server's state in this PostgreSQL database, "
        "postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE (default: an SQLite file in the "
        "state dir)",
    )


def _run(args: argparse.Namespace) -> int:
    from llmgw.cli.demo import DEFAULT_LOAD_S, DemoOptions, run_demo

    if args.rate <= 0:
        raise CliError(f"--rate must be positive, got {args.rate:g}")
    ports = engine_ports_flag(args.engine_ports)
    load_s = DEFAULT_LOAD_S if args.model_load_seconds is None else args.model_load_seconds
    if not 0 <= load_s <= MAX_LOAD_S:  # NaN too
        raise CliError(f"--model-load-seconds must be 0 to {MAX_LOAD_S:g}, got {load_s:g}")
    options = DemoOptions(
        args.headless, args.duration, args.state_dir, args.rate, ports, load_s, _db(args.db)
    )
    return run_demo(options)


def _db(text: str | None) -> str | None:
    """``--db``: a PostgreSQL URL, checked (the server child is given it as it is)."""
    if text is None:
        return None
    from llmgw.server.errors import ConfigError
    from llmgw.server.state.storebackend import PostgresUrl, parse_db

    try:
        target = parse_db(text)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    if not isinstance(target, PostgresUrl):
        raise CliError(f"--db {text!r}: the demo takes a postgresql:// URL (its file is its own)")
    return target.url
