"""AgentService and the agent's link with cluster ids: engines of another cluster are
neither adopted nor stopped (``llmgw.agent.cluster``, ``ControlPlane.register``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpclib.client
import grpclib.server
import pytest
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from llmgw.agent.backoff import BackoffPolicy
from llmgw.agent.cluster import CLUSTER_ID_FILE, ClusterMembership
from llmgw.agent.link import CONNECT_PATH, AgentLink, LinkConfig
from llmgw.api.llmgw.v1 import (
    AgentMessage,
    ControlMessage,
    Gpu,
    NodeInfo,
    NodeState,
    Register,
    ShardState,
    ShardStatus,
    StopShard,
)
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.agentsvc import AgentService
from llmgw.server.wire.codec import CheckedProtoCodec, install_message_limit

FAST = BackoffPolicy(base_s=0.05, cap_s=0.2)
OTHER = "0" * 32


@dataclass
class Running:
    plane: ControlPlane
    service: AgentService
    port: int


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    install_message_limit()
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        service = AgentService(plane, heartbeat_interval_ms=50)
        server = grpclib.server.Server([service], codec=CheckedProtoCodec())
        await server.start("127.0.0.1", 0)
        port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            yield Running(plane, service, port)
        finally:
            server.close()
            await server.wait_closed()


def _node() -> NodeInfo:
    return NodeInfo(node_id="n1", gpus=[Gpu(index=0, uuid="GPU-0")])


async def _until(predicate: Callable[[], bool], limit_s: float = 5.0) -> None:
    async with asyncio.timeout(limit_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


class Agent:
    """A link with a membership in ``state`` that runs shard ``s1`` and records commands."""

    def __init__(self, port: int, state: Path, join: str | None = None) -> None:
        self.membership = ClusterMembership(state, join=join)
        self.commands: list[ControlMessage] = []
        self.link = AgentLink(
            LinkConfig("127.0.0.1", port, backoff=FAST),
            node=_node,
            telemetry=list,
            shards=lambda: [ShardStatus(shard_id="s1", replica_id="r1", state=ShardState.READY)],
            on_command=self._command,
            membership=self.membership,
        )

    async def _command(self, message: ControlMessage) -> None:
        self.commands.append(message)

    async def __aenter__(self) -> Agent:
        self._task = asyncio.create_task(self.link.run())
        await _until(lambda: self.link.stats.connected)
        return self

    async def __aexit__(self, *_: object) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def test_an_agent_without_a_cluster_hands_over_and_remembers(
    running: Running, tmp_path: Path
) -> None:
    async with Agent(running.port, tmp_path) as agent:
        await _until(lambda: "s1" in running.plane.inventory.shards)
        assert agent.membership.remembered == running.plane.cluster_id
    assert (tmp_path / CLUSTER_ID_FILE).read_text().strip() == running.plane.cluster_id


async def test_engines_of_another_cluster_are_not_adopted_until_joined(
    running: Running, tmp_path: Path
) -> None:
    (tmp_path / CLUSTER_ID_FILE).write_text(OTHER + "\n")
    ours = running.plane.cluster_id
    async with Agent(running.port, tmp_path) as agent:
        assert agent.membership.holding_for == ours
        view = running.plane.snapshot()
        (node,) = view.nodes
        assert node.state is NodeState.NOT_READY
        assert node.unadopted_shards == ["s1"] and node.unadopted_cluster_id == OTHER
        assert f"--join-cluster {ours}" in node.state_reason
        assert view.cluster_id == ours
        assert "s1" not in running.plane.inventory.shards
        # a status the link would not send, sent anyway, is not adopted either
        running.plane.shard_status("n1", ShardStatus(shard_id="s2", state=ShardState.READY))
        assert "s2" not in running.plane.inventory.shards
        # no command reaches the engines while they are held
        await running.service.send("n1", ControlMessage(stop_shard=StopShard(shard_id="s1")))
        agent.link.send_status(ShardStatus(shard_id="s1", state=ShardState.FAILED))
        await asyncio.sleep(0.2)
        assert agent.commands == []
        assert running.plane.inventory.nodes["n1"].unadopted["s1"].state == ShardState.READY
    assert (tmp_path / CLUSTER_ID_FILE).read_text().strip() == OTHER

    async with Agent(running.port, tmp_path, join=ours) as agent:  # the operator's action
        await _until(lambda: "s1" in running.plane.inventory.shards)
        (node,) = running.plane.snapshot().nodes
        assert node.state is NodeState.READY and not node.unadopted_shards
        await running.service.send("n1", ControlMessage(stop_shard=StopShard(shard_id="s1")))
        await _until(lambda: bool(agent.commands))


async def test_a_malformed_cluster_id_is_refused_and_not_stored(running: Running) -> None:
    channel = grpclib.client.Channel("127.0.0.1", running.port)
    register = Register(protocol_version=PROTOCOL_VERSION, node=_node(), cluster_id="x\n|y")
    try:
        async with channel.request(
            CONNECT_PATH, Cardinality.STREAM_STREAM, AgentMessage, ControlMessage
        ) as stream:
            await stream.send_message(AgentMessage(register=register))
            await stream.end()
            with pytest.raises(GRPCError) as err:
                _ = [m async for m in stream]
    finally:
        channel.close()
    assert err.value.status is Status.INVALID_ARGUMENT
    assert "Register.cluster_id" in (err.value.message or "")
    assert "n1" not in running.plane.inventory.nodes
