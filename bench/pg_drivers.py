"""asyncpg against psycopg 3 (async) on the store's kind of writes, on a private cluster.

    python -m bench.pg_drivers [--upserts 10000] [--batch 100] [--singles 1000] [--rounds 3]

Two workloads, each on a fresh table per driver and round: ``--upserts`` small upserts
(``INSERT … ON CONFLICT DO UPDATE`` of a text key and two integers, what ``touch_nodes``
and ``save_replicas`` write) in transactions of ``--batch`` rows through ``executemany``;
and ``--singles`` single-row writes, each its own transaction (what an audit record or a
cordon is). Prints the best round's wall time and this process's CPU time per driver, and
the ratio to asyncpg's. The cluster runs with ``fsync=off`` (``bench/pgcluster.py``): the
figures are the drivers' cost and the round trips, not the disk's.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import psycopg

from bench.pgcluster import find_bindir, private_cluster

_TABLE = "CREATE TABLE t (k TEXT PRIMARY KEY, a BIGINT NOT NULL, b BIGINT NOT NULL)"
_UPSERT = "INSERT INTO t (k, a, b) VALUES ({}, {}, {}) ON CONFLICT (k) DO UPDATE SET a = excluded.a"


@dataclass(frozen=True, slots=True)
class Figures:
    """One workload's best round: wall seconds and this process's CPU seconds."""

    wall_s: float
    cpu_s: float


Rows = Sequence[tuple[str, int, int]]


async def _asyncpg_batches(url: str, rows: Rows, batch: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("DROP TABLE IF EXISTS t; " + _TABLE)
        sql = _UPSERT.format("$1", "$2", "$3")
        for start in range(0, len(rows), batch):
            async with conn.transaction():
                await conn.executemany(sql, rows[start : start + batch])
    finally:
        await conn.close()


async def _asyncpg_singles(url: str, rows: Rows, batch: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("DROP TABLE IF EXISTS t; " + _TABLE)
        sql = _UPSERT.format("$1", "$2", "$3")
        for row in rows:
            await conn.execute(sql, *row)
    finally:
        await conn.close()


async def _psycopg_batches(url: str, rows: Rows, batch: int) -> None:
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    try:
        await conn.execute("DROP TABLE IF EXISTS t")
        await conn.execute(_TABLE)
        sql = _UPSERT.format("%s", "%s", "%s")
        for start in range(0, len(rows), batch):
            async with conn.transaction(), conn.cursor() as cur:
                await cur.executemany(sql, rows[start : start + batch])
    finally:
        await conn.close()


async def _psycopg_singles(url: str, rows: Rows, batch: int) -> None:
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True, prepare_threshold=0)
    try:
        await conn.execute("DROP TABLE IF EXISTS t")
        await conn.execute(_TABLE)
        sql = _UPSERT.format("%s", "%s", "%s")
        for row in rows:
            await conn.execute(sql, row)
    finally:
        await conn.close()


Work = Callable[[str, Rows, int], Awaitable[None]]


async def _best(work: Work, url: str, rows: Rows, batch: int, rounds: int) -> Figures:
    best: Figures | None = None
    for _ in range(rounds):
        wall, cpu = time.perf_counter(), time.process_time()
        await work(url, rows, batch)
        took = Figures(time.perf_counter() - wall, time.process_time() - cpu)
        if best is None or took.wall_s < best.wall_s:
            best = took
    assert best is not None
    return best


async def _measure(url: str, args: argparse.Namespace) -> list[tuple[str, str, Figures]]:
    upserts = [(f"node-{i % 2000}", i, i * 7) for i in range(args.upserts)]
    singles = [(f"audit-{i}", i, i) for i in range(args.singles)]
    cases: list[tuple[str, str, Work, Rows]] = [
        ("asyncpg", f"{args.upserts} upserts, batches of {args.batch}", _asyncpg_batches, upserts),
        ("psycopg", f"{args.upserts} upserts, batches of {args.batch}", _psycopg_batches, upserts),
        ("asyncpg", f"{args.singles} single-row writes", _asyncpg_singles, singles),
        ("psycopg", f"{args.singles} single-row writes", _psycopg_singles, singles),
    ]
    return [
        (driver, what, await _best(work, url, rows, args.batch, args.rounds))
        for driver, what, work, rows in cases
    ]


def _table(results: list[tuple[str, str, Figures]]) -> str:
    base: dict[str, Figures] = {what: f for driver, what, f in results if driver == "asyncpg"}
    lines = [f"{'workload':<36} {'driver':<8} {'wall s':>8} {'cpu s':>8} {'wall/asyncpg':>13}"]
    for driver, what, f in results:
        ratio = f.wall_s / base[what].wall_s
        lines.append(f"{what:<36} {driver:<8} {f.wall_s:>8.3f} {f.cpu_s:>8.3f} {ratio:>12.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison on a private cluster and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--upserts", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--singles", type=int, default=1_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    bindir = find_bindir()
    if bindir is None:
        print("no PostgreSQL binaries (initdb) on PATH or in /usr/lib/postgresql")
        return 1
    with private_cluster(bindir) as cluster:
        results: Any = asyncio.run(_measure(cluster.url(), args))
    print(_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
