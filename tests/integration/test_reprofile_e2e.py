"""A rolling reprofile under load, with the server killed in the middle, then a node drain.

Real processes on loopback: the server, three simulated DGX agents and ``llmgw sim-engine``
engines. While it runs, an observer polls the cluster over gRPC-web (as the console does)
and a load sends completions straight to READY replicas, with each replica's API key read
from the server's database (no gateway yet in between). What must hold, from issue #4:

- no request fails, and the server never shows fewer than four READY replicas (while it
  hears from every agent: just after its restart it knows nothing yet);
- a server killed with SIGKILL mid-reprofile and started again finishes the reprofile with
  no shard ever running on two nodes and no engine started twice (every shard keeps the
  one pid it had, ``restarts`` stays 0);
- a node drain brings its replicas up elsewhere before retiring them, with the same checks.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from procs import Cluster

from llmgw.api.llmgw.v1 import Cluster as ClusterView
from llmgw.api.llmgw.v1 import ShardState
from llmgw.client.channel import GrpcWebChannel, Timeouts
from llmgw.client.control import ControlClient
from llmgw.client.errors import ClientError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
AGENT_FLAGS = ("--engine-bin", SIM_BIN, "--restart-backoff", "1", "--restart-backoff-max", "1")
NODES = ("a1", "a2", "a3")
COUNT = 4

PROFILES = Path(__file__).parents[1] / "data" / "profiles" / "good-chat-a-b.toml"
FILE = PROFILES.read_text() + '\n[deployments.chat]\nprofile = "chat-a"\nreplicas = 4\n'


class Observer:
    """Polls the server; remembers what every poll showed. A poll that fails (the server
    is down) keeps the last view: the engines serve on while the server is away."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.view = ClusterView()
        self.polls = 0
        self.counting = False  # set once the deployment first has every replica READY
        self.lowest_ready: int | None = None  # fewest READY replicas a poll showed since
        self.nodes_of: dict[str, set[str]] = defaultdict(set)  # shard id → nodes it ran on
        self.pids_of: dict[str, set[int]] = defaultdict(set)  # shard id → engine pids
        self.restarts: dict[str, int] = {}
        self.keys: dict[str, str] = {}

    def ready(self, profile: str = "") -> list[tuple[str, str]]:
        """(replica id, endpoint) of each READY replica (of ``profile``, if named)."""
        return [
            (r.replica_id, r.endpoint)
            for r in self.view.replicas
            if r.state is ShardState.READY and (not profile or r.profile == profile)
        ]

    def running(self) -> list[tuple[str, str]]:
        """(shard id, node id) of every shard not STOPPED."""
        return [
            (s.shard_id, s.node_id)
            for s in self.view.shards
            if s.status is not None and s.status.state is not ShardState.STOPPED
        ]

    async def run(self, client: ControlClient) -> None:
        while True:
            try:
                view = await client.get_cluster()
            except ClientError:
                await asyncio.sleep(0.2)
                continue
            self._record(view)
            await asyncio.sleep(0.2)

    def _record(self, view: ClusterView) -> None:
        self.view, self.polls = view, self.polls + 1
        # A restarted server knows a node's shards again only once its agent is back; until
        # then it cannot say READY (the load shows the engines serving meanwhile).
        if self.counting and all(n.connected for n in view.nodes):
            ready = len(self.ready())
            self.lowest_ready = (
                ready if self.lowest_ready is None else min(self.lowest_ready, ready)
            )
        for shard in view.shards:
            status = shard.status
            if status is None or status.state is ShardState.STOPPED:
                continue
            self.nodes_of[shard.shard_id].add(shard.node_id)
            if status.pid:
                self.pids_of[shard.shard_id].add(status.pid)
            self.restarts[shard.shard_id] = status.restarts
        if any(r.replica_id not in self.keys for r in view.replicas):
            self.keys.update(_api_keys(self.cluster.root / "server.db"))


def _api_keys(db: Path) -> dict[str, str]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT replica_id, record FROM replicas").fetchall()
    conn.close()
    return {replica_id: json.loads(record)["api_key"] for replica_id, record in rows}


class Load:
    """A completion every ``every_s``, straight to the next READY replica the observer saw."""

    def __init__(self, observer: Observer, every_s: float = 0.05) -> None:
        self.observer = observer
        self.every_s = every_s
        self.ok = 0
        self.failed: list[str] = []
        self.served: dict[str, int] = defaultdict(int)

    async def run(self) -> None:
        turn = 0
        async with httpx.AsyncClient(timeout=10) as http:
            while True:
                targets = self.observer.ready()
                if targets:
                    replica_id, endpoint = targets[turn % len(targets)]
                    turn += 1
                    await self._one(http, replica_id, endpoint)
                await asyncio.sleep(self.every_s)

    async def _one(self, http: httpx.AsyncClient, replica_id: str, endpoint: str) -> None:
        key = self.observer.keys.get(replica_id, "")
        body = {"model": "chat", "prompt": f"hello {self.ok}", "max_tokens": 4}
        try:
            reply = await http.post(
                f"{endpoint}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
        except httpx.HTTPError as exc:
            self.failed.append(f"{replica_id}: {type(exc).__name__} {exc}")
            return
        if reply.status_code != 200:
            self.failed.append(f"{replica_id}: HTTP {reply.status_code} {reply.text[:200]}")
        else:
            self.ok += 1
            self.served[replica_id] += 1


async def until(check: Callable[[], object], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"timed out after {within_s}s waiting for {what}"
        await asyncio.sleep(0.2)


async def cli(cluster: Cluster, *args: str) -> str:
    done = await asyncio.to_thread(cluster.cli, *args)
    return done.stdout


def assert_one_copy_and_no_restart(observer: Observer) -> None:
    twice = {s: n for s, n in observer.nodes_of.items() if len(n) > 1}
    assert not twice, f"shards seen running on two nodes: {twice}"
    restarted = {s: p for s, p in observer.pids_of.items() if len(p) > 1}
    assert not restarted, f"engines started twice: {restarted}"
    assert set(observer.restarts.values()) == {0}, observer.restarts


async def reprofile_with_a_server_kill(fleet: Cluster, observer: Observer) -> None:
    before = {s: set(p) for s, p in observer.pids_of.items()}
    out = await cli(fleet, "reprofile", "chat", "--profile", "chat-b")
    assert out.startswith("deployment chat reprofiled to chat-b")

    def mid_way() -> bool:  # one surge done and the next under way
        return sum(r.profile == "chat-b" for r in observer.view.replicas) >= 2

    await until(mid_way, 90, "the second surge replica placed")
    fleet.kill("server")  # SIGKILL
    polls = observer.polls
    await asyncio.sleep(1.0)
    await asyncio.to_thread(fleet.start_server)
    await until(lambda: observer.polls > polls + 2, 30, "polls from the restarted server")
    await until(
        lambda: len(observer.ready("chat-b")) == COUNT == len(observer.view.replicas),
        120,
        "every replica on chat-b and READY",
    )
    kept = [
        s for s, pids in before.items() if s in observer.pids_of and observer.pids_of[s] == pids
    ]
    assert kept, "the old engines that ran through the server's restart kept their pids"


async def drain_a_node(fleet: Cluster, observer: Observer) -> None:
    count: defaultdict[str, int] = defaultdict(int)
    for _, node_id in observer.running():
        count[node_id] += 1
    busiest = max(sorted(count), key=lambda n: count[n])
    moving = {s for s, n in observer.running() if n == busiest}
    out = await cli(fleet, "drain-node", busiest)
    assert out.startswith(f"node {busiest} cordoned; replacing")

    def moved() -> bool:
        running = observer.running()
        off = all(n != busiest for _, n in running) and moving.isdisjoint(s for s, _ in running)
        return off and len(observer.ready("chat-b")) == COUNT == len(observer.view.replicas)

    await until(moved, 120, f"{busiest}'s replicas running elsewhere")


async def test_reprofile_under_load_survives_a_server_kill_then_a_node_drain(
    fleet: Cluster, tmp_path: Path
) -> None:
    await asyncio.to_thread(fleet.start_server)
    for node_id in NODES:
        fleet.start_agent(node_id, "dgx-h100", *AGENT_FLAGS)
    path = tmp_path / "chat.toml"
    path.write_text(FILE)
    observer = Observer(fleet)
    load = Load(observer)
    timeouts = Timeouts(connect=1.0, call=3.0)
    async with GrpcWebChannel(fleet.url, timeouts=timeouts) as channel:
        tasks = [asyncio.create_task(observer.run(ControlClient(channel)))]
        try:
            await until(lambda: len(observer.view.nodes) == len(NODES), 30, "three nodes")
            assert "deployment chat applied" in await cli(fleet, "apply", "-f", str(path))
            await until(lambda: len(observer.ready("chat-a")) == COUNT, 90, "4 READY replicas")
            observer.counting = True
            tasks.append(asyncio.create_task(load.run()))
            await reprofile_with_a_server_kill(fleet, observer)
            assert_one_copy_and_no_restart(observer)
            await drain_a_node(fleet, observer)
            await asyncio.sleep(1.0)  # a little load on the final replicas
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    assert load.failed == [], load.failed[:5]
    assert load.ok > 100 and len(load.served) > COUNT  # old and new replicas both served
    assert observer.lowest_ready == COUNT  # READY never dropped below the count
    assert_one_copy_and_no_restart(observer)
