"""``llmgw logs`` end to end: a real server with tokens, a simulated DGX agent running
``llmgw sim-engine`` (which logs every request with ``--enable-log-requests``), the CLI as a
subprocess over gRPC-web, and a native grpclib client."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpclib.client
import httpx
import pytest
from procs import Cluster, wait_for

from llmgw.api.llmgw.v1 import ControlServiceStub, LogsRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
BACKOFF = ("--restart-backoff", "1", "--restart-backoff-max", "1")
READY = "SHARD_STATE_READY"
LOG_MAX = 8 << 10  # the first run (about 3 KiB) stays below; ~30 requests fill the second
LOG_FLAGS = ("--log-max-bytes", str(LOG_MAX), "--log-retention", "3600")
FILE = """
[profiles.chat]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/chat"
served_model_name = "chat"
args = ["--enable-log-requests"]

[deployments.chat]
profile = "chat"
replicas = 1
"""


def _secret(root: Path, name: str, token: str) -> Path:
    path = root / name
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


def _shard(cluster: Cluster) -> dict[str, Any] | None:
    out = cluster.cli("get", "shards", "-o", "json", check=False)
    shards = json.loads(out.stdout).get("shards", []) if out.returncode == 0 else []
    ready = [s for s in shards if s["status"].get("state") == READY]
    return ready[0] if len(ready) == 1 else None


def _file_lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines()


def _last_lines_of(got: list[str], count: int, before: list[str], after: list[str]) -> bool:
    """Whether ``got`` is the last ``count`` lines of the file at some moment between the
    reads ``before`` and ``after`` (it only grows)."""
    ends = range(max(len(before), count), len(after) + 1)
    return any(got == after[end - count : end] for end in ends)


def _ask(cluster: Cluster, text: str) -> None:
    reply = httpx.post(
        f"{cluster.gateway_url}/v1/completions",
        json={"model": "chat", "prompt": text, "max_tokens": 2},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text


class Follower:
    """``llmgw logs NAME --follow`` as a subprocess, its lines collected as they arrive."""

    def __init__(self, cluster: Cluster, *args: str) -> None:
        env = {**os.environ, "LLMGW_TOKEN": cluster.token or ""}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "logs", *args, "--follow", "--server", cluster.url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def collected(self) -> list[str]:
        while not self.lines.empty():
            self.seen.append(self.lines.get_nowait())
        return self.seen

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=20)
        self._reader.join(timeout=10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


async def _native_tail(port: int, token: str, name: str, count: int) -> list[str]:
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        stub = ControlServiceStub(channel, metadata={"authorization": f"Bearer {token}"})
        lines: list[str] = []
        async with asyncio.timeout(20):
            async for chunk in stub.stream_logs(LogsRequest(name=name, tail_lines=count)):
                lines.extend(chunk.lines)
        return lines
    finally:
        channel.close()


def _start(fleet: Cluster, tmp_path: Path) -> dict[str, str]:
    tokens = {role: fleet.create_token(role) for role in ("admin", "operator", "viewer", "agent")}
    fleet.start_server()
    agent_token = _secret(tmp_path, "agent.token", tokens["agent"])
    logs = tmp_path / "a1" / "logs"  # a gone shard's old logs, and a gone shard's recent one
    logs.mkdir(parents=True)
    for name in ("gone-9.0.log", "gone-9.0.previous.log", "recent-9.0.log"):
        (logs / name).write_text("x\n")
    for name in ("gone-9.0.log", "gone-9.0.previous.log"):
        os.utime(logs / name, (time.time() - 7200, time.time() - 7200))
    fleet.start_agent(
        "a1",
        "dgx-h100",
        "--engine-bin",
        SIM_BIN,
        *BACKOFF,
        "--token-file",
        str(agent_token),
        *LOG_FLAGS,
    )
    fleet.token = tokens["admin"]
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY")
    path = tmp_path / "chat.toml"
    path.write_text(FILE)
    fleet.cli("apply", "-f", str(path))
    wait_for(lambda: _shard(fleet), 60, "chat's shard READY")
    fleet.token = tokens["operator"]
    return tokens


def test_logs_tail_follow_previous_and_refusals(fleet: Cluster, tmp_path: Path) -> None:
    tokens = _start(fleet, tmp_path)
    shard = _shard(fleet)
    assert shard is not None
    shard_id, replica_id = shard["shardId"], shard["replicaId"]
    log_file = tmp_path / "a1" / "logs" / f"{shard_id}.log"
    _ask(fleet, "warm up")
    wait_for(lambda: "Received request" in log_file.read_text(), 20, "the request logged")

    # --tail N: the engine's last N lines, as its file on the node holds them (the engine
    # logs each health probe too: the file may have grown by the time it is read here)
    before = _file_lines(log_file)
    tail = fleet.cli("logs", replica_id, "--tail", "3").stdout.splitlines()
    assert _last_lines_of(tail, 3, before, _file_lines(log_file)), tail
    everything = fleet.cli("logs", shard_id).stdout.splitlines()
    assert everything[: len(before)] == before
    assert "Starting vLLM API server" in "\n".join(everything)
    tail = asyncio.run(_native_tail(fleet.grpc_port, tokens["operator"], shard_id, 2))
    assert _last_lines_of(tail, 2, before, _file_lines(log_file)), tail

    # --follow --tail 0: only what the engine writes from now on
    follower = Follower(fleet, replica_id, "--tail", "0")
    try:
        wait_for(
            lambda: "log stream" in fleet.log("a1") and "follow True" in fleet.log("a1"),
            20,
            "the agent serving the follow",
        )

        def logged_after() -> bool:
            _ask(fleet, "follow me")
            return any("Received request" in line for line in follower.collected())

        wait_for(logged_after, 30, "a request logged after the follow began", every=0.5)
        assert not any("Starting vLLM API server" in x for x in follower.collected())
    finally:
        follower.stop()
    wait_for(lambda: "cancelled" in fleet.log("a1"), 20, "the cancel reaching the agent")

    # --previous after a kill -9 of the engine: the run before the restart
    os.kill(int(shard["status"]["pid"]), signal.SIGKILL)
    wait_for(
        lambda: (s := _shard(fleet)) is not None and int(s["status"].get("restarts", 0)) >= 1,
        60,
        "the engine restarted and READY",
    )
    previous = fleet.cli("logs", replica_id, "--previous").stdout.splitlines()
    assert previous == _file_lines(log_file.with_name(f"{shard_id}.previous.log"))
    assert "(restart 0)" in previous[0] and "Received request" in "\n".join(previous)
    current = fleet.cli("logs", replica_id).stdout.splitlines()
    assert "(restart 1)" in current[0] and "Received request" not in "\n".join(current)

    # --log-max-bytes: past it the log rotates, and the whole run still reads as one
    def rotated() -> bool:
        for n in range(10):
            _ask(fleet, f"fill {n}")
        return log_file.with_name(f"{shard_id}.log.1").exists()

    wait_for(rotated, 90, f"the log rotated past {LOG_MAX} bytes", every=0)
    older = _file_lines(log_file.with_name(f"{shard_id}.log.1"))
    assert "(restart 1)" in older[0] and log_file.stat().st_size < LOG_MAX
    assert fleet.cli("logs", replica_id).stdout.splitlines()[: len(older)] == older
    before = _file_lines(log_file)
    tail = fleet.cli("logs", replica_id, "--tail", "4").stdout.splitlines()
    assert _last_lines_of(tail, 4, before, _file_lines(log_file)), tail

    # the old logs of gone shards were pruned at the start; a recent one stays
    assert sorted(p.name for p in log_file.parent.glob("*-9.0.*")) == ["recent-9.0.log"]
    assert "removed gone-9.0.log" in fleet.log("a1")

    # refusals: a viewer, unknown names, follow with previous
    fleet.token = tokens["viewer"]
    refused = fleet.cli("logs", replica_id, check=False)
    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        "llmgw: PERMISSION_DENIED: StreamLogs needs the operator role; this token has the "
        "viewer role"
    )
    fleet.token = tokens["operator"]
    unknown = fleet.cli("logs", "chat-99", check=False)
    assert (unknown.returncode, unknown.stderr.strip()) == (
        1,
        "llmgw: NOT_FOUND: no replica or shard named 'chat-99'",
    )
    both = fleet.cli("logs", replica_id, "--follow", "--previous", check=False)
    assert both.returncode == 1 and "INVALID_ARGUMENT" in both.stderr

    # a node that disconnects ends its follow streams, saying so
    follower = Follower(fleet, replica_id, "--tail", "1")
    try:
        wait_for(lambda: follower.collected(), 20, "the follow's first line")
        fleet.kill("a1")
        assert follower.proc.wait(timeout=20) == 1
        assert follower.proc.stderr is not None
        error = follower.proc.stderr.read()
        assert "UNAVAILABLE: node a1 disconnected" in error, error
    finally:
        follower.stop()
    gone = fleet.cli("logs", replica_id, check=False)
    assert gone.returncode == 1 and "node a1 is not connected" in gone.stderr


MULTI = """
[profiles.big]
engine = "sim"
gpu_class = "H100"
tp = 1
pp = 2
nodes = 2
model_path = "/models/big"
served_model_name = "big"

[deployments.big]
profile = "big"
replicas = 1
"""


def _ready_shards(cluster: Cluster, count: int) -> list[dict[str, Any]] | None:
    out = cluster.cli("get", "shards", "-o", "json", check=False)
    shards = json.loads(out.stdout).get("shards", []) if out.returncode == 0 else []
    ready = [s for s in shards if s["status"].get("state") == READY]
    return ready if len(ready) == count else None


def test_all_shards_of_a_multi_node_replica_each_line_named(fleet: Cluster, tmp_path: Path) -> None:
    fleet.start_server()
    for node_id in ("m1", "m2"):
        fleet.start_agent(node_id, "dgx-h100", "--engine-bin", SIM_BIN, *BACKOFF)
    both = {"m1": "NODE_STATE_READY", "m2": "NODE_STATE_READY"}
    wait_for(lambda: fleet.node_states() == both, 30, "both agents READY")
    path = tmp_path / "big.toml"
    path.write_text(MULTI)
    fleet.cli("apply", "-f", str(path))
    shards = wait_for(lambda: _ready_shards(fleet, 2), 90, "both shards of big READY")
    files = {s["shardId"]: tmp_path / s["nodeId"] / "logs" / f"{s['shardId']}.log" for s in shards}
    assert sorted(files) == ["big-1.0", "big-1.1"]
    before = {shard: _file_lines(path) for shard, path in files.items()}
    out = fleet.cli("logs", "big-1", "--all-shards", "--tail", "2").stdout.splitlines()
    for shard, path in files.items():
        mine = [line.removeprefix(f"[{shard}] ") for line in out if line.startswith(f"[{shard}] ")]
        assert _last_lines_of(mine, 2, before[shard], _file_lines(path)), (shard, out)
    assert len(out) == 4
    rank0 = fleet.cli("logs", "big-1", "--tail", "2").stdout.splitlines()
    assert _last_lines_of(rank0, 2, before["big-1.0"], _file_lines(files["big-1.0"]))
