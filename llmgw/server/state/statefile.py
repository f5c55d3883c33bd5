"""Which file the control server's state is in, and whose it is.

Pointing ``--db`` at the wrong file must never cost the fleet, so a state database has an
identity and the server checks it before it writes anything:

- A path that does not exist yet is a new cluster: the database is built beside it under
  a temporary name and linked into place whole (``Store`` does it), so a start cut short
  never leaves a half-made (0-byte) file that a later start would have to guess about.
- An existing file must be ours: not empty (:func:`refuse_foreign_file`: a 0-byte file is
  what a truncation, a failed copy or ``touch`` leaves, and booting it would start an
  empty cluster with authentication off), an SQLite file, and one that holds the
  ``llmgw_meta`` table (:func:`check_llmgw_tables`), or, for a file from before that table
  existed, llmgw's own tables at a schema version llmgw wrote. Anything else is refused
  with what it is, and nothing is written to it.
- A PostgreSQL database (``--db postgresql://…``) must be empty or hold the meta table;
  one with other tables is another program's and is refused untouched (``storepg``).
- The meta table holds the **cluster id** (:func:`ensure_cluster_id`): random, made when
  the database is, added on the first start of an older file. The server sends it to every
  agent on registration and each agent remembers it, so an agent whose engines belong to
  another cluster (a server started on another, or a new, file) does not hand them over.

One server at a time per file is ``llmgw.server.state.statelock``'s part.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import aiosqlite

from llmgw.server.errors import StoreError
from llmgw.server.state.storebackend import Backend

META_TABLE = "llmgw_meta"
"""The table that says a database is llmgw's: ``key`` → ``value`` (``cluster_id``, ``created``)."""

META_SCHEMA = f"""CREATE TABLE IF NOT EXISTS {META_TABLE} (
    key     TEXT PRIMARY KEY,
    value   TEXT NOT NULL
)"""

CLUSTER_ID_KEY = "cluster_id"
CLUSTER_ID_RULE = "32 lowercase hexadecimal digits"
_CLUSTER_ID = re.compile(r"[0-9a-f]{32}")

# Tables every llmgw state database has had since schema version 1: a file from before the
# meta table is recognised by them.
_LEGACY_TABLES = frozenset({"nodes", "audit"})

_SQLITE_MAGIC = b"SQLite format 3\x00"

_ADVICE = (
    "give --db the server's own state file, or a path that does not exist yet to start a new "
    "cluster"
)


def new_cluster_id() -> str:
    """A fresh random cluster id (uuid4, hex)."""
    return uuid.uuid4().hex


def valid_cluster_id(text: str) -> bool:
    """Whether ``text`` is a cluster id as :func:`new_cluster_id` makes them."""
    return _CLUSTER_ID.fullmatch(text) is not None


def refuse_foreign_file(path: Path) -> None:
    """StoreError unless ``path`` (which exists) looks like an SQLite file with content.

    Reads only; the file is never opened for writing here.
    """
    try:
        with path.open("rb") as file:
            head = file.read(len(_SQLITE_MAGIC))
    except OSError as exc:
        raise StoreError(f"cannot open the state database {path}: {exc}") from exc
    if not head:
        raise StoreError(
            f"{path} is empty: not an llmgw state database; {_ADVICE} "
            "(a server's database is never empty: restore it from a backup, or remove the file)"
        )
    if head != _SQLITE_MAGIC:
        raise StoreError(f"{path} is not an llmgw state database (not an SQLite file); {_ADVICE}")


async def check_llmgw_tables(db: aiosqlite.Connection, path: Path, *, newest: int) -> None:
    """StoreError unless the open database ``db`` is an llmgw state database, or one of a
    schema version above ``newest`` (a newer llmgw's: the migration refuses it by name).

    Only reads: call it before anything (``PRAGMA journal_mode`` included) writes.
    """
    query = "SELECT name FROM sqlite_master WHERE type = 'table'"
    async with db.execute(query) as cursor:
        tables = {str(row[0]) for row in await cursor.fetchall()}
    if META_TABLE in tables:
        return
    async with db.execute("PRAGMA user_version") as cursor:
        row = await cursor.fetchone()
    version = int(row[0]) if row else 0
    if version > newest:
        return
    if version >= 1 and _LEGACY_TABLES <= tables:
        return  # an llmgw database from before the meta table: it gets one now
    holds = f"it holds the tables {', '.join(sorted(tables))}" if tables else "it holds no tables"
    raise StoreError(
        f"{path} is not an llmgw state database (no {META_TABLE} table; {holds}); {_ADVICE}"
    )


async def ensure_cluster_id(db: Backend, where: str, *, created_ms: int) -> tuple[str, bool]:
    """The database's cluster id, made (with the meta table) if it has none yet, and
    whether it was made now.

    Runs in its own transaction; a stored id that is not one is a StoreError naming the row.
    """
    async with db.transaction():
        await db.execute(META_SCHEMA)
    query = f"SELECT value FROM {META_TABLE} WHERE key = ?"
    rows = await db.fetch(query, (CLUSTER_ID_KEY,))
    if rows:
        stored = str(rows[0][0])
        if not valid_cluster_id(stored):
            raise StoreError(
                f"{where}: table {META_TABLE}, row {CLUSTER_ID_KEY!r}: {stored[:64]!r} is not a "
                f"cluster id ({CLUSTER_ID_RULE}); the database is damaged: restore it from a "
                "backup"
            )
        return stored, False
    async with db.transaction():
        await db.executemany(
            f"INSERT INTO {META_TABLE} (key, value) VALUES (?, ?) ON CONFLICT DO NOTHING",
            [(CLUSTER_ID_KEY, new_cluster_id()), ("created", str(created_ms))],
        )
    made = await db.fetch(query, (CLUSTER_ID_KEY,))  # another server's, if it came first
    return str(made[0][0]), True


def unreadable_row(path: Path | str, table: str, key: str, why: object) -> StoreError:
    """The error that stops a start on a stored row that cannot be read.

    A row skipped would be state lost without a word: a replica forgotten gives its port
    and GPUs to another while its engines still run, a node or deployment forgotten is
    work undone. So the start stops, naming the row, and the operator decides.
    """
    return StoreError(
        f"{path}: table {table}, row {key[:128]!r} cannot be read ({why}); the server does "
        "not start without it: restore the database from a backup, or remove that row "
        "yourself if what it holds may be lost"
    )
