"""``llmgw key create|list|revoke``: tenants' gateway keys, on the operator API (admin role).

Over gRPC-web like the other operator commands (``llmgw.cli.rpc``: ``--server``, ``--token``,
``--token-file``, ``$LLMGW_TOKEN``). The server checks every field again and keeps only a
key's SHA-256 (``llmgw.server.wire.tenantkeys``); ``create`` prints the key alone on the
first line of stdout (``llmgw key create --tenant t > t.key`` keeps it in the file's first
line), then what was made: the key is never shown again. ``--expires`` takes a duration
from now (``90d``, ``12h``, ``1d12h``, ``30m``, ``45s``) or an ISO-8601 time
(``2027-01-31T00:00:00Z``; one without a zone is UTC). ``list`` never shows a key or its
digest; ``-o json`` prints a list of objects. ``revoke KEY_ID`` makes every gateway refuse
the key within about a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from datetime import UTC, datetime

from llmgw.api.llmgw.v1 import CreateKeyRequest, KeyPriority, TenantKey
from llmgw.cli.errors import CliError
from llmgw.cli.rpc import add_client_flags, call
from llmgw.cli.tables import render_table
from llmgw.client import ControlClient

__all__ = ["expiry_ms", "key_rows", "limit", "models_list", "register"]

LIMIT_MAX = 10**9
_PRIORITY = {"interactive": KeyPriority.INTERACTIVE, "batch": KeyPriority.BATCH}
_PRIORITY_NAME = {value: name for name, value in _PRIORITY.items()}
_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
_UNIT_S = (86_400, 3_600, 60, 1)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``key create``, ``key list`` and ``key revoke``."""
    p = sub.add_parser(
        "key",
        help="create, list or revoke tenants' gateway keys",
        description="Manage tenants' API keys for the gateways (the admin role). Once any "
        "key exists, every gateway answers a request without a valid key 401.",
    )
    verbs = p.add_subparsers(title="verbs", metavar="VERB", required=True)
    create = verbs.add_parser("create", help="make a key and print it once")
    create.add_argument("--tenant", required=True, metavar="T", help="whose key it is")
    create.add_argument(
        "--models", type=models_list, default=[], metavar="A,B", help="models it may use (all)"
    )
    for flag, text in (
        ("--rpm", "requests per minute, fleet-wide"),
        ("--tpm", "tokens (prompt + completion) per minute, fleet-wide"),
        ("--max-concurrency", "requests in flight at once"),
    ):
        create.add_argument(flag, type=limit, default=0, metavar="N", help=f"{text} (0: none)")
    create.add_argument("--priority", choices=sorted(_PRIORITY), default="interactive")
    create.add_argument(
        "--expires",
        type=expiry_ms,
        default=0,
        metavar="DURATION|ISO-8601",
        help="refused from then on: 90d, 12h, 1d12h, or 2027-01-31T00:00:00Z (default never)",
    )
    create.add_argument("--note", default="", metavar="TEXT", help="who or what it is for")
    listing = verbs.add_parser("list", help="list live keys (never a key)")
    listing.add_argument("--tenant", default="", metavar="T", help="only this tenant's keys")
    listing.add_argument("-o", "--output", choices=("table", "json"), default="table")
    revoke = verbs.add_parser("revoke", help="revoke a key: every gateway refuses it at once")
    revoke.add_argument("key_id", metavar="KEY_ID")
    for verb, run in ((create, _create), (listing, _list), (revoke, _revoke)):
        add_client_flags(verb)
        verb.set_defaults(command=run)


def models_list(text: str) -> list[str]:
    """``--models a,b``: the names, in order; an empty one or one given twice is refused."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"an empty model name in {text!r}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a model named twice in {text!r}")
    return names


def limit(text: str) -> int:
    """A limit: a whole number from 0 (no limit) to 10^9."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value <= LIMIT_MAX:
        raise argparse.ArgumentTypeError(f"{value}: from 0 (no limit) to {LIMIT_MAX}")
    return value


def expiry_ms(text: str, now_s: float | None = None) -> int:
    """``--expires``: a duration from now or an ISO-8601 time, as Unix ms in the future."""
    now = time.time() if now_s is None else now_s
    match = _DURATION.fullmatch(text.strip())
    if text.strip() and match is not None:
        seconds = sum(
            int(part or 0) * unit for part, unit in zip(match.groups(), _UNIT_S, strict=True)
        )
        if seconds <= 0:
            raise argparse.ArgumentTypeError(f"a duration must be more than 0: {text!r}")
        return int((now + seconds) * 1000)
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a duration (90d, 12h, 1d12h, 30m) or an ISO-8601 time: {text!r}"
        ) from None
    at = at if at.tzinfo is not None else at.replace(tzinfo=UTC)
    if at.timestamp() <= now:
        raise argparse.ArgumentTypeError(f"{text!r} is in the past")
    return int(at.timestamp() * 1000)


def _when(unix_ms: int) -> str:
    if not unix_ms:
        return "never"
    return datetime.fromtimestamp(unix_ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _limits(key: TenantKey) -> str:
    parts = [
        f"models {','.join(key.models) or 'any'}",
        f"rpm {key.rpm or 'no limit'}",
        f"tpm {key.tpm or 'no limit'}",
        f"max concurrency {key.max_concurrency or 'no limit'}",
        f"priority {_PRIORITY_NAME.get(key.priority, str(key.priority))}",
        f"expires {_when(key.expires_unix_ms)}",
    ]
    return ", ".join(parts)


def _create(args: argparse.Namespace) -> int:
    request = CreateKeyRequest(
        tenant=args.tenant,
        models=args.models,
        rpm=args.rpm,
        tpm=args.tpm,
        max_concurrency=args.max_concurrency,
        priority=_PRIORITY[args.priority],
        expires_unix_ms=args.expires,
        note=args.note,
    )

    async def create(client: ControlClient) -> object:
        return await client.create_key(request)

    made = asyncio.run(call(args.server, create))
    created = made.created
    if not made.key or created is None:
        raise CliError("the server answered no key")
    sys.stdout.write(
        f"{made.key}\nkey {created.key_id} for tenant {created.tenant} created "
        f"(it is not shown again): {_limits(created)}\n"
    )
    return 0


def key_rows(keys: list[TenantKey]) -> list[list[str]]:
    """``key list``'s table: a header, then a row per key."""
    header = ["KEY-ID", "TENANT", "MODELS", "RPM", "TPM", "CONC", "PRIORITY", "EXPIRES", "NOTE"]
    rows = [
        [
            k.key_id, k.tenant, ",".join(k.models) or "*", str(k.rpm or "-"),
            str(k.tpm or "-"), str(k.max_concurrency or "-"),
            _PRIORITY_NAME.get(k.priority, str(k.priority)), _when(k.expires_unix_ms), k.note,
        ]
        for k in keys
    ]  # fmt: skip
    return [header, *rows]


def _json(key: TenantKey) -> dict[str, object]:
    return {
        "key_id": key.key_id,
        "tenant": key.tenant,
        "models": list(key.models),
        "rpm": key.rpm,
        "tpm": key.tpm,
        "max_concurrency": key.max_concurrency,
        "priority": _PRIORITY_NAME.get(key.priority, str(key.priority)),
        "expires_unix_ms": key.expires_unix_ms,
        "created_unix_ms": key.created_unix_ms,
        "note": key.note,
    }


def _list(args: argparse.Namespace) -> int:
    async def listing(client: ControlClient) -> object:
        return await client.list_keys(args.tenant)

    keys: list[TenantKey] = asyncio.run(call(args.server, listing))
    if args.output == "json":
        sys.stdout.write(json.dumps([_json(k) for k in keys], indent=2) + "\n")
    else:
        sys.stdout.write(render_table(key_rows(keys)) + "\n")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    async def revoke(client: ControlClient) -> object:
        return await client.revoke_key(args.key_id)

    result = asyncio.run(call(args.server, revoke))
    sys.stdout.write(f"{result.message}\n")
    return 0
