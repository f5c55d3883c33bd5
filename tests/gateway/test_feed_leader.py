"""The gateway's feed follower and reporter with several control servers (issue #17): a
follower's not_leader sends the feed to the leader at once, a server that is down or a
leader not in the list to the next server, and reports go where the feed goes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpclib.client
import grpclib.server
import pytest
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError

from llmgw.addresses import free_port
from llmgw.api.llmgw.v1 import (
    NotLeader,
    RouterFeedEvent,
    RouterFeedRequest,
    RouterReport,
    RouterReportAck,
    RouterSnapshot,
    RouteTarget,
)
from llmgw.gateway.feed import FollowConfig, ServerList, feed_channel, follow
from llmgw.gateway.routing.table import RoutingTable
from llmgw.server.wire.codec import CheckedProtoCodec

SLOW = FollowConfig(base_s=30.0, cap_s=30.0, keepalive_s=5, keepalive_timeout_s=5)
pytestmark = pytest.mark.timeout(30)


@dataclass
class FakeRouter:
    """A follower naming ``leader_address`` (``linger``: ending only once the client has
    gone, so that the event is read), or a leader whose snapshot holds ``replica``."""

    replica: str = ""
    follower: bool = False
    leader_address: str = ""
    linger: bool = False
    feeds: int = 0
    reports: list[str] = field(default_factory=list)

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/llmgw.v1.RouterService/Feed": Handler(
                self.feed, Cardinality.UNARY_STREAM, RouterFeedRequest, RouterFeedEvent
            ),
            "/llmgw.v1.RouterService/Report": Handler(
                self.report, Cardinality.UNARY_UNARY, RouterReport, RouterReportAck
            ),
        }

    async def feed(self, stream: Any) -> None:
        self.feeds += 1
        await stream.recv_message()
        if self.follower:
            answer = NotLeader(self.leader_address, 2, "leader", "follower")
            await stream.send_message(RouterFeedEvent(not_leader=answer))
            if self.linger:
                await asyncio.sleep(1.0)
            raise GRPCError(
                Status.UNAVAILABLE,
                f"server f does not lead: the leader is l at {self.leader_address} (epoch 2)",
            )
        target = RouteTarget(replica_id=self.replica, model="m", endpoint="http://127.0.0.1:1")
        await stream.send_message(RouterFeedEvent(snapshot=RouterSnapshot(targets=[target])))
        await asyncio.Event().wait()

    async def report(self, stream: Any) -> None:
        if self.follower:
            raise GRPCError(Status.UNAVAILABLE, "not the leader")
        message = await stream.recv_message()
        self.reports.append(message.gateway_id)
        await stream.send_message(RouterReportAck())


@contextlib.asynccontextmanager
async def serving(fake: FakeRouter) -> AsyncIterator[int]:
    server = grpclib.server.Server([fake], codec=CheckedProtoCodec())
    await server.start("127.0.0.1", 0)
    try:
        yield server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def following(ports: list[int]) -> AsyncIterator[tuple[RoutingTable, ServerList]]:
    servers = ServerList([("127.0.0.1", port) for port in ports])
    table = RoutingTable()
    stop = asyncio.Event()

    def channel() -> grpclib.client.Channel:
        return feed_channel(*servers.current, SLOW)

    task = asyncio.create_task(follow(channel, table, stop=stop, config=SLOW, servers=servers))
    try:
        yield table, servers
    finally:
        stop.set()
        await task


async def until(predicate: Callable[[], object], limit_s: float = 10.0) -> None:
    async with asyncio.timeout(limit_s):
        while not predicate():  # noqa: ASYNC110 (polls plain attributes)
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("linger", [True, False], ids=["not_leader", "unavailable-only"])
async def test_the_feed_follows_a_follower_to_the_leader(linger: bool) -> None:
    leader = FakeRouter(replica="r-leader")
    async with serving(leader) as leader_port:
        follower = FakeRouter(
            follower=True, leader_address=f"127.0.0.1:{leader_port}", linger=linger
        )
        async with serving(follower) as follower_port:
            async with following([follower_port, leader_port]) as (table, servers):
                await until(lambda: table.targets())  # SLOW: a backoff would take 15 s
                assert [t.replica_id for t in table.targets()] == ["r-leader"]
                assert servers.current == ("127.0.0.1", leader_port)
            assert follower.feeds == 1


async def test_a_down_server_and_an_unknown_leader_lead_to_the_next_server() -> None:
    leader = FakeRouter(replica="r1")
    stranger = FakeRouter(follower=True, leader_address="10.9.9.9:50051", linger=True)
    async with serving(leader) as leader_port, serving(stranger) as stranger_port:
        async with following([free_port(), stranger_port, leader_port]) as (table, servers):
            await until(lambda: table.targets())
            assert servers.current == ("127.0.0.1", leader_port)
        assert stranger.feeds == 1


def test_server_list_finds_addresses_as_parsed() -> None:
    servers = ServerList([("a", 1), ("::1", 2)])
    assert servers.index_of("[::1]:2") == 1 and servers.index_of("a:01") == 0
    assert servers.index_of("b:1") is None and servers.index_of("nonsense") is None
    assert servers.named_in("not the leader; the leader is a:1.") == 0
    with pytest.raises(ValueError, match="at least one"):
        ServerList([])


def test_a_list_that_follows_any_leader_takes_in_one_slot_for_the_named_leader() -> None:
    closed = ServerList([("own", 1)])
    assert closed.leader_index("c:3") is None  # a gateway's --server list is the operator's
    servers = ServerList([("own", 1)], follow_any_leader=True)
    assert servers.leader_index("own:1") == 0
    assert servers.leader_index("b:2") == 1 and servers.servers == (("own", 1), ("b", 2))
    assert servers.leader_index("c:3") == 1 and servers.servers == (("own", 1), ("c", 3))
    assert servers.leader_index("not an address") is None and len(servers.servers) == 2


async def test_reports_go_to_the_server_the_feed_follows() -> None:
    from llmgw.gateway.app import Gateway
    from llmgw.gateway.reporter import ReportConfig, report_forever
    from llmgw.gateway.standalone import _FollowedChannel

    first, second = FakeRouter(replica="r1"), FakeRouter(replica="r2")
    async with serving(first) as first_port, serving(second) as second_port:
        servers = ServerList([("127.0.0.1", first_port), ("127.0.0.1", second_port)])
        channel = _FollowedChannel(servers, lambda: feed_channel(*servers.current, SLOW))
        config = ReportConfig(gateway_id="g1", started_at_unix_ms=1, interval_s=0.05)
        task = asyncio.create_task(report_forever(channel, Gateway(RoutingTable()), config))
        try:
            await until(lambda: first.reports)
            servers.advance()  # the feed moved to the second server
            await until(lambda: second.reports)
            count = len(first.reports)
            await until(lambda: len(second.reports) >= 3)
            assert len(first.reports) == count  # nothing more to the server left behind
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            channel.close()
