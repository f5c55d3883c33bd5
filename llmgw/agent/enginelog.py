"""An engine's log: the file it writes itself, and the last lines of it kept in memory.

The engine's stdout and stderr go straight to ``STATE_DIR/logs/SHARD.log`` (appended; the
agent writes a header line before each start, after the run before became
``SHARD.previous.log``: ``llmgw.agent.logfiles`` has the layout). The agent follows the file
from where the engine started writing, so the ring buffer works the same for engines it
spawned and for engines it adopted after a restart. Once the file passes
``max_file_bytes`` (checked at each refresh) it is rotated to ``SHARD.log.1`` and emptied.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from pathlib import Path

from llmgw.agent.logfiles import DEFAULT_MAX_BYTES, LogFiles

DEFAULT_LINES = 1000

log = logging.getLogger(__name__)
_READ_LIMIT = 1 << 20  # per refresh; a faster writer is skipped ahead to its tail
_TAIL_BYTES = 64 << 10


class EngineLog:
    """The log file of one shard and a ring buffer of its last lines."""

    def __init__(
        self,
        path: Path,
        *,
        max_lines: int = DEFAULT_LINES,
        max_file_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.path = path
        self.files = LogFiles(path.parent, path.name.removesuffix(".log"))
        self.max_file_bytes = max_file_bytes
        self._lines: deque[str] = deque(maxlen=max_lines)
        self._offset = 0
        self._partial = b""

    def open_for_engine(self, header: str) -> int:
        """A file descriptor for the engine's stdout/stderr (the caller closes it)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.files.start_run()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        os.write(fd, f"=== llmgw {stamp}: {header}\n".encode())
        self.follow_from(os.fstat(fd).st_size)
        return fd

    def follow_from(self, offset: int) -> None:
        """Read the file from ``offset`` on (the ring buffer keeps what was read before)."""
        self._offset = offset
        self._partial = b""

    def follow_tail(self) -> None:
        """Follow an existing file from near its end (an adopted engine's log)."""
        try:
            size = self.path.stat().st_size
        except OSError:
            size = 0
        self.follow_from(max(0, size - _TAIL_BYTES))

    def refresh(self) -> None:
        """Take in what the engine wrote since the last call."""
        try:
            with self.path.open("rb") as file:
                size = os.fstat(file.fileno()).st_size
                if size < self._offset:  # truncated or replaced
                    self.follow_from(0)
                if size - self._offset > _READ_LIMIT:
                    self.follow_from(size - _TAIL_BYTES)
                file.seek(self._offset)
                chunk = file.read(size - self._offset)
        except OSError:
            return
        self._offset += len(chunk)
        *complete, self._partial = (self._partial + chunk).split(b"\n")
        self._lines.extend(line.decode("utf-8", "replace").rstrip("\r") for line in complete)
        if self._offset > self.max_file_bytes:
            self._rotate()

    def _rotate(self) -> None:
        try:
            self.files.rotate()
        except OSError as exc:  # a full disk: the engine goes on appending
            log.warning("log of shard %s not rotated: %s", self.files.shard_id, exc)
            return
        self.follow_from(0)

    def tail(self, lines: int | None = None) -> list[str]:
        """The last ``lines`` lines (all that are kept when None)."""
        kept = list(self._lines)
        return kept if lines is None else kept[-lines:] if lines > 0 else []

    def last_line(self, limit: int = 200) -> str:
        """The last non-empty line, cut to ``limit`` characters ('' when there is none)."""
        for line in reversed(self._lines):
            if line.strip() and not line.startswith("=== llmgw "):
                text = line.strip()
                return text if len(text) <= limit else text[: limit - 1] + "…"
        return ""
