"""Copying an SQLite state database into PostgreSQL, whole (``llmgw db migrate``).

The tables copied are every table the schema defines (:func:`schema_tables`: read from
``storeschema.MIGRATIONS``' ``CREATE TABLE`` statements, so a table a new schema version adds
is copied without a change here) and ``llmgw_meta`` (the cluster id and when the cluster
was made). Steps, in :func:`copy_sqlite_to_postgres`:

1. The source is locked like a server locks it (``statelock.hold_state_lock``, held to the
   end): a server running on it is named and the copy refused; none can start meanwhile.
2. The source is read, never written: SQLite's backup API copies it (opened read-only) into
   a snapshot in a temporary folder, and ``Store`` opens the snapshot, which checks it is an
   llmgw database and brings an older schema to the current version (the snapshot, not the
   source). A source of a newer schema is refused by name.
3. The target is opened (``storepg.PgBackend``: another program's database is refused) and,
   if empty, given the current schema. Then, in one transaction with every table locked, a
   target that holds any row of a schema table is refused, naming what it holds; else every
   row of every table is inserted with its ids, in batches (``executemany``), the source's
   ``llmgw_meta`` rows replace the target's (the schema version stays the target's, which is
   the same), and the identity sequences of the tables with ``AUTOINCREMENT`` ids are set
   past the highest id copied. Any failure rolls it all back (the schema made in step 3
   stays: an empty llmgw database, which a second try accepts).
4. A fresh ``Store`` opens the target and the row counts and the cluster id are compared
   with the source's (the source's lock still held); a difference is a StoreError.

The source's rows are read with ``sqlite3`` on the event loop's thread, a batch at a time,
between the batches' inserts (the command runs nothing else meanwhile).

Errors are StoreError (or ConfigError for a ``--from``/``--to`` that will not do), never
holding the URL's password (``storebackend.redact_url``).
"""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from llmgw.server.errors import ConfigError, StoreError
from llmgw.server.state.statefile import META_TABLE, refuse_foreign_file
from llmgw.server.state.statelock import hold_state_lock
from llmgw.server.state.store import Store
from llmgw.server.state.storebackend import URL_FORM, Backend, PostgresUrl, parse_db
from llmgw.server.state.storepg import VERSION_KEY, PgBackend, PgTimeouts
from llmgw.server.state.storeschema import MIGRATIONS, SCHEMA_VERSION

__all__ = [
    "CopyReport",
    "TableCopy",
    "copy_sqlite_to_postgres",
    "identity_tables",
    "parse_source",
    "parse_target",
    "schema_tables",
]

BATCH_ROWS: Final = 5000
SQLITE_PREFIX: Final = "sqlite:"
_CREATE = re.compile(r"CREATE TABLE (?:IF NOT EXISTS )?(\w+)\s*\((.*?)\n\s*\);", re.DOTALL)
_IDENTITY = re.compile(r"^\s*(\w+)\s+INTEGER PRIMARY KEY AUTOINCREMENT\b", re.MULTILINE)
# One statement may run as long as a batch takes; connecting stays quick to fail.
_COPY_TIMEOUTS: Final = PgTimeouts(connect_s=10.0, command_s=600.0, pool_size=1)


def _creates() -> Iterator[tuple[str, str]]:
    for version in sorted(MIGRATIONS):
        for match in _CREATE.finditer(MIGRATIONS[version]):
            yield match.group(1), match.group(2)


def schema_tables() -> tuple[str, ...]:
    """Every table the schema's migrations create, in the order they create them."""
    return tuple(dict.fromkeys(name for name, _ in _creates()))


def identity_tables() -> dict[str, str]:
    """The tables with an ``AUTOINCREMENT`` id (an identity column on PostgreSQL), by name:
    the id column's name."""
    found = {}
    for name, body in _creates():
        identity = _IDENTITY.search(body)
        if identity is not None:
            found[name] = identity.group(1)
    return found


def parse_source(text: str) -> Path:
    """``--from``: ``sqlite:PATH`` or a plain path (an existing file); ConfigError otherwise."""
    path_text = text.removeprefix(SQLITE_PREFIX)
    if not path_text:
        raise ConfigError("--from: no path (sqlite:PATH, or a path)")
    try:
        target = parse_db(path_text, "--from")
    except ConfigError as exc:
        raise ConfigError(f"{exc}; --from takes an SQLite file: sqlite:PATH") from None
    if isinstance(target, PostgresUrl):
        raise ConfigError(
            f"--from {target}: the source must be an SQLite file (sqlite:PATH); "
            "copying out of PostgreSQL is not supported"
        )
    if not target.is_file():
        why = "is not a file" if target.exists() else "does not exist"
        raise ConfigError(f"--from {target}: {why}")
    return target


def parse_target(text: str) -> PostgresUrl:
    """``--to``: a ``postgresql://`` URL; ConfigError (no password in it) otherwise."""
    if "://" not in text:
        raise ConfigError(f"--to {text!r}: give a PostgreSQL URL ({URL_FORM})")
    target = parse_db(text, "--to")
    if not isinstance(target, PostgresUrl):  # pragma: no cover - parse_db returns a URL here
        raise ConfigError(f"--to: give a PostgreSQL URL ({URL_FORM})")
    return target


@dataclass(frozen=True, slots=True)
class TableCopy:
    """How many rows of one table were copied."""

    table: str
    rows: int


@dataclass(frozen=True, slots=True)
class CopyReport:
    """What a copy did: from where to where, which cluster, rows per table, how long."""

    source: str
    target: str  # the URL, password hidden
    cluster_id: str
    tables: tuple[TableCopy, ...]
    seconds: float

    @property
    def rows(self) -> int:
        """Every row copied, all tables together."""
        return sum(t.rows for t in self.tables)


async def copy_sqlite_to_postgres(
    source: Path, target: PostgresUrl, *, batch: int = BATCH_ROWS
) -> CopyReport:
    """Copy every table of the SQLite state database ``source`` into the PostgreSQL database
    ``target`` (empty, or an llmgw database without rows), in one transaction, and check the
    result; StoreError naming what stopped it."""
    started = time.monotonic()
    refuse_foreign_file(source)
    with hold_state_lock(source), tempfile.TemporaryDirectory(prefix="llmgw-copy-") as tmp:
        snapshot = Path(tmp) / "snapshot.db"
        cluster_id = await _snapshot(source, snapshot)
        conn = sqlite3.connect(f"{snapshot.as_uri()}?mode=ro", uri=True)
        try:
            tables = await _copy_rows(conn, target, batch)
        finally:
            conn.close()
        await _verify(target, tables, cluster_id)
    return CopyReport(str(source), str(target), cluster_id, tables, time.monotonic() - started)


async def _snapshot(source: Path, snapshot: Path) -> str:
    """Copy ``source`` (read-only) to ``snapshot`` and bring that to the current schema; the
    cluster id it holds."""
    await asyncio.to_thread(_backup, source, snapshot)
    try:
        async with Store(snapshot) as store:
            return store.cluster_id
    except StoreError as exc:
        raise StoreError(str(exc).replace(str(snapshot), str(source))) from exc


def _backup(source: Path, snapshot: Path) -> None:
    """SQLite's online backup of ``source``, opened read-only, into a new owner-only file."""
    try:
        os.close(os.open(snapshot, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        src = sqlite3.connect(f"{source.resolve().as_uri()}?mode=ro", uri=True)
        try:
            dst = sqlite3.connect(snapshot)
            try:
                src.backup(dst)
            finally:
                dst.close()
        finally:
            src.close()
    except (OSError, sqlite3.Error) as exc:
        raise StoreError(f"cannot read {source}: {exc}") from exc


async def _target_schema(db: Backend) -> None:
    """The current schema on the target (a newer one is refused); no cluster id is made:
    the source's is copied."""
    version = await db.schema_version()
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{db.where} has schema version {version}; this llmgw knows up to {SCHEMA_VERSION}"
        )
    if version < SCHEMA_VERSION:
        scripts = [MIGRATIONS[v] for v in range(version + 1, SCHEMA_VERSION + 1)]
        await db.migrate(scripts, SCHEMA_VERSION)


async def _copy_rows(
    conn: sqlite3.Connection, target: PostgresUrl, batch: int
) -> tuple[TableCopy, ...]:
    db = PgBackend(target, _target_schema, _COPY_TIMEOUTS)
    await db.open()
    try:
        tables = schema_tables()
        async with db.transaction():
            await db.execute(
                f"LOCK TABLE {', '.join((*tables, META_TABLE))} IN ACCESS EXCLUSIVE MODE"
            )
            await _refuse_held(db, tables)
            copied = [TableCopy(t, await _copy_table(conn, db, t, batch)) for t in tables]
            copied.append(TableCopy(META_TABLE, await _copy_meta(conn, db)))
            await _reset_identities(db)
        return tuple(copied)
    finally:
        await db.close()


async def _refuse_held(db: Backend, tables: Sequence[str]) -> None:
    held = []
    for table in tables:
        (count,) = (await db.fetch(f"SELECT COUNT(*) FROM {table}"))[0]
        if count:
            held.append(f"{count} {table}")
    if held:
        raise StoreError(
            f"{db.where} already holds llmgw state ({', '.join(held)} rows): nothing was "
            "copied; give --to an empty database"
        )


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [str(row[1]) for row in conn.execute(f"PRAGMA table_info({table})")]


async def _copy_table(conn: sqlite3.Connection, db: Backend, table: str, batch: int) -> int:
    columns = _columns(conn, table)
    if not columns:
        raise StoreError(f"the source has no table {table}")  # the snapshot was migrated
    names = ", ".join(columns)
    insert = f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' * len(columns))})"
    cursor = conn.execute(f"SELECT {names} FROM {table}")
    count = 0
    while rows := cursor.fetchmany(batch):
        try:
            await db.executemany(insert, rows)
        except StoreError as exc:
            raise StoreError(f"table {table}, rows {count + 1}–{count + len(rows)}: {exc}") from exc
        count += len(rows)
    return count


async def _copy_meta(conn: sqlite3.Connection, db: Backend) -> int:
    """The source's meta rows (the cluster id, when it was made) over the target's; the
    schema version row stays the target's (both are ``SCHEMA_VERSION``)."""
    rows: list[tuple[Any, ...]] = [
        (str(key), str(value))
        for key, value in conn.execute(f"SELECT key, value FROM {META_TABLE}")
        if key != VERSION_KEY
    ]
    await db.executemany(
        f"INSERT INTO {META_TABLE} (key, value) VALUES (?, ?)"
        " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        rows,
    )
    return len(rows)


async def _reset_identities(db: Backend) -> None:
    """Each identity sequence past the highest id now in its table (the next insert's id)."""
    for table, column in identity_tables().items():
        await db.fetch(
            f"SELECT setval(pg_get_serial_sequence('{table}', '{column}'),"
            f" COALESCE(MAX({column}), 0) + 1, false) FROM {table}"
        )


async def _verify(target: PostgresUrl, tables: Sequence[TableCopy], cluster_id: str) -> None:
    """Open the target as a server would and compare its rows and cluster id with what was
    copied; StoreError on a difference."""
    async with Store(target) as store:
        if store.cluster_id != cluster_id:
            raise StoreError(
                f"{store.path_text}: cluster id {store.cluster_id} after the copy, "
                f"the source's is {cluster_id}"
            )
        wrong = []
        for copied in tables:
            if copied.table == META_TABLE:
                continue
            (count,) = (await store.backend.fetch(f"SELECT COUNT(*) FROM {copied.table}"))[0]
            if count != copied.rows:
                wrong.append(f"{copied.table}: {count} rows, {copied.rows} copied")
    if wrong:
        raise StoreError(f"{target}: the copy does not match its source ({'; '.join(wrong)})")
