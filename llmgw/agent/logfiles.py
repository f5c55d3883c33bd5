"""Where an agent keeps each shard's engine output, how much of it, and for how long.

In ``STATE_DIR/logs/`` (0700, its files 0600), per shard:

- ``SHARD.log``: the current run, written by the engine itself (its stdout and stderr,
  appended, after one ``=== llmgw`` header line the agent writes before each start);
- ``SHARD.log.1``: the older part of the current run. Once ``SHARD.log`` passes
  ``max_bytes`` (default 10 MiB, ``llmgw agent --log-max-bytes``) it is copied here and
  emptied in place (the engine appends, so it goes on writing at the start of the emptied
  file; a line written during the copy may be lost, as with logrotate's ``copytruncate``);
- ``SHARD.previous.log``: the run before the engine's last start (the last ``max_bytes``
  of it at most), what ``llmgw logs --previous`` shows.

So a shard holds at most three times ``max_bytes`` on disk. Once the agent no longer runs
a shard, its files are removed ``retention`` after their last write (default 24 h,
``llmgw agent --log-retention``): :func:`prune`.

Reading (``llmgw.agent.logserve``): :func:`tail_lines` gives a run's last lines, and
:class:`LogFollower` what is appended to the current run from a point on, across the
copy-and-empty of a rotation and across a restart (the old file becomes the previous one).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmgw.statefiles import FILE_MODE

DEFAULT_MAX_BYTES = 10 << 20
DEFAULT_RETENTION_S = 24 * 3600.0
_BLOCK = 64 << 10
_SUFFIXES = (".previous.log", ".log.1", ".log")  # longest first: ".log" ends them all


@dataclass(frozen=True, slots=True)
class LogFiles:
    """The files of one shard's engine output (see the module doc)."""

    directory: Path
    shard_id: str

    @property
    def current(self) -> Path:
        return self.directory / f"{self.shard_id}.log"

    @property
    def rotated(self) -> Path:
        return self.directory / f"{self.shard_id}.log.1"

    @property
    def previous(self) -> Path:
        return self.directory / f"{self.shard_id}.previous.log"

    def run(self, *, previous: bool = False) -> list[Path]:
        """The files of the current run (or the previous one) that exist, oldest first."""
        paths = [self.previous] if previous else [self.rotated, self.current]
        return [path for path in paths if path.exists()]

    def start_run(self) -> None:
        """Before an engine starts: the run that was current becomes the previous one."""
        try:
            if self.current.stat().st_size == 0:
                return
        except FileNotFoundError:
            return
        self.current.replace(self.previous)
        self.rotated.unlink(missing_ok=True)  # the older part of the run now previous

    def rotate(self) -> None:
        """Copy the current run's file to ``SHARD.log.1`` and empty it in place."""
        partial = self.directory / f".{self.shard_id}.log.1.partial"
        shutil.copyfile(self.current, partial)
        os.chmod(partial, FILE_MODE)
        partial.replace(self.rotated)
        os.truncate(self.current, 0)


def shard_of(name: str) -> str | None:
    """The shard id a log file's name belongs to (None for another file)."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix) and not name.startswith("."):
            return name[: -len(suffix)]
    return None


def prune(
    directory: Path, keep: Collection[str], retention_s: float, now: float | None = None
) -> list[Path]:
    """Remove the log files of shards not in ``keep`` last written over ``retention_s``
    seconds before ``now`` (wall clock: file times are); the paths removed."""
    cutoff = (time.time() if now is None else now) - retention_s
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        shard = shard_of(entry.name)
        if shard is None or shard in keep or not entry.is_file(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except FileNotFoundError:
            continue
    return removed


def tail_lines(files: Sequence[tuple[Path, int]], count: int | None) -> list[bytes]:
    """The last ``count`` lines (every line when None) of ``files`` read as one text (a
    rotation may split a line between two files), each ``(path, end)`` up to byte ``end``;
    a last line without a line end counts. Reads only as much as those lines take."""
    if count is None:
        return list(_lines_of(files))
    if count == 0:
        return []
    blocks: list[bytes] = []  # newest first
    newlines = 0
    for path, end in reversed(files):
        for block in _blocks_backwards(path, end):
            blocks.append(block)
            newlines += block.count(b"\n")
            if newlines > count:
                break
        if newlines > count:
            break
    lines = b"".join(reversed(blocks)).split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return lines[-count:]


def _blocks_backwards(path: Path, end: int) -> Iterator[bytes]:
    try:
        with path.open("rb") as file:
            position = min(end, os.fstat(file.fileno()).st_size)
            while position > 0:
                size = min(_BLOCK, position)
                position -= size
                file.seek(position)
                yield file.read(size)
    except FileNotFoundError:
        return


def _lines_of(files: Sequence[tuple[Path, int]]) -> Iterator[bytes]:
    carry = b""
    for path, end in files:
        try:
            with path.open("rb") as file:
                left = end
                while left > 0 and (block := file.read(min(_BLOCK, left))):
                    left -= len(block)
                    *whole, carry = (carry + block).split(b"\n")
                    yield from whole
        except FileNotFoundError:
            continue
    if carry:
        yield carry


class LogFollower:
    """What is appended to a shard's current run from the moment this was made on."""

    def __init__(self, files: LogFiles) -> None:
        self.files = files
        self._file: int | None = None
        self.offset = 0
        self._rotated_at: int | None = None  # still to read from SHARD.log.1, from here
        try:
            self._file = os.open(files.current, os.O_RDONLY)
            self.offset = os.fstat(self._file).st_size
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._file is not None:
            os.close(self._file)
            self._file = None

    def read(self, limit: int) -> bytes:
        """Up to ``limit`` bytes written since the last call (b"" when there are none)."""
        if self._rotated_at is not None:
            data = _read_at(self.files.rotated, self._rotated_at, limit)
            self._rotated_at = self._rotated_at + len(data) if len(data) == limit else None
            return data
        try:
            seen = os.stat(self.files.current)
        except FileNotFoundError:
            return b""
        if self._file is None:
            self._file = os.open(self.files.current, os.O_RDONLY)
            self.offset = 0
        if os.fstat(self._file).st_ino != seen.st_ino:  # a new run: ours is the previous now
            rest = self._read(self._file, self.offset, limit)
            if len(rest) < limit:
                os.close(self._file)
                self._file, self.offset = None, 0
            return rest
        if seen.st_size < self.offset:  # rotated: what we had not read is in SHARD.log.1
            self._rotated_at, self.offset = self.offset, 0
            return self.read(limit)
        return self._read(self._file, self.offset, limit)

    def _read(self, fd: int, offset: int, limit: int) -> bytes:
        data = os.pread(fd, limit, offset)
        self.offset = offset + len(data)
        return data


def _read_at(path: Path, offset: int, limit: int) -> bytes:
    try:
        with path.open("rb") as file:
            file.seek(offset)
            return file.read(limit)
    except FileNotFoundError:
        return b""
