"""``llmgw describe``, ``llmgw scale`` and ``llmgw rollout status|history|undo``: their flags; what
they print (``llmgw.cli.describe``) is imported when one of them runs."""

from __future__ import annotations

import argparse
import asyncio

from llmgw.cli.rollout_wait import add_wait_flags
from llmgw.cli.rpc import add_client_flags

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``describe``, ``scale`` and ``rollout``."""
    p = sub.add_parser(
        "describe",
        help="everything known about a deployment, replica or node, and its recent events",
        description="Show what the server knows about one deployment, replica or node (spec, "
        "state, replicas and shards with their nodes, GPUs, ports and reasons; a node's GPUs, "
        "telemetry and cordon) and its recent events: reconciler decisions, state changes and "
        "operator actions, kept across server restarts.",
    )
    p.add_argument("kind", choices=["deployment", "replica", "node"])
    p.add_argument("name", metavar="NAME")
    p.add_argument("-o", "--output", choices=["text", "json"], default="text")
    add_client_flags(p)
    p.set_defaults(command=_run_describe)
    p = sub.add_parser(
        "scale",
        help="set a deployment's replica count",
        description="Set a deployment's replica count (a live change: stored and audited; the "
        "next apply of a file with another count sets that one). Refused for a deployment "
        'whose autoscale policy is in mode "act": the autoscaler sets its count.',
    )
    p.add_argument("deployment", metavar="DEPLOYMENT")
    p.add_argument("replicas", metavar="N", type=_count)
    add_wait_flags(p)
    add_client_flags(p)
    p.set_defaults(command=_run_scale)
    p = sub.add_parser(
        "rollout",
        help="a deployment's rollout: its status, its profile revisions, or undo to one",
        description="Wait until a deployment's replicas are all ready on its current profile "
        "(status: exit 0, or exit 1 naming what blocks it: no place for a replica, a crash "
        "loop, or --timeout), list its profile revisions (history), or roll it back to the "
        "previous one or --to-revision N (undo; --wait then waits as status does): replicas "
        "are replaced one at a time, each new one READY before an old one drains.",
    )
    p.add_argument("verb", choices=["status", "history", "undo"])
    p.add_argument("deployment", metavar="DEPLOYMENT")
    p.add_argument(
        "--to-revision", type=_count, default=0, metavar="N", help="(undo) default: the previous"
    )
    add_wait_flags(p)
    add_client_flags(p)
    p.set_defaults(command=_run_rollout)


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _run_describe(args: argparse.Namespace) -> int:
    from llmgw.cli.describe import run_describe

    return asyncio.run(run_describe(args.server, args.kind, args.name, args.output))


def _run_scale(args: argparse.Namespace) -> int:
    from llmgw.cli.describe import run_scale

    wait_s = args.timeout if args.wait else None
    return asyncio.run(run_scale(args.server, args.deployment, args.replicas, wait_s))


def _run_rollout(args: argparse.Namespace) -> int:
    from llmgw.cli.describe import run_rollout
    from llmgw.cli.errors import CliError

    if args.verb != "undo" and (args.to_revision or args.wait):
        raise CliError("--to-revision and --wait apply to 'rollout undo' only")
    if args.verb == "status":
        from llmgw.cli.rollout_wait import wait_ready
        from llmgw.cli.rpc import call

        names = [args.deployment]
        return int(asyncio.run(call(args.server, lambda c: wait_ready(c, names, args.timeout))))
    wait_s = args.timeout if args.wait else None
    return asyncio.run(
        run_rollout(args.server, args.verb, args.deployment, args.to_revision, wait_s)
    )
