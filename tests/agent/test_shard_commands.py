"""Commands and shard statuses on the agent's stream: supervisor + AgentLink + AgentService.

A real grpclib server on loopback; the agent side is the link wired to a supervisor as
``llmgw agent`` wires it, running tests/agent/fake_engine.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpclib.server
import pytest
from test_supervisor import Harness, fake_launcher, start

from llmgw.agent.backoff import BackoffPolicy
from llmgw.agent.link import AgentLink, LinkConfig
from llmgw.agent.supervisor import Supervisor
from llmgw.api.llmgw.v1 import (
    ControlMessage,
    DrainShard,
    NodeInfo,
    ShardState,
    ShardStatus,
)
from llmgw.server.state.inventory import InventoryConfig
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.agentsvc import AgentService
from llmgw.server.wire.codec import CheckedProtoCodec, install_message_limit

S = ShardState
FAST = BackoffPolicy(base_s=0.05, cap_s=0.2)
pytestmark = pytest.mark.timeout(60)


@dataclass
class Server:
    plane: ControlPlane
    service: AgentService
    port: int

    def shard(self, shard_id: str) -> ShardStatus | None:
        shard = self.plane.inventory.shards.get(shard_id)
        return shard.status if shard is not None else None


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    install_message_limit()
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store, InventoryConfig(grace_s=1.0))
        service = AgentService(plane, heartbeat_interval_ms=50)
        grpc = grpclib.server.Server([service], codec=CheckedProtoCodec())
        await grpc.start("127.0.0.1", 0)
        port = grpc._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            yield Server(plane, service, port)
        finally:
            service.shutdown()
            grpc.close()
            await grpc.wait_closed()


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        await h.cleanup()


@contextlib.asynccontextmanager
async def agent(server: Server, harness: Harness) -> AsyncIterator[tuple[Supervisor, AgentLink]]:
    """A supervisor and a link wired as ``llmgw agent`` wires them."""
    holder: list[AgentLink] = []

    def on_status(status: ShardStatus) -> None:
        harness.recorder(status)  # for the cleanup of every engine started
        holder[0].send_status(status)

    supervisor = Supervisor(harness.config(), launcher=fake_launcher, on_status=on_status)
    link = AgentLink(
        LinkConfig("127.0.0.1", server.port, backoff=FAST),
        node=lambda: NodeInfo(node_id="n1"),
        telemetry=list,
        shards=supervisor.statuses,
        on_command=supervisor.handle,
    )
    holder.append(link)
    harness.supervisors.append(supervisor)
    await supervisor.open()
    task = asyncio.create_task(link.run())
    try:
        yield supervisor, link
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await supervisor.close()


async def _until(predicate: Callable[[], object], limit_s: float = 15.0) -> None:
    async with asyncio.timeout(limit_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


def _state(server: Server, shard_id: str) -> ShardState | None:
    status = server.shard(shard_id)
    return status.state if status is not None else None


async def test_commands_on_the_stream_start_and_drain_a_shard(
    server: Server, harness: Harness
) -> None:
    async with agent(server, harness) as (supervisor, _link):
        await _until(lambda: "n1" in server.service.connections)
        await server.service.send("n1", ControlMessage(start_shard=start("s1")))
        await _until(lambda: _state(server, "s1") is S.READY)
        status = server.shard("s1")
        assert status is not None and status.pid > 0 and status.endpoint

        await server.service.send(
            "n1", ControlMessage(drain_shard=DrainShard(shard_id="s1", grace_seconds=5))
        )
        await _until(lambda: _state(server, "s1") is S.STOPPED)
        assert server.shard("s1").reason == "drained: no request in flight"  # type: ignore[union-attr]
        assert supervisor.statuses() == []


async def test_register_carries_the_shards_and_statuses_resume_after_a_reconnect(
    server: Server, harness: Harness, tmp_path: Path
) -> None:
    async with agent(server, harness) as (supervisor, link):
        await _until(lambda: "n1" in server.service.connections)
        await supervisor.start(start("s1"))
        await _until(lambda: _state(server, "s1") is S.READY)
        first = server.shard("s1")
        assert first is not None

        # the server forgets the shard and the stream breaks: the new Register brings it back
        sessions = link.stats.sessions
        del server.plane.inventory.shards["s1"]
        server.service.connections["n1"].close("test: reconnect")
        await _until(lambda: link.stats.sessions > sessions and _state(server, "s1") is S.READY)
        assert server.shard("s1").pid == first.pid  # type: ignore[union-attr]

        # a change after the reconnect streams as usual
        os.kill(first.pid, signal.SIGKILL)
        await _until(lambda: _state(server, "s1") is S.FAILED)
        failed = server.shard("s1")
        assert failed is not None and failed.exit_code == -9 and failed.exited
        await _until(lambda: _state(server, "s1") is S.READY)
        again = server.shard("s1")
        assert again is not None and again.restarts == 1 and again.pid != first.pid


async def test_statuses_raised_while_disconnected_never_follow_a_newer_register(
    server: Server,
) -> None:
    """Register carries the current state; older queued statuses are not sent after it."""
    link = AgentLink(
        LinkConfig("127.0.0.1", server.port, backoff=FAST),
        node=lambda: NodeInfo(node_id="n1"),
        telemetry=list,
        shards=lambda: [ShardStatus(shard_id="s1", state=S.READY, reason="now")],
    )
    for state in (S.PENDING, S.STARTING, S.LOADING):  # raised before any stream existed
        link.send_status(ShardStatus(shard_id="s1", state=state))
    seen: list[ShardState] = []

    async def watch() -> None:
        async for event in server.plane.hub.subscribe():
            if event.shard is not None and event.shard.status is not None:
                seen.append(event.shard.status.state)  # noqa: PERF401 (endless stream)

    watcher = asyncio.create_task(watch())
    task = asyncio.create_task(link.run())
    try:
        await _until(lambda: link.stats.heartbeats >= 5)
        link.send_status(ShardStatus(shard_id="s1", state=S.DRAINING))  # raised while connected
        await _until(lambda: len(seen) >= 2)
        await asyncio.sleep(0.2)
    finally:
        task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    assert seen == [S.READY, S.DRAINING]
