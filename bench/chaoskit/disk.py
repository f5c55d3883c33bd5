"""The chaos run's state disk: the server's database on a small tmpfs that the run mounts and
the ``fill-disk`` fault fills with a file, frees, fills again and frees.

Mounting needs root (`StateDisk.mount` answers why not, and the run leaves the fault out);
`StateDisk.close` frees and unmounts it, whatever happened (lazily: a process still holding
a file there lets go when it ends).
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Final

SIZE: Final = "16m"  # the database and its WAL (up to ~4 MiB between checkpoints) fit well
_CHUNK: Final = b"\0" * (256 << 10)


class StateDisk:
    """A tmpfs at ``path`` for the server's database, and the file that fills it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.filler = path / "filler"
        self.mounted = False

    def mount(self) -> str | None:
        """Mount it; None when it is, else why not (in words)."""
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={SIZE},mode=0700", "tmpfs", str(self.path)],
                capture_output=True,
                text=True,
                check=False,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"mount: {exc}"
        if done.returncode != 0:
            return (done.stderr.strip() or f"mount exited {done.returncode}").splitlines()[0]
        self.mounted = True
        return None

    def fill(self) -> int:
        """Write the filler until no byte is left (ENOSPC); the bytes it holds."""
        with self.filler.open("ab", buffering=0) as out:
            for chunk in (_CHUNK, b"\0" * 4096, b"\0"):  # to the last byte of the last page
                try:
                    while out.write(chunk):
                        pass
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
        if os.statvfs(self.path).f_bavail:
            raise RuntimeError(f"{self.path} has room left after filling it")
        return self.filler.stat().st_size

    def free(self) -> None:
        """Remove the filler."""
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        """Free and unmount (lazily); safe to call twice."""
        self.free()
        if self.mounted:
            self.mounted = False
            subprocess.run(["umount", "-l", str(self.path)], check=False, timeout=30)
