"""``llmgw apply``, ``llmgw delete`` and ``llmgw events``: their flags; what they do
(``llmgw.cli.apply``) is imported when one of them runs."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from llmgw.cli.rollout_wait import add_wait_flags
from llmgw.cli.rpc import add_client_flags

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``apply``, ``delete`` and ``events``."""
    p = sub.add_parser(
        "apply",
        help="apply profiles and deployments from a TOML file",
        description="Check a profiles/deployments TOML file and apply it; a bad file is "
        "refused whole, naming every problem by its key path. Exit 1 when a replica it asks "
        "for cannot be placed (the answer says why).",
    )
    p.add_argument("-f", "--file", type=Path, required=True, metavar="FILE")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the server's diff against what runs now (keep, add, remove, roll, "
        "unplaceable, with replica names, nodes, GPUs and ports); change nothing. Exit 1 "
        "when something cannot be placed",
    )
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    add_wait_flags(p)
    add_client_flags(p)
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
    add_client_flags(p)
    p.set_defaults(command=_run_delete)
    p = sub.add_parser(
        "events",
        help="show the audit log of operator actions",
        description="Show who did what to which target, when, and how it ended.",
    )
    p.add_argument("--follow", action="store_true", help="keep printing new ones until Ctrl-C")
    add_client_flags(p)
    p.set_defaults(command=_run_events)


def _run_apply(args: argparse.Namespace) -> int:
    from llmgw.cli.apply import run_apply

    wait_s = args.timeout if args.wait else None
    return run_apply(
        args.server, args.file, dry_run=args.dry_run, output=args.output, wait_s=wait_s
    )


def _run_delete(args: argparse.Namespace) -> int:
    from llmgw.cli.apply import run_delete

    return asyncio.run(run_delete(args.server, args.kind, args.name, force=args.force))


def _run_events(args: argparse.Namespace) -> int:
    from llmgw.cli.apply import run_events

    return asyncio.run(run_events(args.server, follow=args.follow))
