"""Probes of an engine's HTTP endpoint on loopback: readiness, health and requests in flight.

Readiness follows what the engines do (spec/vllm-openai-server.md): vLLM does not bind its
port until it is ready, llama.cpp binds at once and answers ``/health`` 503 while loading.
So: a refused connection means STARTING, a ``/health`` that fails or is not 200 means
LOADING, and ``/health`` 200 followed by ``/v1/models`` 200 (with the engine's API key)
means READY. Every request has explicit timeouts and no connection is reused (an engine
restarted on the same port must not meet a stale pooled connection).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import httpx

from llmgw.agent.engines.base import LaunchSpec
from llmgw.api.llmgw.v1 import ShardState

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
_MAX_COUNT = 2.0**53  # the in-flight count a page can report at most


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


def parse_in_flight(text: str) -> int | None:
    """Sum of the in-flight gauges in a Prometheus text page; None when it has none."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = _sample(line)
        if name in IN_FLIGHT_GAUGES and value is not None:
            found = True
            total += value
    if not found:
        return None
    # Finite gauges can still sum past the largest float (an absurd page): cap, not crash.
    return round(min(max(total, -_MAX_COUNT), _MAX_COUNT))


def _sample(line: str) -> tuple[str, float | None]:
    """``name{labels} value [timestamp]`` → (name, value); label values may hold spaces."""
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        name, rest = line[:brace], line[line.rfind("}") + 1 :]
    else:
        name, _, rest = line.partition(" ")
    fields = rest.split()
    try:
        value = float(fields[0]) if fields else None
    except ValueError:
        return name, None
    return name, value if value is not None and math.isfinite(value) else None


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
        try:
            reply = await self._client.get(
                self.endpoint(launch) + "/metrics", headers=_auth(launch)
            )
        except httpx.HTTPError as exc:
            return InFlight(None, f"/metrics: {_describe(exc)}")
        if reply.status_code != 200:
            return InFlight(None, f"/metrics answered {reply.status_code}")
        count = parse_in_flight(reply.text)
        if count is None:
            return InFlight(None, "/metrics has no in-flight gauge", supported=False)
        return InFlight(count, f"{count} requests in flight")


def _auth(launch: LaunchSpec) -> dict[str, str]:
    return {"Authorization": f"Bearer {launch.api_key}"} if launch.api_key else {}


def _describe(exc: httpx.HTTPError) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
