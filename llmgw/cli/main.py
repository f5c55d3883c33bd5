"""The ``llmgw`` command line: parse flags, run one subcommand, exit with its status.

Each command module registers its subcommands (``register(sub)``: the parser, and the
function that runs it as ``command``); this module holds the list of them, the logging
setup, and the one place a ``CliError`` is caught. Errors a user can fix (a malformed flag,
a server that does not answer) print one line on stderr and exit non-zero; they never show
a traceback.

The package's docstring (``llmgw.cli``) says what may import what.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from llmgw import __version__
from llmgw.cli import (
    actions,
    agent,
    console,
    db,
    demo_command,
    desired,
    gateway,
    get,
    history,
    logs,
    server,
    simengine,
    tenantkeys,
    token,
    usage,
)
from llmgw.cli.errors import CliError
from llmgw.cli.rpc import use_client_flags

__all__ = ["COMMANDS", "LOGGER_FLOORS", "build_parser", "main"]

Command = Callable[[argparse.Namespace], int]
COMMANDS: tuple[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None], ...] = (
    server.register,  # server
    agent.register,  # agent
    get.register,  # get, cordon, uncordon
    actions.register,  # start, drain, reprofile, drain-node
    logs.register,  # logs
    desired.register,  # apply, delete, events
    history.register,  # describe, scale, rollout
    demo_command.register,  # demo
    simengine.register,  # sim-engine
    gateway.register,  # gateway
    console.register,  # console
    token.register,  # token create|list|revoke
    tenantkeys.register,  # key create|list|revoke
    usage.register,  # usage (what tenants used)
    db.register,  # db migrate
)
"""Each command module's ``register``, in the order ``llmgw --help`` lists the commands."""

LOGGER_FLOORS: dict[str, int] = {
    # At DEBUG these log what passes through them: aiosqlite every statement with its
    # parameters (replica rows with their API keys, profiles with their env values), hpack
    # and h2 every header they code (``authorization`` too), grpclib and asyncio the
    # messages and callbacks they handle. They stay at INFO (or WARNING) whatever
    # --log-level says, so a debug log holds no secret.
    "aiosqlite": logging.INFO,
    "asyncpg": logging.INFO,  # the same rule for the PostgreSQL driver (--db postgresql://)
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
        use_client_flags(args)
        return command(args)
    except KeyboardInterrupt:
        return 130
    except CliError as exc:
        print(f"llmgw: {exc}", file=sys.stderr)
        return exc.exit_code


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
    for register in COMMANDS:
        register(sub)
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for name, floor in LOGGER_FLOORS.items():
        logging.getLogger(name).setLevel(max(floor, logging.root.level))
