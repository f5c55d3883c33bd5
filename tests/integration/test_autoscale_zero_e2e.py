"""Scale to zero and back end to end: a real server (its autoscaler deciding every second
over a four-second window), a simulated DGX agent whose ``llmgw sim-engine`` replicas load
their model for two seconds before they answer, and the in-server gateway.

Shown: a deployment with ``min = 0`` starts with no replica; a request for it is held by
the gateway, the autoscaler learns from the gateway's figures that one waits and starts a
replica (``from_zero``), and the request is answered once that replica is READY, after its
cold start; idle again, the deployment goes back to zero (``to_zero``)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
BACKOFF = ("--restart-backoff", "1", "--restart-backoff-max", "1")
LOAD_S = 2.0

FILE = f"""
[profiles.chat-sim]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/chat"
served_model_name = "chat"
args = ["--sim-load-seconds", "{LOAD_S:g}"]

[deployments.chat]
profile = "chat-sim"

[deployments.chat.autoscale]
min = 0
max = 2
ttft_p90_ms = 5000
scale_down_after_s = 3
"""


def _chat(cluster: Cluster) -> dict[str, Any]:
    out = cluster.cli("get", "deployments", "-o", "json", check=False)
    shown = json.loads(out.stdout)["deployments"] if out.returncode == 0 else []
    return next((d for d in shown if d["name"] == "chat"), {})


def test_a_held_request_starts_a_replica_from_zero_and_idle_goes_back(
    fleet: Cluster, tmp_path: Path
) -> None:
    fleet.start_server(
        "--autoscale-interval", "1", "--autoscale-window", "4", "--gateway-hold-timeout", "60"
    )
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN, *BACKOFF)
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "the agent READY")
    path = tmp_path / "zero.toml"
    path.write_text(FILE)
    fleet.cli("apply", "-f", str(path))
    assert _chat(fleet).get("replicas", 0) == 0  # a new act-mode deployment starts at min

    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    started = time.monotonic()
    answer = httpx.post(f"{fleet.gateway_url}/v1/chat/completions", json=body, timeout=90)
    waited = time.monotonic() - started
    assert answer.status_code == 200, answer.text
    assert waited >= LOAD_S  # held through the replica's cold start
    described = fleet.cli("describe", "deployment", "chat").stdout
    assert "from_zero: 0 → 1" in described

    wait_for(lambda: _chat(fleet).get("replicas", 0) == 0, 60, "chat back to zero replicas")
    autoscale = _chat(fleet)["status"]["autoscale"]
    assert autoscale.get("desired", 0) == 0 and autoscale["reason"] in ("to_zero", "hold")
    assert "to_zero: 1 → 0" in fleet.cli("describe", "deployment", "chat").stdout
