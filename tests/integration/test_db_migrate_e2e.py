"""``llmgw db migrate`` end to end: a server's SQLite state file, with a node and an applied
deployment, copied into PostgreSQL (the private cluster of tests/pgcluster.py); refused
while the server runs on the file; then a server on the PostgreSQL database serves the same
deployment and the same node, and the agent, which remembers the cluster id, comes back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

EXAMPLE = (Path(__file__).parents[1] / "data" / "profiles" / "good-issue-example.toml").read_text()


def _deployments(cluster: Cluster) -> list[str]:
    out = cluster.cli("get", "deployments", "-o", "json")
    return [str(d["name"]) for d in json.loads(out.stdout)["deployments"]]


def _migrate(source: Path, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", "db", "migrate", "--from", f"sqlite:{source}", "--to", url],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_server_on_the_migrated_database_serves_the_same_fleet(
    pg_url: str, fleet: Cluster, tmp_path: Path
) -> None:
    cluster = fleet
    server = cluster.start_server()  # on its SQLite file
    cluster.start_agent("a1")
    wait_for(lambda: cluster.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY")
    document = tmp_path / "chat.toml"
    document.write_text(EXAMPLE)
    applied = cluster.cli("apply", "-f", str(document), check=False)
    assert applied.returncode == 0, applied.stdout + applied.stderr

    source = cluster.root / "server.db"
    refused = _migrate(source, pg_url)
    assert refused.returncode == 1
    assert f"in use by llmgw server pid {server.pid}" in refused.stderr

    cluster.kill("server", signal.SIGTERM)
    done = _migrate(source, pg_url)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("migrated ")

    cluster.db = pg_url
    cluster.start_server()
    assert _deployments(cluster) == ["chat"]
    # the agent reconnects and is taken back: the cluster id came over with the rows
    wait_for(lambda: cluster.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY again")
    agent_log = cluster.log("a1")
    assert "belong to cluster" not in agent_log and "joined cluster" not in agent_log
