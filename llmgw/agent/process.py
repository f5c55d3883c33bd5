"""Engine processes: spawned in their own session, watched, and signalled as a group.

An engine is started with ``posix_spawn`` in a new session, so its process group id is
its pid and every process it forks (vLLM's ``EngineCore`` and workers) shares that group:
stopping sends SIGTERM to the group, then SIGKILL to the group after the grace. Its stdin
is /dev/null and its stdout and stderr are appended to its log file, never a pipe, so an
engine keeps running (and logging) when the agent dies.

A process is identified by its pid, its start time in clock ticks since boot (field 22 of
``/proc/PID/stat``) and the boot id: a pid alone may be reused, the three together cannot.
Children of this agent are reaped with ``waitpid``; engines adopted from a previous agent
are not our children, so their end shows in /proc (gone, or a zombie).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmgw.agent.errors import SpawnError

log = logging.getLogger(__name__)

PROC = Path("/proc")
_RESET_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_GONE_STATES = frozenset("ZXx")  # zombie, dead


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """One process, unambiguously: pid, start time (ticks since boot) and boot id."""

    pid: int
    start_ticks: int
    boot_id: str


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` the supervisor reads."""

    state: str
    pgrp: int
    session: int
    start_ticks: int


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """How a process ended: its exit code, ``-N`` for signal N, None when unknown."""

    code: int | None

    def describe(self) -> str:
        if self.code is None:
            return "exited (exit code unknown: not a child of this agent)"
        if self.code < 0:
            try:
                name = signal.Signals(-self.code).name
            except ValueError:
                name = f"signal {-self.code}"
            return f"killed by {name} (exit code {self.code})"
        return f"exited with code {self.code}"


def read_stat(pid: int, proc: Path = PROC) -> ProcStat | None:
    """``/proc/PID/stat`` parsed, or None when there is no such process."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses.
    fields = text[text.rindex(")") + 2 :].split()
    return ProcStat(
        state=fields[0], pgrp=int(fields[2]), session=int(fields[3]), start_ticks=int(fields[19])
    )


def boot_id(proc: Path = PROC) -> str:
    """This boot's id: start times count from boot, so a record from another boot is stale."""
    try:
        return (proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return ""


def identify(pid: int) -> ProcessIdentity | None:
    """The identity of the running process ``pid``, or None when there is none."""
    stat = read_stat(pid)
    if stat is None:
        return None
    return ProcessIdentity(pid=pid, start_ticks=stat.start_ticks, boot_id=boot_id())


def is_running(identity: ProcessIdentity) -> bool:
    """Whether that very process (not a later one with its pid) is alive."""
    stat = read_stat(identity.pid)
    return (
        stat is not None
        and stat.start_ticks == identity.start_ticks
        and identity.boot_id == boot_id()
        and stat.state not in _GONE_STATES
    )


def leftovers(identity: ProcessIdentity) -> list[int]:
    """Processes still in the session of a leader that is gone (vLLM's EngineCore, say).

    Only when no process holds the leader's pid any more: a session id can then only be
    the dead leader's, and members started after it are its children.
    """
    if read_stat(identity.pid) is not None or identity.boot_id != boot_id():
        return []
    found = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        stat = read_stat(int(entry.name))
        if (
            stat is not None
            and stat.session == identity.pid
            and stat.start_ticks >= identity.start_ticks
            and stat.state not in _GONE_STATES
        ):
            found.append(int(entry.name))
    return found


def resolve_command(argv: Sequence[str]) -> str:
    """The executable of ``argv`` (searched on PATH like a shell); SpawnError if none."""
    if not argv:
        raise SpawnError("the engine's command line is empty")
    path = argv[0] if "/" in argv[0] else shutil.which(argv[0])
    if path is None or not os.access(path, os.X_OK):
        raise SpawnError(f"cannot execute {argv[0]!r}: not found or not executable")
    return path


class EngineProcess:
    """One engine's process group, whether this agent spawned it or adopted it."""

    def __init__(self, identity: ProcessIdentity) -> None:
        self.identity = identity
        self._exit: ExitStatus | None = None

    @property
    def pid(self) -> int:
        return self.identity.pid

    @classmethod
    def spawn(cls, argv: Sequence[str], env: Mapping[str, str], log_fd: int) -> EngineProcess:
        """Start ``argv`` in a new session with stdout/stderr on ``log_fd``."""
        path = resolve_command(argv)
        actions = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, log_fd, 1),
            (os.POSIX_SPAWN_DUP2, log_fd, 2),
        ]
        try:
            pid = os.posix_spawn(
                path, list(argv), dict(env), file_actions=actions, setsid=True,
                setsigdef=_RESET_SIGNALS,
            )  # fmt: skip
        except OSError as exc:
            raise SpawnError(f"cannot execute {argv[0]!r}: {exc.strerror or exc}") from exc
        stat = read_stat(pid)
        ticks = stat.start_ticks if stat is not None else 0
        return cls(ProcessIdentity(pid=pid, start_ticks=ticks, boot_id=boot_id()))

    def poll(self) -> ExitStatus | None:
        """None while the engine's main process runs; how it ended once it has."""
        if self._exit is not None:
            return self._exit
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # adopted: someone else's child
            if not is_running(self.identity):
                self._exit = ExitStatus(None)
            return self._exit
        if pid == 0:
            return None
        self._exit = ExitStatus(os.waitstatus_to_exitcode(status))
        return self._exit

    def group_alive(self) -> bool:
        """Whether any process of the engine's group is left."""
        if self._exit is None and self.poll() is None:
            return True
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return False  # the group id now belongs to another user's processes: not ours
        return True

    def signal_group(self, sig: signal.Signals) -> bool:
        """Send ``sig`` to the whole group; False when the group is gone."""
        if not self.group_alive():
            return False
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    async def terminate(self, grace_s: float, *, poll_s: float = 0.05) -> ExitStatus | None:
        """SIGTERM to the group, SIGKILL to the group after ``grace_s``; wait until it is gone."""
        if self.signal_group(signal.SIGTERM):
            if not await self._wait_gone(grace_s, poll_s):
                log.warning(
                    "engine pid %d still running %.1fs after SIGTERM; sending SIGKILL to its group",
                    self.pid,
                    grace_s,
                )
                self.signal_group(signal.SIGKILL)
                if not await self._wait_gone(10.0, poll_s):
                    log.error("engine group %d survived SIGKILL for 10s", self.pid)
        return self.poll()

    async def _wait_gone(self, timeout_s: float, poll_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.group_alive():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True


def kill_leftovers(identity: ProcessIdentity) -> int:
    """SIGKILL what is left of a dead leader's session; returns how many were signalled."""
    count = 0
    for pid in leftovers(identity):
        try:
            os.kill(pid, signal.SIGKILL)
            count += 1
        except (ProcessLookupError, PermissionError):
            continue
    if count:
        log.warning("killed %d leftover processes of engine pid %d", count, identity.pid)
    return count
