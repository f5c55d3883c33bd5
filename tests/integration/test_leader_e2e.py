"""Several servers on one PostgreSQL database (issue #17), as real processes: exactly one
leads; a follower relays operators' calls to it and feeds its gateway from it; a leader
killed (kill -9) or frozen (SIGSTOP) is replaced within seconds at a higher epoch, and a
frozen one that wakes knows at once that it no longer leads."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpclib.client
import httpx
import pytest
from procs import Cluster, wait_for

from bench.pgcluster import find_bindir, private_cluster
from llmgw.api.llmgw.v1 import ControlServiceStub, GetClusterRequest, Leadership
from llmgw.promtext import metric_samples

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

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
SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"


def leader(cluster: Cluster) -> tuple[int, int] | None:
    """(llmgw_leader, llmgw_leader_epoch) from the server's /metrics."""
    text = cluster.metrics()
    if text is None:
        return None
    leading = metric_samples(text, "llmgw_leader")
    epoch = metric_samples(text, "llmgw_leader_epoch")
    return int(leading[0][1]), int(epoch[0][1])


def _pair(pg_url: str, tmp_path: Path) -> tuple[Cluster, Cluster]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    return Cluster(tmp_path / "a", db=pg_url), Cluster(tmp_path / "b", db=pg_url)


@pytest.fixture
def pair(pg_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    a, b = _pair(pg_url, tmp_path)
    try:
        yield a, b
    finally:
        for cluster in (a, b):
            for proc in cluster.procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
            cluster.stop_all()
            cluster.release_engine_ports()


def test_one_leads_a_follower_names_it_and_a_killed_leader_is_replaced(
    pair: tuple[Cluster, Cluster], tmp_path: Path
) -> None:
    a, b = pair
    a.start_server()
    assert wait_for(lambda: leader(a), 10, "a's /metrics")[0] == 1
    epoch = leader(a)[1]  # type: ignore[index]
    b.start_server(follower=True)
    assert leader(b) == (0, epoch)

    a.start_agent("n1", "dgx-h100", "--engine-bin", SIM_BIN)
    wait_for(lambda: a.node_states().get("n1") == "NODE_STATE_READY", 30, "n1 READY on a")
    document = tmp_path / "chat.toml"
    document.write_text(DEPLOYMENT)
    assert "deployment chat applied" in a.cli("apply", "-f", str(document)).stdout
    assert "its own gateway" not in _token_list(b)  # no token: it would turn auth on

    began = time.monotonic()
    a.kill("server", signal.SIGKILL)
    wait_for(lambda: leader(b) == (1, epoch + 1), 10, "b leading at the next epoch")
    took = time.monotonic() - began
    assert took < 5, f"failover took {took:.1f}s"
    out = b.cli("get", "deployments", "-o", "json")
    assert '"chat"' in out.stdout  # the desired state came through the database
    assert "n1" in b.nodes()  # remembered; its agent would have to reach b


def test_a_follower_relays_operators_calls_and_its_gateway_serves_the_leaders_replicas(
    pair: tuple[Cluster, Cluster], tmp_path: Path
) -> None:
    a, b = pair
    admin = a.create_token("admin", "ops")
    viewer = a.create_token("viewer", "dashboards")
    a.token = b.token = admin
    a.start_server()
    wait_for(lambda: (leader(a) or (0, 0))[0] == 1, 10, "a leading")
    b.start_server(follower=True)
    agent_token = tmp_path / "agent.token"
    agent_token.write_text(a.create_token("agent", "n1"))
    a.start_agent("n1", "dgx-h100", "--engine-bin", SIM_BIN, "--token-file", str(agent_token))
    wait_for(lambda: b.node_states().get("n1") == "NODE_STATE_READY", 30, "n1 READY via b")

    document = tmp_path / "chat.toml"
    document.write_text(DEPLOYMENT)
    assert "deployment chat applied" in b.cli("apply", "-f", str(document)).stdout  # on b
    replicas = wait_for(lambda: _ready_replicas(b), 60, "chat's replica READY, read via b")
    assert _ready_replicas(a) == replicas  # the leader acted on the follower's write
    said = asyncio.run(_leadership(b.grpc_port, admin))  # native gRPC, relayed by b
    assert said.leader_address == f"127.0.0.1:{a.grpc_port}"
    assert said.server_id == f"127.0.0.1:{b.grpc_port}" and not said.leading  # b answered
    b.token = viewer
    refused = b.cli("scale", "chat", "2", check=False)
    assert refused.returncode != 0 and "operator" in refused.stderr  # roles hold on b too
    b.token = "llmgw_forged"  # refused by b itself, before any relay
    refused = b.cli("get", "nodes", check=False)
    assert "UNAUTHENTICATED" in refused.stderr and "relayed" not in refused.stderr
    b.token = admin

    def answered() -> int:
        body = {"model": "chat", "prompt": "hello", "max_tokens": 4}
        try:
            return httpx.post(f"{b.gateway_url}/v1/completions", json=body, timeout=5).status_code
        except httpx.HTTPError:
            return 0

    wait_for(lambda: answered() == 200, 30, "b's gateway routing to the leader's replica")
    tokens = _token_list(a)
    assert f"llmgw server 127.0.0.1:{b.grpc_port}: its own gateway" in tokens
    b.kill("server", signal.SIGTERM)
    wait_for(lambda: "its own gateway" not in _token_list(a), 10, "b's turn token deleted")


async def _leadership(port: int, token: str) -> Leadership:
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        metadata = {"authorization": f"Bearer {token}"}
        cluster = await ControlServiceStub(channel).get_cluster(
            GetClusterRequest(), metadata=metadata, timeout=10
        )
    finally:
        channel.close()
    assert cluster.leadership is not None
    return cluster.leadership


def _token_list(cluster: Cluster) -> str:
    command = [sys.executable, "-m", "llmgw", "token", "list", "--db", str(cluster.db)]
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=30).stdout


def test_a_frozen_leader_is_deposed_and_knows_it_when_it_wakes(
    pair: tuple[Cluster, Cluster],
) -> None:
    a, b = pair
    a.start_server()
    wait_for(lambda: (leader(a) or (0, 0))[0] == 1, 10, "a leading")
    epoch = leader(a)[1]  # type: ignore[index]
    b.start_server(follower=True)

    a.procs["server"].send_signal(signal.SIGSTOP)
    wait_for(lambda: leader(b) == (1, epoch + 1), 10, "b leading while a is frozen")
    a.procs["server"].send_signal(signal.SIGCONT)
    woke = time.monotonic()
    wait_for(lambda: leader(a) == (0, epoch + 1), 10, "a following after it wakes")
    assert time.monotonic() - woke < 5
    log = a.log("server")
    assert "the leader lease ran out: this server stops acting now" in log
    assert re.search(r"follows: server \S+ does not lead", log)
    # b still leads, alone
    assert leader(b) == (1, epoch + 1)


def test_a_clean_stop_hands_over_at_once(pair: tuple[Cluster, Cluster]) -> None:
    a, b = pair
    a.start_server()
    wait_for(lambda: (leader(a) or (0, 0))[0] == 1, 10, "a leading")
    b.start_server(follower=True)
    began = time.monotonic()
    a.kill("server", signal.SIGTERM)  # releases the lease on its way out
    wait_for(lambda: (leader(b) or (0, 0))[0] == 1, 10, "b leading")
    assert time.monotonic() - began < 1.5  # sooner than the lease's time to live


def _ready_replicas(cluster: Cluster) -> list[str] | None:
    out = cluster.cli("get", "replicas", "-o", "json", check=False)
    if out.returncode != 0:
        return None
    replicas = json.loads(out.stdout)["replicas"]
    return sorted(r["replicaId"] for r in replicas if r.get("state") == "SHARD_STATE_READY")


def test_an_agent_follows_the_new_leader_which_adopts_its_engine(
    pair: tuple[Cluster, Cluster], tmp_path: Path
) -> None:
    a, b = pair
    a.start_server()
    wait_for(lambda: (leader(a) or (0, 0))[0] == 1, 10, "a leading")
    epoch = leader(a)[1]  # type: ignore[index]
    b.start_server(follower=True)
    servers = f"127.0.0.1:{b.grpc_port},127.0.0.1:{a.grpc_port}"  # the follower first
    a.spawn(
        "n1", "agent", "--server", servers, "--node-id", "n1", "--simulate", "dgx-h100",
        "--state-dir", str(a.root / "n1"), "--engine-bin", SIM_BIN,
    )  # fmt: skip
    wait_for(lambda: a.node_states().get("n1") == "NODE_STATE_READY", 30, "n1 READY on a")
    document = tmp_path / "chat.toml"
    document.write_text(DEPLOYMENT)
    assert "deployment chat applied" in a.cli("apply", "-f", str(document)).stdout
    before = wait_for(lambda: _ready_replicas(a), 60, "chat's replica READY on a")

    a.kill("server", signal.SIGKILL)
    wait_for(lambda: leader(b) == (1, epoch + 1), 10, "b leading")
    wait_for(lambda: b.node_states().get("n1") == "NODE_STATE_READY", 30, "n1 READY on b")
    assert wait_for(lambda: _ready_replicas(b), 30, "the replica READY on b") == before
    time.sleep(3)  # a few rounds of b's reconciler: it adopts, it starts no second replica
    assert _ready_replicas(b) == before
    out = json.loads(b.cli("get", "replicas", "-o", "json").stdout)["replicas"]
    assert len(out) == 1
    assert f"registered with 127.0.0.1:{b.grpc_port}" in a.log("n1")
    remembered = (a.root / "n1" / "leader-epoch").read_text().split()
    assert remembered == [str(epoch + 1), (a.root / "n1" / "cluster-id").read_text().strip()]


def test_servers_outlive_their_database_and_one_leads_again(tmp_path: Path) -> None:
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed")
    with private_cluster(bindir) as pg:
        a, b = _pair(pg.url("postgres"), tmp_path)
        try:
            a.start_server()
            wait_for(lambda: (leader(a) or (0, 0))[0] == 1, 10, "a leading")
            b.start_server(follower=True)
            pg.stop("immediate")  # as a crash
            wait_for(lambda: (leader(a) or (1, 0))[0] == 0, 10, "a deposed")
            time.sleep(4)  # several turns begin and end without a database
            assert a.procs["server"].poll() is None and b.procs["server"].poll() is None
            pg.start()
            wait_for(
                lambda: [(leader(c) or (0, 0))[0] for c in (a, b)].count(1) == 1, 20, "a leader"
            )
        finally:
            for cluster in (a, b):
                cluster.stop_all()
                cluster.release_engine_ports()
