"""The store's SQLite backend: one file, through aiosqlite (``--db PATH``).

What is SQLite's alone lives here: the file's modes (its directory 0700, the file, its
``-wal`` and ``-shm`` 0600: ``llmgw.statefiles``; looser modes found on open are tightened,
and said so in the log), a new file built under a temporary name and linked into place
whole, a file that is not an llmgw state database refused untouched
(``llmgw.server.state.statefile``), WAL with ``synchronous=FULL``, and the schema version
in ``PRAGMA user_version``. The lock beside the file is ``llmgw.server.state.statelock``'s.

sqlite's errors that mean the file cannot be written now become StoreUnwritable
(``llmgw.server.state.storehealth.unwritable``) in :meth:`SqliteBackend._mapped`, the one
place; any other sqlite error is our bug and stays what it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiosqlite

from llmgw.server.errors import StoreError
from llmgw.server.state.statefile import check_llmgw_tables, new_cluster_id, refuse_foreign_file
from llmgw.server.state.storebackend import Backend, Row
from llmgw.server.state.storehealth import unwritable
from llmgw.server.state.storeschema import COLUMNS_6, SCHEMA_VERSION
from llmgw.statefiles import owner_only_umask, private_dir, private_files, sidecars

__all__ = ["SqliteBackend"]

log = logging.getLogger(__name__)

Prepare = Callable[[Backend], Awaitable[None]]


class SqliteBackend:
    """An SQLite file as the store's backend (:class:`~llmgw.server.state.storebackend.Backend`)."""

    nodes_order = "rowid"  # nodes oldest first: in the order they were inserted
    lock_rows_sql = ""
    now_ms_sql = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"

    def __init__(self, path: Path, prepare: Prepare) -> None:
        self._path = path
        self._prepare = prepare  # the store's: migrate, then the cluster id
        self.conn: aiosqlite.Connection | None = None

    @property
    def where(self) -> str:
        return str(self._path)

    @property
    def path(self) -> Path:
        """The database file."""
        return self._path

    async def open(self) -> None:
        """Open (creating if needed) the file and bring its schema up to date.

        A file that is not an llmgw state database is refused before anything is written
        to it (``llmgw.server.state.statefile``); a missing one is created whole.
        """
        try:
            private_dir(self._path.parent)
            with owner_only_umask():  # the file and its -wal/-shm are 0600 from the start
                if not self._path.exists():
                    await self._create()
                refuse_foreign_file(self._path)  # before anything touches a foreign file
                private_files(sidecars(self._path))
                self.conn = await aiosqlite.connect(self._path)
                await check_llmgw_tables(self.conn, self._path, newest=SCHEMA_VERSION)
                await self._prepare(self)
            private_files(sidecars(self._path))  # those made before (or by the lock) too
        except (OSError, aiosqlite.Error) as exc:
            await self.close()
            raise StoreError(f"cannot open the state database {self._path}: {exc}") from exc
        except BaseException:
            await self.close()
            raise

    async def _create(self) -> None:
        """Build a new database under a temporary name beside the path, then link it into
        place: a start cut short leaves no half-made file at the path. Another process
        that created it first wins; its file is used."""
        temp = self._path.with_name(f".{self._path.name}.new-{os.getpid()}-{new_cluster_id()[:8]}")
        try:
            os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            made = SqliteBackend(temp, self._prepare)
            made.conn = await aiosqlite.connect(temp)
            try:
                await self._prepare(made)
            finally:
                await made.close()
            with contextlib.suppress(FileExistsError):
                os.link(temp, self._path)
            _sync_directory(self._path.parent)
        finally:
            for leftover in (temp, Path(f"{temp}-wal"), Path(f"{temp}-shm")):
                leftover.unlink(missing_ok=True)

    async def durable(self) -> None:
        """WAL with ``synchronous=FULL``: a write that returned survives a kill -9."""
        await self._db.execute("PRAGMA journal_mode=WAL")
        await self._db.execute("PRAGMA synchronous=FULL")

    async def close(self) -> None:
        if self.conn is not None:
            conn, self.conn = self.conn, None
            await conn.close()

    @property
    def _db(self) -> aiosqlite.Connection:
        if self.conn is None:
            raise StoreError("the state database is not open")
        return self.conn

    @contextlib.contextmanager
    def _mapped(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            mapped = unwritable(exc)
            if mapped is None:
                raise
            raise mapped from exc

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with self._mapped():
            async with self._db.execute(sql, params) as cursor:
                return list(await cursor.fetchall())

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        with self._mapped():
            async with self._db.execute(sql, params) as cursor:
                return max(cursor.rowcount, 0)

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        rows = list(rows)
        if rows:
            with self._mapped():
                await self._db.executemany(sql, rows)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        # sqlite3 opens the transaction itself before the first INSERT, UPDATE or DELETE.
        try:
            yield
            with self._mapped():
                await self._db.commit()
        except BaseException:
            if self.conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    await self.conn.rollback()
            raise

    def changes(self) -> int:
        return self.conn.total_changes if self.conn is not None else 0

    async def schema_version(self) -> int:
        rows = await self.fetch("PRAGMA user_version")
        return int(rows[0][0]) if rows else 0

    async def migrate(self, scripts: Sequence[str], version: int) -> None:
        script = "".join(scripts) + await self._add_columns()
        # One transaction: a migration cut short leaves the file at its old version.
        with self._mapped():
            await self._db.executescript(
                f"BEGIN;\n{script}\nPRAGMA user_version={version};\nCOMMIT;"
            )

    async def _add_columns(self) -> str:
        """``ALTER TABLE … ADD COLUMN`` for each column of version 6 the file lacks (SQLite
        has no ADD COLUMN IF NOT EXISTS); a table the same migration creates has them."""
        script = ""
        for table, column, kind in COLUMNS_6:
            present = {str(row[1]) for row in await self.fetch(f"PRAGMA table_info({table})")}
            if column not in present:  # an absent table is created earlier in the script
                script += f"ALTER TABLE {table} ADD COLUMN {column} {kind};\n"
        return script

    async def probe_write(self) -> None:
        """Write the schema version again, unchanged (a page is written, no row changes)."""
        try:
            version = await self.schema_version()
            with self._mapped():
                await self._db.execute(f"PRAGMA user_version={version}")
        except BaseException:
            if self.conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    await self.conn.rollback()
            raise


def _sync_directory(folder: Path) -> None:
    """Make a new name in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
