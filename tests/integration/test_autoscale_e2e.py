"""The autoscaler end to end: a real server (its autoscaler deciding every second over a
six-second window), a simulated DGX agent running ``llmgw sim-engine`` replicas that take
two requests at a time, and bursts of streamed chat through the in-server gateway.

Shown: a deployment with ``min = 1, max = 3`` in mode act scales to 3 under a burst whose
queueing pushes its TTFT p90 over the target, and back to 1 once the load ends, each
change an event by the autoscaler in ``llmgw describe``; one in mode advise under the
same burst, sent through a separate ``llmgw gateway`` that reports its figures to the
server, keeps its count and says, in its status and its events, what it would do."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import Cluster, wait_for

from llmgw.promtext import metric_samples

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
BACKOFF = ("--restart-backoff", "1", "--restart-backoff-max", "1")
# Two requests at a time, 20 ms a token: 16 tokens keep a slot 0.32 s; twelve clients at
# once queue for up to two seconds on one replica, far over the 300 ms target.
ARGS = '["--max-num-seqs", "2", "--sim-decode-ms-per-token", "20"]'
CLIENTS = 12
TOKENS = 16

FILE = f"""
[profiles.chat-sim]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/chat"
served_model_name = "chat"
args = {ARGS}

[profiles.notes-sim]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/notes"
served_model_name = "notes"
args = {ARGS}

[deployments.chat]
profile = "chat-sim"

[deployments.chat.autoscale]
min = 1
max = 3
ttft_p90_ms = 300
scale_down_after_s = 4

[deployments.notes]
profile = "notes-sim"

[deployments.notes.autoscale]
min = 1
max = 3
ttft_p90_ms = 300
scale_down_after_s = 4
mode = "advise"
"""


def _deployments(cluster: Cluster) -> dict[str, dict[str, Any]]:
    out = cluster.cli("get", "deployments", "-o", "json", check=False)
    if out.returncode != 0:
        return {}
    return {d["name"]: d for d in json.loads(out.stdout)["deployments"]}


def _autoscale(cluster: Cluster, name: str) -> dict[str, Any]:
    return dict(_deployments(cluster).get(name, {}).get("status", {}).get("autoscale", {}))


def _ready(cluster: Cluster, name: str) -> int:
    return int(_deployments(cluster).get(name, {}).get("status", {}).get("ready", 0))


def _chat(base: str, model: str, stop: threading.Event) -> None:
    """Streamed chats, one after the other, until ``stop``."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": TOKENS,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=base, timeout=60) as client:
        while not stop.is_set():
            with client.stream("POST", "/v1/chat/completions", json=body) as answer:
                for _ in answer.iter_bytes():
                    pass


@contextmanager
def _burst(*targets: tuple[str, str]) -> Iterator[None]:
    """``CLIENTS`` clients per (gateway URL, model) sending streamed chats while inside."""
    stop = threading.Event()
    with ThreadPoolExecutor(CLIENTS * len(targets)) as pool:
        futures = [
            pool.submit(_chat, base, model, stop) for base, model in targets for _ in range(CLIENTS)
        ]
        try:
            yield
        finally:
            stop.set()
            for future in futures:
                future.result(timeout=60)


def _events(cluster: Cluster, name: str) -> str:
    return cluster.cli("describe", "deployment", name).stdout


def test_a_burst_scales_to_max_and_back_and_advise_only_says(
    fleet: Cluster, tmp_path: Path
) -> None:
    fleet.start_server("--autoscale-interval", "1", "--autoscale-window", "6")
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN, *BACKOFF)
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "the agent READY")
    path = tmp_path / "autoscaled.toml"
    path.write_text(FILE)
    fleet.cli("apply", "-f", str(path))
    wait_for(lambda: _ready(fleet, "chat") == 1 and _ready(fleet, "notes") == 1, 60, "both ready")

    # notes' requests go through a separate gateway: the server knows them from its reports
    separate = fleet.start_gateway("gateway", "--report-interval", "1")
    with _burst((fleet.gateway_url, "chat"), (separate, "notes")):
        wait_for(lambda: _ready(fleet, "chat") == 3, 120, "chat scaled to 3 replicas")
        notes = wait_for(
            lambda: (a := _autoscale(fleet, "notes")).get("desired", 0) > 1 and a,
            30,
            "notes' advice to scale up",
        )
    chat = _autoscale(fleet, "chat")
    assert chat["mode"] == "act" and chat["current"] == 3
    assert notes["mode"] == "advise" and notes.get("current") == 1
    assert notes["reason"] == "scale_up" and float(notes["ttftP90Ms"]) > 300
    assert _deployments(fleet)["notes"]["replicas"] == 1  # advise changed nothing

    wait_for(lambda: _deployments(fleet)["chat"]["replicas"] == 1, 120, "chat back to 1 replica")
    described = _events(fleet, "chat")
    assert "autoscaler" in described and "scale_up" in described and "scale_down" in described
    advice = _events(fleet, "notes")
    assert "autoscale-advise" in advice and "would scale 1 →" in advice

    text = httpx.get(f"{fleet.url}/metrics", timeout=5).text
    desired = {
        labels["deployment"]: value
        for labels, value in metric_samples(text, "llmgw_autoscale_desired")
    }
    assert desired["chat"] == 1
    reasons = {
        (labels["deployment"], labels["reason"])
        for labels, _ in metric_samples(text, "llmgw_autoscale_decisions_total")
    }
    assert {("chat", "scale_up"), ("chat", "scale_down"), ("notes", "scale_up")} <= reasons
