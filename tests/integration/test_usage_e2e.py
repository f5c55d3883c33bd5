"""Durable metering (issue #18): ``llmgw usage -o json`` matches the engine's own prompt,
cached and completion counters within 1 %, for a tenant's requests through the in-server
gateway and a separate ``llmgw gateway``; the hourly totals survive a kill -9 of the server."""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from functools import partial
from pathlib import Path

import httpx
import pytest
from procs import Cluster, wait_for

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
replicas = 1
"""
SHARED = "You are a careful assistant who answers in one short sentence. " * 12
COUNTERS = {
    "prompt": "vllm:prompt_tokens_total",
    "cached": "vllm:prompt_tokens_cached_total",
    "completion": "vllm:generation_tokens_total",
}


def _ask(base: str, key: str | None, prompt: str = "hello") -> int:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": "chat", "prompt": prompt, "max_tokens": 8}
    try:
        return httpx.post(
            f"{base}/v1/completions", json=body, headers=headers, timeout=10
        ).status_code
    except httpx.HTTPError:
        return 0


def _engine_url(fleet: Cluster) -> str:
    replicas = json.loads(fleet.cli("get", "replicas", "-o", "json").stdout)["replicas"]
    [ready] = [r for r in replicas if r.get("state") == "SHARD_STATE_READY"]
    return str(ready["endpoint"])


def _engine_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out = {}
    for name, family in COUNTERS.items():
        values = re.findall(rf"^{re.escape(family)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        out[name] = sum(float(v) for v in values)
    return out


def _usage(fleet: Cluster) -> dict[str, float]:
    rows = json.loads(fleet.cli("usage", "--tenant", "team-u", "-o", "json").stdout)
    return {name: float(sum(r[name] for r in rows)) for name in (*COUNTERS, "requests")}


def test_usage_matches_the_engine_counters_and_survives_a_kill(
    fleet: Cluster, tmp_path: Path
) -> None:
    fleet.start_server()
    fleet.start_agent("n1", "dgx-h100", "--engine-bin", SIM_BIN)
    wait_for(lambda: fleet.node_states().get("n1") == "NODE_STATE_READY", 30, "n1 READY")
    document = tmp_path / "chat.toml"
    document.write_text(DEPLOYMENT)
    fleet.cli("apply", "-f", str(document))
    separate = fleet.start_gateway()
    gateways = [fleet.gateway_url, separate]
    for base in gateways:
        wait_for(partial(lambda b: _ask(b, None) == 200, base), 60, f"{base} serving")
    key = fleet.cli("key", "create", "--tenant", "team-u").stdout.split("\n", 1)[0]
    for base in gateways:
        wait_for(partial(lambda b: _ask(b, None) == 401, base), 5, f"{base} keyed")

    engine = _engine_url(fleet)
    before = _engine_counters(engine)
    sent = 0
    for i in range(12):  # a shared prefix: the engine serves part of each prompt from cache
        assert _ask(gateways[i % 2], key, f"{SHARED} question {i}?") == 200
        sent += 1
    after = _engine_counters(engine)
    spent = {name: after[name] - before[name] for name in COUNTERS}
    assert spent["cached"] > 0 and spent["prompt"] > spent["cached"]

    def matches() -> bool:
        used = _usage(fleet)
        return used["requests"] == sent and all(
            abs(used[name] - spent[name]) <= 0.01 * spent[name] for name in COUNTERS
        )

    try:
        wait_for(matches, 20, "usage")
    except AssertionError:
        raise AssertionError(f"usage {_usage(fleet)} vs engine {spent}") from None

    time.sleep(6)  # past a write of the hourly totals (every 5 s)
    fleet.kill("server", signal.SIGKILL)
    fleet.start_server()
    wait_for(lambda: _usage(fleet)["requests"] == sent, 20, "the usage kept over a kill -9")
    time.sleep(3)  # the separate gateway reports to the new server: a baseline, not a count
    assert _usage(fleet)["requests"] == sent
    assert all(abs(_usage(fleet)[name] - spent[name]) <= 0.01 * spent[name] for name in COUNTERS)
