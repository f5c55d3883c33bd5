"""Helpers for tests/integration: real processes on loopback, started as a user would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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

    def start_server(self, *extra: str) -> subprocess.Popen[bytes]:
        proc = self.spawn(
            "server",
            "server",
            "--grpc-listen",
            f"127.0.0.1:{self.grpc_port}",
            "--http-listen",
            f"127.0.0.1:{self.http_port}",
            "--db",
            str(self.root / "server.db"),
            "--gateway-listen",  # never the default port 8000: tests run beside each other
            f"127.0.0.1:{self.gateway_port}",
            *extra,
        )
        wait_for(self.healthy, 20, "the server's /healthz")
        return proc

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

    def healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "LLMGW_TOKEN": self.token} if self.token else None
        return subprocess.run(
            [sys.executable, "-m", "llmgw", *args, "--server", self.url],
            capture_output=True,
            text=True,
            timeout=30,
            check=check,
            env=env,
        )

    def create_token(self, role: str, note: str = "") -> str:
        """``llmgw token create`` on the server's file; the new token."""
        out = subprocess.run(
            [sys.executable, "-m", "llmgw", "token", "create", "--role", role, "--note", note]
            + ["--db", str(self.root / "server.db")],
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
