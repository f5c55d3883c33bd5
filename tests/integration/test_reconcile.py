"""The reconciler end to end: ``llmgw apply -f`` starts replicas on real agents.

A real server, two simulated DGX agents and ``llmgw sim-engine`` engines, all on loopback:
an applied deployment comes up READY spread over both nodes and serves a completion
through a replica's endpoint with its API key; applied again with fewer replicas, the
extras are drained and stopped and the rest keep serving.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
BACKOFF = ("--restart-backoff", "1", "--restart-backoff-max", "1")

DEPLOYMENT = """
[profiles.chat-tp2]
engine = "sim"
gpu_class = "H100"
tp = 2
model_path = "/models/chat"
served_model_name = "chat"

[deployments.chat]
profile = "chat-tp2"
replicas = {replicas}
"""


def _replicas(cluster: Cluster) -> list[dict[str, Any]]:
    out = cluster.cli("get", "replicas", "-o", "json", check=False)
    return list(json.loads(out.stdout)["replicas"]) if out.returncode == 0 else []


def _ready(cluster: Cluster, count: int) -> list[dict[str, Any]] | None:
    replicas = _replicas(cluster)
    ready = [r for r in replicas if r.get("state") == "SHARD_STATE_READY"]
    return replicas if len(replicas) == count == len(ready) else None


def _shard_nodes(cluster: Cluster) -> dict[str, str]:
    out = cluster.cli("get", "shards", "-o", "json")
    return {s["shardId"]: s["nodeId"] for s in json.loads(out.stdout)["shards"]}


def _key(cluster: Cluster, node_id: str, shard_id: str) -> str:
    """The replica's API key, as its agent keeps it beside the engine record."""
    return (cluster.root / node_id / "engines" / f"{shard_id}.key").read_text()


def _apply(cluster: Cluster, tmp_path: Path, replicas: int) -> None:
    path = tmp_path / f"chat-{replicas}.toml"
    path.write_text(DEPLOYMENT.format(replicas=replicas))
    assert "deployment chat applied" in cluster.cli("apply", "-f", str(path)).stdout


def test_apply_starts_replicas_spread_and_scaling_down_drains(
    fleet: Cluster, tmp_path: Path
) -> None:
    fleet.start_server()
    for node_id in ("a1", "a2"):
        fleet.start_agent(node_id, "dgx-h100", "--engine-bin", SIM_BIN, *BACKOFF)
    both = {"a1": "NODE_STATE_READY", "a2": "NODE_STATE_READY"}
    wait_for(lambda: fleet.node_states() == both, 30, "both agents READY")

    _apply(fleet, tmp_path, 4)
    replicas = wait_for(lambda: _ready(fleet, 4), 60, "4 READY replicas")
    nodes = _shard_nodes(fleet)
    leaders = {r["replicaId"]: nodes[r["shardIds"][0]] for r in replicas}
    # spread over both nodes (2 + 2, unless a replica had to be replaced away from one)
    assert set(leaders.values()) == {"a1", "a2"}
    assert len({r["endpoint"] for r in replicas}) == 4  # one port each, even on one host

    first = replicas[0]
    key = _key(fleet, leaders[first["replicaId"]], first["shardIds"][0])
    body = {"model": "chat", "prompt": "The capital of France is", "max_tokens": 4}
    headers = {"Authorization": f"Bearer {key}"}
    reply = httpx.post(f"{first['endpoint']}/v1/completions", json=body, headers=headers)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"]
    refused = httpx.post(f"{first['endpoint']}/v1/completions", json=body, timeout=10)
    assert refused.status_code == 401  # the engine wants the replica's key

    _apply(fleet, tmp_path, 2)
    kept = wait_for(lambda: _ready(fleet, 2), 60, "2 READY replicas left")
    gone = set(leaders) - {r["replicaId"] for r in kept}
    assert len(gone) == 2
    shards = json.loads(fleet.cli("get", "shards", "-o", "json").stdout)["shards"]
    states = {s["replicaId"]: s["status"]["state"] for s in shards}
    assert all(states[r] == "SHARD_STATE_STOPPED" for r in gone)
    events = fleet.cli("events").stdout
    assert "reconciler" in events and "drain shard" in events
