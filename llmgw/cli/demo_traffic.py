"""The demo's traffic and its summary: chat completions through the gateway at a Poisson rate
(the arrivals and prompts of `llmgw.sim.workload`), and the lines printed at the demo's end
from what it counted and what the gateway's ``/metrics`` said. Nothing here starts a process.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any, Final

import httpx

from llmgw.promtext import metric_samples
from llmgw.sim.workload import DEMO_PROMPTS, Arrivals, chat_body

__all__ = [
    "MODELS",
    "DemoSummary",
    "Workload",
    "WorkloadConfig",
    "WorkloadCounts",
    "decisions_by_tier",
    "metric_sum",
    "render_summary",
]

log = logging.getLogger("llmgw.cli.demo")  # the demo's records, wherever they are made

MODELS: Final = ("chat", "small", "tiny")  # the demo's deployments, by served model
MODEL_WEIGHTS: Final = (0.6, 0.25, 0.15)  # the workload's share of requests per model


# --- the workload --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """The background traffic; seconds and requests per second, all explicit."""

    rate: float = 3.0  # mean requests per second (Poisson arrivals)
    max_in_flight: int = 16  # beyond this, arrivals are skipped, not queued
    max_tokens: int = 16
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 30.0


@dataclass(frozen=True, slots=True)
class WorkloadCounts:
    """Requests sent; answered 200, failed (an error status or no answer), or cut at stop."""

    sent: int = 0
    ok: int = 0
    failed: int = 0
    unfinished: int = 0


class Workload:
    """Chat completions through the gateway until ``stop`` is set; reproducible from a seed."""

    def __init__(
        self,
        gateway: str,
        config: WorkloadConfig | None = None,
        *,
        seed: int = 0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._gateway = gateway
        self._config = config or WorkloadConfig()
        self._rng = random.Random(seed)
        self._transport = transport
        self._counts = {"sent": 0, "ok": 0, "failed": 0, "unfinished": 0}
        self.first_error = ""

    def counts(self) -> WorkloadCounts:
        return WorkloadCounts(**self._counts)

    def body(self) -> dict[str, Any]:
        """The next request: a model by weight, a shared system prompt, a short question."""
        body = chat_body(self._rng, DEMO_PROMPTS, MODELS, MODEL_WEIGHTS)
        return {**body, "max_tokens": self._config.max_tokens}

    async def run(self, stop: asyncio.Event) -> None:
        """Send until ``stop`` is set; requests still in flight then are cancelled."""
        config = self._config
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        client = httpx.AsyncClient(
            base_url=self._gateway, timeout=timeout, transport=self._transport
        )
        arrivals = Arrivals(config.rate, config.max_in_flight, self._rng)
        async with client, asyncio.TaskGroup() as tasks:
            await arrivals.run(stop, lambda: tasks.create_task(self._one(client, self.body())))
            for task in arrivals.pending:
                task.cancel()

    async def _one(self, client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        self._counts["sent"] += 1
        try:
            response = await client.post("/v1/chat/completions", json=body)
        except asyncio.CancelledError:
            self._counts["unfinished"] += 1
            raise
        except httpx.HTTPError as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
            return
        if response.status_code == 200:
            self._counts["ok"] += 1
        else:
            self._failed(f"HTTP {response.status_code}: {response.text[:200]}")

    def _failed(self, why: str) -> None:
        self._counts["failed"] += 1
        if not self.first_error:
            self.first_error = why
        log.debug("demo workload: a request failed: %s", why)


# --- the summary (pure) --------------------------------------------------------------------


def decisions_by_tier(gateway_metrics: str) -> tuple[tuple[str, int, int], ...]:
    """(tier, decisions, of which hits) from ``llmgw_prefix_decisions_total``, by tier."""
    totals: dict[str, list[int]] = {}
    for labels, value in metric_samples(gateway_metrics, "llmgw_prefix_decisions_total"):
        tier = totals.setdefault(labels.get("tier", "?"), [0, 0])
        tier[0] += int(value)
        if labels.get("outcome") == "hit":
            tier[1] += int(value)
    return tuple((t, n, hits) for t, (n, hits) in sorted(totals.items()))


def metric_sum(text: str, name: str) -> float:
    return sum(value for _, value in metric_samples(text, name))


@dataclass(frozen=True, slots=True)
class DemoSummary:
    """What the demo did, for the lines printed at its end."""

    seconds: float
    replicas_ready: int
    replicas_total: int
    requests: WorkloadCounts
    first_error: str = ""
    decisions: tuple[tuple[str, int, int], ...] = ()  # (tier, decisions, hits)
    prefix_hit_tokens: float = 0.0
    prefix_query_tokens: float = 0.0
    unavailable: tuple[str, ...] = ()  # what could not be read, in words


def render_summary(summary: DemoSummary) -> str:
    r = summary.requests
    rows = [
        ("replicas READY", f"{summary.replicas_ready}/{summary.replicas_total}"),
        (
            "requests",
            f"{r.sent} sent in {summary.seconds:.0f}s: {r.ok} ok, {r.failed} failed"
            + (f", {r.unfinished} cut at stop" if r.unfinished else ""),
        ),  # fmt: skip
        (
            "decisions by tier",
            ", ".join(f"{t} {n} ({h} hits)" for t, n, h in summary.decisions) or "none reported",
        ),  # fmt: skip
        ("prefix cache", _hit_rate(summary)),
    ]
    if summary.first_error:
        rows.append(("first failure", summary.first_error))
    rows.extend(("not read", what) for what in summary.unavailable)
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _hit_rate(summary: DemoSummary) -> str:
    if summary.prefix_query_tokens <= 0:
        return "no prompt tokens queried yet"
    rate = summary.prefix_hit_tokens / summary.prefix_query_tokens
    return (
        f"hit rate {rate:.0%} ({summary.prefix_hit_tokens:.0f} of "
        f"{summary.prefix_query_tokens:.0f} prompt tokens from cache, READY engines)"
    )
