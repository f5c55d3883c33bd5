"""Careless command lines get one clean line at once, from the real ``llmgw`` process."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.addresses import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _llmgw(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", *args],
        capture_output=True, text=True, timeout=20, cwd=cwd,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("given", "suggested"),
    [
        ("http://127.0.0.1:50051", "127.0.0.1:50051"),
        ("https://ctl.example:8080/", "ctl.example:8080"),
        ("http://[::1]:50051", "[::1]:50051"),
        ("http://ctl.example", "ctl.example:50051"),
    ],
)
def test_an_agent_given_a_url_refuses_it_at_once_naming_the_host_port_form(
    tmp_path: Path, given: str, suggested: str
) -> None:
    agent = _llmgw("agent", "--server", given, "--state-dir", str(tmp_path / "agent"))
    assert agent.returncode == 1
    assert agent.stderr.splitlines() == [
        f"llmgw: --server {given!r} is a URL; the agent takes the control server's gRPC "
        f"HOST:PORT (its --listen, default port 50051), not a URL: try --server {suggested}"
    ]


def test_a_gateway_given_a_url_refuses_it_at_once() -> None:
    gateway = _llmgw("gateway", "--server", "http://127.0.0.1:50051")
    assert gateway.returncode == 1
    assert gateway.stderr.strip() == (
        "llmgw: --server 'http://127.0.0.1:50051' is a URL; it takes HOST:PORT: "
        "try --server 127.0.0.1:50051"
    )


@pytest.mark.parametrize(
    ("flag", "what"), [("--http-listen", "gRPC-web"), ("--grpc-listen", "native gRPC")]
)
def test_a_busy_port_is_one_line_naming_the_flag(tmp_path: Path, flag: str, what: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = f"127.0.0.1:{holder.getsockname()[1]}"
        ports = {
            "--grpc-listen": f"127.0.0.1:{free_port()}",
            "--http-listen": f"127.0.0.1:{free_port()}",
            "--gateway-listen": f"127.0.0.1:{free_port()}",
            flag: busy,
        }
        args = [part for item in ports.items() for part in item]
        server = _llmgw("server", *args, "--db", str(tmp_path / "server.db"))
    assert server.returncode == 1
    assert "Traceback" not in server.stderr
    last = server.stderr.splitlines()[-1]
    assert last.startswith(f"llmgw: {flag} {busy}: cannot listen for {what}: ")
    assert "address already in use" in last.lower()
