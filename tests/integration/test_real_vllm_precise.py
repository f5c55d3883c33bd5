"""The precise tier against real vLLM (issue #6, "must show"): two replicas of the CPU build
of vLLM 0.32 serving SmolLM2-135M-Instruct with KV events on, run by a server (with its
in-server gateway) and one agent, as a deployment applied with ``llmgw apply``; beside it a
separate ``llmgw gateway --debug-kv-index`` following the same router feed, whose index can
be read key by key.

The environment is found as in test_real_vllm.py (``scripts/setup-real-vllm``). Shown, with
two engines only (each takes about a minute to become healthy on two cores):

1. **Blocks reach the index.** A long completion prompt sent straight to replica A, and a
   long chat straight to replica B: the gateway's ``llmgw_kv_index_replica_blocks`` shows
   exactly each prompt's full 128-token blocks (counted with ``/tokenize``) on its replica.
2. **The gateway's keys are vLLM's.** The gateway's own code path, run here against the
   real engines (``tokenize_input`` → ``TokenizeClient`` on ``/tokenize``, the ``messages``
   form for the chat → ``BlockKeyCache`` keys), yields exactly the keys the index holds
   for A and for B, which the agent made from what vLLM published. Then the same two
   requests through the gateway are precise-tier hits whose *available* and *captured*
   reuse (``llmgw_reuse_tokens_total``) is every full block, with no fallback: had one
   token or one hash differed, the match would stop at that block.
3. **Routed to the holder, and vLLM agrees.** The completion went to A and the chat to B
   (``GetRouterStats``); A's own ``vllm:prefix_cache_hits_total`` rose by exactly the
   completion's cached tokens and B's by exactly the chat's (of different sizes), neither
   from the other's request.
4. **A restart clears the index.** kill -9 B's engine: the agent restarts it; B's blocks
   leave both gateways' indexes (A's stay), at the latest 2 s after the restart, and do not
   come back when B is READY again; the completion through the gateway still hits A. The
   times are logged (run with ``-o log_cli=true --log-cli-level=INFO``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import Cluster, wait_for
from shardops import ShardWatch, listed_shards
from test_real_vllm import (  # noqa: F401 (real_vllm is a fixture)
    BLOCK_SIZE,
    ENGINE_ENV,
    HEALTHY_WITHIN_S,
    PROFILE_ARGS,
    SERVED,
    RealVllm,
    auth,
    metric,
    real_vllm,
    session_members,
    start_agent,
)

from llmgw.api.llmgw.v1 import RouterStats, ShardState
from llmgw.client import ControlClient, GrpcWebChannel
from llmgw.gateway.openai import CHAT_PATH, COMPLETIONS_PATH
from llmgw.gateway.precise import BlockKeyCache
from llmgw.gateway.tokenize import TokenizeClient, TokenizeConfig, tokenize_input
from llmgw.gateway.upstream import UpstreamPool

pytestmark = [pytest.mark.real_vllm, pytest.mark.integration, pytest.mark.slow]

log = logging.getLogger(__name__)

READY = "SHARD_STATE_READY"
HITS = "vllm:prefix_cache_hits_total"
PROMPT = "Lighthouse log: " + " ".join(f"lamp{i} lit" for i in range(220))
SYSTEM = "You are a harbour pilot. Obey these rules: " + ", ".join(
    f"rule {i} is {i * 7 % 13}" for i in range(80)
)
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Which rule says 5?"},
]
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? (\S+)$", re.MULTILINE)


def deployment_file(real: RealVllm) -> str:
    """The real-vLLM profile of test_real_vllm.py as a TOML deployment of two replicas."""
    env = ", ".join(f"{name} = {json.dumps(value)}" for name, value in ENGINE_ENV.items())
    return f"""
[profiles.smollm2-kv]
engine = "vllm"
gpu_class = "cpu"
cpu_threads = 1  # one core each: the two engines share this machine's two
model_path = {json.dumps(str(real.model))}
served_model_name = "{SERVED}"
kv_events = true
args = {json.dumps(PROFILE_ARGS)}
env = {{ {env} }}

[deployments.smollm2]
profile = "smollm2-kv"
replicas = 2
"""


# --- reading the server, the gateway and the engines ---------------------------------------


@dataclass(frozen=True, slots=True)
class Replica:
    replica_id: str
    endpoint: str
    api_key: str
    shard_id: str


def ready_replicas(fleet: Cluster, count: int) -> list[Replica] | None:
    """The READY replicas (by replica id) once there are ``count``, else None."""
    out = fleet.cli("get", "replicas", "-o", "json", check=False)
    if out.returncode != 0:
        return None
    rows = [r for r in json.loads(out.stdout)["replicas"] if r.get("state") == READY]
    if len(rows) != count:
        return None
    keys = api_keys(fleet.root / "server.db")
    found = [
        Replica(r["replicaId"], r["endpoint"], keys[r["replicaId"]], r["shardIds"][0]) for r in rows
    ]
    return sorted(found, key=lambda r: r.replica_id)


def api_keys(db: Path) -> dict[str, str]:
    """Each replica's engine API key, from the server's database (only the gateway has it)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT replica_id, record FROM replicas").fetchall()
    conn.close()
    return {replica_id: json.loads(record)["api_key"] for replica_id, record in rows}


def gateway_metrics(base: str) -> dict[str, float]:
    """The gateway's samples as ``name{labels}`` → value."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {f"{m[0]}{{{m[1]}}}" if m[1] else m[0]: float(m[2]) for m in _SAMPLE.findall(text)}


def indexed(base: str) -> dict[str, int]:
    """``llmgw_kv_index_replica_blocks``: blocks in the gateway's index, by replica id."""
    prefix = 'llmgw_kv_index_replica_blocks{replica="'
    return {
        key[len(prefix) : -2]: int(value)
        for key, value in gateway_metrics(base).items()
        if key.startswith(prefix)
    }


def changed(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    return {
        key: after[key] - before.get(key, 0.0)
        for key in after
        if key.startswith(prefix) and after[key] != before.get(key, 0.0)
    }


def router_stats(fleet: Cluster) -> RouterStats:
    async def read() -> RouterStats:
        async with GrpcWebChannel(fleet.url) as channel:
            return await ControlClient(channel).get_router_stats()

    return asyncio.run(read())


def routed(fleet: Cluster) -> dict[str, int]:
    """Decisions that chose each replica, as ``GetRouterStats`` reports them."""
    return {row.replica_id: row.requests for row in router_stats(fleet).replicas}


def hits(replicas: list[Replica]) -> list[float]:
    """Each engine's own ``vllm:prefix_cache_hits_total`` (its /metrics, no key needed)."""
    return [metric(r.endpoint, HITS) for r in replicas]


def count_tokens(replica: Replica, body: dict[str, Any]) -> int:
    """The prompt's tokens by the engine's own ``/tokenize`` (as the gateway will ask)."""
    body = {"model": SERVED, **body}
    reply = httpx.post(
        f"{replica.endpoint}/tokenize", json=body, headers=auth(replica.api_key), timeout=60
    )
    assert reply.status_code == 200, reply.text
    count: int = reply.json()["count"]
    return count


def full_blocks(tokens: int) -> int:
    """The blocks vLLM caches of a prompt of ``tokens`` tokens; the test wants at least four
    and a partial last block (so every full block is a prefix-cache hit next time)."""
    assert tokens % BLOCK_SIZE and tokens // BLOCK_SIZE >= 4, tokens
    return tokens // BLOCK_SIZE


def debug_keys(base: str) -> dict[str, list[str]]:
    """``GET /debug/kv_index`` of a gateway: each replica's indexed keys (16 hex digits)."""
    reply = httpx.get(f"{base}/debug/kv_index", timeout=10)
    assert reply.status_code == 200, reply.text
    return {r: row["keys"] for r, row in reply.json()["replicas"].items()}


def gateway_keys(replica: Replica, path: str, body: dict[str, Any]) -> list[str]:
    """The block keys the precise tier computes for ``body`` sent to ``path``, by its own
    code against ``replica``'s real ``/tokenize``: what to tokenize (``tokenize_input``),
    the call (``TokenizeClient``), the keys (``BlockKeyCache``, as ``PreciseTier.keys``)."""

    async def compute() -> list[int]:
        pool = UpstreamPool()
        try:
            wanted = tokenize_input(path, json.dumps(body).encode(), SERVED)
            assert not wanted.unsupported and wanted.body, wanted
            client = TokenizeClient(pool, TokenizeConfig(timeout_s=60))
            result = await client.tokenize(replica.endpoint, replica.api_key, wanted.body)
            assert result.tokens is not None, result.failure
            return BlockKeyCache(BLOCK_SIZE).keys(result.tokens, wanted.cache_salt)
        finally:
            await pool.close()

    return [f"{key:016x}" for key in asyncio.run(compute())]


# --- requests --------------------------------------------------------------------------------


def completion_body() -> dict[str, Any]:
    return {"model": SERVED, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}


def chat_body() -> dict[str, Any]:
    return {"model": SERVED, "messages": CHAT, "max_tokens": 1, "temperature": 0}


def send(base: str, path: str, body: dict[str, Any], key: str = "") -> dict[str, Any]:
    headers = auth(key) if key else {}
    reply = httpx.post(f"{base}{path}", json=body, headers=headers, timeout=120)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


# --- the test --------------------------------------------------------------------------------


@pytest.mark.timeout(900)
def test_precise_routing_on_two_real_vllm_replicas(
    real_vllm: RealVllm,  # noqa: F811 (the fixture imported above)
    fleet: Cluster,
    tmp_path: Path,
) -> None:
    # /tokenize takes 6-7 ms here; a 1 s bound keeps a busy CI machine's hiccup from sending
    # one of the two routed requests to the approximate tier (which the test would fail)
    fleet.start_server("--gateway-tokenize-timeout", "1")
    start_agent(fleet, real_vllm)
    keyed = fleet.start_gateway("gateway-debug", "--debug-kv-index")
    wait_for(lambda: fleet.node_states().get("n1") == "NODE_STATE_READY", 60, "n1 READY")
    path = tmp_path / "smollm2.toml"
    path.write_text(deployment_file(real_vllm))
    with ShardWatch(fleet.url) as watch:
        started = time.monotonic()
        assert "deployment smollm2 applied" in fleet.cli("apply", "-f", str(path)).stdout
        found = wait_for(
            lambda: ready_replicas(fleet, 2), 2 * HEALTHY_WITHIN_S, "2 READY replicas", every=1
        )
        log.info("two real vLLM replicas READY after %.1f s", time.monotonic() - started)
        a, b = found
        wait_for(
            lambda: indexed(fleet.gateway_url) == dict.fromkeys([a.replica_id, b.replica_id], 0),
            30,
            "routes",
        )
        blocks = _blocks_reach_the_index(fleet.gateway_url, a, b)
        _gateway_keys_are_the_indexed_keys(keyed, a, b, blocks)
        _precise_hits_on_the_holder(fleet, [a, b], blocks)
        _restart_clears_the_index(fleet, keyed, watch, [a, b], blocks[0])


def _blocks_reach_the_index(base: str, a: Replica, b: Replica) -> tuple[int, int]:
    """The completion straight to A, the chat straight to B: the index shows their blocks
    (exactly: a block more or less on either would fail)."""
    for replica in (a, b):  # warm both tokenizers and chat templates up for the gateway
        count_tokens(replica, {"messages": CHAT, "add_generation_prompt": True})
    prompt_blocks = full_blocks(count_tokens(a, {"prompt": PROMPT}))
    chat_blocks = full_blocks(count_tokens(b, {"messages": CHAT, "add_generation_prompt": True}))
    assert prompt_blocks != chat_blocks  # so that hit counts tell the two apart
    for replica, path, body, want in (
        (a, COMPLETIONS_PATH, completion_body(), prompt_blocks),
        (b, CHAT_PATH, chat_body(), chat_blocks),
    ):
        _send_and_see_blocks(base, replica, path, body, want)
    time.sleep(0.5)  # anything more would show by now
    assert indexed(base) == {a.replica_id: prompt_blocks, b.replica_id: chat_blocks}
    lag = gateway_metrics(base)["llmgw_kv_index_event_lag_max_seconds"]
    log.info("longest engine event → index: %.3f s", lag)
    return prompt_blocks, chat_blocks


def _send_and_see_blocks(
    base: str, replica: Replica, path: str, body: dict[str, Any], blocks: int
) -> None:
    """``body`` straight to ``replica``; wait until the gateway indexes ``blocks`` of it."""
    send(replica.endpoint, path, body, replica.api_key)
    answered = time.monotonic()
    wait_for(lambda: indexed(base).get(replica.replica_id, 0) >= blocks, 30, "blocks", 0.02)
    took = time.monotonic() - answered
    log.info("%s: %d blocks in the index %.3f s after the answer", path, blocks, took)


def _gateway_keys_are_the_indexed_keys(
    keyed: str, a: Replica, b: Replica, blocks: tuple[int, int]
) -> None:
    """The keys the gateway's code computes from the real /tokenize are the indexed ones."""
    want = {a.replica_id: blocks[0], b.replica_id: blocks[1]}

    def complete() -> dict[str, list[str]] | None:
        found = debug_keys(keyed)
        return found if {r: len(k) for r, k in found.items()} == want else None

    held = wait_for(complete, 30, f"{want} keys in the debug gateway's index")
    prompt = gateway_keys(b, COMPLETIONS_PATH, completion_body())  # B tokenizes A's prompt
    chat = gateway_keys(a, CHAT_PATH, chat_body())  # ... and A B's chat
    assert len(prompt) == blocks[0] and len(chat) == blocks[1]
    assert sorted(prompt) == held[a.replica_id]
    assert sorted(chat) == held[b.replica_id]


def _precise_hits_on_the_holder(
    fleet: Cluster, replicas: list[Replica], blocks: tuple[int, int]
) -> None:
    """Both requests again, through the gateway: precise hits on every full block, each on
    the replica holding it, confirmed by the engines' own prefix-cache hits."""
    base = fleet.gateway_url
    a, b = replicas
    before, hits_before, routed_before = gateway_metrics(base), hits(replicas), routed(fleet)
    send(base, COMPLETIONS_PATH, completion_body())
    send(base, CHAT_PATH, chat_body())
    after, hits_after, routed_after = gateway_metrics(base), hits(replicas), routed(fleet)
    decisions = changed(before, after, "llmgw_prefix_decisions_total{")
    fallbacks = changed(before, after, "llmgw_precise_fallbacks_total{")
    hit = 'llmgw_prefix_decisions_total{tier="precise",outcome="hit"}'
    assert decisions == {hit: 2}, (decisions, fallbacks)
    cached = sum(blocks) * BLOCK_SIZE
    reuse = changed(before, after, "llmgw_reuse_tokens_total{")
    delivered = reuse.pop('llmgw_reuse_tokens_total{stage="delivered"}', 0)
    assert reuse == {
        'llmgw_reuse_tokens_total{stage="available"}': cached,
        'llmgw_reuse_tokens_total{stage="captured"}': cached,
    }
    assert 0 <= delivered <= cached  # the engines' own hits, as far as a poll has seen them
    chose = {r: n - routed_before.get(r, 0) for r, n in routed_after.items()}
    assert chose == {a.replica_id: 1, b.replica_id: 1}
    rises = [now - then for now, then in zip(hits_after, hits_before, strict=True)]
    assert rises == [blocks[0] * BLOCK_SIZE, blocks[1] * BLOCK_SIZE], rises
    tokenize = changed(before, after, "llmgw_tokenize_seconds_")
    log.info(
        "through the gateway: A's prefix hits +%d, B's +%d tokens; /tokenize %.1f ms each",
        *rises,
        1000 * tokenize["llmgw_tokenize_seconds_sum"] / tokenize["llmgw_tokenize_seconds_count"],
    )


def _restart_clears_the_index(
    fleet: Cluster, keyed: str, watch: ShardWatch, replicas: list[Replica], prompt_blocks: int
) -> None:
    """kill -9 B's engine: its blocks leave the index, A's stay, and B's stay gone."""
    base = fleet.gateway_url
    a, b = replicas
    pid = int(listed_shards(fleet)[b.shard_id]["status"]["pid"])
    killed_ms = time.time() * 1000
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not indexed(base).get(b.replica_id), 60, "B's blocks gone", 0.02)
    gone_ms = time.time() * 1000
    assert indexed(base).get(a.replica_id) == prompt_blocks
    restarted = watch.wait(b.shard_id, ShardState.STARTING, nth=2, within=60)
    again = watch.wait(b.shard_id, ShardState.READY, nth=2, within=HEALTHY_WITHIN_S)
    assert again.pid != pid and again.restarts == 1 and session_members(pid) == []
    log.info(
        "B's blocks left the index %.0f ms after the kill, %+.0f ms from the agent starting "
        "its engine again (READY %.1f s after that)",
        gone_ms - killed_ms,
        gone_ms - restarted.since_unix_ms,
        (again.since_unix_ms - restarted.since_unix_ms) / 1000,
    )
    assert gone_ms - restarted.since_unix_ms < 2000  # within 2 s of the restart at the latest
    time.sleep(2)  # a stale copy (a replay from before the kill) would show by now
    assert indexed(base) == {a.replica_id: prompt_blocks, b.replica_id: 0}
    assert {r: len(k) for r, k in debug_keys(keyed).items()} == {a.replica_id: prompt_blocks}
    hits_before = hits(replicas)
    send(base, COMPLETIONS_PATH, completion_body())
    rises = [now - then for now, then in zip(hits(replicas), hits_before, strict=True)]
    assert rises == [prompt_blocks * BLOCK_SIZE, 0], rises
