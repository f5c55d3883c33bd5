"""File descriptors (issue 13, hole 5): real ``llmgw`` processes under a low open files limit.

- ``llmgw server``, ``llmgw agent`` and ``llmgw gateway`` started with a soft limit of 256
  (the hard one higher) raise it to the hard limit (``/proc/PID/limits``).
- A server whose hard limit is 256 too, flooded with 400 idle sockets, logs a few lines,
  not megabytes (asyncio logged every failed ``accept()`` with a traceback), and once the
  sockets close every port serves again: ``/healthz``, the gateway, a native RPC.
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpclib.client
import grpclib.exceptions
import httpx
import pytest
from procs import wait_for

from llmgw.addresses import free_port
from llmgw.api.llmgw.v1 import ControlServiceStub, GetClusterRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

LOW = 256
SOFT, HARD = resource.getrlimit(resource.RLIMIT_NOFILE)


def _limited(soft: int, hard: int) -> Callable[[], None]:
    def apply() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return apply


def _open_files_limits(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no 'Max open files' in /proc/{pid}/limits")


class _Procs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, limits: Callable[[], None], *args: str) -> subprocess.Popen[bytes]:
        with (self.root / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "llmgw", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                preexec_fn=limits,
            )
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[_Procs]:
    started = _Procs(tmp_path)
    try:
        yield started
    finally:
        started.stop()


def _server_args(root: Path, grpc: int, http: int, gateway: int) -> list[str]:
    return [
        "server",
        "--grpc-listen",
        f"127.0.0.1:{grpc}",
        "--http-listen",
        f"127.0.0.1:{http}",
        "--gateway-listen",
        f"127.0.0.1:{gateway}",
        "--db",
        str(root / "state" / "server.db"),
    ]


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.skipif(HARD != resource.RLIM_INFINITY and HARD <= LOW, reason="hard limit too low")
def test_every_long_running_process_raises_its_soft_limit_to_the_hard_one(
    procs: _Procs,
) -> None:
    hard = HARD if HARD != resource.RLIM_INFINITY else int(Path("/proc/sys/fs/nr_open").read_text())
    low = _limited(LOW, hard)
    grpc, http = free_port(), free_port()
    started = {
        "server": procs.start("server", low, *_server_args(procs.root, grpc, http, free_port())),
        "agent": procs.start(
            "agent",
            low,
            *("agent", "--server", f"127.0.0.1:{grpc}", "--simulate", "cpu-only"),
            *("--state-dir", str(procs.root / "agent")),
        ),
        "gateway": procs.start(
            "gateway",
            low,
            *("gateway", "--server", f"127.0.0.1:{grpc}", "--listen", f"127.0.0.1:{free_port()}"),
        ),
    }
    raised = (hard, hard)
    for name, proc in started.items():
        wait_for(lambda p=proc: _open_files_limits(p.pid) == raised, 30, f"{name}'s limit raised")  # type: ignore[misc]
        assert "open files limit raised from 256" in procs.log(name).read_text(), name


async def _cluster_answers(port: int) -> bool:
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        async with asyncio.timeout(5):
            await ControlServiceStub(channel).get_cluster(GetClusterRequest())
        return True
    except (OSError, TimeoutError, grpclib.exceptions.GRPCError):
        return False
    finally:
        channel.close()


def _flood(ports: list[int], count: int) -> list[socket.socket]:
    """``count`` idle connections, spread over ``ports``, that send nothing."""
    socks = []
    for i in range(count):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", ports[i % len(ports)]))
        except BlockingIOError:
            pass
        socks.append(s)
    return socks


def test_a_flood_at_the_limit_logs_little_and_every_port_serves_after(procs: _Procs) -> None:
    grpc, http, gateway = free_port(), free_port(), free_port()
    server = procs.start(
        "server", _limited(LOW, LOW), *_server_args(procs.root, grpc, http, gateway)
    )
    wait_for(lambda: _answers(f"http://127.0.0.1:{http}/healthz"), 60, "the server's /healthz")
    assert _open_files_limits(server.pid) == (LOW, LOW)  # nothing to raise it to
    log = procs.log("server")
    before = log.stat().st_size
    socks = _flood([grpc, http, gateway], 400)
    try:
        time.sleep(10)
        grown = log.stat().st_size - before
    finally:
        for s in socks:
            s.close()
    assert server.poll() is None
    assert grown < 16_384, f"{grown} bytes of log in 10 s: {log.read_text()[-2000:]}"
    assert "Too many open files" in log.read_text()  # the flood did reach the limit
    wait_for(lambda: _answers(f"http://127.0.0.1:{http}/healthz"), 20, "/healthz again")
    wait_for(lambda: _answers(f"http://127.0.0.1:{gateway}/healthz"), 20, "the gateway again")
    wait_for(lambda: asyncio.run(_cluster_answers(grpc)), 20, "a native RPC again")
