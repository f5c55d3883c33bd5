"""Real PostgreSQL for the tests: one private cluster per session (``bench/pgcluster.py``:
``initdb`` into a temporary folder, as the ``postgres`` user when we are root, on
127.0.0.1 and a free port), one database per test, created before it and dropped after.

``db`` is the store tests' one fixture over both backends: each test that takes it runs
twice, on an SQLite file and on a PostgreSQL database. Without PostgreSQL's binaries the
PostgreSQL variants skip, saying why, but under ``CI=true`` (``.ci/run`` installs
PostgreSQL) a missing PostgreSQL fails them.

tests/conftest.py imports these fixtures, so every test directory has them.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from bench.pgcluster import PrivateCluster, find_bindir, private_cluster

__all__ = ["db", "pg_cluster", "pg_execute", "pg_fetch", "pg_url"]


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PrivateCluster]:
    """The session's private PostgreSQL cluster."""
    bindir = find_bindir()
    if bindir is None:
        why = "no PostgreSQL binaries (initdb, pg_ctl) on PATH or in /usr/lib/postgresql/*/bin"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}: under CI=true PostgreSQL must be there (.ci/run installs it)")
        pytest.skip(f"{why}: apt-get install postgresql to run the PostgreSQL variants")
    with private_cluster(bindir) as cluster:
        yield cluster


def _client(cluster: PrivateCluster, program: str, *args: str) -> None:
    subprocess.run(
        [str(cluster.bindir / program), "-h", "127.0.0.1", "-p", str(cluster.port), *args],
        check=True,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
    )


@pytest.fixture
def pg_url(pg_cluster: PrivateCluster) -> Iterator[str]:
    """The URL of a new empty database of the private cluster, dropped after the test."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    _client(pg_cluster, "createdb", "-U", "llmgw", name)
    try:
        yield pg_cluster.url(name)
    finally:
        _client(pg_cluster, "dropdb", "-U", "llmgw", "--force", "--if-exists", name)


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """A state database that does not exist yet: an SQLite file's path, or the URL of an
    empty PostgreSQL database."""
    if request.param == "sqlite":
        return tmp_path / "s.db"
    url: str = request.getfixturevalue("pg_url")
    return url


async def pg_execute(url: str, sql: str) -> None:
    """Run ``sql`` (statements, no parameters) on the database at ``url``."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def pg_fetch(url: str, sql: str) -> list[tuple[object, ...]]:
    """The rows of one query on the database at ``url``."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        return [tuple(row) for row in await conn.fetch(sql)]
    finally:
        await conn.close()
