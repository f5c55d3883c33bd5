"""The precise tier end to end: a real server with its in-server gateway, a simulated DGX
agent and three ``llmgw sim-engine`` replicas publishing KV events over ``ipc://``.

The engines' events reach the agent's mirrors, go up its stream as block keys, into the
server's block store, down the router feed into the gateway's KV index; the gateway
tokenizes each chat through a replica's ``/tokenize`` and scores the replicas on the
request's own blocks. Shown, after a warm-up: every decision is the precise tier's (the
server runs with a 2 s ``/tokenize`` bound, so a busy machine's hiccup is no fallback; the
fallback itself is tested in ``test_tokenize_client``), and the chosen replica holds at
least 99 % of the leading blocks the best replica holds (the gateway's own
``llmgw_reuse_tokens_total`` captured / available); the engines' own prefix hits and KV
capacity reach the gateway through its poller.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from precisekit import SIM_BIN, Conversation, profile_file, ready_replicas
from precisekit import metrics as _metrics
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

GROUPS = 3
USERS = 3  # per group


def test_after_warm_up_the_precise_tier_routes_to_the_replica_holding_the_prefix(
    fleet: Cluster, tmp_path: Path
) -> None:
    # `fleet` kills the engines the agent leaves behind (agents keep them for adoption)
    fleet.start_server("--gateway-tokenize-timeout", "2")
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN)
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "agent READY")
    path = tmp_path / "kv.toml"
    path.write_text(profile_file(3))
    assert "deployment chat applied" in fleet.cli("apply", "-f", str(path)).stdout
    wait_for(lambda: ready_replicas(fleet, 3), 90, "3 READY replicas")
    _exercise(fleet.gateway_url)


def _exercise(base: str) -> None:
    routes = "llmgw_replica_in_flight{"
    wait_for(lambda: sum(k.startswith(routes) for k in _metrics(base)) == 3, 30, "3 routes")
    # the engines' counters count from the poller's first reading of each (its baseline):
    # a first poll after the traffic would see no hits delivered
    capacity = "llmgw_engine_kv_capacity_tokens"
    wait_for(lambda: sum(k.startswith(capacity) for k in _metrics(base)) == 3, 30, "3 polls")
    conversations = [Conversation(g, u) for g in range(GROUPS) for u in range(USERS)]
    with httpx.Client(base_url=base, timeout=30) as client:
        for conversation in conversations[::USERS]:  # warm-up: each group's first user
            conversation.ask(client)
        wait_for(lambda: _metrics(base).get("llmgw_kv_index_replicas", 0) >= 1, 20, "blocks")
        time.sleep(0.5)  # the last warm-up request's blocks reach the index too
        before = _metrics(base)
        asked = 0
        for turn in range(2):
            for conversation in conversations:
                if turn or conversation.turns == 0:
                    conversation.ask(client)
                    asked += 1
                    time.sleep(0.1)  # let its blocks be published before the next one
        after = _metrics(base)
    _check_decisions(before, after, asked)
    _check_reuse(before, after)
    _check_delivered(base)


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _check_decisions(before: dict[str, float], after: dict[str, float], asked: int) -> None:
    def changed(prefix: str) -> dict[str, float]:
        return {
            key: after[key] - before.get(key, 0.0)
            for key in after
            if key.startswith(prefix) and after[key] != before.get(key, 0.0)
        }

    decided = changed("llmgw_prefix_decisions_total{")
    assert sum(decided.values()) == asked, decided
    precise = sum(v for k, v in decided.items() if 'tier="precise"' in k)
    hits = decided.get('llmgw_prefix_decisions_total{tier="precise",outcome="hit"}', 0)
    assert not changed("llmgw_precise_fallbacks_total{")
    assert precise == asked, decided
    assert hits >= 0.8 * asked, decided  # the precise tier decided, and found the prefix


def _check_reuse(before: dict[str, float], after: dict[str, float]) -> None:
    available = _delta(before, after, 'llmgw_reuse_tokens_total{stage="available"}')
    captured = _delta(before, after, 'llmgw_reuse_tokens_total{stage="captured"}')
    prompt = _delta(before, after, 'llmgw_reuse_prompt_tokens_total{source="router"}')
    assert available > 0.5 * prompt > 0  # most of each prompt was cached somewhere ...
    assert captured >= 0.99 * available  # ... and the chosen replica held it


def _check_delivered(base: str) -> None:
    # the poller reads the engines' own counters every 5 s: their hits confirm the choices
    def delivered() -> float:
        return _metrics(base).get('llmgw_reuse_tokens_total{stage="delivered"}', 0.0)

    assert wait_for(delivered, 20, "the engines' prefix hits") > 0
    samples = _metrics(base)
    capacity = [v for k, v in samples.items() if k.startswith("llmgw_engine_kv_capacity_tokens")]
    assert len(capacity) == 3 and all(v == 4096 * 16 for v in capacity)
