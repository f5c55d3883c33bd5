"""An agent's engines and a server of another cluster, from outside: real processes.

A server applies a deployment and an agent runs its engines (``llmgw sim-engine``). The
server is then started on a new database (a wrong ``--db``, as a careless operator would):
a new cluster. The agent remembers the first cluster, so it keeps its engines running and
does not hand them over; the new server shows the node NOT_READY with the engines as not
adopted, and stops none of them. Restarting the agent with ``--join-cluster`` and the new
cluster's id hands them over: the new server, which knows none of them, stops them.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from procs import Cluster, wait_for

from llmgw.agent.process import ProcessIdentity, is_running
from llmgw.agent.records import RecordStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
BACKOFF = ("--restart-backoff", "1", "--restart-backoff-max", "1")

DEPLOYMENT = """
[profiles.chat-tp2]
engine = "sim"
gpu_class = "H100"
tp = 2
model_path = "/models/chat"
served_model_name = "chat"

[deployments.chat]
profile = "chat-tp2"
replicas = 2
"""


def cluster_id(db: Path) -> str:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        row = conn.execute("SELECT value FROM llmgw_meta WHERE key = 'cluster_id'").fetchone()
    conn.close()
    return str(row[0])


def engines(cluster: Cluster, node_id: str) -> dict[str, ProcessIdentity]:
    """The engines the agent's records hold (pid, start time), by shard id."""
    found, _ = RecordStore(cluster.root / node_id / "engines").load_all()
    return {r.shard_id: r.identity for r in found}


def ready_replicas(cluster: Cluster) -> list[dict[str, Any]] | None:
    out = cluster.cli("get", "replicas", "-o", "json", check=False)
    replicas = json.loads(out.stdout)["replicas"] if out.returncode == 0 else []
    ready = [r for r in replicas if r.get("state") == "SHARD_STATE_READY"]
    return replicas if len(ready) == len(replicas) == 2 else None


def running(identities: dict[str, ProcessIdentity]) -> set[str]:
    """The shards whose engine process (that very one: pid and start time) still runs."""
    return {shard_id for shard_id, identity in identities.items() if is_running(identity)}


def test_engines_of_another_cluster_are_kept_until_the_operator_hands_them_over(
    fleet: Cluster, tmp_path: Path
) -> None:
    fleet.start_server()
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN, *BACKOFF)
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY")
    document = tmp_path / "chat.toml"
    document.write_text(DEPLOYMENT)
    fleet.cli("apply", "-f", str(document))
    wait_for(lambda: ready_replicas(fleet), 60, "2 READY replicas")
    pids = engines(fleet, "a1")
    assert len(pids) == 2 and running(pids) == set(pids)
    db = fleet.root / "server.db"
    first = cluster_id(db)
    assert (fleet.root / "a1" / "cluster-id").read_text().strip() == first

    # the server comes back on a new database: another cluster, which knows no engine
    fleet.kill("server", signal.SIGTERM)
    for leftover in fleet.root.glob("server.db*"):
        leftover.rename(fleet.root / f"old-{leftover.name}")
    fleet.start_server()
    second = cluster_id(db)
    assert second != first

    def held() -> dict[str, Any] | None:
        node = fleet.nodes().get("a1")
        return node if node and node.get("unadoptedShards") else None

    node = wait_for(held, 30, "a1 reported with its engines not adopted")
    assert sorted(node["unadoptedShards"]) == sorted(pids)
    assert node["unadoptedClusterId"] == first
    assert node["state"] == "NODE_STATE_NOT_READY"
    assert f"--join-cluster {second}" in node["stateReason"]
    table = fleet.cli("get", "nodes").stdout
    assert "not adopted" in table and first in table
    time.sleep(5)  # reconciliation rounds run every second: none may stop them
    assert running(pids) == set(pids)
    shards = json.loads(fleet.cli("get", "shards", "-o", "json").stdout).get("shards", [])
    assert not shards  # not reported as this cluster's
    agent_log = fleet.log("a1")
    assert first in agent_log and f"--join-cluster {second}" in agent_log
    assert (fleet.root / "a1" / "cluster-id").read_text().strip() == first

    # the operator hands the engines over: this cluster knows none of them and stops them
    fleet.kill("a1", signal.SIGTERM)
    assert running(pids) == set(pids)
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN, *BACKOFF, "--join-cluster", second)
    wait_for(lambda: not running(pids), 60, "the handed-over engines stopped as unknown")
    node = wait_for(lambda: fleet.nodes().get("a1"), 10, "a1 listed")
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY again")
    assert not fleet.nodes()["a1"].get("unadoptedShards")
    assert (fleet.root / "a1" / "cluster-id").read_text().strip() == second
