"""``llmgw token``: create, list and revoke the control server's tokens.

Tokens are written to the server's database directly (``--db``: its SQLite file, the same
default as ``llmgw server``, or its ``postgresql://`` URL); a running server reads them
within seconds. The new token is printed once, on stdout, and never again: only its
SHA-256 is kept. Bootstrapping a server with
authentication on::

    llmgw token create --role admin --db FILE > admin.token
    llmgw server --db FILE
    llmgw get nodes --token-file admin.token

Clients of the server (``llmgw get``, ``drain``, ``apply`` …) take ``--token``,
``--token-file`` or ``$LLMGW_TOKEN`` (``llmgw.cli.rpc``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import Any, TypeVar

from llmgw.cli.errors import CliError
from llmgw.protocol import NODE_ID_RULE, valid_node_id
from llmgw.server.errors import ConfigError, StoreError
from llmgw.server.state.store import Store
from llmgw.server.state.storebackend import DbTarget
from llmgw.server.state.tokens import Role, StoredToken
from llmgw.server.wire.auth import hash_token, new_token

CREATABLE_ROLES = tuple(role.value for role in Role)
T = TypeVar("T")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``token create``, ``token list`` and ``token revoke``."""
    p = sub.add_parser(
        "token",
        help="create, list or revoke access tokens",
        description="Manage the control server's tokens in its state file. Creating the "
        "first token turns authentication on.",
    )
    verbs = p.add_subparsers(title="verbs", metavar="VERB", required=True)
    create = verbs.add_parser("create", help="create a token and print it once")
    create.add_argument("--role", required=True, choices=CREATABLE_ROLES)
    create.add_argument("--note", default="", metavar="TEXT", help="who or what it is for")
    create.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="ID",
        help="(agent role) the node ids this token may register, repeatable or comma-separated; "
        "without it an agent token may register any node id",
    )
    _add_db(create)
    create.set_defaults(command=run_create)
    listing = verbs.add_parser("list", help="list tokens (ids, roles, created; never a token)")
    _add_db(listing)
    listing.set_defaults(command=run_list)
    revoke = verbs.add_parser(
        "revoke",
        help="revoke a token by id; a running server also ends the streams open with it",
    )
    revoke.add_argument("token_id", type=int, metavar="ID")
    _add_db(revoke)
    revoke.set_defaults(command=run_revoke)


def _add_db(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--db",
        default=None,
        metavar="FILE|URL",
        help="the server's state file, or its postgresql:// URL",
    )


def _db(args: argparse.Namespace) -> DbTarget:
    from llmgw.server.app import db_target

    try:
        return db_target(args.db)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def run_create(args: argparse.Namespace) -> int:
    role = Role(args.role)
    nodes = bound_nodes(args.node, role)
    token = new_token()
    token_id = _run(_create(_db(args), role, hash_token(token), args.note, nodes))
    sys.stdout.write(token + "\n")
    bound = f" bound to node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)}" if nodes else ""
    sys.stderr.write(f"token {token_id} ({args.role}){bound} created; it is not shown again\n")
    return 0


def bound_nodes(values: list[str], role: Role) -> list[str]:
    """The node ids of ``--node`` (repeatable, comma lists), checked; CliError naming a bad one."""
    nodes = sorted({n.strip() for value in values for n in value.split(",") if n.strip()})
    if nodes and role is not Role.AGENT:
        raise CliError(f"--node binds agent tokens only, not a {role.value} token")
    for node_id in nodes:
        if not valid_node_id(node_id):
            raise CliError(f"--node {node_id!r} is not a valid node id ({NODE_ID_RULE})")
    if values and not nodes:
        raise CliError("--node needs at least one node id")
    return nodes


async def _create(path: DbTarget, role: Role, digest: str, note: str, nodes: list[str]) -> int:
    async with Store(path) as store:
        return await store.add_token(role, digest, note, nodes)


def run_list(args: argparse.Namespace) -> int:
    tokens = _run(_list(_db(args)))
    sys.stdout.write(f"{'ID':>4}  {'ROLE':<9} {'CREATED':<20} {'NODES':<20} NOTE\n")
    for t in tokens:
        created = datetime.fromtimestamp(t.created_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
        nodes = ",".join(sorted(t.nodes)) or "-"
        sys.stdout.write(f"{t.token_id:>4}  {t.role.value:<9} {created:<20} {nodes:<20} {t.note}\n")
    return 0


async def _list(path: DbTarget) -> list[StoredToken]:
    async with Store(path) as store:
        return await store.load_tokens()


def run_revoke(args: argparse.Namespace) -> int:
    if not _run(_revoke(_db(args), args.token_id)):
        raise CliError(f"no token with id {args.token_id}")
    sys.stderr.write(f"token {args.token_id} revoked\n")
    return 0


async def _revoke(path: DbTarget, token_id: int) -> bool:
    async with Store(path) as store:
        return await store.delete_token(token_id)


def _run(work: Coroutine[Any, Any, T]) -> T:
    try:
        return asyncio.run(work)
    except StoreError as exc:
        raise CliError(str(exc)) from exc
