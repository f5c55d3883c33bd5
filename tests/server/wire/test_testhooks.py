"""The --test-hooks command hook, over httpx's ASGI transport."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from llmgw.api.llmgw.v1 import ControlMessage, StartShard, StopShard
from llmgw.server.wire.testhooks import AgentCommandHook


class Agents:
    """What AgentService.send does, for nodes in ``connected``."""

    def __init__(self, *connected: str) -> None:
        self.connected = set(connected)
        self.sent: list[tuple[str, ControlMessage]] = []

    async def send(self, node_id: str, message: ControlMessage) -> bool:
        if node_id not in self.connected:
            return False
        self.sent.append((node_id, message))
        return True


async def downstream(scope: object, receive: object, send: object) -> None:
    """Stands for the gRPC-web app: everything else must reach it."""
    await send({"type": "http.response.start", "status": 299, "headers": []})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"app"})  # type: ignore[operator]


@pytest.fixture
async def client_and_agents() -> AsyncIterator[tuple[httpx.AsyncClient, Agents]]:
    agents = Agents("n1")
    app = AgentCommandHook(downstream, agents.send)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://hooks") as client:
        yield client, agents


async def test_a_command_goes_down_the_nodes_stream(
    client_and_agents: tuple[httpx.AsyncClient, Agents],
) -> None:
    client, agents = client_and_agents
    body = {"startShard": {"shardId": "s1", "profile": {"engine": "sim"}, "port": 8100}}
    reply = await client.post("/debug/agents/n1/command", json=body)
    assert (reply.status_code, reply.json()) == (200, {"sent": True})
    reply = await client.post("/debug/agents/n1/command", json={"stop_shard": {"shardId": "s1"}})
    assert reply.status_code == 200
    assert [node for node, _ in agents.sent] == ["n1", "n1"]
    start = agents.sent[0][1].start_shard
    assert isinstance(start, StartShard) and start.port == 8100
    assert start.profile is not None and start.profile.engine == "sim"
    assert agents.sent[1][1] == ControlMessage(stop_shard=StopShard(shard_id="s1"))


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"{nope", "the body is not JSON"),
        (b"[]", "exactly one of startShard, stopShard, drainShard"),
        (b'{"registered": {}}', "exactly one of"),
        (b'{"startShard": {}, "stopShard": {}}', "exactly one of"),
        (b'{"startShard": {"shardId": "s", "bogus": 1}}', "not a valid ControlMessage"),
        (b'{"stopShard": {"graceSeconds": "soon"}}', "not a valid ControlMessage"),
    ],
)
async def test_a_bad_body_is_refused_and_nothing_sent(
    client_and_agents: tuple[httpx.AsyncClient, Agents], body: bytes, error: str
) -> None:
    client, agents = client_and_agents
    reply = await client.post("/debug/agents/n1/command", content=body)
    assert reply.status_code == 400 and error in reply.json()["error"]
    assert agents.sent == []


async def test_unknown_node_wrong_method_and_other_paths(
    client_and_agents: tuple[httpx.AsyncClient, Agents],
) -> None:
    client, agents = client_and_agents
    reply = await client.post("/debug/agents/n2/command", json={"stopShard": {"shardId": "s"}})
    assert reply.status_code == 404 and "'n2' has no agent connected" in reply.json()["error"]
    reply = await client.get("/debug/agents/n1/command")
    assert reply.status_code == 405 and reply.headers["allow"] == "POST"
    for path in ("/healthz", "/llmgw.v1.ControlService/GetCluster", "/debug/agents/n1/other"):
        reply = await client.post(path, content=b"")
        assert (reply.status_code, reply.text) == (299, "app")
    assert agents.sent == []
