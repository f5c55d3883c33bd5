"""The chaos run's steady load: chat completions through the gateways, each one recorded.

Poisson arrivals at ``rate`` per second (``llmgw.sim.workload``, shared with ``llmgw demo``);
every request picks a model by weight, one of a few long system prompts (shared prefixes, so
the KV caches and the prefix routing move), a short question, a small ``max_tokens``, and
streaming or not. The requests take the gateways in turn (round robin, in the order given:
the same seed sends the same requests through the same gateways). A request is OK when it
answers 200 and, streamed, ends with ``data: [DONE]``; non-streamed, carries a choice.
Anything else (another status, a connection error, a stream cut short, a timeout) is a
failure, kept with its start and end on this process's monotonic clock, the gateway it went
through, and the replica that answered it (the gateway's ``x-llmgw-replica``, when an answer
came), so the checks can hold it against the faults of the same moment on that gateway or
replica.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from llmgw.sim.workload import CHAOS_PROMPTS, Arrivals, chat_body


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """The load's shape; seconds and requests per second."""

    rate: float = 4.0
    models: tuple[tuple[str, float], ...] = (("chat", 0.6), ("code", 0.4))  # (model, weight)
    stream_share: float = 0.5
    max_tokens: tuple[int, int] = (4, 24)
    max_in_flight: int = 32  # beyond this, arrivals are skipped (and counted), not queued
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 30.0


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request: when it ran (monotonic s), what it asked, how it ended."""

    started: float
    ended: float
    model: str
    stream: bool
    ok: bool
    status: int  # 0: no HTTP answer
    error: str = ""
    replica: str = ""  # the replica whose answer came through ("": none did)
    gateway: str = ""  # the name of the gateway it went through


class Load:
    """Send requests until ``stop`` is set, through ``gateways`` (name → URL) in turn;
    `records` holds every finished one. ``transport``: httpx's (tests), else real sockets."""

    def __init__(
        self,
        gateways: Mapping[str, str],
        config: LoadConfig,
        rng: random.Random,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not gateways:
            raise ValueError("a load needs at least one gateway")
        self._gateways = tuple(gateways.items())
        self._transport = transport
        self._config = config
        self._rng = rng
        self._sent = 0  # requests started: the next one goes through gateway _sent % count
        self.records: list[RequestRecord] = []
        self.skipped = 0

    def next_gateway(self) -> tuple[str, str]:
        """(name, URL) of the gateway the next request goes through: each in turn."""
        gateway = self._gateways[self._sent % len(self._gateways)]
        self._sent += 1
        return gateway

    def body(self) -> dict[str, Any]:
        rng, config = self._rng, self._config
        names, weights = zip(*config.models, strict=True)
        return {
            **chat_body(rng, CHAOS_PROMPTS, names, weights),
            "max_tokens": rng.randint(*config.max_tokens),
            "stream": rng.random() < config.stream_share,
        }

    async def run(self, stop: asyncio.Event) -> None:
        """Send until ``stop``; then wait for the requests in flight to end."""
        config = self._config
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        limits = httpx.Limits(max_connections=config.max_in_flight)
        arrivals = Arrivals(config.rate, config.max_in_flight, self._rng)
        http = httpx.AsyncClient(timeout=timeout, limits=limits, transport=self._transport)
        async with http as c:
            await arrivals.run(stop, lambda: asyncio.create_task(self._one(c, self.body())))
            self.skipped = arrivals.skipped
            if arrivals.pending:
                await asyncio.wait(arrivals.pending)

    async def _one(self, client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        gateway, url = self.next_gateway()
        started = time.monotonic()
        head = _Head()
        try:
            ok, error = await _exchange(client, f"{url}/v1/chat/completions", body, head)
        except asyncio.CancelledError:
            raise
        except (httpx.HTTPError, ValueError) as exc:  # ValueError: a body that is not JSON
            ok, error = False, f"{type(exc).__name__}: {exc}"[:300]
        self.records.append(
            RequestRecord(
                started, time.monotonic(), body["model"], body["stream"], ok, head.status,
                error, head.replica, gateway,
            )
        )  # fmt: skip


@dataclass(slots=True)
class _Head:
    """What the answer's head said, kept when its body then fails."""

    status: int = 0
    replica: str = ""


async def _exchange(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], head: _Head
) -> tuple[bool, str]:
    """(ok, why not) of one request, reading a stream to its end; ``head`` filled on the way."""
    async with client.stream("POST", url, json=body) as response:
        head.status = response.status_code
        head.replica = response.headers.get("x-llmgw-replica", "")
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            return False, f"HTTP {response.status_code}: {text[:200]}"
        if body["stream"]:
            lines = [line async for line in response.aiter_lines()]
            done = "data: [DONE]" in lines
            return done, "" if done else f"stream ended without [DONE] ({len(lines)} lines)"
        choices = json.loads(await response.aread()).get("choices")
        return bool(choices), "" if choices else "a 200 answer without choices"


def summarize(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Sent, ok, failed, streamed; p50 and p99 latency (ms, nearest rank) of the ok ones."""
    took = sorted(r.ended - r.started for r in records if r.ok)

    def rank(q: float) -> int:
        return round(1000 * took[min(len(took) - 1, int(q * len(took)))]) if took else 0

    return {
        "sent": len(records),
        "ok": len(took),
        "failed": sum(not r.ok for r in records),
        "streamed": sum(r.stream for r in records),
        "p50_ms": rank(0.5),
        "p99_ms": rank(0.99),
    }


def by_gateway(records: Sequence[RequestRecord]) -> dict[str, tuple[int, int]]:
    """Per gateway (by name, sorted): (requests sent through it, of which failed)."""
    sent = Counter(r.gateway for r in records)
    failed = Counter(r.gateway for r in records if not r.ok)
    return {name: (sent[name], failed[name]) for name in sorted(sent)}
