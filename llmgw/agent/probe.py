"""Probes of an engine's HTTP endpoint on loopback: readiness, health and requests in flight.

Readiness follows what the engines do (spec/vllm-openai-server.md): vLLM does not bind its
port until it is ready, llama.cpp binds at once and answers ``/health`` 503 while loading.
So: a refused connection means STARTING, a ``/health`` that fails or is not 200 means
LOADING, and ``/health`` 200 followed by ``/v1/models`` 200 (with the engine's API key)
means READY. Every request has explicit timeouts and no connection is reused (an engine
restarted on the same port must not meet a stale pooled connection).

``/metrics`` tells the requests an engine holds (a drain waits for none) and, read once when
the engine turns READY, its KV block count (``vllm:cache_config_info``): what the agent caps
the engine's KV event mirrors at (``llmgw.agent.kvevents``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from llmgw.agent.engines.base import LaunchSpec
from llmgw.api.llmgw.v1 import ShardState
from llmgw.promtext import int_label, parse_sample

IN_FLIGHT_GAUGES = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
    }
)
"""Gauges whose sum is the number of requests an engine holds (running or queued)."""
_IN_FLIGHT_PREFIXES = tuple(sorted(IN_FLIGHT_GAUGES))
_MAX_COUNT = 2.0**53  # the in-flight count a page can report at most
CACHE_INFO = "vllm:cache_config_info"


@dataclass(frozen=True, slots=True)
class ProbeTimeouts:
    """Per-request limits of a probe."""

    connect_s: float = 2.0
    read_s: float = 5.0


@dataclass(frozen=True, slots=True)
class Readiness:
    """What a readiness probe saw: STARTING, LOADING or READY, and why."""

    state: ShardState
    detail: str


@dataclass(frozen=True, slots=True)
class InFlight:
    """Requests an engine holds; ``count`` is None when it could not be told.

    ``supported`` is False when the engine answered but exposes no in-flight gauge, so
    waiting longer cannot help.
    """

    count: int | None
    detail: str
    supported: bool = True


@dataclass(frozen=True, slots=True)
class BlockCount:
    """The KV blocks one engine (one data-parallel rank) caches; ``count`` None: unknown."""

    count: int | None
    detail: str


def parse_in_flight(text: str) -> int | None:
    """Sum of the in-flight gauges in a Prometheus text page; None when it has none."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if not line.startswith(_IN_FLIGHT_PREFIXES):
            continue
        try:
            name, _, value = parse_sample(line)
        except ValueError:
            continue
        if name in IN_FLIGHT_GAUGES and math.isfinite(value):
            found = True
            total += value
    if not found:
        return None
    # Finite gauges can still sum past the largest float (an absurd page): cap, not crash.
    return round(min(max(total, -_MAX_COUNT), _MAX_COUNT))


def parse_kv_blocks(text: str) -> int | None:
    """The KV blocks one engine caches, from the ``vllm:cache_config_info`` samples of a
    ``/metrics`` page (one per data-parallel rank: the largest); None when unknown.

    Blocks are ``num_gpu_blocks`` plus ``num_cpu_blocks`` (a CPU tier publishes its blocks
    too), in the hashes events carry: a hybrid model whose ``block_size`` is k times its
    ``hash_block_size`` may publish k hashes per block. Unknown: no sample, a sample with
    ``num_gpu_blocks`` missing, 0 or not a number ("None"), or a CPU offloading tier
    (``kv_offloading_size`` set) whose ``num_cpu_blocks`` is not said.
    """
    counts: list[int] = []
    for line in text.splitlines():
        if not line.startswith(CACHE_INFO):
            continue
        try:
            name, labels, _ = parse_sample(line)
        except ValueError:
            return None
        if name != CACHE_INFO:
            continue
        count = _engine_blocks(labels)
        if count is None:
            return None
        counts.append(count)
    return max(counts, default=None)


def _engine_blocks(labels: dict[str, str]) -> int | None:
    gpu = int_label(labels, "num_gpu_blocks")
    if not gpu:
        return None
    cpu = int_label(labels, "num_cpu_blocks")
    if cpu is None and _offloads(labels):
        return None  # a CPU tier of some GiB: its blocks are not said
    size, hash_size = int_label(labels, "block_size"), int_label(labels, "hash_block_size")
    per_block = -(-size // hash_size) if size and hash_size and hash_size < size else 1
    return (gpu + (cpu or 0)) * per_block


def _offloads(labels: dict[str, str]) -> bool:
    """Whether ``kv_offloading_size`` (GiB; "None" when off) sets up a CPU tier."""
    try:
        return float(labels.get("kv_offloading_size", "None")) > 0
    except ValueError:
        return False


def has_kv_connector(argv: Sequence[str]) -> bool:
    """Whether an engine command adds a KV connector (vLLM's ``--kv-transfer-config``, as
    LMCache does): its tiers publish blocks that ``cache_config_info`` does not count."""
    return any(arg.partition("=")[0].replace("_", "-") == "--kv-transfer-config" for arg in argv)


class EngineProbe:
    """One HTTP client for probing every engine of this agent."""

    def __init__(self, timeouts: ProbeTimeouts | None = None, *, host: str = "127.0.0.1") -> None:
        t = timeouts or ProbeTimeouts()
        self.host = host
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=t.connect_s, read=t.read_s, write=t.read_s, pool=1.0),
            limits=httpx.Limits(max_keepalive_connections=0),
            trust_env=False,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    def endpoint(self, launch: LaunchSpec) -> str:
        return f"http://{self.host}:{launch.port}"

    async def readiness(self, launch: LaunchSpec) -> Readiness:
        """STARTING while the port refuses, LOADING until health and models pass, READY."""
        base = self.endpoint(launch)
        try:
            health = await self._client.get(base + launch.health_path)
        except httpx.ConnectError as exc:
            return Readiness(ShardState.STARTING, f"port {launch.port} not accepting: {exc}")
        except httpx.HTTPError as exc:
            return Readiness(ShardState.LOADING, f"{launch.health_path}: {_describe(exc)}")
        if health.status_code != 200:
            return Readiness(
                ShardState.LOADING, f"{launch.health_path} answered {health.status_code}"
            )
        try:
            models = await self._client.get(base + launch.ready_path, headers=_auth(launch))
        except httpx.HTTPError as exc:
            return Readiness(ShardState.LOADING, f"{launch.ready_path}: {_describe(exc)}")
        if models.status_code != 200:
            return Readiness(
                ShardState.LOADING, f"{launch.ready_path} answered {models.status_code}"
            )
        return Readiness(
            ShardState.READY, f"{launch.health_path} and {launch.ready_path} answer 200"
        )

    async def health(self, launch: LaunchSpec) -> str | None:
        """None when ``/health`` answers 200; otherwise what went wrong."""
        try:
            reply = await self._client.get(self.endpoint(launch) + launch.health_path)
        except httpx.HTTPError as exc:
            return f"{launch.health_path}: {_describe(exc)}"
        if reply.status_code != 200:
            return f"{launch.health_path} answered {reply.status_code}"
        return None

    async def in_flight(self, launch: LaunchSpec) -> InFlight:
        """Requests running or queued in the engine, from its ``/metrics``."""
        text, why = await self._metrics(launch)
        if text is None:
            return InFlight(None, why)
        count = parse_in_flight(text)
        if count is None:
            return InFlight(None, "/metrics has no in-flight gauge", supported=False)
        return InFlight(count, f"{count} requests in flight")

    async def kv_blocks(self, launch: LaunchSpec) -> BlockCount:
        """The KV blocks the engine caches, from its ``/metrics`` (asked once it is READY)."""
        if has_kv_connector(launch.argv):
            return BlockCount(None, "a KV connector's tiers are not in its block count")
        text, why = await self._metrics(launch)
        if text is None:
            return BlockCount(None, why)
        count = parse_kv_blocks(text)
        if count is None:
            return BlockCount(None, f"/metrics does not tell its blocks ({CACHE_INFO})")
        return BlockCount(count, f"{count} KV blocks")

    async def _metrics(self, launch: LaunchSpec) -> tuple[str | None, str]:
        """The engine's ``/metrics`` page, or None and why there is none."""
        try:
            reply = await self._client.get(
                self.endpoint(launch) + "/metrics", headers=_auth(launch)
            )
        except httpx.HTTPError as exc:
            return None, f"/metrics: {_describe(exc)}"
        if reply.status_code != 200:
            return None, f"/metrics answered {reply.status_code}"
        return reply.text, ""


def _auth(launch: LaunchSpec) -> dict[str, str]:
    return {"Authorization": f"Bearer {launch.api_key}"} if launch.api_key else {}


def _describe(exc: httpx.HTTPError) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
