"""A web page attacks a real ``llmgw server`` on loopback, and fails.

Any page a browser shows may send requests to 127.0.0.1: a cross-origin POST that needs no
preflight (the browser sends it and only hides the answer), or, after DNS rebinding, a
same-origin one under the attacker's name. Here those requests are written as a browser
writes them (its ``Origin`` and ``Host`` headers) with ``http.client`` against the server's
gRPC-web and gateway ports, and the cluster's state is read back afterwards: the node is not
cordoned, the deployment not deleted. An origin opened with ``--cors-origin`` works and gets
CORS headers. And while no token exists, the server will not listen beyond loopback.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import Cluster, wait_for

from llmgw.api.llmgw.v1 import DeleteDeploymentRequest, NodeRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CONSOLE = "https://console.example"
EVIL = "http://evil.example"
CONTROL = "/llmgw.v1.ControlService/"
DEPLOYMENT = """
[profiles.p]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/m"
served_model_name = "m"

[deployments.d]
profile = "p"
replicas = 1
"""


@pytest.fixture
def served(fleet: Cluster, tmp_path: Path) -> Iterator[Cluster]:
    """A server opened to CONSOLE, one node (no GPU: nothing starts) and a deployment."""
    fleet.start_server("--cors-origin", CONSOLE)
    fleet.start_agent("n1", "cpu-only")
    wait_for(lambda: fleet.node_states().get("n1") == "NODE_STATE_READY", 30, "node n1 READY")
    (tmp_path / "d.toml").write_text(DEPLOYMENT)
    applied = fleet.cli("apply", "-f", str(tmp_path / "d.toml"), check=False)
    assert "deployment d applied" in applied.stdout, applied.stdout + applied.stderr
    yield fleet


def request(
    port: int, method: str, path: str, headers: dict[str, str], body: bytes = b""
) -> http.client.HTTPResponse:
    """One request with exactly these headers (a ``Host`` given here replaces the real one)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=body or None, headers=headers)
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def grpc_web(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


def web_call(cluster: Cluster, method: str, message: bytes, **headers: str) -> int:
    """A gRPC-web POST as a page sends it ``no-cors``; the HTTP status."""
    sent = {"content-type": "application/grpc-web+proto", **headers}
    return request(cluster.http_port, "POST", CONTROL + method, sent, grpc_web(message)).status


def cordoned(cluster: Cluster) -> bool:
    return bool(cluster.nodes()["n1"].get("cordoned", False))


def deployments(cluster: Cluster) -> list[str]:
    out = cluster.cli("get", "deployments", "-o", "json")
    return [d["name"] for d in json.loads(out.stdout)["deployments"]]


def test_a_foreign_page_cannot_cordon_or_delete(served: Cluster) -> None:
    cordon, delete = bytes(NodeRequest(node_id="n1")), bytes(DeleteDeploymentRequest(name="d"))
    own_host = f"127.0.0.1:{served.http_port}"
    assert web_call(served, "CordonNode", cordon, origin=EVIL) == 403
    assert web_call(served, "DeleteDeployment", delete, origin=EVIL) == 403
    # DNS rebinding: the page's own name now points at 127.0.0.1, so it is same-origin
    rebound = f"evil.example:{served.http_port}"
    assert web_call(served, "CordonNode", cordon, host=rebound) == 403
    assert (
        web_call(served, "DeleteDeployment", delete, host=rebound, origin=f"http://{rebound}")
        == 403
    )
    # another port of loopback is another origin (a dev server, a notebook)
    assert web_call(served, "CordonNode", cordon, origin="http://127.0.0.1:3000") == 403
    assert not cordoned(served)
    assert deployments(served) == ["d"]

    preflight = request(
        served.http_port,
        "OPTIONS",
        CONTROL + "CordonNode",
        {"origin": EVIL, "access-control-request-method": "POST", "host": own_host},
    )
    assert preflight.status == 403
    assert preflight.getheader("access-control-allow-origin") is None

    # the CLI (no Origin, Host 127.0.0.1:PORT) still acts
    served.cli("cordon", "n1")
    assert cordoned(served)


def test_an_opted_in_origin_is_served_with_cors(served: Cluster) -> None:
    asked = {"origin": CONSOLE, "access-control-request-method": "POST"}
    preflight = request(served.http_port, "OPTIONS", CONTROL + "GetCluster", asked)
    assert preflight.status == 204
    assert preflight.getheader("access-control-allow-origin") == CONSOLE
    sent = {"content-type": "application/grpc-web+proto", "origin": f"{CONSOLE}:443"}
    answer = request(served.http_port, "POST", CONTROL + "GetCluster", sent, grpc_web(b""))
    assert answer.status == 200 and answer.getheader("grpc-status") in (None, "0")
    assert answer.getheader("access-control-allow-origin") == f"{CONSOLE}:443"
    assert answer.getheader("vary", "").lower() == "origin"
    served.cli("cordon", "n1")  # and the same RPC from that origin goes through
    assert web_call(served, "UncordonNode", bytes(NodeRequest(node_id="n1")), origin=CONSOLE) == 200
    assert not cordoned(served)


def test_the_gateway_port_refuses_foreign_pages(served: Cluster) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    chat = {"content-type": "text/plain", "origin": EVIL}  # a "simple" request: no preflight
    refused = request(served.gateway_port, "POST", "/v1/chat/completions", chat, body)
    assert refused.status == 403
    rebound = {"host": f"evil.example:{served.gateway_port}"}
    assert request(served.gateway_port, "POST", "/v1/chat/completions", rebound, body).status == 403
    assert request(served.gateway_port, "GET", "/v1/models", {"origin": EVIL}).status == 403

    opened = request(served.gateway_port, "GET", "/v1/models", {"origin": CONSOLE})
    assert opened.status == 200
    assert opened.getheader("access-control-allow-origin") == CONSOLE
    assert request(served.gateway_port, "GET", "/v1/models", {}).status == 200
    for port in (served.http_port, served.gateway_port):  # HTTP/1.1 requires a Host
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
            assert sock.recv(64).split(b" ")[1] in (b"400", b"403")


def test_the_test_hooks_refuse_foreign_pages_too(cluster: Cluster) -> None:
    """--test-hooks sends engine commands to agents (a StartShard runs a command line)."""
    cluster.start_server("--test-hooks")
    stop = json.dumps({"stopShard": {"shardId": "s1"}}).encode()
    hook = "/debug/agents/n1/command"
    for headers in ({"origin": EVIL}, {"host": f"evil.example:{cluster.http_port}"}):
        refused = request(cluster.http_port, "POST", hook, headers, stop)
        assert refused.status == 403, headers
    # without them it answers (404: no agent n1 is connected)
    assert request(cluster.http_port, "POST", hook, {}, stop).status == 404


@pytest.mark.parametrize(
    "flags",
    [
        ("--grpc-listen", "0.0.0.0:0"),
        # an address of no interface here: the old server failed to bind it, the new one
        # must refuse before it tries (the check runs before anything binds)
        ("--http-listen", "192.0.2.1:0"),
    ],
)
def test_no_tokens_means_loopback_only(tmp_path: Path, flags: tuple[str, str]) -> None:
    args = ["--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", *flags]
    done = subprocess.run(
        [sys.executable, "-m", "llmgw", "server", *args, "--gateway-listen", "off"]
        + ["--db", str(tmp_path / "server.db")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode != 0
    line = done.stderr.strip().splitlines()[-1]
    assert f"refusing to listen on {flags[0]} {flags[1]}" in line
    assert "--insecure-no-auth" in line
    assert "llmgw token create --role admin --db" in line
