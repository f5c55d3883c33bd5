"""``llmgw console``: the interactive console, or ``--once`` a snapshot for scripts.

The console talks to the control server's gRPC-web port through httpx; ``--token`` is sent
as ``authorization: Bearer TOKEN`` on every call. ``--read-only`` hides every action and
makes the client refuse mutating calls before sending them. While the screen is up, log
records go to ``--log-file`` (or nowhere): a line on stderr would tear the screen. Textual
is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
from pathlib import Path

from llmgw.cli.errors import CliError
from llmgw.cli.rpc import DEFAULT_WEB_URL
from llmgw.cli.screenlog import logging_to
from llmgw.cli.tables import render_table
from llmgw.cli.tls import add_client_ca_flag
from llmgw.client import ClientError, ControlClient, GrpcWebChannel, RpcError, ServerUnreachable

VIEW_NAMES = ("overview", "nodes", "replicas", "shards", "router", "events", "deployments")
"""The console's views (llmgw.tui.registry.VIEWS, tested to agree)."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``console`` and its flags."""
    p = sub.add_parser(
        "console",
        help="open the interactive console (live topology, replicas, router, events)",
        description="Open the operator console on a control server: live GPU topology, "
        "replica and shard states, router statistics and events, k9s-style keys (':' "
        "jumps to a view, 'space' pauses, 'c' copies the selected id, 'q' quits). It "
        "never exits when the server goes away: the badge turns STALE and it reconnects.",
    )
    p.add_argument(
        "--server",
        default=DEFAULT_WEB_URL,
        metavar="URL",
        help=f"the control server's gRPC-web URL (default: {DEFAULT_WEB_URL})",
    )
    p.add_argument("--token", default=None, help="an operator token, sent as a Bearer token")
    add_client_ca_flag(p)
    p.add_argument(
        "--read-only", action="store_true", help="hide every action; send no mutating call"
    )
    p.add_argument("--no-mouse", action="store_true", help="leave the mouse to the terminal")
    p.add_argument("--view", choices=VIEW_NAMES, default="overview", help="the first view")
    p.add_argument(
        "--once",
        action="store_true",
        help="print one snapshot (see -o) and exit instead of opening the console",
    )
    p.add_argument(
        "-o",
        "--output",
        choices=["table", "json"],
        default="table",
        help="with --once: text tables (default) or the console's JSON",
    )
    p.add_argument(
        "--log-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="append log records here while the console is open (default: discard them)",
    )
    p.set_defaults(command=run_console_command)


def run_console_command(args: argparse.Namespace) -> int:
    headers = {"authorization": f"Bearer {args.token}"} if args.token else None
    if args.once:
        return asyncio.run(_once(args.server, headers, args.output))
    with logging_to(args.log_file):
        return asyncio.run(
            _interactive(
                args.server,
                headers,
                read_only=args.read_only,
                mouse=not args.no_mouse,
                view=args.view,
            )
        )


async def _once(server: str, headers: dict[str, str] | None, output: str) -> int:
    from llmgw.tui.report import snapshot_json, snapshot_tables
    from llmgw.tui.stream import fetch_snapshot

    try:
        async with GrpcWebChannel(server, headers=headers) as channel:
            snapshot = await fetch_snapshot(ControlClient(channel, read_only=True))
    except ServerUnreachable as exc:
        raise CliError(f"cannot reach the control server at {server}: {exc}") from exc
    except RpcError as exc:
        raise CliError(f"{exc.status.name}: {exc.message}") from exc
    except ClientError as exc:
        raise CliError(str(exc)) from exc
    if output == "json":
        sys.stdout.write(json.dumps(snapshot_json(snapshot, server), indent=2) + "\n")
        return 0
    for i, (title, rows) in enumerate(snapshot_tables(snapshot)):
        sys.stdout.write(("\n" if i else "") + f"{title}\n{render_table(rows)}\n")
    return 0


async def _interactive(
    server: str, headers: dict[str, str] | None, *, read_only: bool, mouse: bool, view: str
) -> int:
    from llmgw.tui.app import GC_THRESHOLDS, ConsoleApp
    from llmgw.tui.stream import WatchSession

    gc.set_threshold(*GC_THRESHOLDS)  # this process is the console: see GC_THRESHOLDS
    try:
        channel = GrpcWebChannel(server, headers=headers)
    except ClientError as exc:
        raise CliError(str(exc)) from exc
    async with channel:
        client = ControlClient(channel, read_only=read_only)
        app = ConsoleApp(
            WatchSession(client), client=client, server=server, read_only=read_only, view=view
        )
        await app.run_async(mouse=mouse)
    return app.return_code or 0
