"""Operator actions end to end: ``llmgw drain|start|reprofile|drain-node`` against a real
server, two simulated DGX agents and ``llmgw sim-engine`` engines on loopback."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
BACKOFF = ("--restart-backoff", "1", "--restart-backoff-max", "1")
READY = "SHARD_STATE_READY"

PROFILES = Path(__file__).parents[1] / "data" / "profiles" / "good-chat-a-b.toml"
FILE = PROFILES.read_text() + '\n[deployments.chat]\nprofile = "chat-a"\nreplicas = 2\n'


def _replicas(cluster: Cluster) -> list[dict[str, Any]]:
    out = cluster.cli("get", "replicas", "-o", "json", check=False)
    return list(json.loads(out.stdout)["replicas"]) if out.returncode == 0 else []


def _ready(cluster: Cluster, count: int, profile: str = "") -> list[dict[str, Any]] | None:
    replicas = _replicas(cluster)
    ready = [r for r in replicas if r.get("state") == READY]
    right = all(r.get("profile") == profile for r in replicas) if profile else True
    return replicas if len(replicas) == count == len(ready) and right else None


def _count(cluster: Cluster) -> int:
    out = cluster.cli("get", "deployments", "-o", "json")
    (chat,) = json.loads(out.stdout)["deployments"]
    return int(chat.get("replicas", 0))


def _shards(cluster: Cluster) -> list[dict[str, Any]]:
    return list(json.loads(cluster.cli("get", "shards", "-o", "json").stdout)["shards"])


def _running_shards(cluster: Cluster) -> list[dict[str, Any]]:
    return [s for s in _shards(cluster) if s["status"]["state"] != "SHARD_STATE_STOPPED"]


def _start_fleet(fleet: Cluster, tmp_path: Path) -> None:
    fleet.start_server()
    for node_id in ("a1", "a2"):
        fleet.start_agent(node_id, "dgx-h100", "--engine-bin", SIM_BIN, *BACKOFF)
    both = {"a1": "NODE_STATE_READY", "a2": "NODE_STATE_READY"}
    wait_for(lambda: fleet.node_states() == both, 30, "both agents READY")
    path = tmp_path / "chat.toml"
    path.write_text(FILE)
    assert "deployment chat applied" in fleet.cli("apply", "-f", str(path)).stdout
    wait_for(lambda: _ready(fleet, 2), 60, "2 READY replicas")


def _drain_then_start(fleet: Cluster) -> None:
    victim, kept = sorted(r["replicaId"] for r in _replicas(fleet))
    out = fleet.cli("drain", victim).stdout
    assert out.strip() == f"replica {victim} draining; deployment chat scaled down to 1 replica"
    left = wait_for(lambda: _ready(fleet, 1), 60, "the drained replica gone")
    assert [r["replicaId"] for r in left] == [kept]
    assert _count(fleet) == 1
    events = fleet.cli("events").stdout
    assert f"drain shard {victim}.0" in events and f"replica/{victim}" in events

    assert "scaled up to 2 replicas" in fleet.cli("start", "chat").stdout
    wait_for(lambda: _ready(fleet, 2), 60, "2 READY replicas again")
    assert _count(fleet) == 2


def _reprofile(fleet: Cluster) -> None:
    old = {s["status"]["profileFingerprint"] for s in _running_shards(fleet)}
    out = fleet.cli("reprofile", "chat", "--profile", "chat-b").stdout
    assert out.startswith("deployment chat reprofiled to chat-b")
    lowest, deadline = 2, time.monotonic() + 90
    while _ready(fleet, 2, "chat-b") is None:
        assert time.monotonic() < deadline, "reprofile did not finish"
        ready = [r for r in _replicas(fleet) if r.get("state") == READY]
        lowest = min(lowest, len(ready))
        time.sleep(0.2)
    assert lowest == 2  # READY never dropped below the count at any observed moment
    new = {s["status"]["profileFingerprint"] for s in _running_shards(fleet)}
    assert len(new) == 1 and not new & old


def _drain_node(fleet: Cluster) -> None:
    on_a1 = {s["replicaId"] for s in _running_shards(fleet) if s["nodeId"] == "a1"}
    assert on_a1, "the spread put a replica on a1"
    out = fleet.cli("drain-node", "a1").stdout
    assert out.startswith("node a1 cordoned; replacing")
    wait_for(
        lambda: (
            _ready(fleet, 2)
            and {s["nodeId"] for s in _running_shards(fleet)} == {"a2"}
            and on_a1.isdisjoint(s["replicaId"] for s in _running_shards(fleet))
        ),
        90,
        "a1's replicas moved to a2",
    )


def test_drain_start_reprofile_and_drain_node(fleet: Cluster, tmp_path: Path) -> None:
    _start_fleet(fleet, tmp_path)
    _drain_then_start(fleet)
    _reprofile(fleet)
    _drain_node(fleet)
    refused = fleet.cli("drain", "chat-99", check=False)
    assert refused.returncode == 1
    assert refused.stderr.strip() == "llmgw: NOT_FOUND: no replica named 'chat-99'"
