"""Cache-aware scale-in end to end: a real server, a simulated DGX agent and three ``llmgw
sim-engine`` replicas publishing KV events; the count lowered by ``llmgw scale``.

The test fills each engine's prefix cache with prompts of its choosing, sent to the engine
itself (endpoint and API key from the server's router feed, as a gateway gets them):

- chat-1: one medium prompt of its own (the fewest blocks in all, every one unique);
- chat-2: one long prompt that chat-3 holds too (many blocks, almost none unique);
- chat-3: the same long prompt and a short one of its own (the most blocks, some unique).

The engines' blocks travel as KV events to the agent, up its stream into the server's block
store; once the feed shows every engine's cache as it is, ``llmgw apply --dry-run`` of a
count of two names chat-2 to remove, and ``llmgw scale chat 2`` must retire chat-2: not the
newest (chat-3, the rule without caches in view) nor the one holding the fewest blocks
(chat-1), but the one whose loss costs the fewest blocks no other holds.

Warm placement: with chat-1 on a1 and chat-2 on a3, a node a2 joins and chat is scaled to
one (chat-2 retires); scaled out again, the dry run and then the reconciler put chat-3 on
a3, where the model was loaded before, not on a2, which ties with it on spread and free
GPUs and comes first by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from precisekit import SIM_BIN, FeedIndex, engine_keys, profile_file, ready_replicas, shards
from procs import Cluster, wait_for

from llmgw.gateway.routing.table import Target

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def words(tag: str, count: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(count))


PROMPTS = {
    "chat-1": [words("medium", 300)],
    "chat-2": [words("shared", 900)],
    "chat-3": [words("shared", 900), words("short", 120)],
}


def test_a_scale_in_retires_the_replica_holding_the_fewest_unique_blocks(
    fleet: Cluster, tmp_path: Path
) -> None:
    fleet.start_server()
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN)
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "agent READY")
    path = tmp_path / "kv.toml"
    path.write_text(profile_file(3))
    assert "deployment chat applied" in fleet.cli("apply", "-f", str(path)).stdout
    wait_for(lambda: ready_replicas(fleet, 3), 90, "3 READY replicas")
    with FeedIndex(fleet.grpc_port) as feed:
        targets = wait_for(lambda: _targets(feed, sorted(PROMPTS)), 30, "3 targets on the feed")
        for replica_id, prompts in PROMPTS.items():
            for prompt in prompts:
                _complete(targets[replica_id], prompt)
        held = wait_for(lambda: _in_step(feed, targets), 30, "the feed to equal the caches")
    unique = {r: len(keys - set().union(*(k for o, k in held.items() if o != r)))
              for r, keys in held.items()}  # fmt: skip
    total = {r: len(keys) for r, keys in held.items()}
    # the fleet is as the test means it (each engine's own view)
    assert min(total, key=lambda r: total[r]) == "chat-1", total
    assert min(unique, key=lambda r: unique[r]) == "chat-2", unique
    assert unique["chat-2"] < unique["chat-3"] < unique["chat-1"], unique

    lower = tmp_path / "two.toml"
    lower.write_text(profile_file(2))
    out = fleet.cli("apply", "-f", str(lower), "--dry-run", "-o", "json").stdout
    plan = [(c["action"], c["replica"]) for c in json.loads(out)["changes"]]
    assert plan == [("keep", "chat-1"), ("keep", "chat-3"), ("remove", "chat-2")], out
    fleet.cli("scale", "chat", "2")
    wait_for(lambda: _replica_ids(fleet) == ["chat-1", "chat-3"], 60, "chat-2 retired")
    described = fleet.cli("describe", "replica", "chat-2").stdout
    assert "more replicas than desired; the cheapest to lose: " in described, described


def _targets(feed: FeedIndex, replica_ids: list[str]) -> dict[str, Target] | None:
    found = feed.targets()
    return found if sorted(found) == replica_ids else None


def _complete(target: Target, prompt: str) -> None:
    reply = httpx.post(
        f"{target.url}/v1/completions",
        json={"model": "chat", "prompt": prompt, "max_tokens": 1},
        headers={"Authorization": f"Bearer {target.api_key}"},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text


def _in_step(feed: FeedIndex, targets: dict[str, Target]) -> dict[str, set[int]] | None:
    """Each engine's cached keys, once the feed (the server's block store) shows the same."""
    held = {r: engine_keys(t.url) for r, t in targets.items()}
    same = all(keys and feed.keys_of(r) == keys for r, keys in held.items())
    return held if same else None


def _replica_ids(fleet: Cluster) -> list[str]:
    listed = json.loads(fleet.cli("get", "replicas", "-o", "json").stdout)["replicas"]
    return sorted(r["replicaId"] for r in listed)


def test_a_scale_out_goes_to_the_node_that_loaded_the_model_before(
    fleet: Cluster, tmp_path: Path
) -> None:
    fleet.start_server()
    for node_id in ("a1", "a3"):
        fleet.start_agent(node_id, "dgx-h100", "--engine-bin", SIM_BIN)
    two = {"a1": "NODE_STATE_READY", "a3": "NODE_STATE_READY"}
    wait_for(lambda: fleet.node_states() == two, 30, "a1 and a3 READY")
    path = tmp_path / "kv.toml"
    path.write_text(profile_file(2))
    fleet.cli("apply", "-f", str(path))
    wait_for(lambda: ready_replicas(fleet, 2), 90, "2 READY replicas")
    assert _nodes(fleet) == {"chat-1": "a1", "chat-2": "a3"}
    fleet.start_agent("a2", "dgx-h100", "--engine-bin", SIM_BIN)
    wait_for(lambda: len(fleet.node_states()) == 3 == sum(
        s == "NODE_STATE_READY" for s in fleet.node_states().values()), 30, "a2 READY")  # fmt: skip
    fleet.cli("scale", "chat", "1")
    wait_for(lambda: _replica_ids(fleet) == ["chat-1"], 60, "chat-2 retired")

    # a2 and a3 run nothing of chat and have as many GPUs free; a3 loaded the model before
    out = fleet.cli("apply", "-f", str(path), "--dry-run", "-o", "json")
    adds = [(c["replica"], c["node"]) for c in json.loads(out.stdout)["changes"]
            if c["action"] == "add"]  # fmt: skip
    assert adds == [("chat-3", "a3")], out.stdout
    fleet.cli("scale", "chat", "2")
    wait_for(lambda: ready_replicas(fleet, 2), 90, "2 READY replicas again")
    assert _nodes(fleet) == {"chat-1": "a1", "chat-3": "a3"}


def _nodes(fleet: Cluster) -> dict[str, str]:
    """Each live replica's node (one shard each), as ``llmgw get shards`` says."""
    live = _replica_ids(fleet)
    return {r: s["nodeId"] for r, s in shards(fleet).items() if r in live}
