"""What the chaos run watches: the cluster as the server reports it, the engine processes as
``/proc`` shows them, and at the end the engines' KV caches against the gateway's index.

`Sampler` records a `Sample` every ``every_s``: READY replicas per deployment and, from both
the server's shards and the live engine processes, any replica rank that runs twice. The
server's view counts a shard STARTING, LOADING, READY or DRAINING as running; the processes'
view names each engine from its agent's record (an engine no record names is an *orphan*:
nobody manages it). A sample taken while the server does not answer says so and still
checks the processes. With several servers each sample also reads every server's
``/metrics`` and records which said they lead (``llmgw_leader 1``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

from bench.chaoskit.cluster import ChaosCluster, EngineProc
from bench.chaoskit.ha import read_leaders
from llmgw.api.llmgw.v1 import Cluster, ShardState
from llmgw.client import ClientError

log = logging.getLogger("chaos.observe")

RUNNING = frozenset(
    {ShardState.STARTING, ShardState.LOADING, ShardState.READY, ShardState.DRAINING}
)


@dataclass(frozen=True, slots=True)
class Sample:
    """One look at the cluster (monotonic seconds)."""

    at: float
    reachable: bool  # the server answered GetCluster
    ready: tuple[tuple[str, int], ...]  # (deployment, READY replicas), as the server says
    server_twins: tuple[str, ...]  # replica ranks running as two shards, in words
    process_twins: tuple[str, ...]  # replica ranks with two live engine processes, in words
    orphans: tuple[int, ...]  # live engine pids no agent record names
    engines: int  # live engine processes
    leaders: tuple[str, ...] = ()  # several servers: those that said they lead (sorted)


class ClusterSource(Protocol):
    """What the sampler asks the cluster of (a ControlClient, a chaoskit.ha.LeaderClient)."""

    async def get_cluster(self) -> Cluster: ...


def ready_by_deployment(cluster: Cluster) -> dict[str, int]:
    counts = {d.name: 0 for d in cluster.deployments}
    for replica in cluster.replicas:
        if replica.state == ShardState.READY and replica.deployment in counts:
            counts[replica.deployment] += 1
    return counts


def server_twins(cluster: Cluster) -> list[str]:
    """Replica ranks the server reports running as more than one shard."""
    where: defaultdict[tuple[str, int], list[str]] = defaultdict(list)
    for shard in cluster.shards:
        status = shard.status
        if status is not None and status.state in RUNNING:
            where[(shard.replica_id, status.rank)].append(f"{shard.shard_id}@{shard.node_id}")
    return [
        f"{r} rank {k}: {', '.join(sorted(v))}" for (r, k), v in sorted(where.items()) if len(v) > 1
    ]


def process_twins(engines: Iterable[EngineProc]) -> list[str]:
    """Replica ranks with more than one live engine process."""
    where: defaultdict[tuple[str, int], list[str]] = defaultdict(list)
    for engine in engines:
        if engine.replica_id:
            where[(engine.replica_id, engine.rank)].append(f"pid {engine.pid}@{engine.node}")
    return [
        f"{r} rank {k}: {', '.join(sorted(v))}" for (r, k), v in sorted(where.items()) if len(v) > 1
    ]


class Sampler:
    """Samples until ``stop``; `samples` in order, `last_cluster` the latest answer."""

    def __init__(
        self,
        cluster: ChaosCluster,
        client: ClusterSource,
        every_s: float = 0.5,
        webs: Mapping[str, str] | None = None,
    ) -> None:
        self._cluster = cluster
        self._client = client
        self._webs = dict(webs or {})  # server name → web URL whose /metrics to read
        self._every_s = every_s
        self.samples: list[Sample] = []
        self.last_cluster: Cluster | None = None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.samples.append(await self.sample())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._every_s):
                    await stop.wait()

    async def sample(self) -> Sample:
        at = time.monotonic()
        cluster = await self._cluster_or_none()
        leaders = await self._leaders()
        engines = self._cluster.engines()
        if cluster is not None:
            self.last_cluster = cluster
        return Sample(
            at=at,
            reachable=cluster is not None,
            ready=tuple(sorted(ready_by_deployment(cluster).items())) if cluster else (),
            server_twins=tuple(server_twins(cluster)) if cluster else (),
            process_twins=tuple(process_twins(engines)),
            orphans=tuple(sorted(e.pid for e in engines if not e.shard_id)),
            engines=len(engines),
            leaders=leaders,
        )

    async def _leaders(self) -> tuple[str, ...]:
        if not self._webs:
            return ()
        async with httpx.AsyncClient() as http:
            seen = await read_leaders(http, self._webs)
        return tuple(sorted(name for name, (lead, _) in seen.items() if lead))

    async def _cluster_or_none(self) -> Cluster | None:
        try:
            async with asyncio.timeout(3.0):
                return await self._client.get_cluster()
        except (ClientError, TimeoutError):
            return None


# -- KV: the engines' caches and the gateway's index ---------------------------------------


async def engine_keys(http: httpx.AsyncClient, endpoint: str) -> set[str] | None:
    """An engine's cached block keys (its ``/debug/kv_cache``); None when it does not answer."""
    try:
        response = await http.get(f"{endpoint}/debug/kv_cache")
        response.raise_for_status()
        return set(response.json()["keys"])
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        log.warning("cannot read %s/debug/kv_cache: %s", endpoint, exc)
        return None


async def index_keys(http: httpx.AsyncClient, gateway: str) -> dict[str, set[str]] | None:
    """The gateway's KV index per replica (its ``/debug/kv_index``)."""
    try:
        response = await http.get(f"{gateway}/debug/kv_index")
        response.raise_for_status()
        replicas = response.json()["replicas"]
        return {replica: set(entry["keys"]) for replica, entry in replicas.items()}
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        log.warning("cannot read %s/debug/kv_index: %s", gateway, exc)
        return None


@dataclass(frozen=True, slots=True)
class KvReading:
    """Both sides at one moment: each KV-events replica's engine keys, and the keys of the
    index of each gateway read (by its name)."""

    engines: dict[str, set[str] | None]  # replica id → keys (None: unreadable)
    indexes: dict[str, dict[str, set[str]] | None]  # gateway → replica id → keys

    def differences(self) -> list[str]:
        """Every way an index differs from the engines, in words (empty when all agree)."""
        out = [
            f"{r}: the engine's cache could not be read"
            for r, k in self.engines.items()
            if k is None
        ]
        for gateway, index in sorted(self.indexes.items()):
            if index is None:
                out.append(f"{gateway}: its index could not be read")
            else:
                out += [f"{gateway}: {d}" for d in self._index_differences(index)]
        return out

    def _index_differences(self, index: dict[str, set[str]]) -> list[str]:
        out: list[str] = []
        for replica, keys in sorted(self.engines.items()):
            held = index.get(replica, set())
            if keys is not None and keys != held:
                out.append(
                    f"{replica}: {len(keys - held)} of the engine's {len(keys)} blocks missing "
                    f"from the index, {len(held - keys)} indexed blocks not in the engine"
                )
        out.extend(
            f"{replica}: {len(keys)} blocks indexed for a replica with no READY KV engine"
            for replica, keys in sorted(index.items())
            if replica not in self.engines and keys
        )
        return out


async def read_kv(
    http: httpx.AsyncClient, gateways: dict[str, str], replicas: Sequence[tuple[str, str]]
) -> KvReading:
    """``replicas``: (replica id, endpoint) of every READY replica with KV events;
    ``gateways``: name → URL of each gateway whose index to read."""
    engines = {rid: await engine_keys(http, endpoint) for rid, endpoint in replicas}
    indexes = {name: await index_keys(http, url) for name, url in gateways.items()}
    return KvReading(engines, indexes)
