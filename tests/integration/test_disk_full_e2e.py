"""A full state disk, from outside: the server's ``--db`` on a 4 MiB tmpfs that the test
fills with a file while a real server, a simulated agent and a ``llmgw sim-engine`` replica
run.

Shown: the server stays up (all three ports); ``/healthz`` answers 503 naming the full
database; ``llmgw apply`` and ``llmgw cordon`` fail with UNAVAILABLE "state database full";
reads still answer; the agent stays READY and the gateway still answers a completion. With
the file removed, ``/healthz`` is 200 again by itself, the refused apply is retried and
sticks, and after a SIGKILL and a restart everything acknowledged before and after is there.

Mounting needs root (as here and in CI); without it the test is skipped, saying so.
"""

from __future__ import annotations

import contextlib
import errno
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
READY = "SHARD_STATE_READY"
TMPFS_SIZE = "4m"
RECOVERY_S = 20  # the store's backoff is capped at 5 s; the rest is slack for a busy machine

FILE = """
[profiles.chat-sim]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/chat"
served_model_name = "chat"

[deployments.chat]
profile = "chat-sim"
replicas = {replicas}
"""


@pytest.fixture
def state_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs for the server's state; unmounted after the processes stopped (request
    it before ``fleet``, whose teardown runs first)."""
    mount_point = tmp_path / "state"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _fill(disk: Path) -> Path:
    """Write a file until the disk has no byte left."""
    filler = disk / "filler"
    chunk = b"\0" * (64 << 10)
    with filler.open("wb", buffering=0) as out:
        try:
            while True:
                out.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    with contextlib.suppress(OSError), filler.open("ab", buffering=0) as out:
        while out.write(b"\0"):  # the last bytes of a partly used page
            pass
    return filler


def _health(cluster: Cluster) -> tuple[int, str]:
    server = cluster.procs["server"]
    assert server.poll() is None, (
        f"the server exited ({server.returncode}): " + cluster.log("server")[-3000:]
    )
    try:
        reply = httpx.get(f"{cluster.url}/healthz", timeout=2)
    except httpx.HTTPError as exc:
        return 0, str(exc)
    return reply.status_code, reply.text


def _apply(cluster: Cluster, tmp_path: Path, replicas: int) -> subprocess.CompletedProcess[str]:
    path = tmp_path / f"chat-{replicas}.toml"
    path.write_text(FILE.format(replicas=replicas))
    return cluster.cli("apply", "-f", str(path), check=False)


def _get(cluster: Cluster, kind: str) -> dict[str, Any]:
    out = cluster.cli("get", kind, "-o", "json")
    return dict(json.loads(out.stdout))


def _replicas_wanted(cluster: Cluster) -> int:
    (chat,) = _get(cluster, "deployments")["deployments"]
    return int(chat.get("replicas", 0))


def _ready(cluster: Cluster, count: int) -> bool:
    replicas = _get(cluster, "replicas").get("replicas", [])
    return len(replicas) == count and all(r.get("state") == READY for r in replicas)


def _complete(cluster: Cluster) -> str:
    reply = httpx.post(
        f"{cluster.gateway_url}/v1/completions",
        json={"model": "chat", "prompt": "Once upon a time", "max_tokens": 4},
        timeout=10,
    )
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def _assert_all_up(cluster: Cluster) -> None:
    assert cluster.procs["server"].poll() is None, cluster.log("server")[-3000:]
    assert cluster.node_states() == {"a1": "NODE_STATE_READY"}


def test_full_state_disk_keeps_serving_and_recovers(
    state_disk: Path, fleet: Cluster, tmp_path: Path
) -> None:
    db = state_disk / "server.db"
    fleet.start_server("--db", str(db))
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN)
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "the agent READY")
    assert _apply(fleet, tmp_path, 1).returncode == 0
    wait_for(lambda: _ready(fleet, 1), 60, "1 READY replica")

    filler = _fill(state_disk)
    status, text = wait_for(
        lambda: (h := _health(fleet))[0] == 503 and h, 15, "/healthz 503 with the disk full"
    )
    assert "state database full" in text and "database or disk is full" in text, text

    refused = _apply(fleet, tmp_path, 2)
    assert refused.returncode != 0
    assert "UNAVAILABLE" in refused.stderr and "state database full" in refused.stderr
    cordon = fleet.cli("cordon", "a1", check=False)
    assert cordon.returncode != 0
    assert "UNAVAILABLE" in cordon.stderr and "state database full" in cordon.stderr
    _assert_all_up(fleet)  # reads answer, the agent's stream lives
    assert _replicas_wanted(fleet) == 1  # the refused apply changed nothing
    assert _complete(fleet)  # the gateway routes on
    assert _health(fleet)[0] == 503

    filler.unlink()
    wait_for(lambda: _health(fleet) == (200, "ok"), RECOVERY_S, "/healthz 200 once space returns")
    retried = _apply(fleet, tmp_path, 2)
    assert retried.returncode == 0, retried.stderr
    wait_for(lambda: _ready(fleet, 2), 60, "2 READY replicas after the retried apply")
    assert fleet.cli("cordon", "a1", check=False).returncode == 0

    fleet.kill("server", signal.SIGKILL)  # what was acknowledged is on disk, nothing else
    fleet.start_server("--db", str(db))
    assert _replicas_wanted(fleet) == 2
    nodes = fleet.nodes()
    assert set(nodes) == {"a1"} and nodes["a1"].get("cordoned") is True, nodes
    log = fleet.log("server")
    assert "database or disk is full" in log and "takes writes again" in log
    assert "Traceback" not in log
