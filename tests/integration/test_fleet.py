"""The foundation end to end: a server and two simulated DGX agents as real processes."""

from __future__ import annotations

import signal
import time

import pytest
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

GRACE = 3.0


def _both_ready(cluster: Cluster) -> bool:
    return cluster.node_states() == {"a1": "NODE_STATE_READY", "a2": "NODE_STATE_READY"}


def test_agents_register_fail_and_come_back(cluster: Cluster) -> None:
    cluster.start_server("--node-grace", str(GRACE))
    cluster.start_agent("a1")
    cluster.start_agent("a2")
    wait_for(lambda: _both_ready(cluster), 30, "both agents READY")

    nodes = cluster.nodes()
    for node_id in ("a1", "a2"):
        info = nodes[node_id]["info"]
        gpus = info["gpus"]
        assert len(gpus) == 8
        assert all(
            sorted(g["nvlinkPeers"]) == [i for i in range(8) if i != g.get("index", 0)]
            for g in gpus
        )
        assert len(info["fabrics"]) == 8
        assert {f["rateGbps"] for f in info["fabrics"]} == {400.0}
        assert all(any(p["path"] == "PIX" for p in g["nicPaths"]) for g in gpus)
    uuids = {g["uuid"] for n in nodes.values() for g in n["info"]["gpus"]}
    assert len(uuids) == 16

    # kill -9 one agent: NOT_READY within the grace
    killed_at = time.monotonic()
    cluster.kill("a1")
    wait_for(
        lambda: cluster.node_states().get("a1") == "NODE_STATE_NOT_READY", GRACE + 2, "a1 NOT_READY"
    )
    assert time.monotonic() - killed_at <= GRACE + 2
    assert cluster.node_states()["a2"] == "NODE_STATE_READY"

    # start it again: READY under the same node id (kept in its state dir)
    cluster.spawn(
        "a1",
        "agent",
        "--server",
        f"127.0.0.1:{cluster.grpc_port}",
        "--simulate",
        "dgx-h100",
        "--state-dir",
        str(cluster.root / "a1"),
    )
    wait_for(lambda: _both_ready(cluster), 30, "a1 READY again under the same id")

    # cordon a node, then kill -9 the server and start it on the same database
    assert "cordoned" in cluster.cli("cordon", "a2").stdout
    first_seen = {k: v["firstSeenUnixMs"] for k, v in cluster.nodes().items()}
    cluster.kill("server")
    cluster.start_server("--node-grace", str(GRACE))
    wait_for(
        lambda: cluster.node_states() == {"a1": "NODE_STATE_READY", "a2": "NODE_STATE_CORDONED"},
        45,
        "both agents back on their own, the cordon kept",
    )
    nodes = cluster.nodes()
    assert {k: v["firstSeenUnixMs"] for k, v in nodes.items()} == first_seen
    assert all(len(n["info"]["gpus"]) == 8 for n in nodes.values())


def test_server_stops_cleanly_on_sigterm(cluster: Cluster) -> None:
    server = cluster.start_server()
    cluster.start_agent("a1", "l4-pcie")
    wait_for(lambda: cluster.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY")
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=15) == 0
    assert "Traceback" not in cluster.log("server")
    cluster.procs.pop("server")


def test_get_tables_and_unreachable_server(cluster: Cluster) -> None:
    out = cluster.cli("get", "nodes", check=False)
    assert out.returncode != 0
    assert out.stderr.startswith("llmgw: cannot reach the control server")
    assert len(out.stderr.strip().splitlines()) == 1
    cluster.start_server()
    cluster.start_agent("mig", "a100-mig")
    wait_for(lambda: cluster.node_states() == {"mig": "NODE_STATE_READY"}, 30, "mig READY")
    table = cluster.cli("get", "gpus").stdout
    assert "mig" in table and "3g.40gb" in table
    header, mig = cluster.cli("get", "nodes").stdout.splitlines()[:2]
    assert header.split()[:2] == ["NODE", "STATE"]
    assert "4 (12 MIG slices)" in mig and "A100" in mig  # 4 GPUs, their slices apart
    missing = cluster.cli("cordon", "nope", check=False)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
