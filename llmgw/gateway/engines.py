"""What the engines say about themselves: a poller of every READY replica's ``/metrics``.

Every ``interval_s`` the poller GETs ``/metrics`` from each READY replica of the routing
table (at most ``concurrency`` at once, each within ``timeout_s``; a replica that fails is
skipped until the next round and counted in ``llmgw_engine_polls_total{outcome}``) and reads
these families of vLLM's (spec/vllm-openai-server.md, the simulated engine's metrics.py):

* ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` (tokens): the
  reuse the engine *delivered*. Each series (one per ``engine`` label: data-parallel ranks
  count apart) is turned into increments between two polls; a counter that went down was
  reset (the engine restarted) and its whole new value is the increment, as Prometheus'
  ``rate()`` reads it. Increments go to the gateway's ``llmgw_reuse_tokens_total
  {stage="delivered"}`` and to a window of ``window_s`` per replica, whose Δhits/Δqueries is
  the replica's hit ratio.
* ``vllm:cache_config_info{block_size, num_gpu_blocks}``: the replica's block size (the
  precise tier's fallback when the KV feed has not said it) and its KV capacity in tokens,
  ``num_gpu_blocks × block_size`` summed over its engines, handed to ``on_capacity`` after
  every poll (the gateway tells the approximate tree, in characters at the characters per
  token it has learned so far: ``PrefixPolicy.set_replica_capacity``).
* ``vllm:kv_cache_usage_perc``, ``vllm:num_requests_waiting`` and
  ``vllm:num_requests_running``: how full the engine is, reported per replica
  (``ReplicaRouterStats.kv_usage``, ``engine_waiting``, ``engine_running``) for the
  console and the autoscaler.

A replica that leaves the table is forgotten (``on_capacity(replica_id, None)``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from llmgw.gateway.errors import UpstreamError
from llmgw.gateway.metrics import GatewayMetrics, labelled
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.gateway.tokenize import failure_reason, fetch
from llmgw.gateway.upstream import UpstreamPool
from llmgw.promtext import int_label, parse_sample

log = logging.getLogger(__name__)

__all__ = [
    "EngineFacts",
    "EnginePoller",
    "EngineSample",
    "PollerConfig",
    "ReuseWindow",
    "parse_engine_metrics",
]

QUERIES: Final = "vllm:prefix_cache_queries_total"
HITS: Final = "vllm:prefix_cache_hits_total"
CACHE_INFO: Final = "vllm:cache_config_info"
KV_USAGE: Final = "vllm:kv_cache_usage_perc"
WAITING: Final = "vllm:num_requests_waiting"
RUNNING: Final = "vllm:num_requests_running"
_WANTED: Final = (QUERIES, HITS, CACHE_INFO, KV_USAGE, WAITING, RUNNING)
_MAX_INCREMENT = float(2**53)  # a larger sum of increments is no real engine's
_MAX_QUEUE = float(2**32 - 1)  # requests waiting or running: a uint32 on the wire


@dataclass(frozen=True, slots=True)
class PollerConfig:
    """How often and how carefully the poller asks."""

    interval_s: float = 5.0
    timeout_s: float = 2.0  # one replica's whole answer
    concurrency: int = 8
    window_s: float = 60.0  # the hit ratio's window
    max_bytes: int = 4 * 1024 * 1024  # a larger /metrics answer is refused (malformed)

    def __post_init__(self) -> None:
        if min(self.interval_s, self.timeout_s, self.window_s) <= 0 or self.concurrency < 1:
            raise ValueError("intervals, timeouts and the window must be > 0, concurrency >= 1")


@dataclass(frozen=True, slots=True)
class EngineSample:
    """What one ``/metrics`` answer says. Counters per series (the ``engine`` label)."""

    queries: dict[str, float]
    hits: dict[str, float]
    block_size: int  # 0: not said
    kv_tokens: int  # num_gpu_blocks × block_size over the engines; 0: not said
    kv_usage: float | None = None  # share of the KV cache in use (0..1); None: not said
    waiting: int | None = None  # requests queued in the engine, over its ranks; None: not said
    running: int | None = None  # requests in its running batches, over its ranks


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """A replica's engine as last polled (a snapshot: safe to hand to other tasks)."""

    replica_id: str
    block_size: int
    kv_tokens: int
    queried_tokens: int  # prefix-cache queries since the gateway first polled it
    hit_tokens: int
    hit_ratio: float | None  # Δhits / Δqueries over the window; None: no queries in it
    resets: int  # counter resets seen (engine restarts)
    polled_at: float  # time.monotonic()
    kv_usage: float | None = None  # share of its KV cache in use (0..1); None: not said
    waiting: int | None = None  # its engine's requests waiting, as polled; None: not said
    running: int | None = None  # its engine's requests running, as polled; None: not said


def parse_engine_metrics(text: str) -> EngineSample:
    """The prefix-cache counters, cache config, KV-cache usage and request queues of a
    vLLM ``/metrics`` page (usage: the mean over the engine's DP ranks, whose caches are
    the same size; waiting and running: summed over them). ValueError for a sample of
    those families that cannot be read."""
    queries: dict[str, float] = {}
    hits: dict[str, float] = {}
    usage: dict[str, float] = {}
    queues: dict[str, dict[str, float]] = {WAITING: {}, RUNNING: {}}
    block_size = kv_tokens = 0
    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue
        name, labels, value = parse_sample(line)
        series = labels.get("engine", "")
        if name == QUERIES:
            queries[series] = value
        elif name == HITS:
            hits[series] = value
        elif name == CACHE_INFO:
            size, blocks = _int_label(labels, "block_size"), _int_label(labels, "num_gpu_blocks")
            block_size = block_size or size
            kv_tokens += size * blocks
        elif name == KV_USAGE and math.isfinite(value):
            usage[series] = min(max(value, 0.0), 1.0)
        elif name in queues and math.isfinite(value):
            queues[name][series] = min(max(value, 0.0), _MAX_QUEUE)
    kv_usage = sum(usage.values()) / len(usage) if usage else None
    waiting, running = (_total(queues[name]) for name in (WAITING, RUNNING))
    return EngineSample(queries, hits, block_size, kv_tokens, kv_usage, waiting, running)


def _total(series: dict[str, float]) -> int | None:
    return min(round(sum(series.values())), int(_MAX_QUEUE)) if series else None


def _int_label(labels: dict[str, str], name: str) -> int:
    return int_label(labels, name) or 0  # "None" and the like: not said


class ReuseWindow:
    """Prefix-cache counters of one replica → increments, totals and a windowed ratio."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.queried = 0  # totals of increments
        self.hit = 0
        self.resets = 0
        self._last: dict[tuple[str, str], float] = {}
        self._window: deque[tuple[float, int, int]] = deque()

    def update(self, sample: EngineSample, now: float) -> tuple[int, int]:
        """Fold one poll in; the (queried, hit) tokens since the previous one."""
        queried, reset = self._increment("q", sample.queries)
        hit, hits_reset = self._increment("h", sample.hits)
        self.resets += reset or hits_reset
        self.queried += queried
        self.hit += hit
        self._window.append((now, queried, hit))
        while self._window and self._window[0][0] < now - self.window_s:
            self._window.popleft()
        return queried, hit

    def ratio(self) -> float | None:
        queried = sum(q for _, q, _ in self._window)
        return sum(h for _, _, h in self._window) / queried if queried else None

    def _increment(self, kind: str, values: dict[str, float]) -> tuple[int, bool]:
        """The increments of one counter's series since the last poll, and whether one of
        them was reset."""
        total = 0.0
        reset = False
        for series, value in values.items():
            if not math.isfinite(value) or value < 0:
                continue  # not a counter's value: ignored, the baseline kept
            last = self._last.get((kind, series))
            self._last[(kind, series)] = value
            if last is None:
                continue  # first sight: a baseline, not an increment
            if value < last:
                reset = True
                total += value  # restarted from 0: all of it is new
            else:
                total += value - last
        return int(min(total, _MAX_INCREMENT)), reset


class EnginePoller:
    """Polls READY replicas' ``/metrics``; see the module docstring."""

    def __init__(
        self,
        table: RoutingTable,
        pool: UpstreamPool,
        config: PollerConfig = PollerConfig(),
        *,
        metrics: GatewayMetrics | None = None,
        on_capacity: Callable[[str, int | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.polls: Counter[str] = Counter()  # outcome → count
        self._table = table
        self._pool = pool
        self._metrics = metrics
        self._on_capacity = on_capacity
        self._clock = clock
        self._windows: dict[str, ReuseWindow] = {}
        self._facts: dict[str, EngineFacts] = {}
        self._capacity: dict[str, int] = {}

    def facts(self, replica_id: str) -> EngineFacts | None:
        return self._facts.get(replica_id)

    def block_size(self, replica_id: str) -> int:
        """``replica_id``'s tokens per block as its engine last said (0: unknown)."""
        facts = self._facts.get(replica_id)
        return facts.block_size if facts is not None else 0

    async def run(self) -> None:
        """Poll every ``interval_s`` (the first round one interval after the start) until
        cancelled."""
        delay = self.config.interval_s
        while True:
            await asyncio.sleep(delay)
            started = self._clock()
            await self.poll_once()
            delay = max(0.0, self.config.interval_s - (self._clock() - started))

    async def poll_once(self) -> None:
        """One round over the READY replicas (at most ``concurrency`` at once)."""
        targets = [t for t in self._table.targets() if t.ready]
        self._forget_gone({t.replica_id for t in targets})
        gate = asyncio.Semaphore(self.config.concurrency)

        async def one(target: Target) -> None:
            async with gate:
                await self._poll(target)

        async with asyncio.TaskGroup() as group:
            for target in targets:
                group.create_task(one(target))

    async def _poll(self, target: Target) -> None:
        outcome = await self._fetch(target)
        if isinstance(outcome, str):
            self.polls[outcome] += 1
            log.debug("engine poll of %s: %s", target.replica_id, outcome)
            return
        self.polls["ok"] += 1
        self._fold(target.replica_id, outcome)

    async def _fetch(self, target: Target) -> EngineSample | str:
        try:
            async with asyncio.timeout(self.config.timeout_s):
                status, body = await fetch(
                    self._pool,
                    target.url,
                    b"GET",
                    b"/metrics",
                    api_key=target.api_key,
                    limit=self.config.max_bytes,
                )
        except TimeoutError:
            return "timeout"
        except UpstreamError as exc:
            return failure_reason(exc)
        if status != 200:
            return "status"
        try:
            return parse_engine_metrics(body.decode("utf-8", "replace"))
        except ValueError:
            return "malformed"

    def _fold(self, replica_id: str, sample: EngineSample) -> None:
        now = self._clock()
        window = self._windows.get(replica_id)
        if window is None:
            window = self._windows[replica_id] = ReuseWindow(self.config.window_s)
        queried, hit = window.update(sample, now)
        if self._metrics is not None and (queried or hit):
            self._metrics.delivered(queried, hit)
        self._facts[replica_id] = EngineFacts(
            replica_id,
            sample.block_size,
            sample.kv_tokens,
            window.queried,
            window.hit,
            window.ratio(),
            window.resets,
            now,
            sample.kv_usage,
            sample.waiting,
            sample.running,
        )
        if sample.kv_tokens:  # every poll: what it means in characters is learned meanwhile
            self._capacity[replica_id] = sample.kv_tokens
            if self._on_capacity is not None:
                self._on_capacity(replica_id, sample.kv_tokens)

    def _forget_gone(self, ready: set[str]) -> None:
        for replica_id in [r for r in self._windows if r not in ready]:
            del self._windows[replica_id]
            self._facts.pop(replica_id, None)
            if self._capacity.pop(replica_id, None) is not None and self._on_capacity:
                self._on_capacity(replica_id, None)

    def lines(self) -> Iterable[str]:
        """The poller's metric families (a ``GatewayMetrics`` collector)."""
        out: list[str] = []
        for name, help_, attr in (
            (
                "llmgw_engine_prefix_cache_queries_total",
                "Prompt tokens an engine looked up in its prefix cache, as polled "
                "(since the gateway first polled it; engine restarts counted through).",
                "queried_tokens",
            ),
            (
                "llmgw_engine_prefix_cache_hits_total",
                "Prompt tokens an engine found in its prefix cache, as polled.",
                "hit_tokens",
            ),
        ):
            totals = {r: getattr(f, attr) for r, f in self._facts.items()}
            labelled(out, name, "counter", help_, "replica", totals)
        capacity = {r: f.kv_tokens for r, f in self._facts.items() if f.kv_tokens}
        labelled(
            out,
            "llmgw_engine_kv_capacity_tokens",
            "gauge",
            "An engine's KV cache in tokens (num_gpu_blocks x block_size).",
            "replica",
            capacity,
        )
        labelled(
            out,
            "llmgw_engine_polls_total",
            "counter",
            "Polls of engines' /metrics, by outcome.",
            "outcome",
            dict(self.polls),
        )
        return out
