"""The gateway's Prometheus metrics, kept in plain counters and written as text exposition.

Our own few lines instead of ``prometheus_client``: the hot path pays a dict increment per
counter and a ``bisect`` per histogram observation, and ``/metrics`` writes text format
0.0.4 (``# HELP``/``# TYPE`` per family, histograms as cumulative ``_bucket{le=…}`` with
``+Inf``, ``_sum`` and ``_count``). Label cardinality stays bounded: tiers × outcomes,
status codes, the models of the routing table, the replicas of the routing table.

Families::

    llmgw_requests_total{status}                      OpenAI requests answered, by HTTP status
                                                      ("499": the client went away first,
                                                      "502": the replica broke off mid-response)
    llmgw_prefix_decisions_total{tier,outcome}        routing decisions by tier and outcome
    llmgw_router_decision_seconds                     time in the policy per decision
    llmgw_upstream_ttft_seconds{model}                request sent → first body byte (streams)
    llmgw_upstream_latency_seconds{model}             request sent → response ended
    llmgw_upstream_failures_total{reason}             attempts given up before a first byte
                                                      (connect, closed, status, protocol)
    llmgw_replica_in_flight{replica}                  requests in flight per replica
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
DECISION_BUCKETS: tuple[float, ...] = (
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1,
)  # fmt: skip


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


class GatewayMetrics:
    """Everything ``/metrics`` shows; updated by the gateway on its one event loop."""

    def __init__(self) -> None:
        self.requests: dict[int, int] = {}
        self.decisions: dict[tuple[str, str], int] = {}
        self.failures: dict[str, int] = {}
        self.decision_seconds = Histogram(DECISION_BUCKETS)
        self.ttft: dict[str, Histogram] = {}
        self.latency: dict[str, Histogram] = {}

    def request_done(self, status: int) -> None:
        self.requests[status] = self.requests.get(status, 0) + 1

    def decided(self, tier: str, outcome: str, seconds: float) -> None:
        key = (tier, outcome)
        self.decisions[key] = self.decisions.get(key, 0) + 1
        self.decision_seconds.observe(seconds)

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

    def render(self, in_flight: Mapping[str, int]) -> bytes:
        """The text exposition; ``in_flight`` is requests in flight by replica id."""
        out: list[str] = []
        _family(out, "llmgw_requests_total", "counter", "OpenAI requests answered, by status.")
        out.extend(
            f'llmgw_requests_total{{status="{status}"}} {count}'
            for status, count in sorted(self.requests.items())
        )
        self._render_decisions(out)
        _family(
            out,
            "llmgw_upstream_failures_total",
            "counter",
            "Upstream attempts given up before a first byte (then retried if a replica is left).",
        )
        out.extend(
            f"llmgw_upstream_failures_total{{reason={_quote(reason)}}} {count}"
            for reason, count in sorted(self.failures.items())
        )
        self._render_upstream(out)
        _family(out, "llmgw_replica_in_flight", "gauge", "Requests in flight per replica.")
        out.extend(
            f"llmgw_replica_in_flight{{replica={_quote(replica)}}} {count}"
            for replica, count in sorted(in_flight.items())
        )
        out.append("")
        return "\n".join(out).encode()

    def _render_decisions(self, out: list[str]) -> None:
        _family(
            out,
            "llmgw_prefix_decisions_total",
            "counter",
            "Routing decisions by tier and outcome.",
        )
        out.extend(
            f"llmgw_prefix_decisions_total{{tier={_quote(tier)},outcome={_quote(outcome)}}} {n}"
            for (tier, outcome), n in sorted(self.decisions.items())
        )
        _family(
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
            _family(out, name, "histogram", help_)
            for model, histogram in sorted(by_model.items()):
                out.extend(histogram.lines(name, f"model={_quote(model)},"))


def _family(out: list[str], name: str, kind: str, help_: str) -> None:
    out.append(f"# HELP {name} {help_}")
    out.append(f"# TYPE {name} {kind}")


def _quote(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _number(value: float) -> str:
    return repr(float(value))  # "0.005", "1.0", "5e-06", "inf": all valid sample values


__all__ = ["CONTENT_TYPE", "DECISION_BUCKETS", "LATENCY_BUCKETS", "GatewayMetrics", "Histogram"]
