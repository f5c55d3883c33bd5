"""Scale from zero's other half, with real processes: a request for the model of an
autoscaled deployment (mode "act") that has no READY replica is held by the gateway, the
server's and a separate ``llmgw gateway`` alike, during the replica's cold start (the
simulated engine's --sim-load-seconds), and answered once it is READY; a gateway whose
--hold-timeout is shorter than the cold start answers 503 with Retry-After. A flood of
held requests from another process fills the queue only to --hold-queue, the rest are
answered 503 at once, and a killed flooder frees every place it held.

The policy is written into the server's state file between two starts (what the
autoscaler part's ``[deployments.NAME.autoscale]`` keys store), so this test needs only
the gateway's part."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from procs import Cluster, wait_for

from llmgw.api.llmgw.v1 import AutoscalePolicy, Deployment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
COLD_START_S = 15  # the gateways and CLI calls before the requests take some of it
FILE = """
[profiles.chat-sim]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/chat"
served_model_name = "chat"
args = ["--sim-load-seconds", "{load_s}"]

[deployments.chat]
profile = "chat-sim"
replicas = 0
"""
BODY = {"model": "chat", "prompt": "Once upon a time", "max_tokens": 2}


def _make_autoscaled(db: Path) -> None:
    """Deployment chat as the autoscaler owns it: mode act, min 0, one replica wanted."""
    with sqlite3.connect(db) as conn:
        (blob,) = conn.execute("SELECT deployment FROM deployments WHERE name = 'chat'").fetchone()
        deployment = Deployment.parse(blob)
        deployment.autoscale = AutoscalePolicy(
            min=0, max=1, ttft_p90_ms=800, scale_down_after_s=300, mode="act"
        )
        deployment.replicas = 1
        conn.execute(
            "UPDATE deployments SET deployment = ? WHERE name = 'chat'", (bytes(deployment),)
        )


def _held_total(url: str, outcome: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'llmgw_held_requests_total{{model="chat",outcome="{outcome}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _states(cluster: Cluster) -> list[str]:
    out = cluster.cli("get", "replicas", "-o", "json", check=False)
    return [r.get("state", "") for r in json.loads(out.stdout or '{"replicas": []}')["replicas"]]


def _cold_autoscaled(fleet: Cluster, tmp_path: Path, load_s: int, *server: str) -> None:
    """A server and one agent, deployment chat autoscaled (min 0) with its one replica
    placed and loading for ``load_s`` seconds."""
    fleet.start_server()
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN)
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY")
    path = tmp_path / "chat.toml"
    path.write_text(FILE.format(load_s=load_s))
    fleet.cli("apply", "-f", str(path))
    fleet.kill("server", 15)
    _make_autoscaled(fleet.root / "server.db")
    fleet.start_server(*server)


def test_requests_are_held_through_a_cold_start(fleet: Cluster, tmp_path: Path) -> None:
    _cold_autoscaled(fleet, tmp_path, COLD_START_S, "--gateway-hold-timeout", "60")
    separate = fleet.start_gateway("gw", "--hold-timeout", "60")
    impatient = fleet.start_gateway("gw-short", "--hold-timeout", "1")

    assert "SHARD_STATE_READY" not in _states(fleet)  # cold: placed, starting or loading
    with ThreadPoolExecutor(4) as pool:
        held = [
            pool.submit(httpx.post, f"{url}/v1/completions", json=BODY, timeout=90)
            for url in (fleet.gateway_url, separate, fleet.gateway_url)
        ]
        refused = httpx.post(f"{impatient}/v1/completions", json=BODY, timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert "became ready within 1 s" in refused.json()["error"]["message"]
        assert not any(f.done() for f in held)  # still cold: the others wait
        wait_for(lambda: _held_total(impatient, "timeout") == 1, 10, "the timeout counted")
        replies = [f.result(timeout=120) for f in held]
    assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
    assert _states(fleet) == ["SHARD_STATE_READY"]
    assert _held_total(fleet.gateway_url, "ready") == 2
    assert _held_total(separate, "ready") == 1


FLOODER = """
import json, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
body = b'{"model": "chat", "prompt": "x", "max_tokens": 2}'
head = (b"POST /v1/completions HTTP/1.1\\r\\nHost: 127.0.0.1:%d\\r\\n"
        b"Content-Type: application/json\\r\\nContent-Length: %d\\r\\n\\r\\n" % (port, len(body)))
socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
for s in socks:
    s.sendall(head + body)
statuses = []
deadline = time.monotonic() + 5
for s in socks:
    s.settimeout(max(deadline - time.monotonic(), 0.01))
    try:
        statuses.append(s.recv(64).split(b" ")[1].decode())
    except OSError:
        statuses.append("none")
print(json.dumps({"answered_503": statuses.count("503"), "unanswered": statuses.count("none")}),
      flush=True)
time.sleep(600)  # the held ones stay held until this process is killed
"""


def _gauge(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith('llmgw_held_requests{model="chat"} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _is_held(url: str) -> bool:
    """A request for chat is held (not answered within a second), then given up."""
    try:
        httpx.post(f"{url}/v1/completions", json=BODY, timeout=1)
    except httpx.TimeoutException:
        return True
    return False


def test_a_flood_of_held_requests_is_bounded_and_freed_when_its_client_dies(
    fleet: Cluster, tmp_path: Path
) -> None:
    _cold_autoscaled(fleet, tmp_path, 600)  # never READY within the test
    url = fleet.start_gateway("gw", "--hold-queue", "16", "--hold-timeout", "120")
    port = url.rsplit(":", 1)[1]
    wait_for(lambda: _is_held(url), 30, "chat held at the gateway (the feed says scalable)")
    wait_for(lambda: _gauge(url) == 0, 10, "the probe gone")
    command = [sys.executable, "-c", FLOODER, port, "64"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as flooder:
        try:
            assert flooder.stdout is not None
            report = json.loads(flooder.stdout.readline())
            assert report == {"answered_503": 48, "unanswered": 16}  # past the 16: at once
            assert _gauge(url) == 16
            began = time.monotonic()
            assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
            full = httpx.post(f"{url}/v1/completions", json=BODY, timeout=5)
            assert time.monotonic() - began < 2.0
            assert full.status_code == 503 and full.headers["retry-after"] == "5", full.text
        finally:
            flooder.kill()
    wait_for(lambda: _gauge(url) == 0, 10, "the killed flooder's places freed")
    assert _held_total(url, "gone") == 17 and _held_total(url, "full") == 49  # and the probe
    with ThreadPoolExecutor(1) as pool:  # a place is to be had again
        held = pool.submit(httpx.post, f"{url}/v1/completions", json=BODY, timeout=5)
        wait_for(lambda: _gauge(url) == 1, 5, "a new request held")
        with pytest.raises(httpx.TimeoutException):
            held.result(timeout=30)
