"""The gateway's Prometheus metrics, kept in plain counters and written as text exposition.

Our own few lines instead of ``prometheus_client``: the hot path pays a dict increment per
counter and a ``bisect`` per histogram observation, and ``/metrics`` writes text format
0.0.4 with ``llmgw.promtext`` (``# HELP``/``# TYPE`` per family, histograms as cumulative
``_bucket{le=…}`` with ``+Inf``, ``_sum`` and ``_count``). Label cardinality stays bounded:
tiers × outcomes, status codes, the two OpenAI routes, the models of the routing table
(any other model a client names counts as "unknown"), the replicas of the routing table.

Families::

    llmgw_requests_total{model,route,status}          OpenAI requests answered: the model as
                                                      asked when a replica serves it, else
                                                      "unknown"; the path (/v1/completions,
                                                      /v1/chat/completions; "unknown" when
                                                      refused before it was read); the HTTP
                                                      status ("499": the client went away
                                                      first, "502": the replica broke off
                                                      mid-response)
    llmgw_prefix_decisions_total{tier,outcome}        routing decisions by tier and outcome
    llmgw_router_decision_seconds                     time in the policy per decision
    llmgw_upstream_ttft_seconds{model}                request sent → first body byte (streams)
    llmgw_upstream_latency_seconds{model}             request sent → response ended
    llmgw_upstream_failures_total{reason}             attempts given up before a first byte
                                                      (connect, closed, status, protocol)
    llmgw_replica_in_flight{replica}                  requests in flight per replica
    llmgw_held_requests{model}                        requests held now (holding.py)
    llmgw_held_requests_total{model,outcome}          held requests by how they ended

The precise tier (precise.py, tokenize.py, engines.py)::

    llmgw_precise_fallbacks_total{reason}             requests the approximate tier decided
                                                      instead, by why (precise.py docstring)
    llmgw_precise_seconds                             the precise tier's own work per request:
                                                      block keys + index match + scoring
    llmgw_tokenize_seconds                            /tokenize calls (answer cache misses)
    llmgw_tokenize_failures_total{reason}             timeout, connect, closed, protocol,
                                                      status, malformed
    llmgw_reuse_tokens_total{stage}                   prompt tokens reusable from KV caches:
                                                      "available" (the best candidate's leading
                                                      blocks), "captured" (the chosen one's),
                                                      "delivered" (engines' own prefix hits)
    llmgw_reuse_prompt_tokens_total{source}           what those are out of: "router" (prompt
                                                      tokens of precise decisions; available
                                                      and captured), "engine" (the engines'
                                                      prefix-cache queries; delivered)
    llmgw_engine_prefix_cache_{queries,hits}_total{replica}
                                                      an engine's own prefix-cache queries and
                                                      hits (tokens) as polled, since the
                                                      gateway first polled it (engine restarts
                                                      counted through); the hit rate is
                                                      rate(hits) / rate(queries)
    llmgw_engine_kv_capacity_tokens{replica}          num_gpu_blocks × block_size, as polled
    llmgw_engine_polls_total{outcome}                 /metrics polls: ok, timeout, connect,
                                                      closed, protocol, status, malformed
    llmgw_kv_index_{replicas,keys,blocks}             the KV index's size (gauges)
    llmgw_kv_index_replica_blocks{replica}            blocks indexed per replica (those of the
                                                      routing table with KV events; 0 after a
                                                      reset)
    llmgw_kv_index_{resets,refused,stored,removed}_total
    llmgw_kv_index_event_lag_seconds                  an engine's event → the index
                                                      (histogram, EVENT_LAG_BUCKETS)
    llmgw_kv_index_event_lag_max_seconds              the longest of those

Shares are ratios of two counters' rates, e.g. captured / available =
``rate(llmgw_reuse_tokens_total{stage="captured"}[5m]) /
rate(llmgw_reuse_tokens_total{stage="available"}[5m])``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from llmgw import promtext
from llmgw.gateway.routing.kvindex import EVENT_LAG_BUCKETS, KvIndexStats
from llmgw.promtext import family, quote_label

CONTENT_TYPE = promtext.CONTENT_TYPE.encode()

LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
DECISION_BUCKETS: tuple[float, ...] = (
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1,
)  # fmt: skip
TOKENIZE_BUCKETS: tuple[float, ...] = (
    2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip

UNKNOWN_LABEL = "unknown"
"""The ``model`` of a request for a model no replica serves (or unread), and the ``route``
of one refused before its path was read: labels stay bounded whatever clients send."""

Collector = Callable[[], Iterable[str]]
"""Lines (families with HELP and TYPE) read at each render: gauges of other objects."""


class Histogram:
    """Counts per bucket (upper bounds, ``le``), a sum and a count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> Iterable[str]:
        """Sample lines; ``labels`` is ``""`` or ``'a="b",'`` (rendered label pairs + comma)."""
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            yield f'{name}_bucket{{{labels}le="{_number(bound)}"}} {running}'
        yield f'{name}_bucket{{{labels}le="+Inf"}} {self.count}'
        braces = f"{{{labels.rstrip(',')}}}" if labels else ""
        yield f"{name}_sum{braces} {_number(self.sum)}"
        yield f"{name}_count{braces} {self.count}"


@dataclass(frozen=True, slots=True)
class MetricFigures:
    """The gateway's counters at one instant (copies: safe to hand to other tasks).

    Every figure is cumulative since the gateway started; ``routed`` counts the decisions
    that chose each replica (only those the gateway reported with a replica id).
    """

    decisions: Mapping[tuple[str, str], int]  # (tier, outcome) → decisions
    requests: Mapping[int, int]  # HTTP status → requests answered
    reuse: Mapping[str, int]  # stage (available, captured, delivered) → tokens
    reuse_prompt: Mapping[str, int]  # source (router, engine) → prompt tokens
    routed: Mapping[str, int]  # replica id → decisions that chose it


class GatewayMetrics:
    """Everything ``/metrics`` shows; updated by the gateway on its one event loop."""

    def __init__(self) -> None:
        self.requests: dict[int, int] = {}  # by status (GetRouterStats)
        self.requests_by: dict[tuple[str, str, int], int] = {}  # (model, route, status)
        self.decisions: dict[tuple[str, str], int] = {}
        self.failures: dict[str, int] = {}
        self.decision_seconds = Histogram(DECISION_BUCKETS)
        self.ttft: dict[str, Histogram] = {}
        self.latency: dict[str, Histogram] = {}
        self.precise_fallbacks: dict[str, int] = {}
        self.precise_seconds = Histogram(DECISION_BUCKETS)
        self.tokenize_seconds = Histogram(TOKENIZE_BUCKETS)
        self.tokenize_failures: dict[str, int] = {}
        self.reuse = {"available": 0, "captured": 0, "delivered": 0}
        self.reuse_prompt = {"router": 0, "engine": 0}
        self.routed: dict[str, int] = {}
        self._collectors: list[Collector] = []

    def add_collector(self, collector: Collector) -> None:
        """Render ``collector``'s lines at the end of every exposition."""
        self._collectors.append(collector)

    def request_done(
        self, status: int, model: str = UNKNOWN_LABEL, route: str = UNKNOWN_LABEL
    ) -> None:
        """One OpenAI request answered: ``model`` as the gateway labels it (a model it
        serves, else ``UNKNOWN_LABEL``), ``route`` its path (``UNKNOWN_LABEL`` when refused
        before the gateway read it)."""
        self.requests[status] = self.requests.get(status, 0) + 1
        key = (model, route, status)
        self.requests_by[key] = self.requests_by.get(key, 0) + 1

    def decided(self, tier: str, outcome: str, seconds: float, replica_id: str = "") -> None:
        """One routing decision; ``replica_id`` (when given) is the replica it chose."""
        key = (tier, outcome)
        self.decisions[key] = self.decisions.get(key, 0) + 1
        self.decision_seconds.observe(seconds)
        if replica_id:
            self.routed[replica_id] = self.routed.get(replica_id, 0) + 1

    def forget_replica(self, replica_id: str) -> None:
        """Drop a replica that left the routing table from ``routed`` (bounded labels)."""
        self.routed.pop(replica_id, None)

    def figures(self) -> MetricFigures:
        """A frozen copy of the counters (``GetRouterStats`` reads these)."""
        return MetricFigures(
            decisions=MappingProxyType(dict(self.decisions)),
            requests=MappingProxyType(dict(self.requests)),
            reuse=MappingProxyType(dict(self.reuse)),
            reuse_prompt=MappingProxyType(dict(self.reuse_prompt)),
            routed=MappingProxyType(dict(self.routed)),
        )

    def upstream_failed(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1

    def first_byte(self, model: str, seconds: float) -> None:
        histogram = self.ttft.get(model)
        if histogram is None:
            histogram = self.ttft[model] = Histogram(LATENCY_BUCKETS)
        histogram.observe(seconds)

    def finished(self, model: str, seconds: float) -> None:
        histogram = self.latency.get(model)
        if histogram is None:
            histogram = self.latency[model] = Histogram(LATENCY_BUCKETS)
        histogram.observe(seconds)

    def precise_fallback(self, reason: str) -> None:
        self.precise_fallbacks[reason] = self.precise_fallbacks.get(reason, 0) + 1

    def precise_decided(
        self, prompt_tokens: int, available: int, captured: int, seconds: float
    ) -> None:
        """One precise decision: its prompt, the reuse on offer and taken, its own cost."""
        self.reuse_prompt["router"] += prompt_tokens
        self.reuse["available"] += available
        self.reuse["captured"] += captured
        self.precise_seconds.observe(seconds)

    def tokenized(self, seconds: float, failure: str = "") -> None:
        """One /tokenize call (``failure`` "" when it gave tokens)."""
        self.tokenize_seconds.observe(seconds)
        if failure:
            self.tokenize_failures[failure] = self.tokenize_failures.get(failure, 0) + 1

    def delivered(self, queried_tokens: int, hit_tokens: int) -> None:
        """Prefix-cache queries and hits an engine counted since its last poll."""
        self.reuse_prompt["engine"] += queried_tokens
        self.reuse["delivered"] += hit_tokens

    def render(self, in_flight: Mapping[str, int]) -> bytes:
        """The text exposition; ``in_flight`` is requests in flight by replica id."""
        out: list[str] = []
        family(
            out,
            "llmgw_requests_total",
            "counter",
            "OpenAI requests answered, by model, route and status.",
        )
        out.extend(
            f"llmgw_requests_total{{model={quote_label(model)},route={quote_label(route)},"
            f'status="{status}"}} {count}'
            for (model, route, status), count in sorted(self.requests_by.items())
        )
        self._render_decisions(out)
        family(
            out,
            "llmgw_upstream_failures_total",
            "counter",
            "Upstream attempts given up before a first byte (then retried if a replica is left).",
        )
        out.extend(
            f"llmgw_upstream_failures_total{{reason={quote_label(reason)}}} {count}"
            for reason, count in sorted(self.failures.items())
        )
        self._render_upstream(out)
        family(out, "llmgw_replica_in_flight", "gauge", "Requests in flight per replica.")
        out.extend(
            f"llmgw_replica_in_flight{{replica={quote_label(replica)}}} {count}"
            for replica, count in sorted(in_flight.items())
        )
        self._render_precise(out)
        for collector in self._collectors:
            out.extend(collector())
        out.append("")
        return "\n".join(out).encode()

    def _render_decisions(self, out: list[str]) -> None:
        family(
            out,
            "llmgw_prefix_decisions_total",
            "counter",
            "Routing decisions by tier and outcome.",
        )
        out.extend(
            f"llmgw_prefix_decisions_total"
            f"{{tier={quote_label(tier)},outcome={quote_label(outcome)}}} {n}"
            for (tier, outcome), n in sorted(self.decisions.items())
        )
        family(
            out,
            "llmgw_router_decision_seconds",
            "histogram",
            "Time the routing policy took per decision.",
        )
        out.extend(self.decision_seconds.lines("llmgw_router_decision_seconds", ""))

    def _render_upstream(self, out: list[str]) -> None:
        for name, help_, by_model in (
            (
                "llmgw_upstream_ttft_seconds",
                "Streaming requests: request sent upstream to first body byte, by model.",
                self.ttft,
            ),
            (
                "llmgw_upstream_latency_seconds",
                "Request sent upstream to response ended, by model.",
                self.latency,
            ),
        ):
            family(out, name, "histogram", help_)
            for model, histogram in sorted(by_model.items()):
                out.extend(histogram.lines(name, f"model={quote_label(model)},"))

    def _render_precise(self, out: list[str]) -> None:
        labelled(
            out,
            "llmgw_precise_fallbacks_total",
            "counter",
            "Requests the approximate tier decided because the precise tier could not.",
            "reason",
            self.precise_fallbacks,
        )
        family(
            out,
            "llmgw_precise_seconds",
            "histogram",
            "The precise tier's own work per request: block keys, index match, scoring.",
        )
        out.extend(self.precise_seconds.lines("llmgw_precise_seconds", ""))
        family(out, "llmgw_tokenize_seconds", "histogram", "Calls to a replica's /tokenize.")
        out.extend(self.tokenize_seconds.lines("llmgw_tokenize_seconds", ""))
        labelled(
            out,
            "llmgw_tokenize_failures_total",
            "counter",
            "Calls to /tokenize that gave no tokens, by reason.",
            "reason",
            self.tokenize_failures,
        )
        labelled(
            out,
            "llmgw_reuse_tokens_total",
            "counter",
            "Prompt tokens reusable from KV caches: available (best candidate), "
            "captured (chosen replica), delivered (engines' own prefix-cache hits).",
            "stage",
            self.reuse,
        )
        labelled(
            out,
            "llmgw_reuse_prompt_tokens_total",
            "counter",
            "Prompt tokens the reuse stages are out of: router (precise decisions), "
            "engine (engines' prefix-cache queries).",
            "source",
            self.reuse_prompt,
        )


def kv_index_lines(
    stats: KvIndexStats, replica_blocks: Mapping[str, int] | None = None
) -> list[str]:
    """The KV index's families (the gateway renders them through a collector);
    ``replica_blocks`` (replica id → blocks indexed) adds the per-replica gauge."""
    out: list[str] = []
    for name, help_, value in (
        ("llmgw_kv_index_replicas", "Replicas with at least one block indexed.", stats.replicas),
        ("llmgw_kv_index_keys", "Distinct block keys indexed.", stats.keys),
        ("llmgw_kv_index_blocks", "(replica, block) pairs indexed.", stats.blocks),
    ):
        gauge(out, name, help_, value)
    if replica_blocks is not None:
        labelled(
            out,
            "llmgw_kv_index_replica_blocks",
            "gauge",
            "Blocks indexed per replica with KV events in the routing table.",
            "replica",
            replica_blocks,
        )
    for name, help_, value in (
        ("llmgw_kv_index_resets_total", "Replica resets that dropped blocks.", stats.resets),
        ("llmgw_kv_index_refused_total", "Malformed feed changes refused.", stats.refused),
        ("llmgw_kv_index_stored_total", "(replica, block) pairs added.", stats.stored),
        ("llmgw_kv_index_removed_total", "(replica, block) pairs removed.", stats.removed),
    ):
        family(out, name, "counter", help_)
        out.append(f"{name} {value}")
    lag = "llmgw_kv_index_event_lag_seconds"
    family(out, lag, "histogram", "Time from an engine's KV event to the index.")
    out.extend(_lag_histogram(stats).lines(lag, ""))
    gauge(
        out,
        "llmgw_kv_index_event_lag_max_seconds",
        "The longest time from an engine's KV event to the index.",
        stats.event_lag_max_s,
    )
    return out


def _lag_histogram(stats: KvIndexStats) -> Histogram:
    histogram = Histogram(EVENT_LAG_BUCKETS)
    counts = list(stats.event_lag_counts) or [0] * (len(EVENT_LAG_BUCKETS) + 1)
    histogram.counts, histogram.sum, histogram.count = counts, stats.event_lag_sum_s, sum(counts)
    return histogram


def labelled(
    out: list[str], name: str, kind: str, help_: str, label: str, values: Mapping[str, float]
) -> None:
    """One family with one label: HELP, TYPE and a sample per value, sorted by label."""
    family(out, name, kind, help_)
    out.extend(
        f"{name}{{{label}={quote_label(key)}}} {_value(v)}" for key, v in sorted(values.items())
    )


def gauge(out: list[str], name: str, help_: str, value: float) -> None:
    """One unlabelled gauge."""
    family(out, name, "gauge", help_)
    out.append(f"{name} {_value(value)}")


def _value(value: float) -> str:
    return str(value) if isinstance(value, int) else _number(value)


def _number(value: float) -> str:
    return repr(float(value))  # "0.005", "1.0", "5e-06", "inf": all valid sample values


__all__ = [
    "CONTENT_TYPE",
    "UNKNOWN_LABEL",
    "DECISION_BUCKETS",
    "LATENCY_BUCKETS",
    "TOKENIZE_BUCKETS",
    "Collector",
    "GatewayMetrics",
    "Histogram",
    "MetricFigures",
    "gauge",
    "kv_index_lines",
    "labelled",
]
