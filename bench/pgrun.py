"""Running a benchmark on SQLite, on PostgreSQL, or on both in one run.

``--db sqlite|postgresql|both`` is parsed by :func:`backends`. For PostgreSQL a private
cluster (:mod:`bench.pgcluster`: ``initdb`` into a temporary folder, 127.0.0.1 only, no
fsync) is started by :func:`postgres`, and removed after. With SQLite the server's store
work happens in the server process; with PostgreSQL much of it happens in the cluster's
own processes, so :func:`cluster_cpu_seconds` reads their CPU time from ``/proc`` (the
postmaster, its live children, and the children it has already reaped) for the benchmark
to add to the server's, and :func:`pin_cluster` pins them to the server's CPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from bench.kit import CLK_TCK
from bench.pgcluster import PrivateCluster, find_bindir, private_cluster

__all__ = [
    "BACKENDS",
    "backends",
    "cluster_cpu_seconds",
    "cluster_pids",
    "pin_cluster",
    "postgres",
]

BACKENDS = ("sqlite", "postgresql", "both")


def backends(choice: str) -> tuple[str, ...]:
    """The backends ``--db CHOICE`` names, in the order they run: SQLite first."""
    if choice == "both":
        return ("sqlite", "postgresql")
    if choice in ("sqlite", "postgresql"):
        return (choice,)
    raise ValueError(f"--db must be one of {', '.join(BACKENDS)}, not {choice!r}")


@contextlib.contextmanager
def postgres() -> Iterator[PrivateCluster]:
    """A private PostgreSQL cluster for the run; a clear error when none is installed."""
    bindir = find_bindir()
    if bindir is None:
        raise SystemExit(
            "--db postgresql needs PostgreSQL's server programs (initdb, pg_ctl) on PATH "
            "or in /usr/lib/postgresql/VERSION/bin (Debian: apt-get install postgresql)"
        )
    with private_cluster(bindir) as cluster:
        yield cluster


def _postmaster(cluster: PrivateCluster) -> int:
    """The postmaster's pid: the first line of ``postmaster.pid`` in the data folder."""
    return int((cluster.data / "postmaster.pid").read_text().split("\n", 1)[0])


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (field 3 onwards)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def cluster_pids(cluster: PrivateCluster) -> list[int]:
    """The postmaster and every live process it forked (backends, checkpointer, …)."""
    parent = _postmaster(cluster)
    pids = [parent]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int(_stat(int(entry.name))[1]) == parent:
                    pids.append(int(entry.name))
    return pids


def cluster_cpu_seconds(cluster: PrivateCluster) -> float:
    """User + system CPU seconds the cluster used so far: its live processes', plus what
    the postmaster's reaped children used (``cutime + cstime``: closed connections)."""
    parent = _postmaster(cluster)
    fields = _stat(parent)
    total = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    for pid in cluster_pids(cluster)[1:]:
        with contextlib.suppress(OSError, IndexError):
            child = _stat(pid)
            total += int(child[11]) + int(child[12])
    return total / CLK_TCK


def pin_cluster(cluster: PrivateCluster, cpu: int) -> None:
    """Pin the cluster's processes to ``cpu``; backends forked later inherit it."""
    for pid in cluster_pids(cluster):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, {cpu})
