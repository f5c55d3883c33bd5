"""A follower's ControlService relays each call to the leader (llmgw.server.wire.relay):
the caller's credential goes along, the leader's answers and refusals come back as they
are, a Cluster says the follower answered, and no leader, an unreachable one or a call
already relayed end UNAVAILABLE naming the leader."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpclib.client
import grpclib.events
import grpclib.server
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from tlspki import Pki

from llmgw.api.llmgw.v1 import (
    ActionResult,
    ApplyDeploymentRequest,
    Cluster,
    ControlServiceBase,
    ControlServiceStub,
    GetClusterRequest,
    Leadership,
    NotLeader,
    WatchEvent,
    WatchRequest,
)
from llmgw.server.wire.relay import RELAYED_BY, LeaderRelay
from llmgw.tls import ALPN_GRPC, TlsFiles, client_context, server_context


class _Leader(ControlServiceBase):
    async def get_cluster(self, message: GetClusterRequest) -> Cluster:
        return Cluster(leadership=Leadership(server_id="A", leader_id="A", leading=True, epoch=7))

    async def watch(self, message: WatchRequest) -> AsyncIterator[WatchEvent]:
        yield WatchEvent(revision=1, snapshot=await self.get_cluster(GetClusterRequest()))
        yield WatchEvent(revision=2, node_removed="n9")

    async def apply_deployment(self, message: ApplyDeploymentRequest) -> ActionResult:
        raise GRPCError(Status.PERMISSION_DENIED, "role viewer may not apply")


@dataclass
class _Lease:
    """What LeaderRelay reads of Leadership: who leads, and why this server does not."""

    leader_address: str
    leader_id: str = "A"
    server_id: str = "B"
    seen: list[Any] = field(default_factory=list)

    def not_leader(self) -> NotLeader:
        return NotLeader(
            leader_address=self.leader_address, leader_id=self.leader_id, leader_epoch=7,
            server_id=self.server_id,
        )  # fmt: skip

    def refusal(self) -> str:
        if not self.leader_address:
            return f"server {self.server_id} does not lead, and no server leads now"
        return f"server {self.server_id} does not lead: the leader is at {self.leader_address}"


async def _serve(services: list[Any], seen: list[Any] | None = None) -> grpclib.server.Server:
    server = grpclib.server.Server(services)
    if seen is not None:

        async def record(event: grpclib.events.RecvRequest) -> None:
            seen.append(dict(event.metadata))

        grpclib.events.listen(server, grpclib.events.RecvRequest, record)
    await server.start("127.0.0.1", 0)
    return server


def _port(server: grpclib.server.Server) -> int:
    return int(server._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]


@pytest.fixture
async def leader() -> AsyncIterator[tuple[int, list[Any]]]:
    seen: list[Any] = []
    server = await _serve([_Leader()], seen)
    try:
        yield _port(server), seen
    finally:
        server.close()
        await server.wait_closed()


async def _follower(lease: _Lease) -> tuple[grpclib.server.Server, LeaderRelay]:
    relay = LeaderRelay(lease)  # type: ignore[arg-type]
    return await _serve([relay]), relay


async def _stub_call(port: int, call: str, message: Any, **kwargs: Any) -> Any:
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        method = getattr(ControlServiceStub(channel), call)
        if call == "watch":
            return [event async for event in method(message, **kwargs)]
        return await method(message, timeout=5, **kwargs)
    finally:
        channel.close()


async def test_a_call_goes_to_the_leader_with_its_credential_and_says_who_answered(
    leader: tuple[int, list[Any]],
) -> None:
    port, seen = leader
    server, relay = await _follower(_Lease(f"127.0.0.1:{port}"))
    try:
        bearer = {"authorization": "Bearer llmgw_secret", "x-other": "kept here"}
        cluster = await _stub_call(
            _port(server), "get_cluster", GetClusterRequest(), metadata=bearer
        )
        events = await _stub_call(_port(server), "watch", WatchRequest(), metadata=bearer)
    finally:
        server.close()
        relay.close()
    assert cluster.leadership == Leadership(server_id="B", leader_id="A", epoch=7, leading=False)
    assert [e.revision for e in events] == [1, 2] and events[1].node_removed == "n9"
    assert events[0].snapshot.leadership.server_id == "B"
    assert not events[0].snapshot.leadership.leading
    assert seen[0]["authorization"] == "Bearer llmgw_secret" and seen[0][RELAYED_BY] == "B"
    assert "x-other" not in seen[0]  # only the credential goes along
    assert relay.relayed == 2


async def test_the_leaders_refusal_comes_back_as_it_is(leader: tuple[int, list[Any]]) -> None:
    server, relay = await _follower(_Lease(f"127.0.0.1:{leader[0]}"))
    try:
        with pytest.raises(GRPCError) as refused:
            await _stub_call(_port(server), "apply_deployment", ApplyDeploymentRequest())
    finally:
        server.close()
        relay.close()
    assert refused.value.status is Status.PERMISSION_DENIED
    assert refused.value.message == "role viewer may not apply"


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize(
    ("lease", "said"),
    [
        (_Lease(""), "no server leads now"),
        (_Lease("127.0.0.1:1", leader_id="B"), "does not lead"),  # the lease names us
        (_Lease("not an address"), "cannot be dialled"),
    ],
)
async def test_with_no_leader_to_reach_the_call_is_unavailable(lease: _Lease, said: str) -> None:
    server, relay = await _follower(lease)
    try:
        with pytest.raises(GRPCError) as refused:
            await _stub_call(_port(server), "get_cluster", GetClusterRequest())
    finally:
        server.close()
        relay.close()
    assert refused.value.status is Status.UNAVAILABLE and said in (refused.value.message or "")
    assert relay.relayed == 0


async def test_a_leader_that_cannot_be_reached_is_named() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    server, relay = await _follower(_Lease(address))
    try:
        with pytest.raises(GRPCError) as refused:
            await _stub_call(_port(server), "get_cluster", GetClusterRequest())
    finally:
        server.close()
        relay.close()
    message = refused.value.message or ""
    assert refused.value.status is Status.UNAVAILABLE
    assert f"the leader is at {address}" in message and "cannot be reached" in message


async def test_a_call_relayed_once_is_not_relayed_again(leader: tuple[int, list[Any]]) -> None:
    server, relay = await _follower(_Lease(f"127.0.0.1:{leader[0]}"))
    try:
        with pytest.raises(GRPCError) as refused:
            await _stub_call(
                _port(server), "get_cluster", GetClusterRequest(), metadata={RELAYED_BY: "C"}
            )
    finally:
        server.close()
        relay.close()
    assert refused.value.status is Status.UNAVAILABLE
    assert "relayed here by server C" in (refused.value.message or "")
    assert leader[1] == []  # the leader was never asked


@pytest.mark.parametrize("trusted", ["ca", "other_ca"])
async def test_over_tls_the_leader_must_hold_a_certificate_the_follower_trusts(
    pki: Pki, trusted: str
) -> None:
    leader = grpclib.server.Server([_Leader()])
    await leader.start("127.0.0.1", 0, ssl=server_context(TlsFiles(pki.cert, pki.key), ALPN_GRPC))
    ca = pki.ca if trusted == "ca" else pki.other_ca
    relay = LeaderRelay(
        _Lease(f"127.0.0.1:{_port(leader)}"),  # type: ignore[arg-type]
        ssl=client_context(ca, ALPN_GRPC),
    )
    follower = await _serve([relay])
    try:
        if trusted == "ca":
            cluster = await _stub_call(_port(follower), "get_cluster", GetClusterRequest())
            assert cluster.leadership.leader_id == "A"
        else:
            with pytest.raises(GRPCError) as refused:
                await _stub_call(_port(follower), "get_cluster", GetClusterRequest())
            message = refused.value.message or ""
            assert "cannot be reached" in message and "CERTIFICATE_VERIFY_FAILED" in message
    finally:
        follower.close()
        relay.close()
        leader.close()
