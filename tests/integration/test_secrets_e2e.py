"""Secrets end to end (issue #8): real ``llmgw server``, agent, ``llmgw sim-engine`` and
``llmgw gateway`` processes on loopback.

- A replica's API key reaches its engine through the environment: it is in the engine's
  ``/proc/PID/environ`` (which only its owner reads) and in no ``/proc/PID/cmdline`` (which
  every user reads), the engine refuses requests without it, and no log holds it.
- The OpenAI gateways (the server's own and a separate ``llmgw gateway``) take client keys
  from a key file: /v1 without one of them is answered 401, /healthz and /metrics stay open,
  the official ``openai`` client works with a key, and no log holds a key.
- ``llmgw token revoke`` ends a console's Watch (gRPC-web), a gateway's Feed (native) and a
  separate gateway's feed that are already open with that token, with UNAUTHENTICATED, and
  the token is refused afterwards.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpclib.client
import httpx
import openai
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from procs import Cluster, wait_for
from shardops import command, listed_shards

from llmgw.addresses import free_port
from llmgw.api.llmgw.v1 import Cluster as ClusterReply
from llmgw.api.llmgw.v1 import (
    EngineProfile,
    GetClusterRequest,
    RouterFeedEvent,
    RouterFeedRequest,
    RouterServiceStub,
    StartShard,
    WatchEvent,
    WatchRequest,
)
from llmgw.client import GrpcWebChannel, RpcError
from llmgw.server.wire.auth import REVOKED

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
CLIENT_KEY = "sk-client-5b0e9d41c2a7f836"


def _secret_file(root: Path, name: str, text: str) -> Path:
    path = root / name
    path.write_text(text)
    path.chmod(0o600)
    return path


def _all_logs(root: Path) -> dict[str, str]:
    """Every log under the test's folder: the processes' and the engines' own."""
    return {str(p.relative_to(root)): p.read_text(errors="replace") for p in root.rglob("*.log")}


def _start_shard(port: int, key: str, gpu: str) -> dict[str, Any]:
    profile = EngineProfile(
        name="chat-sim",
        engine="sim",
        gpu_class="H100",
        tp=1,
        model_path="/models/chat",
        served_model_name="chat",
    )
    message = StartShard(
        shard_id="chat-0",
        replica_id="chat",
        profile=profile,
        profile_fingerprint="fp-chat",
        gpu_uuids=[gpu],
        port=port,
        api_key=key,
    )
    return {"startShard": message.to_dict()}


def _ready(cluster: Cluster) -> dict[str, Any] | None:
    status = listed_shards(cluster).get("chat-0", {}).get("status", {})
    return status if status.get("state") == "SHARD_STATE_READY" else None


def test_an_agent_gives_its_engine_the_key_through_the_environment(fleet: Cluster) -> None:
    fleet.start_server("--test-hooks")  # the test says which port: no clash with other runs
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN)
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "the agent READY")
    key = "sk-replica-" + secrets.token_urlsafe(24)
    gpu = fleet.nodes()["a1"]["info"]["gpus"][0]["uuid"]
    command(fleet, "a1", _start_shard(free_port(), key, gpu))
    status = wait_for(lambda: _ready(fleet), 60, "the shard READY")

    pid = int(status["pid"])
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"sim-engine" in argv and b"--served-model-name" in argv  # the engine's own
    assert b"--api-key" not in argv
    assert not [word for word in argv if key.encode() in word]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"VLLM_API_KEY={key}".encode() in environ  # readable by its owner only

    endpoint = status["endpoint"]
    assert httpx.get(f"{endpoint}/v1/models", timeout=5).status_code == 401
    with_key = {"authorization": f"Bearer {key}"}
    assert httpx.get(f"{endpoint}/v1/models", headers=with_key, timeout=5).status_code == 200

    logs = _all_logs(fleet.root)
    assert {"server.log", "a1.log"} <= set(logs)
    assert [name for name in logs if name.startswith("a1/")]  # the engine's own log too
    assert [name for name, text in logs.items() if key in text] == []


def test_gateways_answer_401_without_a_client_key(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = _secret_file(cluster.root, "client.keys", f"# the test's client\n{CLIENT_KEY}\n")
    cluster.start_server("--gateway-api-key-file", str(keys))
    monkeypatch.setenv("LLMGW_GATEWAY_API_KEY", CLIENT_KEY)  # the separate one: from its env
    separate = cluster.start_gateway("gw")
    for base in (cluster.gateway_url, separate):
        refused = httpx.post(f"{base}/v1/completions", json={"model": "chat", "prompt": "hi"})
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "AuthenticationError"
        assert httpx.get(f"{base}/healthz").status_code == 200
        assert httpx.get(f"{base}/metrics").status_code == 200
        with openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError):
                wrong.models.list()
        with openai.OpenAI(base_url=f"{base}/v1", api_key=CLIENT_KEY, max_retries=0) as client:
            assert client.models.list().data == []  # let in: no replica serves anything yet
            with pytest.raises(openai.NotFoundError):  # routed, not refused
                client.completions.create(model="chat", prompt="hi", max_tokens=1)
    logs = _all_logs(cluster.root)
    assert {"server.log", "gw.log"} <= set(logs)
    assert [name for name, text in logs.items() if CLIENT_KEY in text] == []


# --- revocation ----------------------------------------------------------------------------


def _token_ids(cluster: Cluster) -> dict[str, int]:
    """Token ids by note, from ``llmgw token list``."""
    out = subprocess.run(
        [sys.executable, "-m", "llmgw", "token", "list", "--db", str(cluster.root / "server.db")],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    rows = [line.split() for line in out.splitlines()[1:] if line.strip()]
    return {row[-1]: int(row[0]) for row in rows if len(row) >= 5}


def _revoke(cluster: Cluster, token_id: int) -> float:
    subprocess.run(
        [sys.executable, "-m", "llmgw", "token", "revoke", str(token_id)]
        + ["--db", str(cluster.root / "server.db")],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return time.monotonic()


async def _watch_until_cut(url: str, token: str, opened: asyncio.Event) -> RpcError:
    headers = {"authorization": f"Bearer {token}"}
    async with GrpcWebChannel(url, headers=headers) as channel:
        try:
            async for _ in channel.server_stream(
                "/llmgw.v1.ControlService/Watch", WatchRequest(), WatchEvent
            ):
                opened.set()
        except RpcError as exc:
            return exc
    raise AssertionError("the Watch ended without an error")


async def _feed_until_cut(port: int, token: str, opened: asyncio.Event) -> GRPCError:
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        feed = RouterServiceStub(channel).feed(
            RouterFeedRequest(), metadata={"authorization": f"Bearer {token}"}
        )
        async for event in feed:
            assert isinstance(event, RouterFeedEvent)
            opened.set()
    except GRPCError as exc:
        return exc
    finally:
        channel.close()
    raise AssertionError("the Feed ended without an error")


async def _cut_both(cluster: Cluster, viewer: str, gateway: str, ids: dict[str, int]) -> None:
    watch_open, feed_open = asyncio.Event(), asyncio.Event()
    async with asyncio.timeout(60):
        watch = asyncio.create_task(_watch_until_cut(cluster.url, viewer, watch_open))
        feed = asyncio.create_task(_feed_until_cut(cluster.grpc_port, gateway, feed_open))
        await watch_open.wait()
        await feed_open.wait()
        for task, note in ((watch, "console"), (feed, "edge")):
            revoked_at = await asyncio.to_thread(_revoke, cluster, ids[note])
            error = await task
            took = time.monotonic() - revoked_at  # since `llmgw token revoke` returned
            assert (error.status, error.message) == (Status.UNAUTHENTICATED, REVOKED), note
            assert took < 1.5, f"{note}'s stream ended {took:.2f} s after the revocation"
    headers = {"authorization": f"Bearer {viewer}"}
    async with GrpcWebChannel(cluster.url, headers=headers) as channel:
        with pytest.raises(RpcError) as refused:
            await channel.unary(
                "/llmgw.v1.ControlService/GetCluster", GetClusterRequest(), ClusterReply
            )
    assert refused.value.status is Status.UNAUTHENTICATED


def test_revoking_a_token_ends_the_streams_open_with_it(cluster: Cluster) -> None:
    cluster.token = cluster.create_token("admin", "root")
    viewer = cluster.create_token("viewer", "console")
    gateway = cluster.create_token("gateway", "edge")
    separate = cluster.create_token("gateway", "separate")
    ids = _token_ids(cluster)
    cluster.start_server()
    token_file = _secret_file(cluster.root, "gw.token", separate)
    cluster.start_gateway("gw", "--token-file", str(token_file))

    asyncio.run(_cut_both(cluster, viewer, gateway, ids))

    _revoke(cluster, ids["separate"])  # its feed has been open since before _cut_both
    wait_for(lambda: REVOKED in cluster.log("gw"), 10, "the separate gateway's feed cut")
    assert "router feed lost" in cluster.log("gw")
    server_log = cluster.log("server")
    for note in ("console", "edge", "separate"):
        assert f"token:{ids[note]} ({note}) was revoked: 1 open call(s) ended" in server_log
    for name, text in _all_logs(cluster.root).items():
        assert not [t for t in (viewer, gateway, separate) if t in text], name
