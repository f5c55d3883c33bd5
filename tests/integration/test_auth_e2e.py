"""Authentication end to end: a real ``llmgw server`` with tokens and a join token, agents,
gateways and CLI commands with and without them, and every RPC probed on both ports."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path

import grpclib.client
import pytest
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from procs import Cluster, wait_for

import llmgw.api.llmgw.v1 as api
from llmgw.client import GrpcWebChannel, RpcError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PROFILES = Path(__file__).parents[1] / "data" / "profiles" / "good-chat-a-b.toml"
FILE = PROFILES.read_text() + '\n[deployments.chat]\nprofile = "chat-a"\nreplicas = 1\n'
WRONG = "llmgw_" + "x" * 43


def every_handler() -> dict[str, Handler]:
    services = [getattr(api, n) for n in dir(api) if n.endswith("ServiceBase")]
    return {path: h for cls in services for path, h in cls().__mapping__().items()}


def write_secret(root: Path, name: str, token: str) -> Path:
    path = root / name
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


# --- probing every RPC ------------------------------------------------------------------


async def native_status(port: int, path: str, handler: Handler, token: str | None) -> Status:
    metadata = {"authorization": f"Bearer {token}"} if token else None
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        async with asyncio.timeout(10):
            async with channel.request(
                path,
                handler.cardinality,
                handler.request_type,
                handler.reply_type,
                metadata=metadata,
            ) as stream:
                await stream.send_message(handler.request_type(), end=True)
                await stream.recv_message()
                await stream.recv_trailing_metadata()
    except GRPCError as exc:
        return exc.status
    finally:
        channel.close()
    return Status.OK


async def web_status(url: str, path: str, handler: Handler, token: str | None) -> Status:
    headers = {"authorization": f"Bearer {token}"} if token else None
    request = handler.request_type()
    try:
        async with GrpcWebChannel(url, headers=headers) as channel:
            if handler.cardinality is Cardinality.UNARY_UNARY:
                await channel.unary(path, request, handler.reply_type)
            else:
                async with asyncio.timeout(10):
                    async for _ in channel.server_stream(path, request, handler.reply_type):
                        break
    except RpcError as exc:
        return exc.status
    return Status.OK


async def probe_all(cluster: Cluster, token: str | None) -> dict[str, tuple[Status, Status]]:
    found = {}
    for path, handler in sorted(every_handler().items()):
        native = await native_status(cluster.grpc_port, path, handler, token)
        web = await web_status(cluster.url, path, handler, token)
        found[path] = (native, web)
    return found


# --- the tests --------------------------------------------------------------------------


def test_tokens_are_required_everywhere_and_never_logged(cluster: Cluster) -> None:
    root = cluster.root
    admin = cluster.create_token("admin", "root")
    gateway_token = cluster.create_token("gateway", "gw")
    join = "join-" + secrets.token_urlsafe(24)
    cluster.start_server("--join-token-file", str(write_secret(root, "join.token", join)))
    assert "authentication is off" not in cluster.log("server")

    expected = dict.fromkeys(every_handler(), (Status.UNAUTHENTICATED,) * 2)
    assert asyncio.run(probe_all(cluster, None)) == expected
    assert asyncio.run(probe_all(cluster, WRONG)) == expected
    assert cluster.cli("get", "nodes", check=False).stderr.strip() == (
        "llmgw: UNAUTHENTICATED: a bearer token is required"
    )

    cluster.start_agent("good", "dgx-h100", "--token-file", str(root / "join.token"))
    cluster.start_agent("nojoin")
    cluster.start_agent("badjoin", "dgx-h100", "--token-file", str(write_secret(root, "b", WRONG)))
    cluster.token = admin
    wait_for(lambda: cluster.node_states() == {"good": "NODE_STATE_READY"}, 30, "good READY")
    for name in ("nojoin", "badjoin"):
        wait_for(lambda n=name: "UNAUTHENTICATED" in cluster.log(n), 20, f"{name} refused")  # type: ignore[misc]
    assert "the bearer token is not valid" in cluster.log("badjoin")
    assert "a bearer token is required" in cluster.log("nojoin")
    assert set(cluster.node_states()) == {"good"}

    cluster.start_gateway("gw-ok", "--token-file", str(write_secret(root, "g", gateway_token)))
    cluster.start_gateway("gw-admin", "--token-file", str(write_secret(root, "a", admin)))
    cluster.start_gateway("gw-none")
    wait_for(lambda: "PERMISSION_DENIED" in cluster.log("gw-admin"), 20, "gw-admin refused")
    assert "Feed needs the gateway role; this token has the admin role" in cluster.log("gw-admin")
    wait_for(lambda: "UNAUTHENTICATED" in cluster.log("gw-none"), 20, "gw-none refused")
    assert "router feed lost" not in cluster.log("gw-ok")  # its feed was let in
    out = cluster.cli("get", "nodes", "-o", "json").stdout
    _assert_no_secret_logged(cluster, [admin, gateway_token, join, WRONG], also=out)


def _assert_no_secret_logged(cluster: Cluster, secrets_: list[str], also: str = "") -> None:
    logs = {p.name: p.read_text(errors="replace") for p in cluster.root.glob("*.log")}
    assert {"server.log", "good.log", "nojoin.log", "badjoin.log"} <= set(logs)
    logs["cli output"] = also
    for name, text in logs.items():
        for secret in secrets_:
            assert secret not in text, f"a token appears in {name}"


# --- roles -------------------------------------------------------------------------------


def _count(cluster: Cluster) -> int:
    out = cluster.cli("get", "deployments", "-o", "json")
    (chat,) = json.loads(out.stdout)["deployments"]
    return int(chat.get("replicas", 0))


def _cordoned(cluster: Cluster) -> bool:
    return bool(cluster.nodes()["a1"].get("cordoned", False))


def _as(cluster: Cluster, token: str, *args: str) -> tuple[int, str]:
    cluster.token, saved = token, cluster.token
    try:
        done = cluster.cli(*args, check=False)
    finally:
        cluster.token = saved
    return done.returncode, done.stdout + done.stderr


def test_a_viewer_cannot_act_and_an_operator_is_audited(cluster: Cluster, tmp_path: Path) -> None:
    admin = cluster.create_token("admin")
    viewer = cluster.create_token("viewer", "dash")
    operator = cluster.create_token("operator", "alice")
    agent = cluster.create_token("agent", "rack1")
    cluster.start_server("--test-hooks")  # test hooks: the reconciler is off (no engines here)
    cluster.token = admin
    agent_file = write_secret(tmp_path, "agent.token", agent)
    cluster.start_agent("a1", "dgx-h100", "--token-file", str(agent_file))
    wait_for(lambda: cluster.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY")
    path = tmp_path / "chat.toml"
    path.write_text(FILE)
    code, text = _as(cluster, viewer, "apply", "-f", str(path))
    assert code == 1 and "PERMISSION_DENIED: ApplyDeployment needs the admin role" in text
    code, text = _as(cluster, operator, "apply", "-f", str(path))
    assert code == 1 and "this token has the operator role" in text
    assert "deployment chat applied" in cluster.cli("apply", "-f", str(path)).stdout

    for args in (
        ("drain", "chat-1"),
        ("start", "chat"),
        ("reprofile", "chat", "--profile", "chat-b"),
        ("drain-node", "a1"),
        ("cordon", "a1"),
        ("delete", "deployment", "chat"),
    ):
        code, text = _as(cluster, viewer, *args)
        assert code == 1 and "PERMISSION_DENIED" in text, (args, text)
        assert "this token has the viewer role" in text
    code, text = _as(cluster, viewer, "get", "deployments", "-o", "json")
    assert code == 0 and '"chat"' in text  # a viewer reads
    assert _count(cluster) == 1 and not _cordoned(cluster)  # nothing the viewer asked happened

    assert _as(cluster, operator, "start", "chat")[0] == 0
    assert _count(cluster) == 2
    assert _as(cluster, operator, "cordon", "a1")[0] == 0
    assert _cordoned(cluster)
    events = cluster.cli("events").stdout
    mine = [line for line in events.splitlines() if "(alice)" in line]
    assert any("deployment/chat" in line for line in mine), events
    assert any("a1" in line for line in mine), events
    applied = [line for line in events.splitlines() if "apply" in line and "ok" in line]
    assert applied and all("token:1" in line for line in applied), events
    secrets_ = [admin, viewer, operator, agent]
    for log in cluster.root.glob("*.log"):
        text = log.read_text(errors="replace")
        assert not [s for s in secrets_ if s in text], f"a token appears in {log.name}"
