"""``llmgw demo``: a control server and simulated GPU nodes on loopback, as real processes.

It starts ``llmgw server`` on free loopback ports and one ``llmgw agent --simulate`` per
fixture, waits until every node is READY, prints the cluster, then keeps everything running
until Ctrl-C (or ``--duration``) and stops the processes it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from llmgw.api.llmgw.v1 import NodeState
from llmgw.cli.get import run_get
from llmgw.cli.main import DEFAULT_WEB_URL, CliError
from llmgw.client import ClientError, ControlClient, GrpcWebChannel

DEMO_NODES = (("dgx-1", "dgx-h100"), ("mig-1", "a100-mig"), ("l4-1", "l4-pcie"))
READY_TIMEOUT_S = 60.0
DEFAULT_GRPC_PORT = 50051  # the server's defaults, so `llmgw get …` works without --server
DEFAULT_HTTP_PORT = 8080
DEFAULT_GATEWAY_PORT = 8000


def free_port(preferred: int = 0) -> int:
    """``preferred`` if it is free on 127.0.0.1, else any port that was free a moment ago."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_demo(duration: float | None, state_dir: Path | None) -> int:
    with _state_dir(state_dir) as root:
        grpc_port, http_port = free_port(DEFAULT_GRPC_PORT), free_port(DEFAULT_HTTP_PORT)
        gateway_port = free_port(DEFAULT_GATEWAY_PORT)
        url = f"http://127.0.0.1:{http_port}"
        logs = root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        procs = [
            _spawn(
                [
                    "server",
                    "--grpc-listen",
                    f"127.0.0.1:{grpc_port}",
                    "--http-listen",
                    f"127.0.0.1:{http_port}",
                    "--gateway-listen",
                    f"127.0.0.1:{gateway_port}",
                    "--db",
                    str(root / "server.db"),
                ],
                logs / "server.log",
            )
        ]
        try:
            for node_id, fixture in DEMO_NODES:
                procs.append(
                    _spawn(
                        [
                            "agent",
                            "--server",
                            f"127.0.0.1:{grpc_port}",
                            "--node-id",
                            node_id,
                            "--simulate",
                            fixture,
                            "--state-dir",
                            str(root / node_id),
                        ],
                        logs / f"{node_id}.log",
                    )
                )
            asyncio.run(_wait_ready(url, len(DEMO_NODES)))
            _show(url, root, f"http://127.0.0.1:{gateway_port}")
            _wait(duration)
        finally:
            _stop(procs)
    return 0


@contextlib.contextmanager
def _state_dir(given: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="llmgw-demo-") as tmp:
        yield Path(tmp)


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "llmgw", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


async def _wait_ready(url: str, count: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    ready = 0
    while time.monotonic() < deadline:
        with contextlib.suppress(ClientError):
            async with GrpcWebChannel(url) as channel:
                cluster = await ControlClient(channel).get_cluster()
            ready = sum(n.state == NodeState.READY for n in cluster.nodes)
            if ready >= count:
                return
        await asyncio.sleep(0.3)
    raise CliError(f"only {ready} of {count} demo nodes became READY in {READY_TIMEOUT_S:g}s")


def _show(url: str, root: Path, gateway: str) -> None:
    print(f"llmgw demo: control server at {url} (gRPC-web), state and logs in {root}")
    print(f"llmgw demo: OpenAI-compatible gateway at {gateway}/v1\n")
    asyncio.run(run_get(url, "nodes", "table"))
    print()
    asyncio.run(run_get(url, "gpus", "table"))
    flag = "" if url == DEFAULT_WEB_URL else f" --server {url}"
    print(
        f"\nTry: llmgw get gpus{flag}   |   llmgw get nodes -o json{flag}   |   "
        f"llmgw cordon l4-1{flag}"
    )


def _wait(duration: float | None) -> None:
    if duration is not None:
        time.sleep(duration)
        return
    print("Running; press Ctrl-C to stop.", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            time.sleep(3600)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
