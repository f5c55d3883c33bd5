"""bench/pgrun.py and the ``--db`` choice of bench/control.py and bench/reconcile.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import asyncpg
import pytest

from bench import control
from bench.controlkit.report import backend_rows
from bench.controlkit.step import Step
from bench.pgcluster import PrivateCluster
from bench.pgrun import backends, cluster_cpu_seconds, cluster_pids, pin_cluster
from bench.reconcile import timed_writes
from llmgw.server.state.store import Store


def test_backends_names_each_run_sqlite_first() -> None:
    assert backends("sqlite") == ("sqlite",)
    assert backends("postgresql") == ("postgresql",)
    assert backends("both") == ("sqlite", "postgresql")
    with pytest.raises(ValueError, match="mysql"):
        backends("mysql")


def test_control_db_option_defaults_to_sqlite_and_refuses_others() -> None:
    assert control.parse_main([]).db == "sqlite"
    assert control.parse_main(["--db", "both"]).db == "both"
    with pytest.raises(SystemExit):
        control.parse_main(["--db", "mysql"])


def _step(label: str, agents: int, cpu_s: float, p99: int) -> Step:
    return Step(
        label=label, agents=agents, registered=agents, reg_wall_s=1.0, reg_p99_ms=5,
        window_s=10.0, heartbeats=10 * agents, acks=10 * agents, rtt_p50_ms=1, rtt_p99_ms=p99,
        server_cpu_s=cpu_s, server_rss_mib=50.0, client_cpu_s=1.0, other_cpu_s=0.0,
        client_lag_p99_ms=1, reconnects=0, connected=agents,
    )  # fmt: skip


def test_backend_rows_divide_postgresql_cpu_per_heartbeat_by_sqlite() -> None:
    ramp = [
        _step("lite", 100, 1.0, 8),
        _step("lite", 200, 2.0, 9),
        _step("pg", 100, 1.2, 12),  # 1.2× at 100 agents
        _step("pg", 200, 4.0, 900),  # 2× at 200: over the 1.5× limit
    ]
    rows = backend_rows(ramp, "lite", "pg")
    assert [r[0] for r in rows] == ["100", "200"]
    assert rows[0][1:] == ["8", "12", "1,000", "1,200", "1.20×", "yes"]
    assert rows[1][5:] == ["2.00×", "NO"]
    assert backend_rows(ramp[:2], "lite", "pg") == []


async def test_cluster_cpu_counts_the_backends_work(pg_cluster: PrivateCluster) -> None:
    pin_cluster(pg_cluster, min(os.sched_getaffinity(0)))
    before = cluster_cpu_seconds(pg_cluster)
    conn = await asyncpg.connect(pg_cluster.url())
    try:
        assert len(cluster_pids(pg_cluster)) > 1  # the postmaster and its children
        await conn.execute("SELECT count(*) FROM generate_series(1, 3000000)")
        alive = cluster_cpu_seconds(pg_cluster) - before  # the live backend's own counters
    finally:
        await conn.close()
    assert alive >= 0.05
    # a closed backend's CPU counts once the postmaster has reaped it (cutime): soon after,
    # later on a loaded machine
    for _ in range(150):
        if cluster_cpu_seconds(pg_cluster) - before >= alive - 0.02:
            break
        await asyncio.sleep(0.1)
    assert cluster_cpu_seconds(pg_cluster) - before >= alive - 0.02


async def test_timed_writes_records_each_save_replicas(db: Path | str) -> None:
    async with Store(db) as store:
        calls = timed_writes(store)
        await store.save_replicas([])
        await store.save_replicas(iter([]))
    assert [rows for rows, _ in calls] == [0, 0]
    assert all(seconds >= 0 for _, seconds in calls)
