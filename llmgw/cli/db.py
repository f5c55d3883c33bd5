"""``llmgw db migrate``: copy a server's SQLite state file into a PostgreSQL database.

::

    llmgw db migrate --from sqlite:/var/lib/llmgw/state.db \\
        --to postgresql://llmgw@db.example:5432/llmgw
    llmgw server --db postgresql://llmgw@db.example:5432/llmgw

Stop the server first: the copy takes the state file's lock, so it refuses while a server
holds it and no server starts on the file meanwhile. The file is only read. The target must
be an empty database (or an llmgw one without rows); every row goes over in one transaction
with its ids and the cluster id, so the agents keep their engines
(``llmgw.server.state.storecopy``). Prints the rows per table, the time, and one line
``migrated N rows from X to Y``; the URL's password is never printed.
"""

from __future__ import annotations

import argparse
import asyncio

from llmgw.cli.errors import CliError
from llmgw.server.errors import ConfigError, StoreError
from llmgw.server.state.storebackend import URL_FORM
from llmgw.server.state.storecopy import (
    CopyReport,
    copy_sqlite_to_postgres,
    parse_source,
    parse_target,
)

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``db migrate``."""
    p = sub.add_parser(
        "db",
        help="move the server's state database (db migrate)",
        description="Work on the control server's state database while no server runs on it.",
    )
    verbs = p.add_subparsers(title="verbs", metavar="VERB", required=True)
    migrate = verbs.add_parser(
        "migrate",
        help="copy an SQLite state file into an empty PostgreSQL database",
        description="Copy every table of a stopped server's SQLite state file into an empty "
        "PostgreSQL database, in one transaction, keeping the ids and the cluster id; then "
        "open the copy and check its row counts. The file is only read (and locked, so no "
        "server starts on it meanwhile). A target that already holds llmgw rows is refused. "
        "Afterwards start the server with --db and the same URL.",
    )
    migrate.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="sqlite:PATH",
        help="the server's SQLite state file (sqlite:PATH, or a path)",
    )
    migrate.add_argument(
        "--to",
        dest="target",
        required=True,
        metavar="URL",
        help=f"an empty PostgreSQL database: {URL_FORM}",
    )
    migrate.set_defaults(command=run_migrate)


def run_migrate(args: argparse.Namespace) -> int:
    """Copy ``--from`` into ``--to`` and print what was copied."""
    try:
        source = parse_source(str(args.source))
        target = parse_target(str(args.target))
        report = asyncio.run(copy_sqlite_to_postgres(source, target))
    except (ConfigError, StoreError) as exc:
        raise CliError(f"db migrate: {exc}") from exc
    print(_report_text(report))
    return 0


def _report_text(report: CopyReport) -> str:
    width = max(len(t.table) for t in report.tables)
    lines = [f"{t.table:<{width}}  {t.rows:>9}" for t in report.tables]
    lines.append(f"cluster {report.cluster_id}, {report.seconds:.2f} s")
    lines.append(f"migrated {report.rows} rows from {report.source} to {report.target}")
    return "\n".join(lines)
