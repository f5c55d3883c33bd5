"""A private PostgreSQL cluster for tests and benchmarks: ``initdb`` into a folder of its
own, listening on 127.0.0.1 only (on a free port) and on a unix socket in that folder,
stopped and removed after.

PostgreSQL refuses to run as root, so as root (CI) the folder is given to the ``postgres``
system user (Debian's package makes it), or to ``nobody``, and every PostgreSQL program
runs through ``runuser -u USER``. The binaries are found on ``PATH`` or in Debian's
``/usr/lib/postgresql/VERSION/bin`` (newest first): :func:`find_bindir` is None when there
are none.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from llmgw.addresses import free_port

__all__ = ["PrivateCluster", "find_bindir", "private_cluster"]

_SUPERUSER = "llmgw"  # the cluster's own superuser (initdb -U), whoever runs it
_START_TIMEOUT_S = 60


def find_bindir() -> Path | None:
    """The folder holding ``initdb``, ``pg_ctl`` and ``postgres``; None when absent."""
    on_path = shutil.which("initdb")
    if on_path is not None and shutil.which("pg_ctl") is not None:
        return Path(on_path).resolve().parent
    debian = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    return debian[-1].parent if debian else None


def _run_as() -> str | None:
    """The user PostgreSQL runs as when we are root; None when we are not root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError("running as root and neither the postgres nor the nobody user exists")


@dataclass(slots=True)
class PrivateCluster:
    """One running private cluster; :meth:`url` names a database in it."""

    root: Path  # holds data/, the socket and the log
    bindir: Path
    port: int
    user: str | None  # the system user it runs as (as root); None: ours

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "postgres.log"

    def url(self, database: str = "postgres") -> str:
        """A postgresql:// URL of ``database`` over TCP on 127.0.0.1 (no password: trust)."""
        return f"postgresql://{_SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def _command(self, *args: str) -> list[str]:
        prefix = ["runuser", "-u", self.user, "--"] if self.user else []
        return [*prefix, *args]

    def _pg(self, program: str, *args: str, check: bool = True) -> None:
        subprocess.run(
            self._command(str(self.bindir / program), *args),
            check=check,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=_START_TIMEOUT_S,
        )

    def init(self) -> None:
        """``initdb``: trust authentication, no fsync (a test cluster: speed over safety)."""
        self._pg("initdb", "-D", str(self.data), "-U", _SUPERUSER, "-A", "trust", "-E", "UTF8")

    def start(self) -> None:
        """Start it and wait until it takes connections."""
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories={self.root}"
            " -c fsync=off -c full_page_writes=off -c max_connections=200"
        )
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m MODE`` (``fast``: end sessions; ``immediate``: as a crash)."""
        self._pg("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", check=False)


@contextlib.contextmanager
def private_cluster(bindir: Path) -> Iterator[PrivateCluster]:
    """A private cluster started in a new temporary folder; stopped and removed after."""
    user = _run_as()
    # Under /tmp: the postgres user can reach it (a $TMPDIR under /root it could not), and
    # the socket's path stays within a unix socket's 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="llmgw-pg-", dir="/tmp"))
    try:
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chown(root, entry.pw_uid, entry.pw_gid)
        root.chmod(0o700)
        cluster = PrivateCluster(root, bindir, free_port(), user)
        cluster.init()
        cluster.start()
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
