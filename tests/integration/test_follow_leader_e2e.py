"""Agents follow the leader among several servers on one PostgreSQL database (issue #17),
as real processes: an agent given ``--server FOLLOWER,LEADER`` registers with the leader,
and when the leader is killed it moves to the server that leads next and remembers its
epoch in ``leader-epoch``."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import Cluster, wait_for
from test_leader_e2e import SIM_BIN, leader

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.fixture
def pair(pg_url: str, tmp_path: Path) -> Iterator[tuple[Cluster, Cluster]]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = Cluster(tmp_path / "a", db=pg_url), Cluster(tmp_path / "b", db=pg_url)
    try:
        yield a, b
    finally:
        for cluster in (a, b):
            cluster.stop_all()
            cluster.release_engine_ports()


def test_an_agent_follows_the_leader_and_then_its_successor(
    pair: tuple[Cluster, Cluster],
) -> None:
    a, b = pair
    a.start_server()
    epoch = wait_for(lambda: leader(a), 10, "a's /metrics")[1]
    b.start_server(follower=True)
    servers = f"127.0.0.1:{b.grpc_port},127.0.0.1:{a.grpc_port}"  # the follower first
    a.start_agent("n1", "dgx-h100", "--engine-bin", SIM_BIN, "--server", servers)
    wait_for(lambda: a.node_states().get("n1") == "NODE_STATE_READY", 30, "n1 READY on a")
    epoch_file = a.root / "n1" / "leader-epoch"
    assert epoch_file.read_text().split()[0] == str(epoch)  # EPOCH CLUSTER_ID

    a.kill("server", signal.SIGKILL)
    wait_for(lambda: leader(b) == (1, epoch + 1), 10, "b leading at the next epoch")
    wait_for(lambda: b.node_states().get("n1") == "NODE_STATE_READY", 30, "n1 READY on b")
    assert epoch_file.read_text().split()[0] == str(epoch + 1)
    assert f"registered with 127.0.0.1:{b.grpc_port}" in a.log("n1")
