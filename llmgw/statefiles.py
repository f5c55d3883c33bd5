"""Owner-only state on disk, shared by every process that keeps secrets in files.

The server's SQLite file holds engine API keys and profile environments (HF tokens); the
agent's state directory holds engine records and their key files. Both live in a directory
only their owner may enter (0700) and in files only their owner may read (0600), as
PostgreSQL keeps its data directory. :func:`private_dir` creates such a directory, or
tightens one that exists with looser modes; :func:`private_files` tightens files already
there, :func:`private_tree` a whole directory and what it holds; :func:`owner_only_umask`
makes files that a library creates (SQLite's database and its ``-wal``/``-shm`` files)
owner-only from their first byte. Every tightening is logged at WARNING, naming the path
and both modes. Imports nothing else of llmgw.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
OWNER_ONLY_UMASK = 0o077


def private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) as 0700, or tighten it to 0700 if it is looser.

    Parents that already exist keep their modes; parents created here are 0700 too. A
    symlink to a directory is followed: its target is what gets tightened. A directory
    that is not this user's own (sticky like ``/tmp``, owned by another user, or the home
    directory) is left as it is, with a warning: the files in it are still 0600.
    """
    with owner_only_umask():
        path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    info = path.stat()
    shared = info.st_mode & stat.S_ISVTX or info.st_uid != os.geteuid()
    if shared or path.resolve() == Path.home().resolve():
        if stat.S_IMODE(info.st_mode) & ~DIR_MODE:
            log.warning(
                "%s is a shared directory (mode %04o): left as it is; its llmgw files are "
                "owner-only, but a directory of their own is safer",
                path,
                stat.S_IMODE(info.st_mode),
            )
        return
    _tighten(path, DIR_MODE)


def private_files(paths: Iterable[Path]) -> None:
    """Tighten each file of ``paths`` that exists and is not a symlink to at most 0600."""
    for path in paths:
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode):
            _tighten(path, FILE_MODE)


def private_tree(root: Path) -> None:
    """:func:`private_dir` on ``root``, then every directory under it to 0700 and every
    regular file to 0600 (symlinks are not followed; sockets and FIFOs are left alone)."""
    private_dir(root)
    for top, dirs, files in os.walk(root):
        for name in dirs:
            if not (Path(top) / name).is_symlink():
                _tighten(Path(top) / name, DIR_MODE)
        private_files(Path(top) / name for name in files)


def sidecars(db: Path) -> list[Path]:
    """``db`` and every file beside it whose name starts with its name (an SQLite file's
    ``-wal``, ``-shm`` and ``-journal``, and any lock file named after it)."""
    if not db.parent.is_dir():
        return []
    return sorted(p for p in db.parent.iterdir() if p.name.startswith(db.name))


@contextlib.contextmanager
def owner_only_umask() -> Iterator[None]:
    """Run the block with umask 077, so that whatever it creates is owner-only.

    The umask belongs to the whole process: use it around short creation steps only.
    """
    previous = os.umask(OWNER_ONLY_UMASK)
    try:
        yield
    finally:
        os.umask(previous)


def _tighten(path: Path, most: int) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & ~most:
        tightened = mode & most
        try:
            os.chmod(path, tightened)
        except OSError as exc:  # a read-only filesystem: say so, and go on with what is there
            log.warning("%s is readable by others (mode %04o) and stays so: %s", path, mode, exc)
            return
        log.warning(
            "%s was readable by others (mode %04o): tightened to %04o", path, mode, tightened
        )
