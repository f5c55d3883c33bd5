"""Helpers for tests/integration: real processes on loopback, started as a user would.

Each server a :class:`Cluster` starts gets engine ports of its own (``--engine-ports``): a
random window of free ports (``llmgw.engineports.pick_window``) that no other live cluster
of this process holds, so pytest runs, the demo and people's clusters on one machine
rarely meet on an engine port, and two clusters of one run never do. A test that wants a
particular range says so (``Cluster(root, engine_ports=(LO, HI))`` or
``start_server("--engine-ports", "LO-HI")``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from llmgw.addresses import free_port
from llmgw.engineports import PortRange, format_port_range, parse_port_range, pick_window

_BIND_RETRIES = 3  # first starts that lost a listening port to another process, drawn again
_HELD: set[PortRange] = set()  # engine port windows of the live clusters of this process


def hold_engine_window(holder: object) -> tuple[PortRange, weakref.finalize[..., object]]:
    """A free window of engine ports clear of every window held in this process, held
    until ``holder`` is garbage or the returned finalizer is called, whichever is first."""
    window = pick_window(avoid=sorted(_HELD))
    _HELD.add(window)
    return window, weakref.finalize(holder, _HELD.discard, window)


def wait_for(check: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    """Poll ``check`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Cluster:
    """A server and agents as subprocesses, with their logs under ``root``."""

    root: Path
    grpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    gateway_port: int = field(default_factory=free_port)  # the in-server gateway's
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    token: str | None = None  # sent by cli() (as $LLMGW_TOKEN) once authentication is on
    engine_ports: PortRange | None = None  # None: a window of its own at the first start
    db: str | None = None  # the server's --db; None: server.db under root
    _window: weakref.finalize[..., object] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    _served: bool = field(default=False, init=False, repr=False, compare=False)  # ports in use

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def gateway_url(self) -> str:
        """The in-server gateway's OpenAI base (without ``/v1``)."""
        return f"http://127.0.0.1:{self.gateway_port}"

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.root / f"{name}.log").open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def start_server(self, *extra: str, follower: bool = False) -> subprocess.Popen[bytes]:
        """The server on this cluster's ports and engine port range (kept over restarts),
        once healthy; ``follower``: once it answers (a follower's /healthz is 503)."""
        if "--engine-ports" in extra:  # the test's own range
            self.engine_ports = parse_port_range(extra[extra.index("--engine-ports") + 1])
        else:
            if self.engine_ports is None:
                self.engine_ports, self._window = hold_engine_window(self)
            extra = ("--engine-ports", format_port_range(self.engine_ports), *extra)
        for attempt in range(_BIND_RETRIES + 1):
            log = self.root / "server.log"
            logged = log.stat().st_size if log.exists() else 0
            proc = self.spawn(
                "server",
                "server",
                "--grpc-listen",
                f"127.0.0.1:{self.grpc_port}",
                "--http-listen",
                f"127.0.0.1:{self.http_port}",
                "--db",
                self.db or str(self.root / "server.db"),
                "--gateway-listen",  # never the default port 8000: tests run beside each other
                f"127.0.0.1:{self.gateway_port}",
                *extra,
            )
            # a start on a loaded 2-core CI machine may take long; an exit is seen at once
            wait_for(partial(self._up_or_gone, proc, follower), 60, "the server's /healthz")
            if proc.poll() is None:
                self._served = True
                return proc
            said = log.read_bytes()[logged:].decode(errors="replace")
            if self._served or "cannot listen" not in said or attempt == _BIND_RETRIES:
                raise AssertionError(f"the server exited ({proc.returncode}): {said[-2000:]}")
            # free_port() only found the ports free when this Cluster was made; another
            # process's connection may have taken one since (an ephemeral port): draw again
            self.grpc_port, self.http_port, self.gateway_port = (free_port() for _ in range(3))
        raise AssertionError("unreachable")

    def release_engine_ports(self) -> None:
        """Let other clusters of this process draw this one's window (after stop_all)."""
        if self._window is not None:
            self._window()

    def start_gateway(self, name: str = "gateway", *extra: str) -> str:
        """``llmgw gateway`` following this cluster's server; returns its URL once healthy."""
        url = f"http://127.0.0.1:{free_port()}"
        self.spawn(
            name,
            "gateway",
            "--server",
            f"127.0.0.1:{self.grpc_port}",
            "--listen",
            url.removeprefix("http://"),
            *extra,
        )
        wait_for(lambda: _answers(f"{url}/healthz"), 20, f"{name}'s /healthz")
        return url

    def start_agent(
        self, node_id: str, fixture: str = "dgx-h100", *extra: str
    ) -> subprocess.Popen[bytes]:
        return self.spawn(
            node_id,
            "agent",
            "--server",
            f"127.0.0.1:{self.grpc_port}",
            "--node-id",
            node_id,
            "--simulate",
            fixture,
            "--state-dir",
            str(self.root / node_id),
            *extra,
        )

    def _up_or_gone(self, proc: subprocess.Popen[bytes], follower: bool = False) -> bool:
        if proc.poll() is not None:
            return True
        return self.metrics() is not None if follower else self.healthy()

    def metrics(self) -> str | None:
        """The server's /metrics text (None while it does not answer)."""
        import httpx

        try:
            answer = httpx.get(f"{self.url}/metrics", timeout=1)
        except httpx.HTTPError:
            return None
        return answer.text if answer.status_code == 200 else None

    def healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def cli(
        self, *args: str, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "LLMGW_TOKEN": self.token} if self.token else None
        return subprocess.run(
            [sys.executable, "-m", "llmgw", *args, "--server", self.url],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            env=env,
        )

    def create_token(self, role: str, note: str = "") -> str:
        """``llmgw token create`` on the server's file; the new token."""
        out = subprocess.run(
            [sys.executable, "-m", "llmgw", "token", "create", "--role", role, "--note", note]
            + ["--db", self.db or str(self.root / "server.db")],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return out.stdout.strip()

    def nodes(self) -> dict[str, dict[str, Any]]:
        out = self.cli("get", "nodes", "-o", "json", check=False)
        if out.returncode != 0:
            return {}
        return {n["info"]["nodeId"]: n for n in json.loads(out.stdout)["nodes"]}

    def node_states(self) -> dict[str, str]:
        return {k: v.get("state", "") for k, v in self.nodes().items()}

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(timeout=20)

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
