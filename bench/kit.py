"""What the benchmarks in bench/ share.

* How a benchmark reports itself: the command, the machine, the llmgw revision measured, the
  package versions, the load average; its tables and its progress lines on stderr.
* CPU time read from ``/proc``: a process's, a core's (tasks and interrupts apart).
* Child processes pinned to a core that die with the benchmark and announce their ports on
  stdout (``PORT 8000`` or ``PORTS 8000,8001``); they run as ``python -m bench.X``
  (``module_command``) from the repository root.
* Cells re-run while other processes use the CPU that matters (``quietest``).
* The load client of bench.http and bench.gateway: a raw asyncio HTTP/1.1 keep-alive
  connection, one pre-encoded request in flight, replies read by their content-length or
  chunked framing; nearest-rank percentiles of its latencies.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import math
import os
import platform
import re
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Final, Protocol, Self, TypeVar, cast

CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
HOST: Final = "127.0.0.1"
PR_SET_PDEATHSIG: Final = 1
REPO_ROOT: Final = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def module_command(module: str) -> list[str]:
    """The command that runs ``python -m module`` with this interpreter (a benchmark starts its
    own children this way; they run from the repository root, where ``bench`` is found)."""
    return [sys.executable, "-m", module]


# ======================================================================================
# What a benchmark says about itself
# ======================================================================================


def command_line() -> str:
    """This process's command line, with the interpreter relative when it is below here, and
    ``-m MODULE`` for a module run as ``python -m MODULE`` (as every benchmark here is)."""
    python = os.path.relpath(sys.executable)
    if python.startswith(".."):
        python = sys.executable
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    args = ["-m", spec.name, *sys.argv[1:]] if spec is not None else sys.argv
    return shlex.join([python, *args])


def base_machine() -> dict[str, str]:
    """Cores, CPU model, Python and OS, as a benchmark's header prints them."""
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=False).stdout.strip()
    return {
        "nproc": nproc or str(os.cpu_count()),
        "cpu": model,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }


def machine_facts(versions: str) -> dict[str, str]:
    """``base_machine`` with the package ``versions``, the llmgw revision and the load."""
    return {
        **base_machine(),
        "versions": versions,
        "llmgw": llmgw_revision(),
        "load average at start": load_average(),
    }


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def git_query(*args: str) -> str:
    """The output of a read-only git command in this checkout; "" where it fails."""
    done = subprocess.run(
        ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=False
    )
    return done.stdout.strip() if done.returncode == 0 else ""


def llmgw_revision() -> str:
    """The commit measured, and whether llmgw/ differs from it (untracked files count)."""
    head = git_query("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown (not a git checkout)"
    dirty = git_query("status", "--porcelain", "--", "llmgw")
    return f"git {head}" + (" + uncommitted changes in llmgw/" if dirty else "")


def package_versions(names: Sequence[str], *, mark_missing: bool) -> list[str]:
    """``name version`` of each installed package; a missing one is ``name (missing)`` with
    ``mark_missing``, else left out."""
    parts = []
    for name in names:
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            if mark_missing:
                parts.append(f"{name} (missing)")
    return parts


def render_table(columns: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> str:
    """A Markdown table, or aligned text: the first column left-aligned, the figures right."""
    if markdown:
        lines = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
        return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    return "\n".join(_aligned(r, widths) for r in [columns, *rows])


def _aligned(row: Sequence[str], widths: Sequence[int]) -> str:
    cells = [row[0].ljust(widths[0])]
    cells += [v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)]
    return "  ".join(cells)


def progress_line(text: str) -> None:
    """A progress line on stderr (stdout carries the report)."""
    print(text, file=sys.stderr, flush=True)


def interrupt_on_sigterm() -> None:
    """SIGTERM stops this process as Ctrl-C does, so that its children are stopped too."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_interruptible(
    main: Coroutine[Any, Any, T], loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> T:
    """Run ``main`` in a new event loop. SIGTERM meanwhile cancels it, as Ctrl-C does, and then
    raises KeyboardInterrupt here: raised from a plain signal handler instead, it could land in
    a protocol callback, which the loop takes for a broken connection."""
    sigterm = _SigtermCancels()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        try:
            return runner.run(sigterm.guard(main))
        except asyncio.CancelledError:
            if sigterm.received:
                raise KeyboardInterrupt from None
            raise


class _SigtermCancels:
    """While ``guard`` runs, SIGTERM cancels its task; the handler before is restored after."""

    def __init__(self) -> None:
        self.received = False

    async def guard(self, main: Coroutine[Any, Any, T]) -> T:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        assert task is not None
        before = signal.getsignal(signal.SIGTERM)
        loop.add_signal_handler(signal.SIGTERM, self._cancel, task)
        try:
            return await main
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, before)

    def _cancel(self, task: asyncio.Task[Any]) -> None:
        self.received = True
        task.cancel()


def require_two_cpus(first: int, second: int, flags: str) -> None:
    """SystemExit unless ``first`` and ``second`` are two different CPUs this process may use."""
    cpus = os.sched_getaffinity(0)
    if {first, second} - cpus or first == second:
        raise SystemExit(f"{flags}: two different CPUs among {sorted(cpus)}")


# ======================================================================================
# CPU time from /proc
# ======================================================================================


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) from ``/proc/PID/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_seconds(cpu: int) -> tuple[float, float]:
    """Seconds one CPU spent in tasks (user, nice, system, steal) and in interrupts (irq,
    softirq: on loopback, much of TCP's receive path) since boot, from ``/proc/stat``."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{cpu} "):
            user, nice, system, _, _, irq, softirq, steal = map(int, line.split()[1:9])
            return (user + nice + system + steal) / CLK_TCK, (irq + softirq) / CLK_TCK
    return math.nan, math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of sorted ``values``; NaN when empty."""
    if not values:
        return math.nan
    return values[max(1, math.ceil(q * len(values))) - 1]


class Rerunnable(Protocol):
    """A measured cell that knows how much of its CPU other processes took."""

    attempts: int

    @property
    def others_share(self) -> float: ...


CellT = TypeVar("CellT", bound=Rerunnable)


async def quietest(
    run: Callable[[], Awaitable[CellT]],
    attempts: int,
    max_others: float,
    pause_s: float,
    progress: Callable[[CellT], None],
) -> CellT:
    """``run`` a cell, again (at most ``attempts`` runs, ``pause_s`` apart) while others used
    more than ``max_others`` of the CPU that matters to it; the quietest run is kept."""
    best: CellT | None = None
    for attempt in range(1, attempts + 1):
        cell = await run()
        cell.attempts = attempt
        progress(cell)
        if best is None or cell.others_share < best.others_share:
            best = cell
        if cell.others_share <= max_others:
            break
        if attempt < attempts:
            await asyncio.sleep(pause_s)
    assert best is not None
    return best


# ======================================================================================
# Child processes
# ======================================================================================


@dataclass(slots=True)
class Child:
    """A child process pinned to a core, its stderr (and stdout, unless it announces its
    ports there) in a log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    ports: tuple[int, ...] = ()

    @property
    def port(self) -> int:
        return self.ports[0]

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def pinned_child(cpu: int) -> Callable[[], None]:
    """A ``preexec_fn``: pin to ``cpu`` (its threads too); die with this process."""

    def setup() -> None:
        os.sched_setaffinity(0, {cpu})
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return setup


def spawn(name: str, argv: Sequence[str], cpu: int, log: Path, *, announces: bool) -> Child:
    """Start a child pinned to ``cpu``, its output in ``log``; stdout stays a pipe when the
    child ``announces`` its ports there (and writes nothing else to it)."""
    with log.open("wb") as err:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if announces else err,
            stderr=err,
            preexec_fn=pinned_child(cpu),
            cwd=REPO_ROOT,
        )
    return Child(name, proc, log)


def announced_ports(child: Child, prefix: str, timeout_s: float) -> tuple[int, ...]:
    """Wait for the child's ``PREFIX p1,p2`` line on stdout; its ports. A child that does not
    announce them within ``timeout_s`` is stopped, and RuntimeError raised."""
    assert child.proc.stdout is not None
    line = b""
    with selectors.DefaultSelector() as sel:
        sel.register(child.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            if sel.select(max(0.0, deadline - time.monotonic())):
                chunk = os.read(child.proc.stdout.fileno(), 1)
                if not chunk:
                    break
                line += chunk
    if not line.startswith(prefix.encode() + b" "):
        child.stop()
        raise RuntimeError(f"{child.name} did not start:\n{child.log_tail()}")
    return tuple(int(p) for p in line.split()[1].split(b","))


# ======================================================================================
# The load client: keep-alive HTTP/1.1 over asyncio protocols
# ======================================================================================

_CONTENT_LENGTH: Final = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_CHUNKED: Final = re.compile(rb"\r\ntransfer-encoding:[^\r]*chunked", re.IGNORECASE)
_CLOSE: Final = re.compile(rb"\r\nconnection:[ \t]*close", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes  # de-chunked
    close: bool  # the server will close the connection after it
    first_data: float = math.nan  # perf_counter() when the first SSE ``data:`` came; NaN: not


def parse_chunked(buf: bytearray, start: int) -> tuple[bytes, int] | None:
    """A chunked body starting at ``buf[start:]``: (body, end offset), or None if partial."""
    body = bytearray()
    at = start
    while True:
        eol = buf.find(b"\r\n", at)
        if eol < 0:
            return None
        size = int(bytes(buf[at:eol]).split(b";", 1)[0], 16)
        at = eol + 2
        if size == 0:  # trailer section: header lines up to an empty line
            while True:
                eol = buf.find(b"\r\n", at)
                if eol < 0:
                    return None
                if eol == at:
                    return bytes(body), eol + 2
                at = eol + 2
        if len(buf) < at + size + 2:
            return None
        body += buf[at : at + size]
        at += size + 2


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request in flight at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[Reply] | None = None
        self.lost = False

    @classmethod
    async def open(cls, port: int) -> Self:
        _, conn = await asyncio.get_running_loop().create_connection(cls, HOST, port)
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"the peer closed the connection ({exc})"))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._deliver()

    def _deliver(self) -> None:
        """Complete the waiting request with its reply once the reply is whole."""
        if self.waiter is None or self.waiter.done():
            return
        try:
            reply = self._parse()
        except ValueError as exc:  # unframed or malformed: this connection is done
            self.waiter.set_exception(exc)
            self.close()
            return
        if reply is not None:
            self.waiter.set_result(reply)

    def _parse(self) -> Reply | None:
        buf = self.buf
        head_end = buf.find(b"\r\n\r\n")
        if head_end < 0:
            return None
        head = bytes(buf[: head_end + 2])
        length = _CONTENT_LENGTH.search(head)
        if length is not None:
            end = head_end + 4 + int(length.group(1))
            if len(buf) < end:
                return None
            body = bytes(buf[head_end + 4 : end])
        elif _CHUNKED.search(head):
            parsed = parse_chunked(buf, head_end + 4)
            if parsed is None:
                return None
            body, end = parsed
        else:
            raise ValueError(f"a response without framing: {head!r}")
        del buf[:end]
        return self._reply(int(head[9:12]), body, _CLOSE.search(head) is not None)

    def _reply(self, status: int, body: bytes, close: bool) -> Reply:
        return Reply(status, body, close)

    async def request(self, raw: bytes) -> Reply:
        if self.lost or self.transport is None:
            raise ConnectionError("connection lost")
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
