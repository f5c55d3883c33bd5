"""AgentService over a real grpclib server on loopback, with the agent's own link."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpclib.client
import grpclib.server
import pytest
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from llmgw.agent.backoff import BackoffPolicy
from llmgw.agent.link import CONNECT_PATH, AgentLink, LinkConfig
from llmgw.api.llmgw.v1 import (
    AgentMessage,
    ControlMessage,
    Gpu,
    GpuTelemetry,
    Heartbeat,
    NodeInfo,
    NodeState,
    Register,
    ShardState,
    ShardStatus,
    StopShard,
)
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server.state.inventory import InventoryConfig
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.agentsvc import AgentService, _end_quietly
from llmgw.server.wire.codec import CheckedProtoCodec, install_message_limit

FAST = BackoffPolicy(base_s=0.05, cap_s=0.2)


@dataclass
class Running:
    plane: ControlPlane
    service: AgentService
    port: int


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    install_message_limit()
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store, InventoryConfig(grace_s=1.0))
        service = AgentService(plane, heartbeat_interval_ms=50)
        server = grpclib.server.Server([service], codec=CheckedProtoCodec())
        await server.start("127.0.0.1", 0)
        port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            yield Running(plane, service, port)
        finally:
            server.close()
            await server.wait_closed()


def _node(node_id: str = "n1") -> NodeInfo:
    return NodeInfo(node_id=node_id, gpus=[Gpu(index=0, uuid="GPU-0")])


async def _until(predicate: Callable[[], bool], limit_s: float = 5.0) -> None:
    """Poll a condition another task makes true (there is no event to wait on here)."""
    async with asyncio.timeout(limit_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_link_registers_heartbeats_and_measures_rtt(running: Running) -> None:
    util = iter(range(0, 10_000, 5))
    link = AgentLink(
        LinkConfig("127.0.0.1", running.port, backoff=FAST),
        node=_node,
        telemetry=lambda: [GpuTelemetry(uuid="GPU-0", utilization_pct=next(util) % 100)],
        shards=lambda: [ShardStatus(shard_id="s1", state=ShardState.READY)],
    )
    task = asyncio.create_task(link.run())
    try:
        await _until(lambda: len(link.stats.rtt_ms) >= 3)
        record = running.plane.inventory.nodes["n1"]
        view = running.plane.snapshot()
        assert view.nodes[0].state is NodeState.READY
        assert view.shards[0].shard_id == "s1"  # adopted from Register
        assert record.telemetry["GPU-0"].utilization_pct > 0  # telemetry deltas applied
        assert max(link.stats.rtt_ms) < 1000
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await _until(lambda: running.plane.snapshot().nodes[0].state is NodeState.NOT_READY)


async def test_link_reconnects_after_server_comes_back(tmp_path: Path) -> None:
    install_message_limit()
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        service = AgentService(plane, heartbeat_interval_ms=50)
        server = grpclib.server.Server([service], codec=CheckedProtoCodec())
        await server.start("127.0.0.1", 0)
        port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        link = AgentLink(LinkConfig("127.0.0.1", port, backoff=FAST), node=_node, telemetry=list)
        task = asyncio.create_task(link.run())
        try:
            await _until(lambda: link.stats.sessions == 1 and link.stats.connected)
            service.shutdown()
            server.close()
            await server.wait_closed()
            await _until(lambda: link.backoff.failures >= 2)
            server = grpclib.server.Server([service], codec=CheckedProtoCodec())
            await server.start("127.0.0.1", port)
            await _until(lambda: link.stats.sessions == 2 and link.stats.connected)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            server.close()
            await server.wait_closed()


async def _raw_connect(port: int, *messages: AgentMessage) -> list[ControlMessage]:
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        async with channel.request(
            CONNECT_PATH, Cardinality.STREAM_STREAM, AgentMessage, ControlMessage
        ) as stream:
            for m in messages:
                await stream.send_message(m)
            await stream.end()
            return [m async for m in stream]
    finally:
        channel.close()


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1])
async def test_unsupported_protocol_version_is_refused_clearly(
    running: Running, version: int
) -> None:
    register = AgentMessage(register=Register(protocol_version=version, node=_node()))
    with pytest.raises(GRPCError) as err:
        await _raw_connect(running.port, register)
    assert err.value.status is Status.FAILED_PRECONDITION
    assert f"protocol version {version}" in (err.value.message or "")
    assert "n1" not in running.plane.inventory.nodes  # nothing stored


async def test_first_message_must_be_register(running: Running) -> None:
    with pytest.raises(GRPCError) as err:
        await _raw_connect(running.port, AgentMessage(heartbeat=Heartbeat(seq=1)))
    assert err.value.status is Status.INVALID_ARGUMENT
    assert "must be Register" in (err.value.message or "")


async def test_bad_node_id_is_refused(running: Running) -> None:
    register = AgentMessage(
        register=Register(protocol_version=PROTOCOL_VERSION, node=NodeInfo(node_id="../etc"))
    )
    with pytest.raises(GRPCError) as err:
        await _raw_connect(running.port, register)
    assert err.value.status is Status.INVALID_ARGUMENT and "node id" in (err.value.message or "")


async def test_commands_reach_the_agent(running: Running) -> None:
    got: list[ControlMessage] = []

    async def on_command(message: ControlMessage) -> None:
        got.append(message)

    link = AgentLink(
        LinkConfig("127.0.0.1", running.port, backoff=FAST),
        node=_node,
        telemetry=list,
        on_command=on_command,
    )
    task = asyncio.create_task(link.run())
    try:
        await _until(lambda: "n1" in running.service.connections)
        sent = await running.service.send("n1", ControlMessage(stop_shard=StopShard(shard_id="x")))
        assert sent
        await _until(lambda: bool(got))
        assert got[0].stop_shard is not None and got[0].stop_shard.shard_id == "x"
        assert not await running.service.send("nobody", ControlMessage())
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_second_agent_of_a_live_node_is_refused_naming_the_holder(
    running: Running,
) -> None:
    config = LinkConfig("127.0.0.1", running.port, backoff=FAST, instance_id="aaaa1111")
    holder = AgentLink(config, node=_node, telemetry=list)
    first = asyncio.create_task(holder.run())
    try:
        await _until(lambda: holder.stats.connected)
        with pytest.raises(GRPCError) as refused:
            await _register_once(running.port, instance_id="bbbb2222", run_id="other")
        assert refused.value.status is Status.ALREADY_EXISTS
        message = refused.value.message or ""
        assert "'aaaa1111'" in message and "'bbbb2222'" in message, message
        await asyncio.sleep(0.3)
        assert holder.stats.sessions == 1 and holder.backoff.failures == 0
        assert running.plane.snapshot().nodes[0].state is NodeState.READY
    finally:
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)


async def test_the_same_agent_process_reconnecting_supersedes_its_old_stream(
    running: Running,
) -> None:
    link = AgentLink(
        LinkConfig("127.0.0.1", running.port, backoff=FAST), node=_node, telemetry=list
    )
    task = asyncio.create_task(link.run())
    try:
        await _until(lambda: link.stats.connected)
        old = running.service.connections["n1"]
        await _register_once(running.port, run_id=link.run_id)
        assert old.closed_because.startswith("superseded")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_silent_holder_is_taken_over_after_the_grace(running: Running) -> None:
    channel = grpclib.client.Channel("127.0.0.1", running.port)
    try:
        silent = channel.request(
            CONNECT_PATH, Cardinality.STREAM_STREAM, AgentMessage, ControlMessage
        )
        with pytest.raises(GRPCError) as ended:
            async with silent:
                register = Register(protocol_version=PROTOCOL_VERSION, node=_node(), run_id="s")
                await silent.send_message(AgentMessage(register=register))
                assert (await silent.recv_message()) is not None  # Registered; then silence
                with pytest.raises(GRPCError):  # within the grace (1 s) the holder still wins
                    await _register_once(running.port, run_id="new")
                await asyncio.sleep(1.5)
                await _register_once(running.port, run_id="new")
                await silent.recv_message()
        assert ended.value.status is Status.UNAVAILABLE
        assert "superseded" in (ended.value.message or "")
    finally:
        channel.close()


async def _register_once(port: int, *, instance_id: str = "", run_id: str = "") -> None:
    """Register as n1 on a raw stream, wait for Registered, hang up (GRPCError if refused)."""
    channel = grpclib.client.Channel("127.0.0.1", port)
    register = Register(
        protocol_version=PROTOCOL_VERSION, node=_node(), instance_id=instance_id, run_id=run_id
    )
    try:
        async with channel.request(
            CONNECT_PATH, Cardinality.STREAM_STREAM, AgentMessage, ControlMessage
        ) as stream:
            await stream.send_message(AgentMessage(register=register))
            reply = await stream.recv_message()
            assert reply is not None and reply.registered is not None
            await stream.cancel()
    finally:
        channel.close()


class _HungUp:
    """A server stream whose agent has already reset it (what a shutdown races with)."""

    async def send_trailing_metadata(self, **_: object) -> None:
        raise StreamTerminatedError("Stream reset by remote party, error_code: 0")


async def test_ending_a_stream_the_agent_already_reset_logs_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stream: Any = _HungUp()
    with caplog.at_level(logging.DEBUG):
        await _end_quietly(stream, Status.UNAVAILABLE, "the control server is shutting down")
    assert all(record.levelno < logging.WARNING for record in caplog.records)
    assert all(record.exc_info is None for record in caplog.records)


async def test_a_stream_the_agent_resets_while_the_server_closes_it_ends_quietly(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    link = AgentLink(
        LinkConfig("127.0.0.1", running.port, backoff=FAST), node=_node, telemetry=list
    )
    task = asyncio.create_task(link.run())
    try:
        await _until(lambda: link.stats.connected)
        connection = running.service.connections["n1"]
        handler = connection.task
        assert handler is not None
        wrapper: Any = getattr(connection._stream._stream, "wrapper")  # noqa: B009 (grpclib's)
        with caplog.at_level(logging.INFO, logger="grpclib.server"):
            # both in one tick, as in a shutdown the agent races: the peer's reset (grpclib
            # cancels the handler through its wrapper) and the server's own close
            wrapper.cancel(StreamTerminatedError("Stream reset by remote party"))
            connection.close("the control server is shutting down")
            await _until(handler.done)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
