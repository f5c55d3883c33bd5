"""The chaos run's processes: control servers, gateways, agents, and the engines they start.

Everything listens on 127.0.0.1 and lives under one state directory. The server, the
gateway and each agent are children of this process, each in a session of its own (so a
signal to one process group reaches exactly one of them); the engines are the agents'
children, in sessions of their own too, and outlive an agent that dies (a restarted agent
adopts them). Every process carries ``LLMGW_CHAOS_RUN=<run id>`` in its environment (the
engines inherit it from their agent), which is how `ChaosCluster.engines` finds them in
``/proc`` and how `ChaosCluster.close` kills whatever is left, whoever started it.

The load's gateways are ``gateway``, ``gateway-2``, ... (`ChaosCluster.load_gateways`); a
gateway added later (`ChaosCluster.add_gateway`, e.g. a fresh one at the end) is not one of
them. The server's and the gateways' ports come from outside the kernel's ephemeral range, so an
engine started while the server is down cannot take the port the server restarts on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bench.chaoskit.disk import StateDisk
from llmgw.agent.records import RecordStore
from llmgw.command import LLMGW_COMMAND
from llmgw.engineports import format_port_range, pick_window

RUN_ENV: Final = "LLMGW_CHAOS_RUN"
SIM_ENGINE_BIN: Final = f"sim={shlex.join(LLMGW_COMMAND)} sim-engine"
SERVER: Final = "server"
GATEWAY: Final = "gateway"
MAX_GATEWAYS: Final = 4
_PORT_RANGE: Final = (12000, 20000)  # below engine windows (21000 up) and ephemeral ports


def gateway_names(count: int) -> tuple[str, ...]:
    """The names of ``count`` load gateways: "gateway", then "gateway-2", "gateway-3", ..."""
    return (GATEWAY, *(f"{GATEWAY}-{i}" for i in range(2, count + 1)))


def reserved_port(rng: random.Random) -> int:
    """A port free now, outside the ephemeral range (kept for the run: restarts reuse it)."""
    for _ in range(200):
        port = rng.randrange(*_PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORT_RANGE}")


@dataclass(frozen=True, slots=True)
class EngineProc:
    """An engine process of this run as /proc and its agent's record describe it."""

    pid: int
    node: str  # "" when no agent record names it
    shard_id: str  # "" when no agent record names it
    replica_id: str
    rank: int
    model: str  # --served-model-name
    stopped: bool  # in state T (SIGSTOP)


@dataclass(frozen=True, slots=True)
class AgentOptions:
    """How the agents run: the simulated node and the engine restart policy."""

    fixture: str = "dgx-h100"
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 8.0


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """How many servers, on which database: one on SQLite (``db_url`` None), or several
    sharing a PostgreSQL database and its leader lease (``--lease-ttl``)."""

    count: int = 1
    db_url: str | None = None
    lease_ttl_s: float | None = None


class ChaosCluster:
    """Start, signal and restart the run's processes; `close` leaves nothing behind."""

    def __init__(
        self,
        root: Path,
        nodes: Sequence[str],
        run_id: str,
        agents: AgentOptions = AgentOptions(),
        state_disk: StateDisk | None = None,
        servers: ServerOptions = ServerOptions(),
        gateways: int = 1,
    ) -> None:
        self.root, self.logs = root, root / "logs"
        self.state_disk = state_disk  # the server's database on it (fill-disk), else in root
        self.nodes = tuple(nodes)
        self.run_id = run_id
        self.agent_options = agents
        self._rng = random.SystemRandom()  # ports: not from the run's seed (runs side by side)
        count = servers.count
        if count < 1 or (count > 1 and servers.db_url is None):
            raise ValueError(f"{count} servers: 1, or more on a PostgreSQL db_url")
        names = (SERVER,) if count == 1 else tuple(f"{SERVER}-{i}" for i in range(count))
        self.db_url = servers.db_url  # the servers' shared PostgreSQL (None: SQLite at `db`)
        self.lease_ttl_s = servers.lease_ttl_s
        self.server_grpc = {n: f"127.0.0.1:{reserved_port(self._rng)}" for n in names}
        self.server_web = {n: f"http://127.0.0.1:{reserved_port(self._rng)}" for n in names}
        self.grpc = ",".join(self.server_grpc.values())  # what agents and gateways dial
        self.web = self.server_web[names[0]]  # the first server's web URL
        if not 1 <= gateways <= MAX_GATEWAYS:
            raise ValueError(f"{gateways} gateways: 1 to {MAX_GATEWAYS}")
        self.load_gateways = gateway_names(gateways)  # the load's; not one added later
        self.gateways = {n: f"http://127.0.0.1:{reserved_port(self._rng)}"
                         for n in self.load_gateways}  # fmt: skip
        self.engine_ports = format_port_range(pick_window(rng=self._rng))  # its own engines'
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._duplicates = 0  # duplicate agents started (chaoskit.faults: duplicate-agent)
        self.logs.mkdir(parents=True, exist_ok=True)

    @property
    def db(self) -> Path:
        """The server's state database."""
        disk = self.state_disk
        return (disk.path if disk is not None else self.root) / "server.db"

    @property
    def servers(self) -> tuple[str, ...]:
        """The servers' names: "server", or "server-0", "server-1", ... with several."""
        return tuple(self.server_grpc)

    @property
    def gateway(self) -> str:
        """The URL of the first of the load's gateways (``gateway``)."""
        return self.gateways[GATEWAY]

    @property
    def load_gateway_urls(self) -> dict[str, str]:
        """Name → URL of each gateway the load goes through, in order."""
        return {name: self.gateways[name] for name in self.load_gateways}

    def add_gateway(self, name: str) -> str:
        """Another gateway (started by `start`), e.g. a fresh one at the end; its URL.
        Not one of the load's gateways; ValueError for a name already taken."""
        if name in self.gateways or name in self.server_grpc or name in self.nodes:
            raise ValueError(f"{name!r}: a process of the run already has that name")
        self.gateways[name] = f"http://127.0.0.1:{reserved_port(self._rng)}"
        return self.gateways[name]

    # -- starting -----------------------------------------------------------------------------

    def start(self, name: str) -> int:
        """Start (or restart) ``name``: a server, a gateway or a node id; its pid."""
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"{name} is still running (pid {old.pid})")
        proc = self._spawn(name, self._args(name))
        self.procs[name] = proc
        return proc.pid

    def _args(self, name: str) -> tuple[str, ...]:
        if name in self.server_grpc:
            return self._server_args(name)
        if name in self.gateways:
            return ("gateway", "--server", self.grpc, "--debug-kv-index",
                    "--listen", self.gateways[name].removeprefix("http://"))  # fmt: skip
        if name not in self.nodes:
            raise KeyError(name)
        opts = self.agent_options
        return ("agent", "--server", self.grpc, "--node-id", name,
                "--simulate", opts.fixture, "--state-dir", str(self.root / name),
                "--engine-bin", SIM_ENGINE_BIN,
                "--restart-backoff", str(opts.restart_backoff_s),
                "--restart-backoff-max", str(opts.restart_backoff_max_s))  # fmt: skip

    def _server_args(self, name: str) -> tuple[str, ...]:
        args: tuple[str, ...] = ("server", "--grpc-listen", self.server_grpc[name],
                "--http-listen", self.server_web[name].removeprefix("http://"),
                "--gateway-listen", "off", "--engine-ports", self.engine_ports,
                "--db", self.db_url or str(self.db))  # fmt: skip
        if len(self.server_grpc) > 1:
            args += ("--server-id", name)
        if self.lease_ttl_s is not None:
            args += ("--lease-ttl", f"{self.lease_ttl_s:g}")
        return args

    # -- a duplicate agent (chaoskit.faults: duplicate-agent) --------------------------------

    def start_duplicate(self, node: str) -> tuple[str, int]:
        """A second agent of ``node`` on a fresh copy of its state dir: its name and pid."""
        self._duplicates += 1
        name = f"dup{self._duplicates}-{node}"
        clone = self.root / "duplicates" / name
        shutil.copytree(self.root / node, clone, ignore=shutil.ignore_patterns("kv"))
        args = list(self._args(node))
        args[args.index("--state-dir") + 1] = str(clone)
        self.procs[name] = self._spawn(name, args)
        return name, self.procs[name].pid

    def duplicates(self) -> list[str]:
        """The names of the duplicate agents started so far (their logs are NAME.log)."""
        return [name for name in self.procs if name.startswith("dup")]

    async def logged(self, name: str, needles: Sequence[str], timeout_s: float) -> bool:
        """Wait until ``name``'s log holds one of ``needles``; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = (self.logs / f"{name}.log").read_text(errors="replace")
            if any(needle in text for needle in needles):
                return True
            await asyncio.sleep(0.2)
        return False

    async def registered(self, node: str, timeout_s: float) -> bool:
        """Wait until ``node``'s agent is registered: since its latest start, its log's last
        word on the stream is a registration, not a failure."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = (self.logs / f"{node}.log").read_text(errors="replace")
            run = text.rpartition("=== chaos: starting")[2]
            if run.rfind("registered with") > run.rfind("retrying with backoff"):
                return True
            await asyncio.sleep(0.2)
        return False

    def _spawn(self, name: str, args: Sequence[str]) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", RUN_ENV: self.run_id}
        with (self.logs / f"{name}.log").open("ab") as out:
            out.write(f"\n=== chaos: starting {name} at {time.time():.3f}\n".encode())
            out.flush()
            return subprocess.Popen(
                [*LLMGW_COMMAND, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    # -- signals ------------------------------------------------------------------------------

    def pid(self, name: str) -> int | None:
        proc = self.procs.get(name)
        return proc.pid if proc is not None and proc.poll() is None else None

    def kill(self, name: str) -> int:
        """SIGKILL ``name``'s process group and reap it; the pid it had."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return proc.pid

    def exited(self) -> dict[str, int]:
        """The processes of ours that ended by themselves, with their exit status."""
        return {
            name: code
            for name, proc in self.procs.items()
            if (code := proc.poll()) is not None and code != -signal.SIGKILL
        }

    # -- engines ------------------------------------------------------------------------------

    def engines(self) -> list[EngineProc]:
        """Every live engine process of this run, named from its agent's records."""
        owners = self._recorded()
        found = []
        for pid, argv, state in _tagged(self.run_id.encode()):
            if "sim-engine" not in argv:
                continue
            node, shard_id, replica_id, rank = owners.get(pid, ("", "", "", -1))
            model = _flag(argv, "--served-model-name")
            found.append(EngineProc(pid, node, shard_id, replica_id, rank, model, state == "T"))
        return found

    def _recorded(self) -> dict[int, tuple[str, str, str, int]]:
        owners: dict[int, tuple[str, str, str, int]] = {}
        for node in self.nodes:
            records, _ = RecordStore(self.root / node / "engines").load_all()
            for record in records:
                start = record.start
                owners[record.identity.pid] = (node, record.shard_id, start.replica_id, start.rank)
        return owners

    # -- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        """SIGCONT then SIGKILL every process group of this run (ours and the engines)."""
        pids = {proc.pid for proc in self.procs.values() if proc.poll() is None}
        pids |= {pid for pid, _, _ in _tagged(self.run_id.encode())}
        for sig in (signal.SIGCONT, signal.SIGKILL):
            for pid in pids:  # a group leader's group, and the process itself if it leads none
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, sig)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(True for _ in _tagged(self.run_id.encode())) and time.monotonic() < deadline:
            time.sleep(0.1)


def signal_group(pid: int, sig: int) -> bool:
    """``sig`` to the process group led by ``pid``; False when it is gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _tagged(tag: bytes) -> Iterator[tuple[int, list[str], str]]:
    """(pid, argv, state) of every live process whose environment has ``RUN_ENV=tag``."""
    needle = f"{RUN_ENV}=".encode() + tag
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
            if needle not in environ.split(b"\0"):
                continue
            argv = Path(entry.path, "cmdline").read_bytes().decode(errors="replace")
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # gone, or not ours to read
            continue
        state = stat.rpartition(")")[2].split()[0]
        if state not in ("Z", "X"):
            yield int(entry.name), argv.split("\0"), state


def _flag(argv: Sequence[str], name: str) -> str:
    with contextlib.suppress(ValueError, IndexError):
        return argv[argv.index(name) + 1]
    return ""
