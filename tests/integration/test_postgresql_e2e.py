"""``llmgw server --db postgresql://…`` end to end, on the private PostgreSQL cluster
(tests/pgcluster.py), with one simulated agent: a deployment applied through the CLI, and
the node, are still there after the server is killed and started again, and the URL's
password never reaches the log."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

EXAMPLE = (Path(__file__).parents[1] / "data" / "profiles" / "good-issue-example.toml").read_text()


def _deployments(cluster: Cluster) -> list[str]:
    out = cluster.cli("get", "deployments", "-o", "json")
    return [str(d["name"]) for d in json.loads(out.stdout)["deployments"]]


def test_a_deployment_applied_on_postgresql_survives_a_restart(
    pg_url: str, fleet: Cluster, tmp_path: Path
) -> None:
    cluster = (
        fleet  # kills the engines the reconciler started (set up after pg_url: torn down before)
    )
    # The private cluster trusts local connections: the password is not checked, only carried.
    cluster.db = pg_url.replace("postgresql://llmgw@", "postgresql://llmgw:hunter2@")
    cluster.start_server()
    cluster.start_agent("a1")
    wait_for(lambda: cluster.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY")
    document = tmp_path / "chat.toml"
    document.write_text(EXAMPLE)
    applied = cluster.cli("apply", "-f", str(document), check=False)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert _deployments(cluster) == ["chat"]

    cluster.kill("server", signal.SIGKILL)  # what it answered was committed
    cluster.start_server()
    assert _deployments(cluster) == ["chat"]
    assert "a1" in cluster.nodes()  # remembered, and its agent comes back to it
    wait_for(lambda: cluster.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY again")
    log = cluster.log("server")
    assert "state in postgresql://llmgw:***@127.0.0.1:" in log
    assert "hunter2" not in log
