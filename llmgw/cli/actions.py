"""``llmgw start|drain|reprofile|drain-node``: operator actions on replicas and nodes.

Each prints the server's outcome; a refusal or an unreachable server is one line on
stderr and exit status 1 (``CliError``). ``start`` and ``reprofile`` also exit 1 when the
server answers that some replicas of the deployment cannot be placed (its answer says why).
``reprofile`` is refused by the server for a profile that serves another model name unless
``--allow-model-change``, and for one whose replicas cannot be placed. ``start`` and
``reprofile`` take a deployment or a replica: a name that is a deployment's is the
deployment, anything else is taken as a replica id (``DEPLOYMENT-N``).
``drain-node --dry-run`` prints a line per replica on the node and exits 1 when one of
them could not move now. ``start`` and ``reprofile`` with ``--wait`` then wait until the
deployment is ready on its current profile (``llmgw.cli.rollout_wait``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from llmgw.api.llmgw.v1 import ActionResult
from llmgw.cli.errors import CliError
from llmgw.cli.rollout_wait import add_wait_flags, wait_ready
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
        if verb in ("start", "reprofile"):
            add_wait_flags(p)
        if verb == "drain-node":
            p.add_argument(
                "--dry-run",
                action="store_true",
                help="change nothing: print where placement would move each replica now",
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
            dry_run=getattr(args, "dry_run", False),
            allow_model_change=getattr(args, "allow_model_change", False),
            wait_s=args.timeout if getattr(args, "wait", False) else None,
        )
    )


async def run_action(
    server: str,
    verb: str,
    target: str,
    profile: str = "",
    *,
    dry_run: bool = False,
    allow_model_change: bool = False,
    wait_s: float | None = None,
) -> int:
    """Send one action and print its outcome; 1 when replicas it asks for cannot be placed
    (a drain-node dry run: when one cannot move), or, waiting ``wait_s``, are not ready."""

    async def act(client: ControlClient) -> ActionResult:
        if verb == "drain":
            return await client.drain_replica(target)
        if verb == "drain-node":
            return await client.drain_node(target, dry_run=dry_run)
        deployments = {d.name for d in (await client.get_cluster()).deployments}
        deployment, replica = (target, "") if target in deployments else ("", target)
        if verb == "start":
            return await client.start_replica(deployment, replica_id=replica)
        return await client.reprofile_replica(
            replica, profile=profile, deployment=deployment, allow_model_change=allow_model_change
        )

    result: ActionResult = await call(server, act)
    sys.stdout.write(f"{result.message}\n")
    if dry_run:
        return 0 if result.ok else 1  # 1 when a replica cannot move
    if result.placeable < result.desired:
        return 1
    if wait_s is None or verb not in ("start", "reprofile"):
        return 0
    return int(await call(server, lambda client: _wait_for(client, target, wait_s)))


async def _wait_for(client: ControlClient, target: str, wait_s: float) -> int:
    """Wait on the deployment ``target`` is, or the one of the replica ``target`` names."""
    cluster = await client.get_cluster()
    names = {d.name for d in cluster.deployments} & {target}
    names |= {r.deployment for r in cluster.replicas if r.replica_id == target}
    if not names:
        raise CliError(f"no deployment or replica named {target!r} to wait for")
    return await wait_ready(client, sorted(names), wait_s)
