"""Deployment status end to end: a real server, two simulated agents (a DGX H100 and a
4-GPU L4 box) running ``llmgw sim-engine``, read through ``llmgw get deployments`` and the
server's ``/metrics``: a deployment that fits, one that asks more than the fleet holds,
and what both show when a node goes away."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import Cluster, wait_for

from llmgw.promtext import metric_samples

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
BACKOFF = ("--restart-backoff", "1", "--restart-backoff-max", "1")

# chat fits on the DGX; wide asks three TP-2 replicas of a box with four L4s.
FILE = """
[profiles.chat-tp2]
engine = "sim"
gpu_class = "H100"
tp = 2
model_path = "/models/chat"
served_model_name = "chat"

[profiles.wide-l4]
engine = "sim"
gpu_class = "L4"
tp = 2
model_path = "/models/wide"
served_model_name = "wide"

[deployments.chat]
profile = "chat-tp2"
replicas = 1

[deployments.wide]
profile = "wide-l4"
replicas = 3
"""


def _deployments(cluster: Cluster) -> dict[str, dict[str, Any]]:
    out = cluster.cli("get", "deployments", "-o", "json")
    return {d["name"]: d for d in json.loads(out.stdout)["deployments"]}


def _conditions(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in deployment["status"]["conditions"]}


def _table(cluster: Cluster) -> dict[str, list[str]]:
    lines = cluster.cli("get", "deployments").stdout.splitlines()
    assert lines[0].split() == [
        "NAME",
        "PROFILE",
        "DESIRED",
        "READY",
        "UP-TO-DATE",
        "AVAILABLE",
        "REASON",
    ]
    return {line.split()[0]: line.split(maxsplit=6) for line in lines[1:]}


def _gauges(cluster: Cluster) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{cluster.url}/metrics", timeout=5).text
    out = {}
    for name, label in (
        ("llmgw_deployment_replicas_desired", "deployment"),
        ("llmgw_deployment_replicas_ready", "deployment"),
        ("llmgw_nodes", "state"),
        ("llmgw_replicas", "state"),
        ("llmgw_shards", "state"),
    ):
        for labels, value in metric_samples(text, name):
            out[(name, labels[label])] = value
    assert [labels for labels, _ in metric_samples(text, "llmgw_build_info")] != []
    return out


def _requests_are_counted_by_model_route_and_status(cluster: Cluster) -> None:
    """Through the in-server gateway: a served model keeps its name, any other is unknown."""
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    base = cluster.gateway_url
    assert httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=30).status_code == 200
    made_up = {**chat, "model": "made-up-model-name"}
    assert httpx.post(f"{base}/v1/chat/completions", json=made_up, timeout=30).status_code == 404
    counted = {
        (labels["model"], labels["route"], labels["status"]): value
        for labels, value in metric_samples(
            httpx.get(f"{base}/metrics", timeout=5).text, "llmgw_requests_total"
        )
    }
    assert counted == {
        ("chat", "/v1/chat/completions", "200"): 1,
        ("unknown", "/v1/chat/completions", "404"): 1,
    }


def _settled(cluster: Cluster) -> dict[str, dict[str, Any]] | None:
    """The deployments once chat is ready and wide has its two and the reason for the third."""
    shown = _deployments(cluster)
    chat, wide = shown["chat"].get("status", {}), shown["wide"].get("status", {})
    if chat.get("ready") == 1 and wide.get("ready") == 2 and wide.get("unplaceableReason"):
        return shown
    return None


def test_status_in_get_deployments_and_metrics(fleet: Cluster, tmp_path: Path) -> None:
    fleet.start_server()
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN, *BACKOFF)
    fleet.start_agent("l4", "l4-pcie", "--engine-bin", SIM_BIN, *BACKOFF)
    both = {"a1": "NODE_STATE_READY", "l4": "NODE_STATE_READY"}
    wait_for(lambda: fleet.node_states() == both, 30, "both agents READY")
    path = tmp_path / "fleet.toml"
    path.write_text(FILE)
    applied = fleet.cli("apply", "-f", str(path), check=False)
    assert applied.returncode == 1, applied.stdout + applied.stderr  # wide is short of one
    assert "can be placed" in applied.stdout

    shown = wait_for(lambda: _settled(fleet), 90, "chat ready, wide short of one")
    chat, wide = shown["chat"]["status"], shown["wide"]["status"]
    assert (chat["desired"], chat["ready"], chat["upToDate"], chat["available"]) == (1, 1, 1, 1)
    assert chat.get("reason", "") == ""
    assert _conditions(shown["chat"])["Available"].get("status") is True
    assert _conditions(shown["chat"])["Progressing"]["reason"] == "NewReplicasAvailable"
    reason = wide["unplaceableReason"]
    assert "L4" in reason and wide["unplaceable"] == 1 and wide["reason"] == reason
    assert (wide["desired"], wide["ready"], wide["available"]) == (3, 2, 2)
    assert _conditions(shown["wide"])["Available"].get("status", False) is False  # proto3 JSON
    assert _conditions(shown["wide"])["Progressing"]["reason"] == "Unplaceable"
    assert _conditions(shown["wide"])["ReplicaFailure"]["message"] == reason

    table = _table(fleet)
    assert table["chat"][:6] == ["chat", "chat-tp2", "1", "1", "1", "1"]
    assert table["wide"][:6] == ["wide", "wide-l4", "3", "2", "2", "2"]
    assert table["wide"][6] == reason

    gauges = _gauges(fleet)
    assert gauges[("llmgw_deployment_replicas_desired", "wide")] == 3
    assert gauges[("llmgw_deployment_replicas_ready", "wide")] == 2
    assert gauges[("llmgw_deployment_replicas_ready", "chat")] == 1
    assert (gauges[("llmgw_nodes", "ready")], gauges[("llmgw_nodes", "not_ready")]) == (2, 0)
    assert gauges[("llmgw_replicas", "ready")] == 3 and gauges[("llmgw_replicas", "failed")] == 0
    assert gauges[("llmgw_shards", "ready")] == 3

    _requests_are_counted_by_model_route_and_status(fleet)

    fleet.kill("l4")  # the L4 box goes away: its stream ends, its node is NOT_READY at once
    wait_for(lambda: _gauges(fleet)[("llmgw_nodes", "not_ready")] == 1, 30, "the L4 node NOT_READY")
    gauges = _gauges(fleet)
    assert gauges[("llmgw_nodes", "ready")] == 1
    assert gauges[("llmgw_deployment_replicas_ready", "wide")] == 0
    assert gauges[("llmgw_deployment_replicas_ready", "chat")] == 1
    shown = _deployments(fleet)
    assert shown["wide"]["status"].get("ready", 0) == 0
    assert _conditions(shown["wide"])["Available"]["message"] == "0 of 3 replicas ready"
    assert _table(fleet)["wide"][3] == "0"
