"""``llmgw usage``: what tenants used, per key and model, from the state store (admin role).

The gateways meter every tenant key's requests (llmgw.gateway.tenantmeter) and report them;
the server keeps hourly totals (``tenant_usage_hourly``; llmgw.server.wire.usage) and
``GetUsage`` answers them with what is not stored yet. ``--since`` and ``--until`` take a
duration back from now (``24h``, ``7d``, ``90m``) or an ISO-8601 time (UTC without a zone);
the default is the last 24 hours. ``--by hour`` shows each hour, ``day`` each UTC day,
``total`` (the default) one row per tenant, key and model. ``-o json`` prints a list of
objects, ``-o csv`` a header and rows; both carry the same columns as the table: tenant,
key, model, requests, refused, prompt, cached, uncached, completion, gpu_seconds (and the
period's start with ``--by hour|day``).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import re
import sys
import time
from datetime import UTC, datetime

from llmgw.api.llmgw.v1 import UsageResponse, UsageRow
from llmgw.cli.errors import CliError
from llmgw.cli.rpc import add_client_flags, call
from llmgw.cli.tables import render_table
from llmgw.client import ControlClient

__all__ = ["register", "summarize", "when_ms"]

_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?")
_UNIT_S = (86_400, 3_600, 60)
COLUMNS = (
    "tenant", "key", "model", "requests", "refused", "prompt", "cached", "uncached",
    "completion", "gpu_seconds",
)  # fmt: skip
_DAY_MS = 86_400_000


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "usage",
        help="tenants' metered usage per key and model",
        description="What each tenant key used per model, from the server's hourly totals "
        "(the admin role): requests, refused, prompt tokens (cached and uncached), completion "
        "tokens and GPU-seconds attributed.",
    )
    p.add_argument("--tenant", default="", metavar="T", help="only this tenant")
    p.add_argument(
        "--since", type=when_ms, default=None, metavar="DURATION|ISO-8601",
        help="from this long ago (24h, 7d, 90m) or this time (default: 24h)",
    )  # fmt: skip
    p.add_argument("--until", type=when_ms, default=0, metavar="DURATION|ISO-8601")
    p.add_argument("--by", choices=("total", "day", "hour"), default="total")
    p.add_argument("-o", "--output", choices=("table", "json", "csv"), default="table")
    add_client_flags(p)
    p.set_defaults(command=_usage)


def when_ms(text: str, now_s: float | None = None) -> int:
    """A duration back from now or an ISO-8601 time, in Unix ms."""
    now = time.time() if now_s is None else now_s
    found = _DURATION.fullmatch(text.strip())
    if text.strip() and found is not None and any(found.groups()):
        seconds = sum(int(v or 0) * unit for v, unit in zip(found.groups(), _UNIT_S, strict=True))
        return int((now - seconds) * 1000)
    try:
        parsed = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a duration (24h, 7d, 90m) nor an ISO-8601 time"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp() * 1000)


def summarize(rows: list[UsageRow], by: str) -> list[dict[str, object]]:
    """The rows summed per (period,) tenant, key and model, as the output shows them."""
    merged: dict[tuple[int, str, str, str], list[float]] = {}
    for r in rows:
        period = (
            0
            if by == "total"
            else r.hour_unix_ms - r.hour_unix_ms % (_DAY_MS if by == "day" else 3_600_000)
        )
        sums = merged.setdefault((period, r.tenant, r.key_id, r.model), [0.0] * 6)
        for i, v in enumerate(
            (r.requests, r.refused, r.prompt_tokens, r.cached_prompt_tokens,
             r.completion_tokens, r.gpu_seconds)
        ):  # fmt: skip
            sums[i] += v
    out: list[dict[str, object]] = []
    for (period, tenant, key, model), s in sorted(merged.items()):
        row: dict[str, object] = {}
        if by != "total":
            row["period"] = datetime.fromtimestamp(period / 1000, UTC).strftime("%Y-%m-%dT%H:%MZ")
        row |= {
            "tenant": tenant, "key": key, "model": model, "requests": int(s[0]),
            "refused": int(s[1]), "prompt": int(s[2]), "cached": int(s[3]),
            "uncached": int(s[2] - s[3]), "completion": int(s[4]),
            "gpu_seconds": round(s[5], 3),
        }  # fmt: skip
        out.append(row)
    return out


def _usage(args: argparse.Namespace) -> int:
    since = args.since if args.since is not None else when_ms("24h")
    if args.until and args.until <= since:
        raise CliError("--until must be after --since")

    async def get(client: ControlClient) -> object:
        return await client.get_usage(args.tenant, since, args.until)

    reply: UsageResponse = asyncio.run(call(args.server, get))
    rows = summarize(list(reply.rows), args.by)
    if args.output == "json":
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    elif args.output == "csv":
        buffer = io.StringIO()
        names = (["period"] if args.by != "total" else []) + list(COLUMNS)
        writer = csv.DictWriter(buffer, fieldnames=names, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        sys.stdout.write(buffer.getvalue())
    elif not rows:
        sys.stdout.write("no usage in that period\n")
    else:
        header = [c.upper() for c in rows[0]]
        sys.stdout.write(
            render_table([header, *[[str(v) for v in r.values()] for r in rows]]) + "\n"
        )
    return 0
