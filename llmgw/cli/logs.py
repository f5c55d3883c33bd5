"""``llmgw logs REPLICA|SHARD [--follow] [--tail N] [--previous] [--all-shards]``: an
engine's output.

The server reads it from the node's agent (``ControlService.StreamLogs``, operator role): a
replica name means its rank-0 shard (with ``--all-shards`` every shard, each line prefixed
``[SHARD] `` as ``kubectl logs --all-containers --prefix`` does), a shard name that shard.
Each line is printed as the engine wrote it, its control characters but tabs escaped
(``llmgw.printable``: engine output may hold whatever a prompt held, and must not drive the
terminal). ``--follow`` prints what the engine writes until Ctrl-C (exit 130), the shard
stops, or the stream fails (its node disconnected: one line on stderr, exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from llmgw.cli.errors import CliError
from llmgw.cli.rpc import add_client_flags, call
from llmgw.client import ControlClient
from llmgw.printable import escape

__all__ = ["register", "run_logs"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``logs``."""
    p = sub.add_parser(
        "logs",
        help="print a replica's or a shard's engine output",
        description="Print the engine output of a replica (its rank-0 shard) or a shard, "
        "read from its node's agent through the server (operator role). Each agent keeps "
        "the current run (rotated past --log-max-bytes, one older file) and the run before "
        "the last restart.",
    )
    p.add_argument("name", metavar="REPLICA|SHARD")
    p.add_argument(
        "-f", "--follow", action="store_true", help="keep printing what the engine writes"
    )
    p.add_argument(
        "--tail",
        type=int,
        default=-1,
        metavar="N",
        help="only the last N lines (default: -1, every line the agent keeps)",
    )
    p.add_argument(
        "-p",
        "--previous",
        action="store_true",
        help="the run before the engine's last restart (after a crash, say)",
    )
    p.add_argument(
        "--all-shards",
        action="store_true",
        help="every shard of the replica (a multi-node one runs one per node), each line "
        "prefixed [SHARD]; without it a replica means its rank-0 shard",
    )
    add_client_flags(p)
    p.set_defaults(command=_run)


def _run(args: argparse.Namespace) -> int:
    if args.tail < -1:
        raise CliError(f"--tail must be -1 (every line) or a count, not {args.tail}")
    tail = None if args.tail == -1 else args.tail
    return asyncio.run(
        run_logs(
            args.server,
            args.name,
            follow=args.follow,
            tail=tail,
            previous=args.previous,
            all_shards=args.all_shards,
        )
    )


async def run_logs(
    server: str,
    name: str,
    *,
    follow: bool = False,
    tail: int | None = None,
    previous: bool = False,
    all_shards: bool = False,
) -> int:
    """Print the log lines the server streams, as they arrive."""

    async def read(client: ControlClient) -> None:
        stream = client.stream_logs(
            name, follow=follow, tail=tail, previous=previous, all_shards=all_shards
        )
        try:
            async for chunk in stream:
                prefix = f"[{shown(chunk.shard_id)}] " if all_shards else ""
                sys.stdout.write("".join(f"{prefix}{shown(line)}\n" for line in chunk.lines))
                sys.stdout.flush()
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    try:
        await call(server, read)
    except BrokenPipeError:  # `llmgw logs … | head`
        return 0
    return 0


def shown(line: str) -> str:
    """``line`` safe to print: every control character but a tab escaped."""
    return "\t".join(escape(part) for part in line.split("\t"))
