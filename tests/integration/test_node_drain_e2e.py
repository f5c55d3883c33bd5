"""A node drain that stalls, its dry run, and an uncordon that cancels it, end to end.

A real server, a simulated DGX H100 (``a1``) and a simulated L4 box (``l4-1``), agents
running ``llmgw sim-engine``. Deployment ``chat`` needs two H100s: its replica runs on
``a1`` and fits nowhere else (the L4 box has four free GPUs, of the wrong class). Draining
``a1`` stalls; uncordoning it cancels the drain: the replica keeps running under its id,
and no replacement is started on ``a1`` (as one was before the fix, under a new id).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
BACKOFF = ("--restart-backoff", "1", "--restart-backoff-max", "1")
READY = "SHARD_STATE_READY"
PROFILES = Path(__file__).parents[1] / "data" / "profiles" / "good-chat-a-b.toml"
EMBED = """
[profiles.embed-l4]
engine = "sim"
gpu_class = "L4"
tp = 1
model_path = "/models/embed"
served_model_name = "embed"

[deployments.chat]
profile = "chat-a"
replicas = 1

[deployments.embed]
profile = "embed-l4"
replicas = 1
"""


def _replicas(cluster: Cluster) -> dict[str, dict[str, Any]]:
    out = cluster.cli("get", "replicas", "-o", "json", check=False)
    if out.returncode != 0:
        return {}
    return {r["replicaId"]: r for r in json.loads(out.stdout)["replicas"]}


def _shard_nodes(cluster: Cluster) -> dict[str, str]:
    """Running shard id → its node."""
    shards = json.loads(cluster.cli("get", "shards", "-o", "json").stdout)["shards"]
    return {
        s["shardId"]: s["nodeId"] for s in shards if s["status"]["state"] != "SHARD_STATE_STOPPED"
    }


def _all_ready(cluster: Cluster, ids: set[str]) -> bool:
    replicas = _replicas(cluster)
    return set(replicas) == ids and all(r.get("state") == READY for r in replicas.values())


def _start(fleet: Cluster, tmp_path: Path) -> None:
    fleet.start_server()
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN, *BACKOFF)
    fleet.start_agent("l4-1", "l4-pcie", "--engine-bin", SIM_BIN, *BACKOFF)
    both = {"a1": "NODE_STATE_READY", "l4-1": "NODE_STATE_READY"}
    wait_for(lambda: fleet.node_states() == both, 30, "both agents READY")
    path = tmp_path / "fleet.toml"
    path.write_text(PROFILES.read_text() + EMBED)
    fleet.cli("apply", "-f", str(path))
    wait_for(lambda: _all_ready(fleet, {"chat-1", "embed-1"}), 60, "chat-1 and embed-1 READY")
    assert _shard_nodes(fleet) == {"chat-1.0": "a1", "embed-1.0": "l4-1"}


def _dry_runs(fleet: Cluster) -> None:
    """The server's placement answers: H100s are needed, the L4s do not count."""
    dry = fleet.cli("drain-node", "a1", "--dry-run", check=False)
    assert dry.returncode == 1  # a replica cannot move
    out = dry.stdout.splitlines()
    assert (
        out[0] == "dry run: drain node a1: 1 replica to move, 0 can move now; nothing was changed"
    )
    assert out[1].startswith("chat-1: cannot move (") and "H100" in out[1]
    assert out[1].endswith("it keeps running on a1 until there is room")
    # The L4 replica has no other L4 to go to either, and the free H100s do not take it.
    out = fleet.cli("drain-node", "l4-1", "--dry-run", check=False).stdout.splitlines()
    assert out[1].startswith("embed-1: cannot move (") and "L4" in out[1]
    assert fleet.node_states()["a1"] == "NODE_STATE_READY"  # nothing was changed
    assert "drain-node" not in fleet.cli("events").stdout


def test_uncordon_during_a_stalled_drain_keeps_the_replica(fleet: Cluster, tmp_path: Path) -> None:
    _start(fleet, tmp_path)
    _dry_runs(fleet)

    out = fleet.cli("drain-node", "a1").stdout
    assert out.strip() == "node a1 cordoned; replacing chat-1 elsewhere, one at a time"
    wait_for(
        lambda: "deployment/chat" in fleet.cli("events").stdout, 20, "chat reported unplaceable"
    )
    assert _all_ready(fleet, {"chat-1", "embed-1"})  # stalled: nothing moved

    out = fleet.cli("uncordon", "a1").stdout
    assert out.strip() == "node a1 uncordoned; drain cancelled: chat-1 stays on a1"
    # Before the fix the drain went on once a1 took replicas again: chat-2 was placed on
    # a1 within a round, chat-1 retired. Watch long enough for several rounds.
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        assert set(_replicas(fleet)) == {"chat-1", "embed-1"}
        time.sleep(0.5)
    assert _all_ready(fleet, {"chat-1", "embed-1"})
    assert _shard_nodes(fleet) == {"chat-1.0": "a1", "embed-1.0": "l4-1"}
    assert fleet.node_states()["a1"] == "NODE_STATE_READY"
