"""Tenants' gateway keys on the operator API (CreateKey, ListKeys, RevokeKey: validation
errors name the field, audit records never hold a key, digests are never listed) and on the
router feed (every live key after a snapshot; a create or a revoke sends a new TenantKeys)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpclib.client
import grpclib.server
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from llmgw.api.llmgw.v1 import (
    ControlServiceStub,
    CreateKeyRequest,
    KeyPriority,
    ListKeysRequest,
    NotLeader,
    RevokeKeyRequest,
    RouterFeedEvent,
)
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.controlsvc import ControlService
from llmgw.server.wire.relay import LeaderRelay
from llmgw.server.wire.routersvc import route_events
from llmgw.server.wire.tenantkeys import KEY_PREFIX


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        yield plane


def _future_ms() -> int:
    return int(time.time() * 1000) + 3_600_000


async def test_create_returns_the_key_once_and_stores_only_its_digest(
    plane: ControlPlane,
) -> None:
    svc = ControlService(plane)
    request = CreateKeyRequest(
        tenant="team-a", models=["chat", "code"], rpm=30, tpm=9000, max_concurrency=4,
        priority=KeyPriority.BATCH, expires_unix_ms=_future_ms(), note="nightly evals",
    )  # fmt: skip
    made = await svc.create_key(request)
    assert made.key.startswith(KEY_PREFIX) and len(made.key) == len(KEY_PREFIX) + 43
    created = made.created
    assert created is not None and created.digest == b""
    assert created.key_id.startswith("k_") and len(created.key_id) == 14
    assert (created.tenant, created.models, created.rpm) == ("team-a", ["chat", "code"], 30)
    assert created.priority == KeyPriority.BATCH and created.note == "nightly evals"
    (stored,) = await plane.store.load_tenant_keys()
    assert stored.digest == hashlib.sha256(made.key.encode()).digest()
    assert stored.priority == "batch" and stored.models == ("chat", "code")
    other = await svc.create_key(CreateKeyRequest(tenant="team-a"))
    assert other.key != made.key and other.created is not None
    assert other.created.key_id != created.key_id


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (CreateKeyRequest(tenant=""), "tenant ''"),
        (CreateKeyRequest(tenant="-lead"), "tenant '-lead'"),
        (CreateKeyRequest(tenant="a" * 65), "tenant 'aaa"),
        (CreateKeyRequest(tenant="t", models=["chat", "chat"]), "models: 'chat' given twice"),
        (CreateKeyRequest(tenant="t", models=["two words"]), "models: model name 'two words'"),
        (CreateKeyRequest(tenant="t", models=["a,b"]), "models: model name 'a,b'"),
        (CreateKeyRequest(tenant="t", models=[""]), "models: an empty model name"),
        (CreateKeyRequest(tenant="t", models=[f"m{i}" for i in range(65)]), "models: 65 given"),
        (CreateKeyRequest(tenant="t", rpm=10**9 + 1), "rpm 1000000001: at most"),
        (CreateKeyRequest(tenant="t", tpm=2**32 - 1), "tpm 4294967295: at most"),
        (CreateKeyRequest(tenant="t", max_concurrency=10**9 + 1), "max_concurrency"),
        (CreateKeyRequest(tenant="t", expires_unix_ms=1000), "expires_unix_ms 1000: in the past"),
        (CreateKeyRequest(tenant="t", note="x" * 201), "note: at most 200"),
        (CreateKeyRequest(tenant="t", note="bell\x07"), "note: at most 200 printable"),
        (CreateKeyRequest.parse(b"\x0a\x01t\x30\x05"), "priority 5: unknown"),  # a band unknown
    ],
)
async def test_a_bad_request_is_refused_naming_the_field(
    plane: ControlPlane, request_: CreateKeyRequest, field: str
) -> None:
    with pytest.raises(GRPCError) as caught:
        await ControlService(plane).create_key(request_)
    assert caught.value.status is Status.INVALID_ARGUMENT
    assert field in str(caught.value.message)
    assert await plane.store.load_tenant_keys() == [] and plane.tenant_keys.keys == ()
    (record,) = await plane.store.recent_audit()
    assert (record.action, record.result[:8]) == ("key-create", "refused:")


async def test_list_filters_by_tenant_and_never_shows_a_digest(plane: ControlPlane) -> None:
    svc = ControlService(plane)
    for tenant in ("a", "b", "a"):
        await svc.create_key(CreateKeyRequest(tenant=tenant))
    every = (await svc.list_keys(ListKeysRequest())).keys
    assert [k.tenant for k in every] == ["a", "b", "a"]  # by creation
    assert all(k.digest == b"" for k in every) and all(k.key_id for k in every)
    only_a = (await svc.list_keys(ListKeysRequest(tenant="a"))).keys
    assert [k.key_id for k in only_a] == [every[0].key_id, every[2].key_id]


async def test_revoke_removes_the_key_and_an_unknown_id_is_not_found(
    plane: ControlPlane,
) -> None:
    svc = ControlService(plane)
    made = await svc.create_key(CreateKeyRequest(tenant="team-a"))
    assert made.created is not None
    key_id = made.created.key_id
    result = await svc.revoke_key(RevokeKeyRequest(key_id=key_id))
    assert result.ok and key_id in result.message
    assert (await svc.list_keys(ListKeysRequest())).keys == []
    assert await plane.store.load_tenant_keys() == []
    with pytest.raises(GRPCError) as caught:
        await svc.revoke_key(RevokeKeyRequest(key_id=key_id))  # revoked already
    assert caught.value.status is Status.NOT_FOUND and key_id in str(caught.value.message)


async def test_the_audit_log_names_key_ids_and_tenants_never_a_key(plane: ControlPlane) -> None:
    svc = ControlService(plane)
    made = await svc.create_key(CreateKeyRequest(tenant="team-a"))
    assert made.created is not None
    await svc.revoke_key(RevokeKeyRequest(key_id=made.created.key_id))
    with pytest.raises(GRPCError):
        await svc.revoke_key(RevokeKeyRequest(key_id="k_unknown"))
    records = await plane.store.recent_audit()
    assert [(r.action, r.target, r.result) for r in records] == [
        ("key-create", made.created.key_id, "ok: tenant team-a"),
        ("key-revoke", made.created.key_id, "ok: tenant team-a"),
        ("key-revoke", "k_unknown", "refused: no live key with id 'k_unknown'"),
    ]
    text = repr(records) + repr(plane.snapshot().events)
    assert made.key not in text and made.key[len(KEY_PREFIX) :] not in text


async def _next_keys(events: AsyncIterator[RouterFeedEvent]) -> list[tuple[str, bytes]]:
    while True:
        event = await asyncio.wait_for(anext(events), 5)
        if event.tenant_keys is not None:
            return [(k.key_id, k.digest) for k in event.tenant_keys.keys]


async def test_the_feed_sends_every_key_after_a_snapshot_and_on_each_change(
    plane: ControlPlane,
) -> None:
    svc = ControlService(plane)
    first = await svc.create_key(CreateKeyRequest(tenant="a", expires_unix_ms=_future_ms()))
    assert first.created is not None
    events = route_events(plane)
    try:
        snapshot = await asyncio.wait_for(anext(events), 5)
        assert snapshot.snapshot is not None  # the keys come right after it
        digest = hashlib.sha256(first.key.encode()).digest()
        assert await _next_keys(events) == [(first.created.key_id, digest)]
        second = await svc.create_key(CreateKeyRequest(tenant="b"))
        assert second.created is not None
        made = await _next_keys(events)
        assert [key_id for key_id, _ in made] == [first.created.key_id, second.created.key_id]
        await svc.revoke_key(RevokeKeyRequest(key_id=first.created.key_id))
        assert [key_id for key_id, _ in await _next_keys(events)] == [second.created.key_id]
    finally:
        await events.aclose()


async def test_a_resubscribed_feed_gets_the_keys_again(plane: ControlPlane) -> None:
    await ControlService(plane).create_key(CreateKeyRequest(tenant="a"))
    for _ in range(2):  # each subscriber is told after its snapshot
        events = route_events(plane)
        try:
            assert len(await _next_keys(events)) == 1
        finally:
            await events.aclose()


class _Lease:
    """What LeaderRelay reads of Leadership: the leader is at ``address``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.server_id = "B"

    def not_leader(self) -> NotLeader:
        return NotLeader(leader_address=self.address, leader_id="A", server_id="B")

    def refusal(self) -> str:
        return f"server B does not lead: the leader is at {self.address}"


def _port(server: grpclib.server.Server) -> int:
    return int(server._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]


async def test_a_follower_relays_the_key_calls_to_the_leader(plane: ControlPlane) -> None:
    leader = grpclib.server.Server([ControlService(plane)])
    await leader.start("127.0.0.1", 0)
    relay = LeaderRelay(_Lease(f"127.0.0.1:{_port(leader)}"))  # type: ignore[arg-type]
    follower = grpclib.server.Server([relay])
    await follower.start("127.0.0.1", 0)
    channel = grpclib.client.Channel("127.0.0.1", _port(follower))
    try:
        stub = ControlServiceStub(channel)
        made = await stub.create_key(CreateKeyRequest(tenant="team-a"), timeout=5)
        assert made.created is not None and made.key.startswith(KEY_PREFIX)
        listed = await stub.list_keys(ListKeysRequest(), timeout=5)
        assert [k.key_id for k in listed.keys] == [made.created.key_id]
        with pytest.raises(GRPCError) as caught:
            await stub.revoke_key(RevokeKeyRequest(key_id="k_nope"), timeout=5)
        assert caught.value.status is Status.NOT_FOUND  # the leader's refusal, as it is
    finally:
        channel.close()
        relay.close()
        for server in (follower, leader):
            server.close()
            await server.wait_closed()
    assert relay.relayed == 3 and [k.tenant for k in plane.tenant_keys.keys] == ["team-a"]
