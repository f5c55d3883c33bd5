"""Node facts with control characters cannot forge rows of ``llmgw get`` (issue 13, hole 9).

From outside: a fake agent (raw grpcio bytes, no client of ours) registers with a newline and
an escape sequence in its hostname, a label or a GPU name, and is refused naming the field,
with nothing stored; a node an older server stored with such facts prints escaped, one row;
the agent refuses such ``--labels`` and ``--hostname`` at start.
"""

from __future__ import annotations

import queue
import sqlite3
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
from procs import Cluster, wait_for

from llmgw.api.llmgw.v1 import AgentMessage, Gpu, NodeInfo, Register
from llmgw.protocol import PROTOCOL_VERSION

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CONNECT = "/llmgw.v1.AgentService/Connect"
FORGED = "n1\n\x1b[2Knode-forged  NODE_STATE_READY  8  H100"


class _Requests:
    """A request stream for grpcio that the test feeds one raw message at a time."""

    def __init__(self) -> None:
        self._queue: queue.Queue[bytes | None] = queue.Queue()

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._queue.get, None)

    def send(self, message: bytes) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)


def _register_refused(cluster: Cluster, node: NodeInfo) -> grpc.RpcError:
    message = AgentMessage(register=Register(protocol_version=PROTOCOL_VERSION, node=node))
    requests = _Requests()
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        replies = channel.stream_stream(CONNECT)(iter(requests), timeout=10)
        try:
            requests.send(bytes(message))
            with pytest.raises(grpc.RpcError) as refused:
                next(replies)
        finally:
            requests.close()
    return refused.value


@pytest.mark.parametrize(
    ("node", "field"),
    [
        (NodeInfo(node_id="fake1", hostname=FORGED), "Register.node.hostname"),
        (NodeInfo(node_id="fake1", labels={"zone": FORGED}), 'Register.node.labels["zone"]'),
        (NodeInfo(node_id="fake1", labels={FORGED: "x"}), "Register.node.labels key"),
        (NodeInfo(node_id="fake1", gpus=[Gpu(uuid="GPU-1", name=FORGED)]), "gpus[0].name"),
        (NodeInfo(node_id="fake1", discovery="nvml\x1b]52;c;cHduZWQ=\x07"), "node.discovery"),
    ],
    ids=["hostname", "label-value", "label-key", "gpu-name", "discovery"],
)
def test_a_registration_with_control_characters_is_refused_naming_the_field(
    cluster: Cluster, node: NodeInfo, field: str
) -> None:
    cluster.start_server()
    error = _register_refused(cluster, node)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = error.details() or ""
    assert field in details and "control character" in details, details
    table = cluster.cli("get", "nodes").stdout
    assert "forged" not in table and "\x1b" not in table
    assert table.splitlines()[1:] == ["(none)"]  # nothing stored
    assert cluster.procs["server"].poll() is None


def test_a_node_stored_with_control_characters_prints_escaped_on_one_row(
    cluster: Cluster,
) -> None:
    cluster.start_server()
    cluster.start_agent("n1", "dgx-h100", "--labels", "zone=eu")
    wait_for(lambda: cluster.node_states() == {"n1": "NODE_STATE_READY"}, 30, "n1 READY")
    cluster.kill("n1")
    cluster.kill("server")

    # What an older server stored without the check.
    db = sqlite3.connect(cluster.root / "server.db")
    with db:
        (blob,) = db.execute("SELECT info FROM nodes WHERE node_id = 'n1'").fetchone()
        info = NodeInfo.parse(blob)
        info.labels = {"zone": FORGED}
        info.discovery = "nvml\x1b]52;c;cHduZWQ=\x07"
        info.gpus[0].gpu_class = FORGED
        db.execute("UPDATE nodes SET info = ? WHERE node_id = 'n1'", (bytes(info),))
    db.close()

    cluster.start_server()
    for kind in ("nodes", "gpus"):
        out = cluster.cli("get", kind).stdout
        assert "\x1b" not in out and "\x07" not in out
        rows = out.splitlines()
        assert not any(r.startswith(("\x1b", "node-forged")) for r in rows)
        if kind == "nodes":
            assert len(rows) == 2 and rows[1].startswith("n1 ")
            assert "zone=n1\\n\\x1b[2Knode-forged" in rows[1]
            assert "nvml\\x1b]52;c;cHduZWQ=\\x07" in rows[1]
    assert cluster.nodes()["n1"]["info"]["labels"] == {"zone": FORGED}  # JSON: as stored


@pytest.mark.parametrize(
    ("flag", "value"), [("--labels", "zone=eu\x1b[2K"), ("--hostname", "h\nforged")]
)
def test_the_agent_refuses_control_characters_in_its_own_flags(flag: str, value: str) -> None:
    agent = subprocess.run(
        [sys.executable, "-m", "llmgw", "agent", "--server", "127.0.0.1:1", flag, value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert agent.returncode != 0
    assert flag in agent.stderr and "control character" in agent.stderr, agent.stderr
    assert "Traceback" not in agent.stderr
