"""Tokens and roles (llmgw.server.wire.auth): hashing, the method table, the checks on a real
store, on a native grpclib server and through the gRPC-web bridge, and ``llmgw token``."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import grpclib.client
import grpclib.server
import httpx
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

import llmgw.api.llmgw.v1 as api
from llmgw.api.llmgw.v1 import (
    ActionResult,
    Cluster,
    ControlServiceBase,
    ControlServiceStub,
    GetClusterRequest,
    ReplicaRequest,
)
from llmgw.cli.main import main
from llmgw.client import GrpcWebChannel, RpcError
from llmgw.client.channel import bearer_token
from llmgw.server.state.store import Store
from llmgw.server.state.storeschema import SCHEMA_VERSION
from llmgw.server.state.tokens import Role
from llmgw.server.wire.auth import (
    METHOD_ROLES,
    Authenticator,
    bearer,
    current_actor,
    hash_token,
    install,
    may_call,
    new_token,
)
from llmgw.server.wire.grpcweb import GrpcWebApp

CONTROL = "/llmgw.v1.ControlService/"
CONNECT = "/llmgw.v1.AgentService/Connect"
FEED = "/llmgw.v1.RouterService/Feed"
GATEWAY_RPCS = {FEED, "/llmgw.v1.RouterService/Report"}  # the feed, and reports (#7 follow-up)
READS = {
    "GetCluster",
    "Watch",
    "ListProfiles",
    "GetRouterStats",
    "Describe",
    "RolloutHistory",
}
ACTIONS = {
    "StartReplica",
    "DrainReplica",
    "ReprofileReplica",
    "CordonNode",
    "UncordonNode",
    "DrainNode",
    "StreamLogs",  # a read, but engine output may hold prompts
    "ScaleDeployment",
    "RolloutUndo",
}
DESIRED = {
    "ApplyDeployment",
    "DeleteDeployment",
    "DeleteNode",
    "CreateKey",
    "ListKeys",
    "RevokeKey",
    "GetUsage",  # what tenants spent: admin only, like their keys
}  # admin only


def every_rpc() -> set[str]:
    """Every method of every generated service, so a new RPC without a role fails here."""
    services = [getattr(api, n) for n in dir(api) if n.endswith("ServiceBase")]
    assert len(services) >= 3
    return {path for cls in services for path in cls().__mapping__()}


# --- pure parts --------------------------------------------------------------------------


def test_every_rpc_of_every_service_has_a_role() -> None:
    assert set(METHOD_ROLES) == every_rpc()


@pytest.mark.parametrize("method", sorted(every_rpc()))
def test_role_table(method: str) -> None:
    name = method.rsplit("/", 1)[1]
    allowed = {role for role in Role if may_call(role, method)}
    if method == CONNECT:
        assert allowed == {Role.AGENT}
    elif method in GATEWAY_RPCS:
        assert allowed == {Role.GATEWAY}
    elif name in READS:
        assert allowed == {Role.VIEWER, Role.OPERATOR, Role.ADMIN}
    elif name in ACTIONS:
        assert allowed == {Role.OPERATOR, Role.ADMIN}
    else:
        assert name in DESIRED
        assert allowed == {Role.ADMIN}


def test_unknown_method_is_open_to_no_role() -> None:
    assert not any(may_call(role, "/llmgw.v1.ControlService/Nope") for role in Role)


def test_tokens_are_random_prefixed_and_hashed_with_sha256() -> None:
    a, b = new_token(), new_token()
    assert a != b and a.startswith("llmgw_") and len(a) > 40
    # SHA-256 of "abc" (FIPS 180-2 test vector)
    assert hash_token("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert a not in hash_token(a)


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer  abc ", "abc"),
        ("Basic abc", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("", None),
        (None, None),
    ],
)
def test_bearer_header(header: str | None, token: str | None) -> None:
    assert bearer(header) == token


# --- against a real store ----------------------------------------------------------------


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    async with Store(tmp_path / "server.db") as s:
        yield s


async def add(store: Store, role: Role, note: str = "") -> tuple[int, str]:
    token = new_token()
    return await store.add_token(role, hash_token(token), note), token


async def test_store_keeps_only_the_hash(store: Store, tmp_path: Path) -> None:
    token_id, token = await add(store, Role.VIEWER, "ci")
    [stored] = await store.load_tokens()
    assert (stored.token_id, stored.role, stored.hash, stored.note) == (
        token_id,
        Role.VIEWER,
        hash_token(token),
        "ci",
    )
    assert token.encode() not in (tmp_path / "server.db").read_bytes()
    assert await store.delete_token(token_id)
    assert not await store.delete_token(token_id)
    assert await store.load_tokens() == []


async def test_a_version_4_file_migrates_to_tokens(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    async with Store(path):
        pass
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE tokens")
        conn.execute("PRAGMA user_version=4")
    async with Store(path) as store:
        await add(store, Role.ADMIN)
        assert len(await store.load_tokens()) == 1
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 10


async def test_off_without_tokens_then_on(store: Store) -> None:
    auth = Authenticator(store, refresh_s=0)
    assert not await auth.enabled()
    assert await auth.check(CONTROL + "DrainReplica", None) is None
    assert current_actor() == "operator"
    await add(store, Role.VIEWER)
    assert await auth.enabled()
    with pytest.raises(GRPCError) as caught:
        await auth.check(CONTROL + "GetCluster", None)
    assert caught.value.status is Status.UNAUTHENTICATED


async def test_join_token_alone_turns_it_on(store: Store) -> None:
    auth = Authenticator(store, join_token="s3cret-join")
    assert await auth.enabled()
    principal = await auth.check(CONNECT, "Bearer s3cret-join")
    assert principal is not None and principal.role is Role.AGENT
    assert current_actor() == "join-token"
    for header in (None, "Bearer wrong", "s3cret-join"):
        with pytest.raises(GRPCError) as caught:
            await auth.check(CONNECT, header)
        assert caught.value.status is Status.UNAUTHENTICATED
    with pytest.raises(GRPCError) as caught:
        await auth.check(CONTROL + "GetCluster", "Bearer s3cret-join")
    assert caught.value.status is Status.PERMISSION_DENIED


async def test_roles_and_actor(store: Store) -> None:
    viewer_id, viewer = await add(store, Role.VIEWER)
    operator_id, operator = await add(store, Role.OPERATOR, "alice")
    auth = Authenticator(store)
    assert await auth.check(CONTROL + "GetCluster", f"Bearer {viewer}") is not None
    assert current_actor() == f"token:{viewer_id}"
    with pytest.raises(GRPCError) as caught:
        await auth.check(CONTROL + "DrainReplica", f"Bearer {viewer}")
    assert caught.value.status is Status.PERMISSION_DENIED
    assert caught.value.message == (
        "DrainReplica needs the operator role; this token has the viewer role"
    )
    assert await auth.check(CONTROL + "DrainReplica", f"Bearer {operator}") is not None
    assert current_actor() == f"token:{operator_id} (alice)"
    with pytest.raises(GRPCError) as caught:
        await auth.check(CONTROL + "ApplyDeployment", f"Bearer {operator}")
    assert caught.value.status is Status.PERMISSION_DENIED
    assert "admin role" in (caught.value.message or "")


async def test_new_token_works_at_once_and_revoked_one_soon_stops(store: Store) -> None:
    await add(store, Role.ADMIN)
    auth = Authenticator(store, refresh_s=0.05, miss_refresh_s=0)
    assert await auth.enabled()
    token_id, token = await add(store, Role.VIEWER)  # created while "running"
    assert await auth.check(CONTROL + "Watch", f"Bearer {token}") is not None
    await store.delete_token(token_id)
    auth._loaded_at = None  # as if refresh_s had passed
    with pytest.raises(GRPCError) as caught:
        await auth.check(CONTROL + "Watch", f"Bearer {token}")
    assert caught.value.status is Status.UNAUTHENTICATED


# --- on the wire: native grpclib and gRPC-web --------------------------------------------


class Control(ControlServiceBase):
    """Answers with who the audit log would name, so the context reaching handlers shows."""

    async def get_cluster(self, message: GetClusterRequest) -> Cluster:
        return Cluster(revision=1)

    async def drain_replica(self, message: ReplicaRequest) -> ActionResult:
        return ActionResult(ok=True, message=current_actor())


@pytest.fixture
async def native(store: Store) -> AsyncIterator[int]:
    server = grpclib.server.Server([Control()])
    install(server, Authenticator(store, refresh_s=0))
    await server.start("127.0.0.1", 0)
    try:
        yield server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        server.close()
        await server.wait_closed()


async def native_drain(port: int, token: str | None) -> ActionResult:
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        metadata = {"authorization": f"Bearer {token}"} if token else None
        return await ControlServiceStub(channel).drain_replica(
            ReplicaRequest(replica_id="r1"), metadata=metadata
        )
    finally:
        channel.close()


async def test_native_port_checks_every_call(store: Store, native: int) -> None:
    assert (await native_drain(native, None)).message == "operator"  # off: no tokens yet
    viewer_id, viewer = await add(store, Role.VIEWER)
    operator_id, operator = await add(store, Role.OPERATOR, "bob")
    for token, status in ((None, Status.UNAUTHENTICATED), ("llmgw_nope", Status.UNAUTHENTICATED)):
        with pytest.raises(GRPCError) as caught:
            await native_drain(native, token)
        assert caught.value.status is status
    with pytest.raises(GRPCError) as caught:
        await native_drain(native, viewer)
    assert caught.value.status is Status.PERMISSION_DENIED
    assert "needs the operator role" in (caught.value.message or "")
    assert (await native_drain(native, operator)).message == f"token:{operator_id} (bob)"


async def web_drain(app: GrpcWebApp, token: str | None) -> ActionResult:
    headers = {"authorization": f"Bearer {token}"} if token else None
    transport = httpx.ASGITransport(app=app)
    async with GrpcWebChannel("http://localhost", headers=headers, transport=transport) as channel:
        return await channel.unary(
            CONTROL + "DrainReplica", ReplicaRequest(replica_id="r1"), ActionResult
        )


async def test_grpc_web_port_checks_every_call(store: Store) -> None:
    app = GrpcWebApp([Control()], authorize=Authenticator(store).check)
    operator_id, operator = await add(store, Role.OPERATOR)
    _, viewer = await add(store, Role.VIEWER)
    for token in (None, "llmgw_nope"):
        with pytest.raises(RpcError) as caught:
            await web_drain(app, token)
        assert caught.value.status is Status.UNAUTHENTICATED
    with pytest.raises(RpcError) as caught:
        await web_drain(app, viewer)
    assert caught.value.status is Status.PERMISSION_DENIED
    assert (await web_drain(app, operator)).message == f"token:{operator_id}"


async def test_channel_sends_the_cli_token(store: Store) -> None:
    app = GrpcWebApp([Control()], authorize=Authenticator(store).check)
    token_id, token = await add(store, Role.ADMIN)
    reset = bearer_token.set(token)
    try:
        assert (await web_drain(app, None)).message == f"token:{token_id}"
    finally:
        bearer_token.reset(reset)


# --- llmgw token --------------------------------------------------------------------------


def test_token_create_prints_once_and_list_never_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "server.db"
    assert main(["token", "create", "--role", "operator", "--note", "ci", "--db", str(db)]) == 0
    out = capsys.readouterr()
    token = out.out.strip()
    assert token.startswith("llmgw_") and token not in out.err
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT role, hash, note FROM tokens").fetchall()
    assert rows == [("operator", hash_token(token), "ci")]
    assert main(["token", "list", "--db", str(db)]) == 0
    listed = capsys.readouterr().out
    assert "operator" in listed and "ci" in listed
    assert token not in listed and hash_token(token) not in listed
    assert main(["token", "revoke", "1", "--db", str(db)]) == 0
    assert main(["token", "revoke", "1", "--db", str(db)]) == 1
