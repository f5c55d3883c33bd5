"""``llmgw start|drain|reprofile|drain-node``: operator actions on replicas and nodes.

Each prints the server's outcome; a refusal or an unreachable server is one line on
stderr and exit status 1 (``CliError``). ``start`` and ``reprofile`` also exit 1 when the
server answers that some replicas of the deployment cannot be placed (its answer says why).
``reprofile`` is refused by the server for a profile that serves another model name unless
``--allow-model-change``, and for one whose replicas cannot be placed. ``start`` and
``reprofile`` take a deployment or a replica: a name that is a deployment's is the
deployment, anything else is taken as a replica id (``DEPLOYMENT-N``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from llmgw.api.llmgw.v1 import ActionResult
from llmgw.cli.rpc import add_client_flags, call
from llmgw.client import ControlClient

__all__ = ["register", "run_action"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the four subcommands."""
    specs = (
        ("start", "TARGET", "scale a deployment up by one, or start a stopped replica's again"),
        ("drain", "REPLICA", "drain a replica: in-flight requests finish, then it stops"),
        ("reprofile", "TARGET", "roll a deployment (or a replica's) onto another profile"),
        ("drain-node", "NODE", "cordon a node and move its replicas elsewhere first"),
    )
    for verb, metavar, text in specs:
        p = sub.add_parser(verb, help=text, description=f"{text[0].upper()}{text[1:]}.")
        p.add_argument("target", metavar=metavar)
        if verb == "reprofile":
            p.add_argument("--profile", required=True, metavar="NAME", help="a stored profile")
            p.add_argument(
                "--allow-model-change",
                action="store_true",
                help="allow a profile that serves another model name (its clients' requests "
                "for the old name then fail)",
            )
        add_client_flags(p)
        p.set_defaults(command=_run, verb=verb)


def _run(args: argparse.Namespace) -> int:
    return asyncio.run(
        run_action(
            args.server,
            args.verb,
            args.target,
            getattr(args, "profile", ""),
            allow_model_change=getattr(args, "allow_model_change", False),
        )
    )


async def run_action(
    server: str, verb: str, target: str, profile: str = "", *, allow_model_change: bool = False
) -> int:
    """Send one action and print its outcome; 1 when replicas it asks for cannot be placed."""

    async def act(client: ControlClient) -> ActionResult:
        if verb == "drain":
            return await client.drain_replica(target)
        if verb == "drain-node":
            return await client.drain_node(target)
        deployments = {d.name for d in (await client.get_cluster()).deployments}
        deployment, replica = (target, "") if target in deployments else ("", target)
        if verb == "start":
            return await client.start_replica(deployment, replica_id=replica)
        return await client.reprofile_replica(
            replica, profile=profile, deployment=deployment, allow_model_change=allow_model_change
        )

    result: ActionResult = await call(server, act)
    sys.stdout.write(f"{result.message}\n")
    return 0 if result.placeable >= result.desired else 1
