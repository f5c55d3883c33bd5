#!/usr/bin/env python3
"""Benchmark: the gateway's routing policies on a shared-prefix, multi-turn chat workload.

The workload (llm-d's shape: ``--groups`` groups with a long shared system prompt of
``--system-tokens``, ``--users`` users per group in ``--turns``-turn ChatML conversations
of ``--question-tokens`` questions that carry the model's earlier answers, ``--rate``
requests per second offered, ``--think`` seconds between an answer and the next question)
is replayed in simulated time against ``--engines`` simulated engines built from the
simulated engine's block pool, scheduler and timing model, ``--kv-blocks`` blocks each: by
default a third of the groups' system prompts fit in one engine, so no engine holds the
working set. bench/routing_sim.py builds and replays it; figures depend on the seed only.

Per policy (the gateway's own prefix, round_robin, least_load and session, its PRECISE
tier on an index fed by the engines' KV events (bench/routing_sim.py says how), and an
ORACLE that reads every engine's exact cache at decision time and decides with the prefix
policy's own ``prefix_decision``), with in-flight load counted at decision time:

* delivered prefix-hit rate: prefix_cache_hits / prefix_cache_queries summed over the
  engines' own counters (as vLLM counts them, re-admissions after preemption included);
* simulated TTFT p50/p90/p99: arrival to the first token (queueing, prefill of the uncached
  tokens, steps shared with other requests);
* load imbalance: max / mean requests per engine, and their coefficient of variation;
* ratios: default hit rate / oracle hit rate (target >= 0.8) and round-robin TTFT p90 /
  default TTFT p90 (target >= 2); with the precise tier: its hit rate / the
  oracle's (>= 0.95), its TTFT p90 / the oracle's (<= 1.2), and ahead of the approximate
  (default) tier: its hit rate / the default's (>= 1) and its TTFT p90 / the default's
  (<= 1); the exit status is 1 when a measured ratio misses;
* the precise tier's own cost per decision (block keys, index match, scoring: what
  ``llmgw_precise_seconds`` measures in the gateway), wall time on this machine.

The prefix policy is told each engine's KV capacity in characters (its KV tokens × the
workload's characters per prompt token), as a gateway that knows its replicas' KV
capacity tells it (``PrefixPolicy.set_replica_capacity``); ``--kv-hint F`` scales what it
is told, and ``--kv-hint 0`` tells it nothing (its tree then holds up to
``PrefixConfig.max_chars_per_replica`` per engine, sized for real GPUs, not these engines).

Besides, the reuse ceiling: the share of prompt tokens one unbounded cache could serve in
any arrival order, a bound on every policy's cached share. The oracle is an upper
bound but no strict one: it trades cache for load like the prefix policy, and sees only
what engines hold, not requests still queued for them, where the tree records a choice at
once. The JSON also says, per policy, the share the decisions claimed
(``predicted_share``), what the chosen engine really held when it was chosen
(``exact_chosen_share``) and what the best engine held (``exact_best_share``): the gap
between the first two is the approximate tree's staleness, between the last two the cost
of the choice.

The default rate, 12 requests/s, keeps the oracle's engines about half busy while
round-robin, least-load and session are past saturation. At 8 requests/s round-robin
still keeps up; from 10 it falls behind.

    .venv/bin/python -m bench.routing             # 8 engines, 16 × 32 users, 4 turns
    .venv/bin/python -m bench.routing --policies prefix,precise,oracle
    .venv/bin/python -m bench.routing --quick     # a small workload, seconds
    .venv/bin/python -m bench.routing --json      # figures as JSON on stdout
    .venv/bin/python -m bench.routing --markdown  # also a BENCHMARKS.md section
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from bench.kit import base_machine, command_line
from bench.routing_fleet import (
    DEFAULT_POLICY,
    ORACLE,
    POLICY_ORDER,
    PRECISE,
    BenchConfig,
    precise_micro,
)
from bench.routing_sim import Replay, Replayed, Workload, build_workload, kv_chars_told

QUICK: dict[str, Any] = {
    "engines": 4, "groups": 6, "users": 6, "turns": 3, "system_tokens": 1500,
    "question_tokens": 250, "rate": 6.0, "think_s": 2.0,
}  # fmt: skip
HIT_RATIO, TTFT_RATIO = "default_hit_rate_over_oracle", "rr_ttft_p90_over_default"
TARGETS = {HIT_RATIO: 0.8, TTFT_RATIO: 2.0}  # the prefix policy's: lower bounds, both needed
PRECISE_HIT, PRECISE_TTFT = "precise_hit_rate_over_oracle", "precise_ttft_p90_over_oracle"
AHEAD_HIT, AHEAD_TTFT = "precise_hit_rate_over_default", "precise_ttft_p90_over_default"
PRECISE_TARGETS = {PRECISE_HIT: 0.95, AHEAD_HIT: 1.0}  # the precise tier's: lower bounds, when run
CEILINGS = {PRECISE_TTFT: 1.2, AHEAD_TTFT: 1.0}  # the precise tier's: upper bounds, when run
TARGET_LABELS = {
    HIT_RATIO: "default hit rate / oracle hit rate",
    TTFT_RATIO: "round-robin TTFT p90 / default TTFT p90",
    PRECISE_HIT: "precise hit rate / oracle hit rate",
    PRECISE_TTFT: "precise TTFT p90 / oracle TTFT p90",
    AHEAD_HIT: "precise hit rate / default hit rate",
    AHEAD_TTFT: "precise TTFT p90 / default TTFT p90",
}
ALL_POLICIES = (DEFAULT_POLICY, PRECISE, *POLICY_ORDER[1:], ORACLE)  # the command's default
PRECISE_COST_US = 300  # the precise tier's own work per request: its target
MICRO_BLOCK_SIZES = (16, 128)  # vLLM's GPU default and its CPU build's


FLOORS = {**TARGETS, **PRECISE_TARGETS}


def met(key: str, value: float) -> bool:
    """Whether a ratio meets its target (a floor, or a ceiling)."""
    return value <= CEILINGS[key] if key in CEILINGS else value >= FLOORS[key]


def bound(key: str) -> float:
    return CEILINGS[key] if key in CEILINGS else FLOORS[key]


def bound_text(key: str) -> str:
    return f"{'<=' if key in CEILINGS else '>='} {bound(key):g}"


# -- the figures --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """The figures of one policy's replay."""

    policy: str
    requests: int
    hit_rate: float  # Σ prefix_cache_hits / Σ prefix_cache_queries over the engines
    prompt_cached_share: float  # Σ cached prompt tokens / Σ prompt tokens (first admission)
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    imbalance_max_mean: float  # most requests on one engine / mean per engine
    imbalance_cv: float  # coefficient of variation of requests per engine
    utilization_max: float  # busiest engine's busy time / makespan
    utilization_mean: float
    preemptions: int
    makespan_s: float
    per_engine: tuple[int, ...]
    predicted_share: float  # Σ Decision.matched × prompt tokens / Σ prompt tokens
    exact_chosen_share: float  # … the chosen engine's exact cached share at decision time
    exact_best_share: float  # … the best engine's exact cached share at decision time
    decisions: dict[str, int] = field(default_factory=dict)  # "tier/outcome" → count
    precise_cost_us: dict[str, float] = field(default_factory=dict)  # p50, p90, max, mean


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0..1) of ``values``."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered) - 1e-9))
    return ordered[min(rank, len(ordered)) - 1]


def replay(config: BenchConfig, workload: Workload, policy: str) -> PolicyResult:
    """One policy's figures on a fresh fleet."""
    return summarize(Replay(config, workload, policy).run())


def summarize(run: Replayed) -> PolicyResult:
    """The figures of a finished replay, from the engines' own counters."""
    engines, ttfts, tally, makespan_s = run.engines, run.ttfts, run.tally, run.makespan_s
    queries = sum(e.stats.prefix_queries for e in engines)
    prompt = sum(e.stats.prompt_tokens for e in engines)
    per_engine = tuple(e.routed for e in engines)
    mean = statistics.fmean(per_engine)
    busy = [e.busy_s / makespan_s for e in engines]
    return PolicyResult(
        policy=run.policy,
        requests=len(ttfts),
        hit_rate=sum(e.stats.prefix_hits for e in engines) / queries,
        prompt_cached_share=sum(e.stats.cached_prompt_tokens for e in engines) / prompt,
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p90_s=percentile(ttfts, 0.9),
        ttft_p99_s=percentile(ttfts, 0.99),
        ttft_mean_s=statistics.fmean(ttfts),
        imbalance_max_mean=max(per_engine) / mean,
        imbalance_cv=statistics.pstdev(per_engine) / mean,
        utilization_max=max(busy),
        utilization_mean=statistics.fmean(busy),
        preemptions=sum(e.stats.preemptions for e in engines),
        makespan_s=makespan_s,
        per_engine=per_engine,
        predicted_share=tally.predicted / tally.prompt,
        exact_chosen_share=tally.exact_chosen / tally.prompt,
        exact_best_share=tally.exact_best / tally.prompt,
        decisions=dict(sorted(tally.decisions.items())),
        precise_cost_us=_cost_figures(run.precise_costs),
    )


def _cost_figures(costs: Sequence[float]) -> dict[str, float]:
    """Percentiles of the precise tier's cost per decision, in µs (empty: none)."""
    if not costs:
        return {}
    micro = [c * 1e6 for c in costs]
    return {
        "p50": percentile(micro, 0.5),
        "p90": percentile(micro, 0.9),
        "p99": percentile(micro, 0.99),
        "max": max(micro),
        "mean": statistics.fmean(micro),
        "decisions": float(len(micro)),
    }


# -- the report ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkloadFacts:
    requests: int
    prompt_tokens_mean: float
    shared_prefix_tokens: int  # every group's system prompt
    distinct_tokens: int  # every system prompt and every conversation, answers included
    engine_kv_tokens: int
    reuse_ceiling: float  # cached share of prompt tokens with one unbounded cache (bound)
    chars_per_token: float  # of the rendered prompts
    prefix_replica_chars: int  # what the prefix policy's tree may hold per engine

    @staticmethod
    def of(config: BenchConfig, workload: Workload) -> WorkloadFacts:
        prompts = [t.prompt_len for c in workload.conversations for t in c.turns]
        shared = sum(len(g.tokens) for g in workload.groups)
        return WorkloadFacts(
            requests=len(prompts),
            prompt_tokens_mean=statistics.fmean(prompts),
            shared_prefix_tokens=shared,
            distinct_tokens=shared + sum(len(c.tail_tokens) for c in workload.conversations),
            engine_kv_tokens=config.blocks_per_engine * config.block_size,
            reuse_ceiling=sum(reusable_tokens(workload, config.block_size)) / sum(prompts),
            chars_per_token=workload.chars_per_token,
            prefix_replica_chars=_tree_cap(config, workload),
        )


def _tree_cap(config: BenchConfig, workload: Workload) -> int:
    told = kv_chars_told(config, workload)
    cap = told if told is not None else config.prefix.max_chars_per_replica
    return min(cap or config.prefix.max_chars, config.prefix.max_chars)


def reusable_tokens(workload: Workload, block_size: int) -> list[int]:
    """Per request, the most prompt tokens any cache could hold for it, in any order.

    A prompt block can only be found cached if another conversation contains it (then it
    may have run first) or an earlier turn of the same conversation computed it (its
    prompt or answer); whole blocks, at most all but the prompt's last token, as the
    engine's admission looks them up. Any policy's first-admission cached share is at most
    this total over the prompt tokens: a bound that does not depend on the replay.
    """
    holders: Counter[bytes] = Counter()
    for conv in workload.conversations:
        holders.update(set(conv.hashes))
    out: list[int] = []
    for conv in workload.conversations:
        own = 0  # full blocks computed by this conversation's earlier turns
        for turn in conv.turns:
            usable = (turn.prompt_len - 1) // block_size
            shared = 0
            while shared < usable and holders[conv.hashes[shared]] > 1:
                shared += 1
            out.append(max(shared, min(own, usable)) * block_size)
            own = (turn.prompt_len + len(turn.answer)) // block_size
    return out


@dataclass(frozen=True, slots=True)
class Report:
    config: BenchConfig
    facts: WorkloadFacts
    results: tuple[PolicyResult, ...]
    wall_s: float
    # block size → cost figures (µs) of a 6k-token chat continuing a 5k-token turn
    precise_micro: dict[int, dict[str, float]] = field(default_factory=dict)

    def by_name(self, name: str) -> PolicyResult | None:
        return next((r for r in self.results if r.policy == name), None)

    def ratios(self) -> dict[str, float]:
        """The target ratios whose two policies ran."""
        default, oracle = self.by_name(DEFAULT_POLICY), self.by_name(ORACLE)
        rr = self.by_name("round_robin")
        precise = self.by_name(PRECISE)
        ratios = {}
        if default and oracle:
            ratios[HIT_RATIO] = default.hit_rate / oracle.hit_rate
        if default and rr:
            ratios[TTFT_RATIO] = rr.ttft_p90_s / default.ttft_p90_s
        if precise and oracle:
            ratios[PRECISE_HIT] = precise.hit_rate / oracle.hit_rate
            ratios[PRECISE_TTFT] = precise.ttft_p90_s / oracle.ttft_p90_s
        if precise and default:
            ratios[AHEAD_HIT] = precise.hit_rate / default.hit_rate
            ratios[AHEAD_TTFT] = precise.ttft_p90_s / default.ttft_p90_s
        return ratios

    def targets_met(self) -> bool | None:
        """Every measured target met; None when a ratio of ``TARGETS`` was not measured."""
        ratios = self.ratios()
        if any(key not in ratios for key in TARGETS):
            return None
        return not self.missed()

    def missed(self) -> list[str]:
        """The measured ratios that miss their targets."""
        return [key for key, value in self.ratios().items() if not met(key, value)]

    def as_json(self) -> dict[str, Any]:
        return {
            "command": command_line(),
            "machine": base_machine(),
            "config": asdict(self.config) | {"kv_blocks": self.config.blocks_per_engine},
            "workload": asdict(self.facts),
            "results": [asdict(r) for r in self.results],
            "ratios": self.ratios(),
            "targets_met": self.targets_met(),
            "precise_micro_us": self.precise_micro,
            "wall_s": self.wall_s,
        }

    def head(self) -> list[str]:
        c, f = self.config, self.facts
        kv, fleet = f.engine_kv_tokens, f.engine_kv_tokens * c.engines
        return [
            f"workload: {c.groups} groups × {c.users} users × {c.turns} turns = {f.requests:,} "
            f"requests; system prompt {c.system_tokens:,} tokens, question "
            f"{c.question_tokens:,}; mean prompt {f.prompt_tokens_mean:,.0f} tokens; "
            f"{c.rate:g} requests/s offered, think time {c.think_s:g} s (mean), seed {c.seed}",
            f"fleet: {c.engines} engines × {f.engine_kv_tokens:,} KV tokens "
            f"({c.blocks_per_engine:,} blocks of {c.block_size}); the system prompts alone are "
            f"{f.shared_prefix_tokens:,} tokens = {f.shared_prefix_tokens / kv:.1f}× one engine; "
            f"all distinct tokens {f.distinct_tokens:,} = {f.distinct_tokens / fleet:.1f}× "
            f"the fleet; prefill {c.prefill_s_per_token * 1e6:g} µs/token, decode step "
            f"{c.decode_s_per_token * 1e3:g} ms",
            f"reuse ceiling (one unbounded cache, any order): {_pct(f.reuse_ceiling)} of "
            "prompt tokens",
            f"prefix policy: its tree holds at most {f.prefix_replica_chars:,} characters per "
            + (
                f"engine, the KV capacity it is told ({c.kv_hint:g} × {kv:,} tokens × "
                f"{f.chars_per_token:.2f} characters per prompt token)"
                if c.kv_hint > 0
                else "engine (told no KV capacity: PrefixConfig defaults)"
            )
            + f", {c.prefix.max_chars:,} in all",
        ]

    def rows(self) -> list[tuple[str, ...]]:
        return [
            (
                r.policy + (" (default)" if r.policy == DEFAULT_POLICY else ""),
                _pct(r.hit_rate),
                _pct(r.prompt_cached_share),
                _s(r.ttft_p50_s),
                _s(r.ttft_p90_s),
                _s(r.ttft_p99_s),
                f"{r.imbalance_max_mean:.2f}",
                f"{r.imbalance_cv:.2f}",
                f"{_pct(r.utilization_mean)} / {_pct(r.utilization_max)}",
                str(r.preemptions),
            )
            for r in self.results
        ]

    def verdict(self) -> list[str]:
        ratios = self.ratios()
        lines = []
        precise = self.by_name(PRECISE)
        keys = [*TARGETS, *((*PRECISE_TARGETS, *CEILINGS) if precise else ())]
        for key in keys:
            label = TARGET_LABELS[key]
            value = ratios.get(key)
            if value is None:
                lines.append(f"{label}: not measured (run the policies it compares)")
                continue
            verdict = "met" if met(key, value) else "MISSED"
            shown = f"{value:.2f}"
            if verdict == "MISSED" and float(shown) == bound(key):
                shown = f"{value:.4f}"  # 0.9961 is not 1.00
            lines.append(f"{label}: {shown} (target {bound_text(key)}: {verdict})")
        if precise and precise.precise_cost_us:
            cost = precise.precise_cost_us
            lines.append(
                f"precise tier's own cost per decision (block keys + index match + scoring, "
                f"wall time): p50 {cost['p50']:,.0f} µs, p90 {cost['p90']:,.0f} µs, p99 "
                f"{cost['p99']:,.0f} µs, max {cost['max']:,.0f} µs over "
                f"{cost['decisions']:,.0f} decisions"
            )
        for size, micro in self.precise_micro.items():
            lines.append(
                f"precise tier's own cost, a 6k-token chat continuing a 5k-token turn, 8 "
                f"replicas, block size {size}: p50 {micro['p50']:,.0f} µs, p90 "
                f"{micro['p90']:,.0f} µs (target < {PRECISE_COST_US} µs: "
                f"{'met' if micro['p50'] < PRECISE_COST_US else 'MISSED'} at p50)"
            )
        return [*lines, f"replayed in {self.wall_s:.1f} s of wall time (simulated time)"]

    def render(self, markdown: bool) -> str:
        head = ("policy", "hit rate", "prompt cached", "TTFT p50", "TTFT p90", "TTFT p99",
                "max/mean req", "CV req", "busy mean/max", "preempt")  # fmt: skip
        rows = self.rows()
        facts = [f"{k}: {v}" for k, v in base_machine().items()]
        if markdown:
            out = ["## Routing policies: shared prefixes, multi-turn (bench/routing.py)"]
            out += ["", "```", command_line(), "```", ""]
            out += [f"- {line}" for line in [*facts, *self.head()]]
            out += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            out += ["| " + " | ".join(r) + " |" for r in rows]
            return "\n".join([*out, "", *(f"- {line}" for line in self.verdict())])
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        lines = [f"command: {command_line()}", "; ".join(facts), *self.head(), ""]
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
        return "\n".join([*lines, "", *self.verdict()])


def _pct(share: float) -> str:
    return f"{100 * share:.1f}%"


def _s(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds < 10 else f"{seconds:,.1f} s"


# -- the command -----------------------------------------------------------------------------


def run_bench(config: BenchConfig, policies: Sequence[str] = (*POLICY_ORDER, ORACLE)) -> Report:
    """Build the workload once and replay it under every policy."""
    start = time.perf_counter()
    workload = build_workload(config)
    longest = max(t.prompt_len + len(t.answer) for c in workload.conversations for t in c.turns)
    if -(-longest // config.block_size) > config.blocks_per_engine:
        raise ValueError(
            f"a conversation reaches {longest:,} tokens, more than one engine's KV cache "
            f"({config.blocks_per_engine:,} blocks of {config.block_size}): raise --kv-blocks"
        )
    results = tuple(replay(config, workload, name) for name in policies)
    facts = WorkloadFacts.of(config, workload)
    micro = {}
    if PRECISE in policies:
        micro = {size: _cost_figures(precise_micro(size)) for size in MICRO_BLOCK_SIZES}
    return Report(config, facts, results, time.perf_counter() - start, micro)


_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("engines", int, "simulated engines (replicas of one model)"),
    ("groups", int, "groups, each with its own shared system prompt"),
    ("users", int, "users per group, one conversation each"),
    ("turns", int, "turns per conversation"),
    ("seed", int, "seed of every random draw"),
    ("system_tokens", int, "tokens of each group's system prompt"),
    ("question_tokens", int, "tokens of each question"),
    ("rate", float, "requests per second offered (conversations start at rate / turns)"),
    ("think_s", float, "mean seconds between an answer and the next question"),
    ("kv_blocks", int, "KV blocks per engine (0: a third of the groups' system prompts)"),
    ("kv_hint", float, "tell the prefix policy each engine's KV capacity × this (0: nothing)"),
    ("precise_lag_s", float, "seconds from an engine's KV events to the precise tier's index"),
    ("block_size", int, "tokens per KV block"),
)
_PREFIX_FLAGS: tuple[tuple[str, type], ...] = (
    ("min_share", float),
    ("load_weight", float),
    ("guard_abs", int),
    ("guard_rel", float),
    ("max_chars", int),
    ("max_chars_per_replica", int),
)


def parse_config(argv: Sequence[str] | None) -> tuple[BenchConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(
        prog="python -m bench.routing", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("--quick", action="store_true", help="a small workload (seconds)")
    for name, kind, text in _FLAGS:
        p.add_argument(
            "--" + name.removesuffix("_s").replace("_", "-"),
            dest=name,
            type=kind,
            help=text,
            metavar=name.removesuffix("_s").upper(),
        )
    for name, kind in _PREFIX_FLAGS:
        flag = "--prefix-" + name.replace("_", "-")
        p.add_argument(
            flag, dest=name, type=kind, help="PrefixConfig." + name + " (prefix and oracle)"
        )
    p.add_argument("--policies", default=",".join(ALL_POLICIES), help="comma-separated")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--markdown", action="store_true", help="also print a BENCHMARKS.md section")
    args = p.parse_args(argv)
    config = replace(BenchConfig(), **QUICK) if args.quick else BenchConfig()
    given = {name: getattr(args, name) for name, _, _ in _FLAGS if getattr(args, name) is not None}
    tuned = {
        name: getattr(args, name) for name, _ in _PREFIX_FLAGS if getattr(args, name) is not None
    }
    return replace(config, prefix=replace(config.prefix, **tuned), **given), args


def main(argv: Sequence[str] | None = None) -> int:
    config, args = parse_config(argv)
    policies = [name for name in args.policies.split(",") if name]
    unknown = set(policies) - set(ALL_POLICIES)
    if unknown:
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from {ALL_POLICIES}")
    report = run_bench(config, policies)
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        print(report.render(markdown=False))
    if args.markdown:
        print("\n" + report.render(markdown=True))
    return 1 if report.missed() else 0


if __name__ == "__main__":
    sys.exit(main())
