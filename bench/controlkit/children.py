"""The control benchmark's orchestrator: child processes and /proc readings."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.controlkit.shared import HOST, READ_LIMIT, pin_to
from bench.kit import CLK_TCK, REPO_ROOT, proc_cpu_seconds

# ======================================================================================
# Orchestrator: child processes, /proc readings
# ======================================================================================


def machine_busy_seconds() -> float:
    """CPU seconds all CPUs spent busy since boot (``/proc/stat``; idle and iowait excluded)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass(slots=True)
class Child:
    """A child process in its own session, pinned to a CPU, logging to a file."""

    name: str
    proc: asyncio.subprocess.Process
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float:
        return proc_cpu_seconds(self.pid)

    def alive(self) -> bool:
        return self.proc.returncode is None

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()


class Children:
    """Every child process of the run; ``close`` stops them all (on any exit path)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.all: list[Child] = []

    async def spawn(self, name: str, argv: Sequence[str], cpu: int, pipes: bool = False) -> Child:
        log_path = self.workdir / f"{name}.log"
        pipe = asyncio.subprocess.PIPE if pipes else asyncio.subprocess.DEVNULL
        with log_path.open("wb") as log_file:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=pipe,
                stdout=pipe,
                stderr=log_file,
                preexec_fn=pin_to(cpu),
                cwd=REPO_ROOT,
                start_new_session=True,  # Ctrl-C reaches us only; we stop them in order
                limit=READ_LIMIT,
            )
        child = Child(name, proc, log_path)
        self.all.append(child)
        return child

    async def close(self) -> None:
        await asyncio.gather(*(child.stop() for child in reversed(self.all)))


class Worker:
    """The orchestrator's handle on one ``_agents`` worker: JSON lines over its pipes."""

    def __init__(self, child: Child) -> None:
        self.child = child

    async def call(self, timeout_s: float, **request: Any) -> dict[str, Any]:
        proc = self.child.proc
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write((json.dumps(request) + "\n").encode())
        await proc.stdin.drain()
        line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
        if not line:
            tail = self.child.log_tail()
            raise RuntimeError(f"worker {self.child.name} exited; its log ends:\n{tail}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.call(20.0, op="stop")
        await self.child.stop()


async def wait_listening(child: Child, port: int, timeout_s: float = 30.0) -> None:
    """Wait until ``port`` accepts connections; fail if the child exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited; its log ends:\n{child.log_tail()}")
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection(HOST, port)
            writer.close()
            await writer.wait_closed()
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{child.name} did not listen on {HOST}:{port} within {timeout_s:g}s")
