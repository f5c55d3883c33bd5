"""The control server's own ``/metrics`` (llmgw.server.wire.metrics), parsed back: from figures,
and from a real engine publisher through the agent's subscriber, link and the server."""

from __future__ import annotations

import asyncio
import platform
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpclib.server
import httpx
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

import llmgw
from llmgw.agent.backoff import BackoffPolicy
from llmgw.agent.engines.base import KvEventEndpoints
from llmgw.agent.kvevents import KvFollowConfig
from llmgw.agent.kvhub import KvEventHub
from llmgw.agent.link import AgentLink, LinkConfig
from llmgw.api.llmgw.v1 import ControlServiceBase, NodeInfo, ShardState, ShardStatus
from llmgw.kvcache import BlockStored
from llmgw.server.state.kvblocks import KvBlocksStats
from llmgw.server.state.kvfollow import EngineFollowStats
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.agentsvc import AgentService
from llmgw.server.wire.codec import CheckedProtoCodec, install_message_limit
from llmgw.server.wire.grpcweb import GrpcWebApp
from llmgw.server.wire.metrics import (
    AgentStreamStats,
    FleetFigures,
    render_server_metrics,
    server_metrics,
)
from llmgw.sim.engine.config import KvEventsConfig
from llmgw.sim.engine.kvpublisher import KvEventPublisher

pytestmark = pytest.mark.timeout(60)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"(?:,|$)')
FOLLOW = ("batches", "applied", "gaps", "replays", "replay_failures", "resets", "restarts",
          "decode_errors")  # fmt: skip


def parse(text: str) -> Samples:
    """Prometheus text 0.0.4 → {(name, labels): value}; fails on anything malformed: a
    sample before its family's TYPE, a family typed twice, a counter not named *_total, a
    sample given twice, a label list that does not parse whole."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    samples: Samples = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types and kind in ("counter", "gauge"), line
            assert (kind == "counter") == name.endswith("_total"), line
            types[name] = kind
            continue
        if line.startswith("# HELP "):
            continue
        match = _SAMPLE.match(line)
        assert match is not None, f"malformed: {line!r}"
        name, labels, value = match.groups()
        assert name in types, f"{name} sampled before its TYPE"
        pairs = _LABEL.findall(labels or "")
        assert "".join(f'{k}="{v}",' for k, v in pairs)[:-1] == (labels or ""), line
        unescaped = frozenset((k, v.replace('\\"', '"').replace("\\\\", "\\")) for k, v in pairs)
        assert (name, unescaped) not in samples, f"{line!r} given twice"
        samples[(name, unescaped)] = float(value)
    return samples


def engine_labels(node: str, replica: str, shard: str) -> frozenset[tuple[str, str]]:
    return frozenset({("node", node), ("replica", replica), ("shard", shard)})


def _engine(node: str, shard: str, base: int, last_seq: int | None) -> EngineFollowStats:
    values = [base + i for i in range(9)]  # every counter a different value
    return EngineFollowStats(node, shard, *values, last_seq=last_seq)  # type: ignore[misc]


STORE = KvBlocksStats(replicas=2, blocks=30, deltas=11, stored=40, removed=10, resets=3,
                      malformed=1, ignored=4, drops=5, watchers=1)  # fmt: skip


def test_every_figure_is_a_sample_under_its_own_name_and_labels() -> None:
    engines = [_engine("n1", "s1", 10, 99), _engine('n"2', "s\\2", 100, None)]
    text = render_server_metrics(
        agents_connected=2,
        engines=engines,
        replica_of=lambda node, shard: "r1" if (node, shard) == ("n1", "s1") else "",
        follow_refused=6,
        store=STORE,
        streams=AgentStreamStats(sessions=7, refused_duplicate=8, refused_rate=9),
    ).decode()
    samples = parse(text)
    refused = "llmgw_agent_registrations_refused_total"
    assert samples[(refused, frozenset({("reason", "duplicate")}))] == 8
    assert samples[(refused, frozenset({("reason", "rate")}))] == 9
    one, two = engine_labels("n1", "r1", "s1"), engine_labels('n"2', "", "s\\2")
    for i, name in enumerate(FOLLOW):
        assert samples[(f"llmgw_kv_events_{name}_total", one)] == 10 + i
        assert samples[(f"llmgw_kv_events_{name}_total", two)] == 100 + i
    assert samples[("llmgw_kv_mirror_blocks", one)] == 18
    assert samples[("llmgw_kv_events_last_seq", one)] == 99
    assert ("llmgw_kv_events_last_seq", two) not in samples  # unknown: no sample, not 0
    unlabelled = {name: v for (name, labels), v in samples.items() if not labels}
    assert unlabelled == {
        "llmgw_agents_connected": 2,
        "llmgw_agent_sessions_total": 7,
        "llmgw_kv_follow_refused_total": 6,
        "llmgw_kv_store_replicas": 2,
        "llmgw_kv_store_blocks": 30,
        "llmgw_kv_store_feeds": 1,
        "llmgw_kv_store_deltas_total": 11,
        "llmgw_kv_store_stored_total": 40,
        "llmgw_kv_store_removed_total": 10,
        "llmgw_kv_store_resets_total": 3,
        "llmgw_kv_store_malformed_total": 1,
        "llmgw_kv_store_ignored_total": 4,
        "llmgw_kv_store_drops_total": 5,
    }


def test_with_no_engines_every_family_is_still_declared() -> None:
    text = render_server_metrics(
        agents_connected=0, engines=[], replica_of=lambda n, s: "", follow_refused=0, store=STORE
    ).decode()
    parse(text)
    for name in FOLLOW:
        assert f"# TYPE llmgw_kv_events_{name}_total counter\n" in text


class _Control(ControlServiceBase):
    pass


async def _refuse(path: str, authorization: str | None) -> object:
    raise GRPCError(Status.UNAUTHENTICATED, "no token")


async def test_the_web_port_serves_metrics_without_a_token() -> None:
    served = GrpcWebApp([_Control()], authorize=_refuse, metrics=lambda: b"llmgw_x 1\n")
    bare = GrpcWebApp([_Control()], authorize=_refuse)
    async with (
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=served), base_url="http://localhost"
        ) as c,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=bare), base_url="http://localhost"
        ) as b,
    ):
        response = await c.get("/metrics")
        assert response.status_code == 200 and response.text == "llmgw_x 1\n"
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert (await c.post("/metrics")).status_code == 415  # not a gRPC-web call
        assert (await b.get("/metrics")).status_code == 405  # no metrics: no such page


# -- the chain: engine → agent subscriber → heartbeat → plane → /metrics ----------------------


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="llmgw-m-", dir="/tmp"))  # a socket path is short
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[ControlPlane, AgentService, int]]:
    install_message_limit()
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        service = AgentService(plane, heartbeat_interval_ms=20)
        grpc = grpclib.server.Server([service], codec=CheckedProtoCodec())
        await grpc.start("127.0.0.1", 0)
        port = grpc._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            yield plane, service, port
        finally:
            grpc.close()
            await grpc.wait_closed()


class _Blocks:
    """Stores of new blocks, each chained to the last: a hash per block, counted."""

    def __init__(self) -> None:
        self.count = 0

    def store(self) -> BlockStored:
        parent = self.count or None
        self.count += 1
        return BlockStored((self.count,), parent, (1, 2, 3, 4), 4, medium="GPU", group_idx=0)


async def scrape(web: GrpcWebApp) -> Samples:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=web), base_url="http://localhost"
    ) as c:
        return parse((await c.get("/metrics")).text)


async def caught_up(web: GrpcWebApp, pub: KvEventPublisher) -> Samples:
    """The server's figures once a heartbeat reported the engine's last batch."""
    async with asyncio.timeout(10):
        while True:
            samples = await scrape(web)
            if samples.get(("llmgw_kv_events_last_seq", LABELS)) == pub.next_seq - 1:
                return samples
            await asyncio.sleep(0.02)


LABELS = engine_labels("n1", "r1", "s1")


def _link(port: int, hub: KvEventHub) -> AgentLink:
    return AgentLink(
        LinkConfig("127.0.0.1", port, backoff=BackoffPolicy(base_s=0.05, cap_s=0.2)),
        node=lambda: NodeInfo(node_id="n1"),
        telemetry=list,
        shards=lambda: [ShardStatus(shard_id="s1", replica_id="r1", state=ShardState.READY)],
        kv=hub,
    )


async def test_a_healed_gap_shows_as_a_gap_and_a_replay_and_no_reset(
    server: tuple[ControlPlane, AgentService, int], sock_dir: Path
) -> None:
    plane, service, port = server
    endpoints = KvEventEndpoints(f"ipc://{sock_dir}/pub", f"ipc://{sock_dir}/replay", "kv")
    config = KvEventsConfig(enable_kv_cache_events=True, endpoint=endpoints.endpoint,
                            replay_endpoint=endpoints.replay_endpoint, topic="kv")  # fmt: skip
    hub = KvEventHub(KvFollowConfig(flush_interval_s=0.01, replay_timeout_s=1.0))
    web = GrpcWebApp([_Control()], metrics=lambda: server_metrics(plane, len(service.connections)))
    blocks = _Blocks()
    async with KvEventPublisher(config, encoding="map", vllm_version="0.33.0") as pub:
        hub.follow("s1", endpoints)
        task = asyncio.create_task(_link(port, hub).run())
        try:
            while not hub.counters()["s1"].batches:  # until the SUB has joined
                pub.publish([blocks.store()])
                await asyncio.sleep(0.02)
            before = await caught_up(web, pub)
            pub.drop_next(1)
            pub.publish([blocks.store()])  # lost on the way (kept for replay)
            pub.publish([blocks.store()])  # reveals the gap
            after = await caught_up(web, pub)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await hub.aclose()

    def rose(name: str) -> float:
        key = (f"llmgw_kv_events_{name}_total", LABELS)
        return after[key] - before[key]

    assert (rose("gaps"), rose("replays")) == (1, 1)
    assert rose("resets") == rose("replay_failures") == rose("restarts") == 0
    assert after[("llmgw_kv_events_resets_total", LABELS)] == 0
    assert rose("batches") == 2  # the lost batch too, by replay
    assert after[("llmgw_kv_mirror_blocks", LABELS)] == blocks.count
    assert after[("llmgw_agents_connected", frozenset())] == 1


def test_fleet_gauges_carry_every_state_and_each_deployment() -> None:
    fleet = FleetFigures(
        deployments=(("chat", 3, 1), ('we"ird', 1, 1)),
        nodes={"ready": 2, "not_ready": 1},
        replicas={"ready": 2, "failed": 1},
        shards={"ready": 4},
    )
    text = render_server_metrics(
        agents_connected=0,
        engines=[],
        replica_of=lambda n, s: "",
        follow_refused=0,
        store=STORE,
        fleet=fleet,
    ).decode()
    samples = parse(text)

    def state(name: str, value: str) -> float:
        return samples[(name, frozenset({("state", value)}))]

    assert [state("llmgw_nodes", s) for s in ("ready", "not_ready", "cordoned")] == [2, 1, 0]
    every = ("pending", "starting", "loading", "ready", "draining", "stopped", "failed")
    assert [state("llmgw_replicas", s) for s in every] == [0, 0, 0, 2, 0, 0, 1]
    assert [state("llmgw_shards", s) for s in every] == [0, 0, 0, 4, 0, 0, 0]
    chat, weird = frozenset({("deployment", "chat")}), frozenset({("deployment", 'we"ird')})
    assert samples[("llmgw_deployment_replicas_desired", chat)] == 3
    assert samples[("llmgw_deployment_replicas_ready", chat)] == 1
    assert samples[("llmgw_deployment_replicas_ready", weird)] == 1
    (build,) = [labels for name, labels in samples if name == "llmgw_build_info"]
    assert dict(build)["version"] == llmgw.__version__
    assert dict(build)["python"] == platform.python_version()
