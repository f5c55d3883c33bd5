"""Engine port ranges on real processes: two clusters side by side on one host.

Each cluster's server gets engine ports of its own, one a window the harness drew and one
a range the test gave (``--engine-ports``). Both deploy simulated engines at the same
time; every replica serves on a port of its own cluster's range, the lowest first, and no
port is handed out twice, which is what clusters on the default range would have done
(both start at 20000).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from procs import Cluster, wait_for

from llmgw.engineports import format_port_range, pick_window

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
DEPLOYMENT = """
[profiles.one-gpu]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/chat"
served_model_name = "chat"

[deployments.chat]
profile = "one-gpu"
replicas = 2
"""


def _ready_ports(cluster: Cluster) -> list[int] | None:
    out = cluster.cli("get", "replicas", "-o", "json", check=False)
    if out.returncode != 0:
        return None
    replicas = json.loads(out.stdout)["replicas"]
    ready = [r for r in replicas if r.get("state") == "SHARD_STATE_READY"]
    if len(replicas) != 2 or len(ready) != 2:
        return None
    return sorted(urlsplit(r["endpoint"]).port or 0 for r in ready)


def _up(cluster: Cluster, node_id: str, document: Path, *server_flags: str) -> None:
    cluster.start_server(*server_flags)
    cluster.start_agent(node_id, "dgx-h100", "--engine-bin", SIM_BIN)
    wait_for(lambda: cluster.node_states().get(node_id) == "NODE_STATE_READY", 30, node_id)
    assert "deployment chat applied" in cluster.cli("apply", "-f", str(document)).stdout


def test_two_clusters_on_one_host_serve_on_ports_of_their_own_ranges(
    fleet: Cluster, other_fleet: Cluster, tmp_path: Path
) -> None:
    document = tmp_path / "chat.toml"
    document.write_text(DEPLOYMENT)
    given = pick_window(20, avoid=[fleet.engine_ports] if fleet.engine_ports else [])

    _up(fleet, "a1", document)  # the harness draws its window
    _up(other_fleet, "b1", document, "--engine-ports", format_port_range(given))
    drawn = fleet.engine_ports
    assert drawn is not None and drawn[1] - drawn[0] + 1 == 200
    assert other_fleet.engine_ports == given
    assert drawn[1] < given[0] or given[1] < drawn[0]

    first = wait_for(lambda: _ready_ports(fleet), 60, "fleet's 2 replicas READY")
    second = wait_for(lambda: _ready_ports(other_fleet), 60, "other_fleet's 2 replicas READY")
    assert first == [drawn[0], drawn[0] + 1]  # the lowest ports of its own window
    assert second == [given[0], given[0] + 1]
    assert "engine ports " + format_port_range(drawn) in fleet.log("server")
    assert "in use by another process" not in fleet.log("a1") + other_fleet.log("b1")
