"""bench.gateway's report: per metric the median (min–max) over the reps of each proxy, the
ratios to the peers, the verdicts against the targets, the routing and noise checks."""

from __future__ import annotations

import math
import statistics
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from bench.gwbench.load import Cell, busiest_share, stickiness
from bench.gwbench.profile import Profile, profile_lines
from bench.gwbench.settings import PROXIES, ROUTERS_PYTHON, Settings, family_names
from bench.kit import command_line, machine_facts, package_versions, render_table

Value = Callable[[Cell, "Cell | None"], float]  # (cell, direct's cell of the same rep and kind)


@dataclass(frozen=True, slots=True)
class Metric:
    kind: str
    label: str
    value: Value
    fmt: str


def _added(of: Callable[[Cell], float]) -> Value:
    return lambda c, d: of(c) - of(d) if d is not None else math.nan


def _p(q: float) -> Callable[[Cell], float]:
    return lambda c: c.latency_us(q)


def _first(q: float) -> Callable[[Cell], float]:
    return lambda c: c.first_data_us(q)


def metrics(s: Settings) -> list[Metric]:
    n = s.conns
    return [
        Metric("rps", f"{n} conns: requests/s", lambda c, d: c.rps, ",.0f"),
        Metric("rps", f"{n} conns: proxy CPU µs/request",
               lambda c, d: c.cpu_us_per_request, ",.0f"),
        Metric("rps", f"{n} conns: softirq µs/request on the proxy's core",
               lambda c, d: 1e6 * c.irq_cpu_s / c.requests if c.requests else math.nan, ",.0f"),
        Metric("rps", f"{n} conns: proxy CPU % of its core",
               lambda c, d: 100 * c.proxy_cpu_s / c.window_s, ".0f"),
        Metric("rps", f"{n} conns: client + upstream CPU % of their core",
               lambda c, d: 100 * (c.client_cpu_s + c.upstream_cpu_s) / c.window_s, ".0f"),
        Metric("rps", f"{n} conns: busiest replica's share",
               lambda c, d: busiest_share(c.routes), ".2f"),
        Metric("rps", f"{n} conns: group stickiness", lambda c, d: stickiness(c.routes), ".2f"),
        Metric("lat", "1 conn: latency p50 µs", lambda c, d: c.latency_us(0.5), ",.0f"),
        Metric("lat", "1 conn: latency p99 µs", lambda c, d: c.latency_us(0.99), ",.0f"),
        Metric("lat", "1 conn: added latency p50 µs", _added(_p(0.5)), ",.0f"),
        Metric("lat", "1 conn: added latency p99 µs", _added(_p(0.99)), ",.0f"),
        Metric("lat", "1 conn: proxy CPU µs/request", lambda c, d: c.cpu_us_per_request, ",.0f"),
        Metric("stream", "stream: first data p50 µs", lambda c, d: c.first_data_us(0.5), ",.0f"),
        Metric("stream", "stream: first data p99 µs", lambda c, d: c.first_data_us(0.99), ",.0f"),
        Metric("stream", "stream: added first data p50 µs", _added(_first(0.5)), ",.0f"),
        Metric("stream", "stream: added first data p99 µs", _added(_first(0.99)), ",.0f"),
        Metric("stream", "stream: whole stream p50 µs", lambda c, d: c.latency_us(0.5), ",.0f"),
        Metric("stream", "stream: proxy CPU µs/request", lambda c, d: c.cpu_us_per_request, ",.0f"),
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Summary:
    metric: Metric
    values: Mapping[str, list[float]]  # proxy name → one value per rep

    def median(self, proxy: str) -> float:
        values = [v for v in self.values.get(proxy, []) if not math.isnan(v)]
        return statistics.median(values) if values else math.nan

    def cell(self, proxy: str) -> str:
        values = [v for v in self.values.get(proxy, []) if not math.isnan(v)]
        if not values:
            return "–"
        spec = self.metric.fmt
        text = format(self.median(proxy), spec)
        low, high = format(min(values), spec), format(max(values), spec)
        return text + (f" ({low}–{high})" if low != high else "")

    def ratio(self, a: str, b: str) -> float:
        return self.median(a) / self.median(b) if self.median(b) else math.nan


def summarize(cells: Sequence[Cell], s: Settings) -> dict[str, Summary]:
    direct = {(c.kind, c.rep): c for c in cells if c.proxy == "direct"}
    out = {}
    for m in metrics(s):
        values: dict[str, list[float]] = {}
        for c in cells:
            if c.kind == m.kind:
                values.setdefault(c.proxy, []).append(m.value(c, direct.get((c.kind, c.rep))))
        out[m.label] = Summary(m, values)
    return out


def _ratio_text(r: float) -> str:
    return "–" if math.isnan(r) else f"{r:.2f}×"


def table(summaries: Mapping[str, Summary], family: str, markdown: bool) -> str:
    ours, vllm, sglang = family_names(family)
    columns = ["metric", "direct", ours, vllm, sglang, "llmgw ÷ vllm", "llmgw ÷ sglang"]
    rows = [
        [label, s.cell("direct"), s.cell(ours), s.cell(vllm), s.cell(sglang),
         _ratio_text(s.ratio(ours, vllm)), _ratio_text(s.ratio(ours, sglang))]
        for label, s in summaries.items()
    ]  # fmt: skip
    return render_table(columns, rows, markdown)


TARGET_RR: Final = 1.5  # our CPU per request at most this × vllm-router's, round-robin
TARGET_FIRST_DATA_US: Final = 1000.0  # first streamed byte at most this much after direct's
TARGET_KEYED: Final = 1.10  # CPU per request with a keyed tenant at most this × without


def verdicts(summaries: Mapping[str, Summary], s: Settings) -> list[str]:
    cpu = summaries[f"{s.conns} conns: proxy CPU µs/request"]
    added = summaries["stream: added first data p50 µs"]
    rr, vr, sr = family_names("round_robin")
    px, vc, sc = family_names("prefix")
    out = []

    def mark(value: float, ok: bool) -> str:
        return "NOT MEASURED" if math.isnan(value) else "MET" if ok else "MISSED"

    r = cpu.ratio(rr, vr)
    out.append(
        f"{mark(r, r <= TARGET_RR)}: CPU per request, round-robin: llmgw "
        f"{cpu.median(rr):,.0f} µs vs vllm-router {cpu.median(vr):,.0f} µs = {r:.2f}× "
        f"(target ≤ {TARGET_RR}×; sglang-router {cpu.median(sr):,.0f} µs)."
    )
    r = cpu.ratio(px, vc)
    out.append(
        f"{mark(r, r < 1.0)}: CPU per request, prefix tree on: llmgw prefix "
        f"{cpu.median(px):,.0f} µs vs vllm-router cache_aware {cpu.median(vc):,.0f} µs = "
        f"{r:.2f}× (target < 1×; sglang-router cache_aware {cpu.median(sc):,.0f} µs)."
    )
    for name in (rr, px):
        a = added.median(name)
        out.append(
            f"{mark(a, a <= TARGET_FIRST_DATA_US)}: first streamed byte, {name}: {a:,.0f} µs after "
            f"direct's (target ≤ {TARGET_FIRST_DATA_US:,.0f} µs; vllm-router "
            f"{added.median(vr):,.0f} µs, sglang-router {added.median(sr):,.0f} µs)."
        )
    out += keyed_verdicts(summaries, s)
    return out


def keyed_verdicts(summaries: Mapping[str, Summary], s: Settings) -> list[str]:
    """A tenant's key and limits checked on every request against the same gateway
    without them (issue #18): CPU per request, at most TARGET_KEYED × (unmeasured without
    the keyed proxy)."""
    keyed = next((p.name for p in PROXIES if p.keyed), "")
    plain, _, _ = family_names("prefix")
    out = []
    for label in (f"{s.conns} conns: proxy CPU µs/request", "stream: proxy CPU µs/request"):
        summary = summaries[label]
        r = summary.ratio(keyed, plain)
        if math.isnan(r):
            continue
        mark = "MET" if r <= TARGET_KEYED else "MISSED"
        out.append(
            f"{mark}: {label} with a keyed tenant, its limits on: {summary.median(keyed):,.0f} "
            f"µs against {summary.median(plain):,.0f} µs without, {r:.2f}× (target ≤ "
            f"{TARGET_KEYED:.2f}×)."
        )
    return out


def routing_line(summaries: Mapping[str, Summary], s: Settings) -> str:
    busiest = summaries[f"{s.conns} conns: busiest replica's share"]
    sticky = summaries[f"{s.conns} conns: group stickiness"]
    rr = [p.name for p in PROXIES if p.family == "round_robin"]
    px = [p.name for p in PROXIES if p.family == "prefix"]
    return (
        f"Routing check ({s.replicas} replicas, {s.groups} groups; an even spread puts "
        f"{1 / s.replicas:.2f} of the requests on the busiest replica): round-robin busiest "
        "share " + ", ".join(f"{n} {busiest.median(n):.2f}" for n in rr) + "; prefix policies' "
        "group stickiness (1.00: every group's requests on one replica) "
        + ", ".join(f"{n} {sticky.median(n):.2f}" for n in px)
        + "."
    )


def _others_line(cells: Sequence[Cell], s: Settings) -> str:
    def span(cells: Sequence[Cell]) -> str:
        shares = sorted(100 * c.others_share for c in cells)
        return f"median {statistics.median(shares):.0f}%, at most {shares[-1]:.0f}%"

    rerun = sum(c.attempts > 1 for c in cells)
    return (
        f"Other processes during the kept windows: on CPU {s.proxy_cpu} in the proxies' cells "
        f"{span([c for c in cells if c.proxy != 'direct'])}, on CPU {s.client_cpu} in direct's "
        f"{span([c for c in cells if c.proxy == 'direct'])}; {rerun} of {len(cells)} cells "
        f"were re-run because others used more than {100 * s.max_others:g}% of that CPU."
    )


def settings_line(s: Settings) -> str:
    return (
        f"upstream: {s.replicas} ports in one process (replicas), {s.chunks} SSE events "
        f"{s.token_ms:g} ms apart when streaming, render endpoints answering {s.render}; "
        f"requests: chat completions, {s.groups} groups × {s.users} users, system prompt "
        f"~{s.prefix_chars:,} chars shared per group, question ~{s.question_chars:,} chars; "
        f"proxies pinned to CPU {s.proxy_cpu}, client and upstream to CPU {s.client_cpu}; "
        f"{s.timing.warmup_s:g} s warmup + {s.timing.seconds:g} s per cell, {s.reps} rep(s), "
        "proxies in rotating order; figures are medians (min–max)"
    )


def machine() -> dict[str, str]:
    return machine_facts(_versions())


def _versions() -> str:
    parts = package_versions(("uvloop", "httptools", "aiohttp", "uvicorn"), mark_missing=False)
    if ROUTERS_PYTHON.exists():
        probe = (
            "import importlib.metadata as m; print(m.version('vllm-router'), "
            "m.version('sglang-router'))"
        )
        done = subprocess.run(
            [str(ROUTERS_PYTHON), "-c", probe], capture_output=True, text=True, check=False
        )
        vr, _, sr = done.stdout.strip().partition(" ")
        parts += [f"vllm-router {vr}", f"sglang-router {sr}"]
    return ", ".join(parts)


def render(
    s: Settings,
    facts: Mapping[str, str],
    cells: Sequence[Cell],
    markdown: bool,
    profiles: Sequence[Profile] = (),
) -> str:
    summaries = summarize(cells, s)
    out = []
    if markdown:
        out += ["## Gateway overhead: llmgw vs vllm-router and sglang-router "
                "(bench/gateway.py)", "", "```", command_line(), "```", ""]  # fmt: skip
        out += [f"- {k}: {v}" for k, v in facts.items()] + [f"- settings: {settings_line(s)}"]
    else:
        out += [f"command: {command_line()}"] + [f"{k}: {v}" for k, v in facts.items()]
        out += [f"settings: {settings_line(s)}"]
    for family in ("round_robin", "prefix"):
        out += ["", f"Policy family: {family}", "", table(summaries, family, markdown)]
    out += ["", _others_line(cells, s), "", routing_line(summaries, s), ""]
    out += [("- " if markdown else "") + v for v in verdicts(summaries, s)]
    if profiles:
        out += [
            "",
            "Where our gateway's time goes (py-spy, not pausing it, under the "
            f"{s.conns}-connection load; the innermost Python frame of each sample):",
        ]
        out += ["", "```"] if markdown else [""]
        out += [line for p in profiles for line in profile_lines(p)]
        out += ["```"] if markdown else []
    return "\n".join(out)
