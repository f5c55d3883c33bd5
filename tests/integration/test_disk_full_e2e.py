"""A full state disk, from outside: the server's ``--db`` on a 4 MiB tmpfs that the test
fills with a file while a real server, a simulated agent and a ``llmgw sim-engine`` replica
run.

Shown: the server stays up (all three ports); ``/healthz`` answers 503 naming the full
database; ``llmgw apply`` and ``llmgw cordon`` fail with UNAVAILABLE "state database full";
reads still answer; the agent stays READY and the gateway still answers a completion. With
the file removed, ``/healthz`` is 200 again by itself, the refused apply is retried and
sticks, and after a SIGKILL and a restart everything acknowledged before and after is there.

A read-only disk, from outside: Linux refuses ``mount -o remount,ro`` while a process
holds a file there open for writing (EBUSY), so the test makes the kernel do what it does
to a file system that failed, with ``errors=remount-ro``: the server's ``--db`` on a small
ext4 image on a loop device whose ``trigger_fs_error`` the test writes. The server stays
up, ``/healthz`` is 503 naming the state database, writes answer UNAVAILABLE, reads and the
gateway go on; such a file system comes back only through an unmount and a fsck, after
which a restarted server holds everything acknowledged before.

Mounting needs root (as here and in CI); without it the tests are skipped, saying so.
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

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

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


@pytest.fixture
def failing_disk(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """An 8 MiB ext4 image mounted (loop, ``errors=remount-ro``): (mount point, image, the
    file that makes the kernel fail it); unmounted after the processes stopped."""
    image, mount_point = tmp_path / "state.img", tmp_path / "state"
    mount_point.mkdir()
    with image.open("wb") as out:
        out.truncate(8 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make an ext4 image: {made.stderr.strip()}")
    done = subprocess.run(
        ["mount", "-o", "loop,errors=remount-ro", str(image), str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount an ext4 image on a loop device (needs root): {done.stderr}")
    try:
        device = Path(_mounted_device(mount_point)).name
        trigger = Path("/sys/fs/ext4") / device / "trigger_fs_error"
        if not trigger.exists():
            pytest.skip(f"this kernel has no {trigger}")
        yield mount_point, image, trigger
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def _mounted_device(mount_point: Path) -> str:
    for line in Path("/proc/mounts").read_text().splitlines():
        device, where, *_ = line.split()
        if where == str(mount_point):
            return device
    raise AssertionError(f"{mount_point} is not mounted")


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


def test_a_state_disk_gone_read_only_keeps_serving(
    failing_disk: tuple[Path, Path, Path], fleet: Cluster, tmp_path: Path
) -> None:
    mount_point, image, trigger = failing_disk
    fleet.start_server("--db", str(mount_point / "server.db"))
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN)
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "the agent READY")
    assert _apply(fleet, tmp_path, 1).returncode == 0
    wait_for(lambda: _ready(fleet, 1), 60, "1 READY replica")

    trigger.write_text("llmgw test: the state disk fails\n")  # the kernel makes it read-only
    status, text = wait_for(
        lambda: (h := _health(fleet))[0] == 503 and h, 15, "/healthz 503 with the disk failed"
    )
    assert "state database full/read-only: disk I/O error" in text, text
    assert "until the server restarts" in text, text
    for args in (("cordon", "a1"), ("uncordon", "a1")):
        refused = fleet.cli(*args, check=False)
        assert refused.returncode != 0
        assert "UNAVAILABLE" in refused.stderr and "state database full" in refused.stderr
    assert _apply(fleet, tmp_path, 2).returncode != 0
    _assert_all_up(fleet)
    assert _replicas_wanted(fleet) == 1
    assert _complete(fleet)

    fleet.kill("server", signal.SIGKILL)
    subprocess.run(["umount", str(mount_point)], check=True)
    subprocess.run(["e2fsck", "-fy", str(image)], capture_output=True, check=False)
    subprocess.run(["mount", "-o", "loop", str(image), str(mount_point)], check=True)
    fleet.start_server("--db", str(mount_point / "server.db"))
    assert _replicas_wanted(fleet) == 1
    assert set(fleet.nodes()) == {"a1"}
