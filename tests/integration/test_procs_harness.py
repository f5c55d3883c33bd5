"""The harness's own promises about server starts, on a real server process.

``free_port()`` only finds a port free when a :class:`Cluster` is made; by the first start
another process's connection may hold it. Such a start draws its ports again instead of
waiting a minute for a server that has already exited; any other exit fails at once with
what the server said.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from procs import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_first_start_whose_port_was_taken_draws_new_ports(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    thief = socket.socket()
    thief.bind(("127.0.0.1", cluster.grpc_port))
    thief.listen()
    taken = cluster.grpc_port
    try:
        cluster.start_server()
        assert cluster.grpc_port != taken and cluster.healthy()
        assert "cannot listen for native gRPC" in cluster.log("server")
    finally:
        cluster.stop_all()
        thief.close()
        cluster.release_engine_ports()


def test_a_server_that_exits_for_another_reason_fails_the_start_at_once(tmp_path: Path) -> None:
    (tmp_path / "server.db").write_text("not a database")
    cluster = Cluster(tmp_path)
    began = time.monotonic()
    try:
        with pytest.raises(AssertionError, match="the server exited"):
            cluster.start_server()
    finally:
        cluster.stop_all()
        cluster.release_engine_ports()
    assert time.monotonic() - began < 30
