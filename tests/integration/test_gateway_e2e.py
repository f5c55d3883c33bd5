"""The gateway end to end: the official ``openai`` client through the in-server gateway and
through a separate ``llmgw gateway`` process, in front of a real server, a simulated DGX
agent and two ``llmgw sim-engine`` replicas on loopback.

Shown: streaming and non-streaming chat and completions through both; an engine killed
with SIGKILL in the middle of a run costs no request sent after the kill; a draining
replica (``llmgw drain``), still busy with a long request, gets no new request while the
rest are served by the other replica, and leaving its long request cancels it upstream;
with the control server killed, the separate gateway routes on with the replicas it knew.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from procs import Cluster, wait_for

from llmgw.cli.flags import GATEWAY_POLICIES
from llmgw.gateway.routing.policy import POLICIES

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
BACKOFF = ("--restart-backoff", "1", "--restart-backoff-max", "1")
READY = "SHARD_STATE_READY"
DECODE_MS = 20  # per output token: a long answer keeps a replica busy for seconds
FULL = {"ignore_eos": True}  # vLLM's extension: answer max_tokens tokens, no early stop

FILE = f"""
[profiles.chat-sim]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/chat"
served_model_name = "chat"
args = ["--sim-decode-ms-per-token", "{DECODE_MS}"]

[deployments.chat]
profile = "chat-sim"
replicas = 2
"""


def _replicas(cluster: Cluster) -> list[dict[str, Any]]:
    out = cluster.cli("get", "replicas", "-o", "json", check=False)
    return list(json.loads(out.stdout)["replicas"]) if out.returncode == 0 else []


def _ready(cluster: Cluster, count: int) -> list[dict[str, Any]] | None:
    replicas = _replicas(cluster)
    ready = [r for r in replicas if r.get("state") == READY]
    return replicas if len(replicas) == count == len(ready) else None


def _engine_metric(endpoint: str, name: str) -> float:
    """A sample of a replica's engine /metrics (summed over labels), read directly."""
    text = httpx.get(f"{endpoint}/metrics", timeout=5).text
    pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, flags=re.MULTILINE))


def _served(endpoint: str) -> float:
    """Requests an engine has taken in: finished plus running plus waiting."""
    return sum(
        _engine_metric(endpoint, name)
        for name in (
            "vllm:request_success_total",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
        )
    )


@contextmanager
def _client(base: str) -> Iterator[openai.OpenAI]:
    # the gateway holds the replicas' keys: the client's own key is not checked by it
    with openai.OpenAI(base_url=f"{base}/v1", api_key="client-key", max_retries=0) as client:
        yield client


def _start_fleet(fleet: Cluster, tmp_path: Path) -> list[dict[str, Any]]:
    fleet.start_server()
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN, *BACKOFF)
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "the agent READY")
    path = tmp_path / "chat.toml"
    path.write_text(FILE)
    assert "deployment chat applied" in fleet.cli("apply", "-f", str(path)).stdout
    return list(wait_for(lambda: _ready(fleet, 2), 60, "2 READY replicas"))


def _models(base: str) -> list[str]:
    try:
        body = httpx.get(f"{base}/v1/models", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return []
    return [m["id"] for m in body.get("data", [])]


def _openai_round_trip(base: str) -> None:
    """Every shape the issue names, through the official client."""
    with _client(base) as client:
        assert [m.id for m in client.models.list()] == ["chat"]
        done = client.completions.create(
            model="chat", prompt="Once upon a time", max_tokens=6, extra_body=FULL
        )
        assert done.choices[0].text and done.choices[0].finish_reason == "length"
        assert done.usage is not None and done.usage.completion_tokens == 6
        chat = client.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=5,
            extra_body=FULL,
        )
        assert chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
        pieces = [
            c.choices[0].text
            for c in client.completions.create(
                model="chat", prompt="Stream me", max_tokens=8, stream=True, extra_body=FULL
            )
            if c.choices and c.choices[0].text
        ]
        assert len(pieces) == 8 and "".join(pieces)
        _chat_stream_arrives_as_it_is_made(client)


def _chat_stream_arrives_as_it_is_made(client: openai.OpenAI) -> None:
    tokens = 40  # 0.8 s of decoding: the first piece must come long before the last
    start = time.monotonic()
    arrivals: list[float] = []
    reasons: list[str | None] = []
    stream = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=tokens,
        stream=True,
        extra_body=FULL,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - start)
        if chunk.choices:
            reasons.append(chunk.choices[0].finish_reason)
    assert len(arrivals) == tokens and reasons[-1] == "length"
    assert arrivals[0] < arrivals[-1] - 0.5 * tokens * DECODE_MS / 1000  # not buffered


def _ask(client: openai.OpenAI, n: int) -> str:
    prompt = f"request {n}: " + "words " * (n % 7)
    return client.completions.create(model="chat", prompt=prompt, max_tokens=3).choices[0].text


def _kill_an_engine_during_a_run(fleet: Cluster, base: str) -> None:
    endpoints = {r["replicaId"]: r["endpoint"] for r in _replicas(fleet)}
    results: list[tuple[float, bool, str]] = []  # (sent at, succeeded, why)
    killed_at: list[float] = []
    stop = threading.Event()

    def worker(w: int) -> None:
        with _client(base) as client:
            n = 0
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    _ask(client, w * 1000 + n)
                    results.append((sent, True, ""))
                except openai.OpenAIError as exc:
                    results.append((sent, False, repr(exc)))
                n += 1

    with ThreadPoolExecutor(4) as pool:
        workers = [pool.submit(worker, w) for w in range(4)]
        wait_for(lambda: len(results) >= 20, 30, "20 requests before the kill")
        busiest = max(endpoints, key=lambda r: _served(endpoints[r]))
        assert _served(endpoints[busiest]) > 0
        pid = _engine_pid(fleet, busiest)
        os.kill(pid, signal.SIGKILL)
        killed_at.append(time.monotonic())
        wait_for(lambda: sum(s > killed_at[0] for s, _, _ in results) >= 40, 60, "40 after")
        stop.set()
        for w in workers:
            w.result()
    after = [r for r in results if r[0] > killed_at[0]]
    assert after and all(ok for _, ok, _ in after), [why for _, ok, why in after if not ok]
    wait_for(lambda: _ready(fleet, 2), 60, "the killed engine restarted and READY again")


def _engine_pid(fleet: Cluster, replica_id: str) -> int:
    shards = json.loads(fleet.cli("get", "shards", "-o", "json").stdout)["shards"]
    (shard,) = [s for s in shards if s["replicaId"] == replica_id]
    return int(shard["status"]["pid"])


def _long_stream(
    base: str, out: dict[str, Any], started: threading.Event, quit: threading.Event
) -> None:
    """A chat stream far longer than the test (20 s of decoding), read until ``quit``."""
    with _client(base) as client:
        stream = client.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "A long answer, please."}],
            max_tokens=1000,
            stream=True,
            extra_body=FULL,
        )
        pieces = 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces += 1
                started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                out["finish_reason"] = chunk.choices[0].finish_reason
            if quit.is_set():
                break
        stream.close()  # the client goes away: the gateway must cancel the upstream request
        out["pieces"] = pieces


def _state_of(fleet: Cluster, replica_id: str) -> str:
    return next((r["state"] for r in _replicas(fleet) if r["replicaId"] == replica_id), "gone")


def _draining_gets_nothing_new(fleet: Cluster, base: str) -> None:
    endpoints = {r["replicaId"]: r["endpoint"] for r in _replicas(fleet)}
    out: dict[str, Any] = {}
    started, quit = threading.Event(), threading.Event()
    long = threading.Thread(target=_long_stream, args=(base, out, started, quit))
    long.start()
    try:
        assert started.wait(30), "the long stream never started"
        busy = [r for r, e in endpoints.items() if _engine_metric(e, "vllm:num_requests_running")]
        (victim,) = busy
        (other,) = set(endpoints) - {victim}
        assert fleet.cli("drain", victim).returncode == 0
        wait_for(lambda: _state_of(fleet, victim) == "SHARD_STATE_DRAINING", 20, "DRAINING")
        time.sleep(0.3)  # the feed has carried it to the gateway (milliseconds, on loopback)
        before = {r: _served(e) for r, e in endpoints.items()}
        with _client(base) as client:
            answers = [_ask(client, n) for n in range(12)]
        assert all(answers)
        assert _served(endpoints[victim]) == before[victim]  # nothing new on the drained one
        assert _served(endpoints[other]) == before[other] + 12
        assert _state_of(fleet, victim) == "SHARD_STATE_DRAINING"  # its long request runs on
    finally:
        quit.set()
        long.join(60)
    assert out.get("pieces", 0) > 10 and "finish_reason" not in out, out
    # the client left: the gateway cancelled the upstream request, so the drain ends long
    # before the 1000 tokens would have
    wait_for(lambda: _state_of(fleet, victim) == "gone", 10, "the drained replica gone")


def test_openai_client_through_both_gateways_survives_kill_and_drain(
    fleet: Cluster, tmp_path: Path
) -> None:
    _start_fleet(fleet, tmp_path)
    separate = fleet.start_gateway()
    for base in (fleet.gateway_url, separate):
        wait_for(lambda b=base: _models(b) == ["chat"], 20, f"{base} lists chat")  # type: ignore[misc]
        _openai_round_trip(base)
    _kill_an_engine_during_a_run(fleet, fleet.gateway_url)
    _draining_gets_nothing_new(fleet, separate)
    for name in ("server", "gateway"):
        assert "Traceback" not in fleet.log(name), fleet.log(name)[-3000:]
    _server_away_gateway_serves_on(fleet, separate)


def _server_away_gateway_serves_on(fleet: Cluster, base: str) -> None:
    fleet.kill("server")  # SIGKILL: no goodbye on the feed, the connection just drops
    wait_for(lambda: "router feed lost" in fleet.log("gateway"), 20, "the gateway noticing")
    with _client(base) as client:
        assert all(_ask(client, n) for n in range(3))  # routed with the last table


def test_gateway_stops_cleanly_and_refuses_bad_flags(cluster: Cluster) -> None:
    assert all(name in GATEWAY_POLICIES for name in POLICIES)  # the --help words are true
    cluster.start_server()
    separate = cluster.start_gateway()
    assert httpx.get(f"{separate}/v1/models", timeout=5).json()["data"] == []
    proc = cluster.procs.pop("gateway")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert "llmgw gateway stopped" in cluster.log("gateway")
    bad = subprocess.run(
        [sys.executable, "-m", "llmgw", "gateway", "--policy", "nope"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 1
    assert bad.stderr.strip() == (
        "llmgw: --policy 'nope' is not one of prefix, round_robin, least_load, session"
    )
    server = subprocess.run(
        [sys.executable, "-m", "llmgw", "server", "--gateway-listen", "nowhere"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert server.returncode == 1 and "--gateway-listen 'nowhere' is not HOST:PORT" in server.stderr
