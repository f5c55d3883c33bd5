"""Faults in the precise tier's KV event chain, end to end, seen from the gateway.

A real server with its in-server gateway, a simulated DGX agent and two ``llmgw sim-engine``
replicas publishing KV events over ``ipc://`` (with ``--sim-test-hooks``). The gateway's
index is read two ways: the in-server gateway's ``/metrics`` (``llmgw_kv_index_blocks``,
``llmgw_kv_index_resets_total``) and, per replica, a second gateway index fed by the router
feed as ``llmgw gateway`` feeds its own (precisekit.FeedIndex). The truth is each engine's
own prefix cache (``GET /debug/kv_cache``, as llmgw block keys).

* **kill -9 an engine**: the agent restarts it; its blocks are out of the gateway's index
  no later than 2 s after the new engine process answers ``/health`` (measured on the
  interval itself; in practice they leave when the agent reports the engine FAILED, before
  the restart), they do not come back, and the other replica's blocks stay.
* **A forced gap**: each engine leaves one KV event batch unsent (kept for replay, as a
  message lost on the way); the agent notices the seq gap on the next batch and replays
  from exactly the lost one; no reset reaches the gateway, and afterwards its index holds
  exactly what each engine's cache holds, the lost batch's blocks included. The server's
  own ``/metrics`` (the agent's KV event counters, from its heartbeats) agree: each
  engine's gaps and replays rose by one, its resets and replay failures by none.
* **LoRA**: a chat naming one of the profile's LoRA adapters reaches the replicas serving
  it, is decided by the precise tier on blocks keyed with the adapter's extra key (a hit
  on the index alone, its reuse captured), while the same tokens on the base model find
  nothing.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from precisekit import (
    SIM_BIN,
    Conversation,
    FeedIndex,
    drop_kv_batches,
    engine_keys,
    kv_event_hooks,
    metrics,
    profile_file,
    ready_replicas,
    shards,
)
from procs import Cluster, wait_for

from llmgw.gateway.precise import PreciseConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
log = logging.getLogger(__name__)

REPLICAS = 2
GONE_AFTER_RESTART_S = 2.0  # the bound: blocks out of the index after a restart
BLOCKS = "llmgw_kv_index_blocks"
RESETS = "llmgw_kv_index_resets_total"


def _start(
    fleet: Cluster, tmp_path: Path, adapters: dict[str, str] | None = None
) -> dict[str, str]:
    """Server, agent and READY replicas; each replica's endpoint by replica id. The gateway
    waits up to 2 s for a /tokenize: no decision here falls back for a busy machine."""
    fleet.start_server("--gateway-tokenize-timeout", "2")
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN)
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "agent READY")
    path = tmp_path / "kv.toml"
    path.write_text(profile_file(REPLICAS, "--sim-test-hooks", adapters=adapters))
    assert "deployment chat applied" in fleet.cli("apply", "-f", str(path)).stdout
    replicas = wait_for(lambda: ready_replicas(fleet, REPLICAS), 90, "READY replicas")
    routes = "llmgw_replica_in_flight{"
    wait_for(lambda: sum(k.startswith(routes) for k in metrics(fleet.gateway_url)) == REPLICAS,
             30, "the gateway's routes")  # fmt: skip
    return {r["replicaId"]: r["endpoint"] for r in replicas}


def _converse(base: str, groups: range) -> None:
    """One new conversation per group through the gateway (a new prefix goes to the
    replica holding least, so they spread over the replicas)."""
    with httpx.Client(base_url=base, timeout=30) as client:
        for group in groups:
            Conversation(group, 0).ask(client)


def _in_step(base: str, feed: FeedIndex, endpoints: dict[str, str]) -> dict[str, set[int]]:
    """Each engine's cached keys once the gateway's index holds exactly those (per replica
    in the feed's index, in total in the in-server gateway's)."""

    def same() -> dict[str, set[int]] | None:
        held = {r: engine_keys(e) for r, e in endpoints.items()}
        if any(feed.keys_of(r) != keys for r, keys in held.items()):
            return None
        total = metrics(base).get(BLOCKS)
        return held if total == sum(len(keys) for keys in held.values()) else None

    found: dict[str, set[int]] = wait_for(same, 30, "the index to equal the engines' caches")
    return found


def test_a_killed_engines_blocks_leave_the_index_within_2s_of_its_restart(
    fleet: Cluster, tmp_path: Path
) -> None:
    endpoints = _start(fleet, tmp_path)
    base = fleet.gateway_url
    with FeedIndex(fleet.grpc_port) as feed:
        _converse(base, range(4))
        held = _in_step(base, feed, endpoints)
        assert all(held.values()), {r: len(k) for r, k in held.items()}  # both hold blocks
        victim = max(held, key=lambda r: len(held[r]))
        others = sum(len(keys) for r, keys in held.items() if r != victim)
        old_pid = int(shards(fleet)[victim]["status"]["pid"])

        os.kill(old_pid, signal.SIGKILL)
        killed = time.monotonic()
        up, gone = _restart_and_removal(base, endpoints[victim], others)
        log.info("kill -9 %s (%d blocks): serving again after %.3f s, its blocks out of "
                 "the index after %.3f s", victim, len(held[victim]), up - killed,
                 gone - killed)  # fmt: skip
        assert gone - up <= GONE_AFTER_RESTART_S, (gone - killed, up - killed)
        assert not feed.keys_of(victim) & held[victim]  # not one old block, per replica

        # they do not come back (a replay of the new engine holds nothing old), the other
        # replica's blocks stay, and the new engine's cache is empty, as the index says
        for _ in range(10):
            assert metrics(base).get(BLOCKS) == others
            assert not feed.keys_of(victim) & held[victim]
            time.sleep(0.2)
        assert _in_step(base, feed, endpoints) == {**held, victim: set()}
        status = shards(fleet)[victim]["status"]
        assert int(status["pid"]) != old_pid and int(status.get("restarts", 0)) >= 1

        _converse(base, range(10, 11))  # a new prefix: to the empty, restarted replica
        after = _in_step(base, feed, endpoints)
    assert after[victim] and not after[victim] & held[victim]


def _restart_and_removal(base: str, endpoint: str, others: int) -> tuple[float, float]:
    """When the new engine first answered ``/health`` (the request's send time) and when
    the gateway's index first held only the other replicas' blocks (the answer's time)."""
    up: float | None = None
    gone: float | None = None
    deadline = time.monotonic() + 90
    with httpx.Client(timeout=1) as client:
        while (up is None or gone is None) and time.monotonic() < deadline:
            if up is None:
                sent = time.monotonic()
                try:
                    if client.get(f"{endpoint}/health").status_code == 200:
                        up = sent
                except httpx.HTTPError:
                    pass  # not listening yet
            if gone is None and metrics(base).get(BLOCKS) == others:
                gone = time.monotonic()
            time.sleep(0.02)
    assert up is not None and gone is not None, f"restarted at {up}, blocks gone at {gone}"
    return up, gone


_REPLAYING = re.compile(r"shard (\S+): KV events (\d+)\.\.(\d+) missed; replaying")


FOLLOWED = ("gaps", "replays", "resets", "replay_failures", "restarts")


def _agent_counts(fleet: Cluster, shard_of: dict[str, str]) -> dict[str, dict[str, float]]:
    """Each replica's KV event counters on the server's ``/metrics`` (as the agent's last
    heartbeat said), ``blocks`` its mirror's size; a replica without them is left out."""
    samples = metrics(fleet.url)
    found: dict[str, dict[str, float]] = {}
    for replica, shard in shard_of.items():
        labels = f'{{node="a1",replica="{replica}",shard="{shard}"}}'
        names = {name: f"llmgw_kv_events_{name}_total{labels}" for name in FOLLOWED}
        names["blocks"] = f"llmgw_kv_mirror_blocks{labels}"
        if all(name in samples for name in names.values()):
            found[replica] = {key: samples[name] for key, name in names.items()}
    return found


def _agent_counts_when(
    fleet: Cluster, shard_of: dict[str, str], blocks: dict[str, int]
) -> dict[str, dict[str, float]]:
    """The counters once every replica's heartbeat reports ``blocks`` mirrored."""

    def ready() -> dict[str, dict[str, float]] | None:
        counts = _agent_counts(fleet, shard_of)
        held = {r: c["blocks"] for r, c in counts.items()}
        return counts if held == blocks else None

    found: dict[str, dict[str, float]] = wait_for(ready, 30, "the agent's counters on /metrics")
    return found


def test_a_forced_gap_heals_by_replay_without_a_reset(fleet: Cluster, tmp_path: Path) -> None:
    endpoints = _start(fleet, tmp_path)
    base = fleet.gateway_url
    shard_of = {r: s["shardId"] for r, s in shards(fleet).items()}
    with FeedIndex(fleet.grpc_port) as feed:
        _converse(base, range(2))
        held = _in_step(base, feed, endpoints)
        before = metrics(base)
        counted = _agent_counts_when(fleet, shard_of, {r: len(k) for r, k in held.items()})
        assert before.get(RESETS, 0) == 0 and all(held.values())
        for endpoint in endpoints.values():
            assert drop_kv_batches(endpoint, 1)["dropping"] == 1

        for group in range(20, 40):  # until every engine has sent a batch after its lost one
            hooks = {r: kv_event_hooks(e) for r, e in endpoints.items()}
            if all(h["dropped"] and h["next_seq"] > h["dropped"][-1] + 1 for h in hooks.values()):
                break
            _converse(base, range(group, group + 1))
        else:
            raise AssertionError(f"an engine published nothing after its drop: {hooks}")

        healed = _in_step(base, feed, endpoints)
        after = metrics(base)
        hooks = {r: kv_event_hooks(e) for r, e in endpoints.items()}
        recounted = _agent_counts_when(fleet, shard_of, {r: len(k) for r, k in healed.items()})
    for replica, state in hooks.items():
        (lost,) = state["dropped"]
        assert lost in state["replayed_from"], (replica, state)  # replayed from the lost one
        assert len(healed[replica]) > len(held[replica])  # the gap's blocks are in the index
    assert after.get(RESETS, 0) == before.get(RESETS, 0) == 0  # no reset reached the gateway
    said = fleet.log("a1")  # the agent's own word: one gap per engine, at the lost batch
    gaps = [(shard, int(a), int(b)) for shard, a, b in _REPLAYING.findall(said)]
    shard_of = {r: s["shardId"] for r, s in shards(fleet).items()}
    lost_at = [(shard_of[r], s["dropped"][0], s["dropped"][0]) for r, s in hooks.items()]
    assert sorted(gaps) == sorted(lost_at), said
    assert "are lost; resetting" not in said and "resetting its KV blocks" not in said
    # the server's /metrics say the same: per engine, one forced gap (one batch dropped,
    # above), so one gap and one replay more, and no reset, replay failure or restart
    for replica in endpoints:
        rose = {k: recounted[replica][k] - counted[replica][k] for k in FOLLOWED}
        assert rose == {"gaps": 1, "replays": 1, "resets": 0, "replay_failures": 0,
                        "restarts": 0}, (replica, counted, recounted)  # fmt: skip


ADAPTER = "sql-lora"
CLAIM_TTL_S = PreciseConfig().claim_ttl_s
DECIDED = "llmgw_prefix_decisions_total{"
FALLBACKS = "llmgw_precise_fallbacks_total{"


def _changed(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    return {
        key: after[key] - before.get(key, 0.0)
        for key in after
        if key.startswith(prefix) and after[key] != before.get(key, 0.0)
    }


def test_lora_requests_are_decided_by_the_precise_tier(fleet: Cluster, tmp_path: Path) -> None:
    endpoints = _start(fleet, tmp_path, adapters={ADAPTER: f"/adapters/{ADAPTER}"})
    base = fleet.gateway_url
    with FeedIndex(fleet.grpc_port) as feed, httpx.Client(base_url=base, timeout=30) as client:
        lora = Conversation(0, 0, model=ADAPTER)
        lora.ask(client)  # a new prefix, cached under the adapter's keys
        _in_step(base, feed, endpoints)
        before = metrics(base)
        for _ in range(3):
            lora.ask(client)
            _in_step(base, feed, endpoints)
            time.sleep(CLAIM_TTL_S)  # the next decision sees the index alone, not claims
        after = metrics(base)
        Conversation(0, 0).ask(client)  # the same first turn on the base model
        base_model = metrics(base)
    decided = _changed(before, after, DECIDED)
    fallbacks = _changed(before, after, FALLBACKS)
    assert decided == {DECIDED + 'tier="precise",outcome="hit"}': 3}, (decided, fallbacks)
    reuse = 'llmgw_reuse_tokens_total{stage="%s"}'
    captured = after[reuse % "captured"] - before.get(reuse % "captured", 0)
    available = after[reuse % "available"] - before.get(reuse % "available", 0)
    assert captured >= 0.99 * available > 0  # the adapter's blocks were found, and used
    # its tokens equal the LoRA turn's, but without the adapter they are other blocks
    assert not _changed(after, base_model, DECIDED + 'tier="precise",outcome="hit"}')
