"""What ``llmgw.server.state.store`` needs of a database: the backend protocol, and which
backend a ``--db`` value names.

Two backends implement :class:`Backend`: SQLite (``llmgw.server.state.storesqlite``: a
file, through aiosqlite) and PostgreSQL (``llmgw.server.state.storepg``: a
``postgresql://`` URL, through asyncpg). The store writes its SQL once, with ``?``
parameters and SQLite's types; the PostgreSQL backend converts both in one place each
(``storepg.dollar_params``, ``storepg.postgres_ddl``). Each backend maps its driver's
exceptions to the server's (``StoreError``, ``StoreUnwritable``) inside its own methods, so
no driver exception leaves a backend but an SQLite error that is our bug (as before).

``--db`` (:func:`parse_db`): a ``postgresql://`` or ``postgres://`` URL is PostgreSQL
(:class:`PostgresUrl`, shown and logged with its password hidden); anything else with a
``scheme://`` is refused; the rest is an SQLite file path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from llmgw.server.errors import ConfigError

Row = Sequence[Any]
"""One row a query returned, its columns by position."""

POSTGRES_SCHEMES = ("postgresql", "postgres")
URL_FORM = "postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE"
_HIDDEN = "***"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class Backend(Protocol):
    """One open database behind the store."""

    nodes_order: str
    """What ``ORDER BY`` lists the nodes oldest first with (SQLite's ``rowid``)."""
    lock_rows_sql: str
    """What a ``SELECT`` ends with to lock the rows it reads until the transaction ends
    (PostgreSQL's ``FOR UPDATE``; SQLite has one writer, and no such clause)."""
    now_ms_sql: str
    """An SQL expression of the database's clock in Unix milliseconds (the lease's clock:
    one clock for every server of a database, whatever their own say)."""

    @property
    def where(self) -> str:
        """The database, for messages: a file's path, or a URL with its password hidden."""
        ...

    async def open(self) -> None:
        """Connect, refusing a database that is not llmgw's; StoreError when it cannot."""
        ...

    async def close(self) -> None:
        """Disconnect; safe to call twice."""
        ...

    async def durable(self) -> None:
        """After the schema is current: make a commit survive a kill -9 (SQLite's WAL and
        ``synchronous=FULL``; PostgreSQL's commit already does)."""
        ...

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """The rows of one query (inside the current transaction, if one is open)."""
        ...

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; how many rows it changed."""
        ...

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """Run one statement once per row (nothing when there are none)."""
        ...

    def transaction(self) -> AbstractAsyncContextManager[None]:
        """The statements run inside, committed together when it ends, rolled back when an
        exception leaves it."""
        ...

    def changes(self) -> int:
        """A count of rows changed since the connection opened (it grows with each write
        that changed a row: what ``WriteHealth`` compares)."""
        ...

    async def schema_version(self) -> int:
        """The stored schema version; 0 for an empty database."""
        ...

    async def migrate(self, scripts: Sequence[str], version: int) -> None:
        """Run ``scripts`` (the SQLite-typed DDL of each version after the stored one, in
        order) and store ``version``, in one transaction; the columns of version 6 that a
        database lacks are added too."""
        ...

    async def probe_write(self) -> None:
        """A write that changes nothing: whether the database takes writes now."""
        ...


@dataclass(frozen=True, slots=True)
class PostgresUrl:
    """A ``--db`` that names a PostgreSQL database; ``str()`` hides its password."""

    url: str = field(repr=False)

    def __str__(self) -> str:
        return redact_url(self.url)

    def __repr__(self) -> str:
        return f"PostgresUrl({redact_url(self.url)!r})"


DbTarget = Path | PostgresUrl
"""What ``--db`` names: an SQLite file or a PostgreSQL database."""


def parse_db(text: str, flag: str = "--db") -> DbTarget:
    """``text`` as a database: a PostgreSQL URL, else a file path; ConfigError naming
    ``flag`` when it is a URL that will not do (the message never holds its password)."""
    scheme = _SCHEME.match(text)
    if scheme is None:
        return Path(text)
    if scheme.group(1).lower() not in POSTGRES_SCHEMES:
        raise ConfigError(
            f"{flag} {redact_url(text)!r}: only postgresql:// URLs ({URL_FORM}) or a file path"
        )
    why = _url_problem(text)
    if why is not None:
        raise ConfigError(
            f"{flag} {redact_url(text)!r} is not a PostgreSQL URL ({URL_FORM}): {why}"
        )
    return PostgresUrl(text)


def _url_problem(text: str) -> str | None:
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        return str(exc)
    query = dict(parse_qsl(parts.query))
    if not (parts.hostname or query.get("host")):
        return "no host"
    if port == 0:
        return "port 0"
    if not parts.path.strip("/"):
        return "no database name"
    if "/" in parts.path.strip("/"):
        return f"{parts.path!r} is not one database name"
    if parts.fragment:
        return "a #fragment"
    return None


def redact_url(text: str) -> str:
    """``text`` with the password of its user part and any ``password=`` in its query
    replaced by ``***`` (unparseable text is hidden after its scheme)."""
    try:
        parts = urlsplit(text)
        user, at, host = parts.netloc.rpartition("@")
        if at and ":" in user:
            user = f"{user.split(':', 1)[0]}:{_HIDDEN}"
        query = [
            (key, _HIDDEN if key.lower() == "password" else value)
            for key, value in parse_qsl(parts.query, keep_blank_values=True)
        ]
        netloc = f"{user}{at}{host}"
        return urlunsplit((parts.scheme, netloc, parts.path, urlencode(query, safe="*"), ""))
    except ValueError:
        scheme = _SCHEME.match(text)
        return f"{scheme.group(0) if scheme else ''}{_HIDDEN}"
