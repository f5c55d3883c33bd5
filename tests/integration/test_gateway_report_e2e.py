"""A separate ``llmgw gateway`` reports its routing figures to a control server that runs no
gateway of its own (``--gateway-listen off``): after a few completions through it, the
console's ``--once -o json`` shows its decisions, requests and replica row; the gateway
stopping leaves the totals where they were."""

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
READY = "SHARD_STATE_READY"
FILE = """
[profiles.chat-sim]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/chat"
served_model_name = "chat"

[deployments.chat]
profile = "chat-sim"
replicas = 1
"""
COMPLETIONS = 3


def _ready_replica(cluster: Cluster) -> str | None:
    out = cluster.cli("get", "replicas", "-o", "json", check=False)
    if out.returncode != 0:
        return None
    replicas = json.loads(out.stdout)["replicas"]
    ready = [r["replicaId"] for r in replicas if r.get("state") == READY]
    return ready[0] if len(ready) == len(replicas) == 1 else None


def _console(cluster: Cluster) -> dict[str, Any]:
    out = cluster.cli("console", "--once", "-o", "json")
    return dict(json.loads(out.stdout)["router"])


def _counted(cluster: Cluster, decisions: int) -> dict[str, Any] | None:
    router = _console(cluster)
    return router if router.get("decisions", 0) >= decisions else None


def test_a_separate_gateway_reports_to_a_server_without_its_own(
    fleet: Cluster, tmp_path: Path
) -> None:
    fleet.start_server("--gateway-listen", "off")
    before = _console(fleet)
    assert before["status"] == "UNAVAILABLE" and "runs no gateway" in before["reason"]
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN)
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY")
    path = tmp_path / "chat.toml"
    path.write_text(FILE)
    fleet.cli("apply", "-f", str(path))
    replica_id = wait_for(lambda: _ready_replica(fleet), 60, "a READY replica")

    url = fleet.start_gateway("gw", "--report-interval", "0.5", "--gateway-id", "gw-e2e")
    wait_for(lambda: b'"chat"' in httpx.get(f"{url}/v1/models").content, 20, "the model")
    for i in range(COMPLETIONS):
        body = {"model": "chat", "prompt": f"Once upon a time {i}", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=20).status_code == 200

    router = wait_for(lambda: _counted(fleet, COMPLETIONS), 20, "the gateway's report")
    assert router["status"] == "AVAILABLE"
    assert router["decisions"] == COMPLETIONS
    loads = {row["replicaId"]: row for row in router["replicas"]}
    assert list(loads) == [replica_id]
    assert loads[replica_id]["requests"] == COMPLETIONS
    assert "reports its figures" in fleet.log("server")
    assert "gw-e2e#" in fleet.log("gw")

    fleet.kill("gw")  # gone: its counters stay in the totals
    after = _console(fleet)
    assert after["status"] == "AVAILABLE" and after["decisions"] == COMPLETIONS
