"""Why a request went there, end to end: a real server with its in-server gateway (client keys
and explain keys), a simulated DGX agent, ``llmgw sim-engine`` replicas publishing KV events
and reporting ``usage.prompt_tokens_details.cached_tokens``, and a separate ``llmgw gateway``.

Shown: ``x-llmgw-route`` only when asked with a key that may see it, naming the replica that
answered (``x-llmgw-replica``) and a precise hit on a repeated prompt; the last decisions in
``GetRouterStats`` through ``llmgw get routes`` (the separate gateway's stamped with its id);
the precise tier's check: its predicted reuse matches the engines' reported cached tokens,
and drifts apart when the engine's ``/tokenize`` disagrees with what it caches
(``--sim-tokenize-skew``: what a tokenizer or chat template mismatch does).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from precisekit import SIM_ARGS, SIM_BIN, ready_replicas, system_prompt
from precisekit import metrics as _metrics
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CLIENT_KEY, EXPLAIN_KEY = "sk-client-e2e-41d7", "sk-ops-e2e-9c02"
SIM = ", ".join(json.dumps(a) for a in (*SIM_ARGS, "--enable-prompt-tokens-details"))
DOCUMENT = f"""
[profiles.kv-sim]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/chat"
served_model_name = "chat"
kv_events = true
args = [{SIM}]

[profiles.kv-skewed]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/skewed"
served_model_name = "skewed"
kv_events = true
args = [{SIM}, "--sim-tokenize-skew", "7"]

[deployments.chat]
profile = "kv-sim"
replicas = 2

[deployments.skewed]
profile = "kv-skewed"
replicas = 1
"""
GAP = 'llmgw_route_gap_tokens_total{tier="precise"}'
CHECKED_PROMPT = 'llmgw_route_checked_prompt_tokens_total{tier="precise"}'
CHECKED = 'llmgw_route_answers_total{tier="precise"}'


def ask(
    base: str, prompt: int, *, key: str = EXPLAIN_KEY, explain: bool = True, model: str = "chat"
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    if explain:
        headers["x-llmgw-explain"] = "1"
    messages = [
        {"role": "system", "content": system_prompt(prompt)},
        {"role": "user", "content": f"Question {prompt}: " + "why " * 30},
    ]
    body = {"model": model, "messages": messages, "max_tokens": 4}
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply


def route_of(reply: httpx.Response) -> dict[str, str]:
    """``x-llmgw-route`` as its fields."""
    fields = (part.split("=", 1) for part in reply.headers["x-llmgw-route"].split("; "))
    return dict(fields)


def cached_tokens(reply: httpx.Response) -> int:
    return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def settle() -> None:
    time.sleep(0.6)  # the answer's KV events reach the gateway's index (flush and feed)


def test_the_route_is_explained_kept_and_checked_against_the_engines(
    fleet: Cluster, tmp_path: Path
) -> None:
    (tmp_path / "client.keys").write_text(f"{CLIENT_KEY}\n")
    (tmp_path / "explain.keys").write_text(f"# operators\n{EXPLAIN_KEY}\n")
    fleet.start_server(
        *("--gateway-tokenize-timeout", "2"),
        *("--gateway-api-key-file", str(tmp_path / "client.keys")),
        *("--gateway-explain-key-file", str(tmp_path / "explain.keys")),
    )
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN)
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "agent READY")
    (tmp_path / "kv.toml").write_text(DOCUMENT)
    fleet.cli("apply", "-f", str(tmp_path / "kv.toml"))
    wait_for(lambda: ready_replicas(fleet, 3), 90, "3 READY replicas")
    base = fleet.gateway_url
    routes = "llmgw_replica_in_flight{"
    wait_for(lambda: sum(k.startswith(routes) for k in _metrics(base)) == 3, 30, "3 routes")

    _explained_only_when_asked_and_allowed(base)
    _checked_reuse_stays_near_zero(base)
    _checked_reuse_drifts_with_a_mismatched_tokenizer(base)
    _recent_decisions_in_get_routes(fleet)


def _explained_only_when_asked_and_allowed(base: str) -> None:
    first = ask(base, 0)
    assert route_of(first)["replica"] == first.headers["x-llmgw-replica"]
    wait_for(lambda: _metrics(base).get("llmgw_kv_index_replicas", 0) >= 1, 20, "blocks")
    settle()
    again = ask(base, 0)
    route = route_of(again)
    assert (route["tier"], route["reason"]) == ("precise", "precise-hit"), route
    assert route["replica"] == again.headers["x-llmgw-replica"]
    matched, total = (int(n) for n in route["matched"].split("/"))
    assert total > 40 and matched >= total - 1, route  # the whole prompt but its last block
    assert cached_tokens(again) >= 16 * (total - 1)
    settle()
    _streamed_with_the_route_before_the_body(base)
    assert "x-llmgw-route" not in ask(base, 0, key=CLIENT_KEY).headers  # may not see it
    assert "x-llmgw-route" not in ask(base, 0, explain=False).headers  # did not ask
    refused = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "chat", "messages": []},
        headers={"authorization": "Bearer sk-nobody", "x-llmgw-explain": "1"},
    )
    assert refused.status_code == 401 and "x-llmgw-route" not in refused.headers


def _streamed_with_the_route_before_the_body(base: str) -> None:
    messages = [
        {"role": "system", "content": system_prompt(0)},
        {"role": "user", "content": "Question 0: " + "why " * 30},
    ]
    body = {
        "model": "chat",
        "messages": messages,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer {EXPLAIN_KEY}", "x-llmgw-explain": "1"}
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith(
            "text/event-stream"
        )
        route = route_of(reply)  # in the head: before any event was read
        events = [line for line in reply.iter_lines() if line.startswith("data: {")]
    assert (route["reason"], route["replica"]) == ("precise-hit", reply.headers["x-llmgw-replica"])
    usage = json.loads(events[-1].removeprefix("data: "))["usage"]  # the final usage chunk
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def _checked_reuse_stays_near_zero(base: str) -> None:
    before = _metrics(base)
    for prompt in range(1, 5):
        for _ in range(2):
            ask(base, prompt)
            settle()
    after = _metrics(base)
    checked = after[CHECKED] - before.get(CHECKED, 0)
    gap = after[GAP] - before.get(GAP, 0)
    prompt_tokens = after[CHECKED_PROMPT] - before.get(CHECKED_PROMPT, 0)
    assert checked == 8 and prompt_tokens > 8 * 40 * 16
    assert gap <= 0.02 * prompt_tokens, (gap, prompt_tokens)  # within a block per request


def _checked_reuse_drifts_with_a_mismatched_tokenizer(base: str) -> None:
    before = _metrics(base)
    replies = []
    for _ in range(4):
        replies.append(ask(base, 9, model="skewed"))
        settle()
    after = _metrics(base)
    gap = after[GAP] - before.get(GAP, 0)
    prompt_tokens = after[CHECKED_PROMPT] - before[CHECKED_PROMPT]
    # the first finds the replica holding nothing yet; the others, keys that never match
    assert route_of(replies[0])["reason"] == "fallback-approximate-miss because no_blocks"
    assert all(route_of(r)["reason"] == "precise-miss" for r in replies[1:])
    assert min(cached_tokens(r) for r in replies[1:]) > 0  # while the engine keeps hitting
    assert gap >= 0.8 * prompt_tokens > 0, (gap, prompt_tokens)


def _recent_decisions_in_get_routes(fleet: Cluster) -> None:
    out = json.loads(fleet.cli("get", "routes", "-o", "json").stdout)
    decisions: list[dict[str, Any]] = out["recentDecisions"]
    assert len(decisions) == 5 + 8 + 4
    hits = [d for d in decisions if d.get("reason") == "precise-hit"]
    assert hits and all(d["tier"] == "precise" and d["unit"] == "blocks" for d in hits)
    assert all(int(d["cachedTokens"]) > 0 for d in hits)
    assert all({c["replicaId"] for c in d["candidates"]} >= {d["replicaId"]} for d in decisions)
    assert int(out["checkedRequests"]) == 4 + 8 + 3  # every precise answer, unexplained too
    streamed = decisions[2]  # the stream's cached tokens came from its final usage chunk
    assert streamed["reason"] == "precise-hit" and int(streamed["cachedTokens"]) > 0
    assert int(out["gapTokens"]) > 0 and int(out["predictedTokens"]) > 0
    gw2 = fleet.start_gateway("gw2", "--gateway-id", "gw2", "--report-interval", "0.5")
    reply = httpx.post(
        f"{gw2}/v1/chat/completions",
        json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"x-llmgw-explain": "1"},  # a gateway without client keys explains to all
        timeout=30,
    )
    assert reply.status_code == 200 and "x-llmgw-route" in reply.headers

    def reported() -> list[dict[str, Any]]:
        listed = json.loads(fleet.cli("get", "routes", "-o", "json").stdout)["recentDecisions"]
        return [d for d in listed if d.get("gatewayId", "").startswith("gw2")]

    assert wait_for(reported, 20, "gw2's decision in GetRouterStats")
    table = fleet.cli("get", "routes").stdout
    assert any(line.endswith("precise-hit") for line in table.splitlines()[1:])
    console = json.loads(fleet.cli("console", "--once", "-o", "json").stdout)
    recent = console["router"]["routes"]["recent"]  # the console's router view, newest first
    assert recent[0]["gateway"].startswith("gw2") and recent[0]["replicaId"]
    assert any(row["reason"] == "precise-hit" for row in recent)
    assert table.splitlines()[0].split()[:3] == ["TIME", "GATEWAY", "MODEL"]
