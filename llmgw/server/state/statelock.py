"""One control server per state database: an exclusive lock beside the file.

Two servers on one ``--db`` would each keep their own view of the fleet in memory and
write over each other's decisions. So ``llmgw server`` takes ``FILE.lock`` (beside the
database ``FILE``) with ``flock(LOCK_EX | LOCK_NB)`` before it opens the database or binds
a port, and holds it until it exits; the kernel lets go of it however the process ends
(even ``kill -9``), so a stale lock never needs removing by hand. The holder writes who it
is into the file (pid, host, start time, as JSON), and a second server refuses at once,
naming it. ``llmgw token`` does not take the lock: it writes the database while the server
runs, and SQLite's own locking keeps those writes whole.

``flock`` locks are local to one machine: a database on a network file system shared by
two hosts is not protected by it (keep the state on a local disk).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from llmgw.server.errors import StoreError
from llmgw.statefiles import private_dir


def lock_path(db_path: Path) -> Path:
    """Where the lock of the database ``db_path`` is: ``FILE.lock`` beside it."""
    return db_path.with_name(db_path.name + ".lock")


@contextlib.contextmanager
def hold_state_lock(db_path: Path) -> Iterator[Path]:
    """Hold the exclusive lock of ``db_path`` for the duration; StoreError naming the holder
    when another process has it. Yields the lock file's path."""
    path = lock_path(db_path)
    try:
        private_dir(path.parent)  # the state directory is owner-only from the start
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StoreError(f"cannot create the lock {path} of {db_path}: {exc}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(f"{db_path} is in use by {_holder(fd)}") from None
        except OSError as exc:
            raise StoreError(f"cannot lock {path} of {db_path}: {exc}") from exc
        _write_holder(fd)
        yield path
    finally:
        os.close(fd)  # releases the lock


def _write_holder(fd: int) -> None:
    since = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since})
    os.ftruncate(fd, 0)
    os.pwrite(fd, (text + "\n").encode(), 0)
    os.fsync(fd)


def _holder(fd: int) -> str:
    """Who holds the lock, in words, from what it wrote into the file."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        pid, host, since = int(data["pid"]), str(data["host"]), str(data["since"])
    except (OSError, ValueError, KeyError, TypeError):
        return "another llmgw server (it has not said which yet): stop it, or use another --db"
    return (
        f"llmgw server pid {pid} on host {host} since {since}: stop it, or give this server "
        "another --db"
    )
