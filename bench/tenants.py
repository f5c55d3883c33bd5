#!/usr/bin/env python3
"""Benchmark: tenants on a saturated fleet, in simulated time (issue #18).

Part 1, priority and fairness (bench/tenants_sim.py: the routing benchmark's simulated
engines behind the gateway's own flow scheduler, ``llmgw.gateway.flow``): an interactive
tenant at a steady rate and two batch tenants flooding the fleet, with prompts and answers
of different lengths. Figures, each scenario from the same seed:

* the interactive tenant's TTFT p90, loaded (with flow control) against alone (unloaded):
  target ≤ 1.2×; and without flow control (every request straight to an engine), which
  shows what the queue buys;
* batch throughput (tokens/s, prompt + completion) against what the fleet has left: the
  batch tenants' throughput alone × (1 − the interactive tenant's share of the fleet's
  slot-seconds in the loaded run): target ≥ 90 %;
* fairness between the two batch tenants: Jain's index of their tokens served, target
  ≥ 0.95.

Part 2, fleet-wide rate limits (bench/tenants_limits.py): one key's rpm split over 4
gateways by the server's own split (``llmgw.server.core.tenantsplit``) from their reports,
each gateway enforcing its allowance with its own ``TenantRegistry`` on the simulated clock,
while the key's traffic moves between gateways: the most requests admitted in any sliding
minute, over the limit: target overshoot ≤ 5 %.

Figures depend on the seed only; the exit status is 1 when a target is missed.

    .venv/bin/python -m bench.tenants              # 240 simulated seconds per scenario
    .venv/bin/python -m bench.tenants --quick      # 90 s
    .venv/bin/python -m bench.tenants --markdown   # also a BENCHMARKS.md section
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence

from bench.kit import command_line, machine_facts, percentile, render_table
from bench.tenants_limits import LimitsConfig, LimitsOutcome, run_limits
from bench.tenants_sim import INTERACTIVE, Fleet, Outcome, SimConfig, jain

TARGET_TTFT = 1.2
TARGET_BATCH = 0.90
TARGET_JAIN = 0.95
TARGET_OVERSHOOT = 0.05


@dataclasses.dataclass(frozen=True, slots=True)
class Figures:
    alone_p90_s: float
    loaded_p90_s: float
    unqueued_p90_s: float
    batch_alone_tps: float
    batch_loaded_tps: float
    interactive_slot_share: float
    jain: float
    per_tenant_tps: dict[str, float]

    @property
    def ttft_ratio(self) -> float:
        return self.loaded_p90_s / self.alone_p90_s

    @property
    def batch_ratio(self) -> float:
        left = self.batch_alone_tps * (1 - self.interactive_slot_share)
        return self.batch_loaded_tps / left


def _p90(out: Outcome) -> float:
    return percentile(sorted(out.ttfts), 0.9) if out.ttfts else float("nan")


def _batch_tps(out: Outcome, config: SimConfig) -> float:
    return sum(out.tokens.get(t.name, 0) for t in config.batch) / out.window_s


def measure(config: SimConfig) -> Figures:
    interactive, batch = config.interactive, config.batch
    alone = Fleet(config, (interactive,), flow=True).run()
    batch_only = Fleet(config, batch, flow=True).run()
    loaded = Fleet(config, (interactive, *batch), flow=True).run()
    unqueued = Fleet(config, (interactive, *batch), flow=False).run()
    slots = config.engines * config.max_num_seqs * loaded.window_s
    share = loaded.slot_s.get(interactive.name, 0.0) / slots
    served = [float(loaded.tokens.get(t.name, 0)) for t in batch]
    return Figures(
        _p90(alone), _p90(loaded), _p90(unqueued), _batch_tps(batch_only, config),
        _batch_tps(loaded, config), share, jain(served),
        {name: tokens / loaded.window_s for name, tokens in sorted(loaded.tokens.items())},
    )  # fmt: skip


def _mark(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def verdicts(f: Figures, limits: LimitsOutcome) -> list[tuple[bool, str]]:
    return [
        (f.ttft_ratio <= TARGET_TTFT,
         f"interactive TTFT p90 loaded {1000 * f.loaded_p90_s:.0f} ms against "
         f"{1000 * f.alone_p90_s:.0f} ms alone: {f.ttft_ratio:.2f}× (target ≤ {TARGET_TTFT}×; "
         f"without flow control {1000 * f.unqueued_p90_s:,.0f} ms, "
         f"{f.unqueued_p90_s / f.alone_p90_s:,.1f}×)"),
        (f.batch_ratio >= TARGET_BATCH,
         f"batch throughput {f.batch_loaded_tps:,.0f} tokens/s against {f.batch_alone_tps:,.0f} "
         f"alone × (1 − {f.interactive_slot_share:.3f} the interactive share of slots): "
         f"{100 * f.batch_ratio:.1f} % of what the fleet has left (target ≥ "
         f"{100 * TARGET_BATCH:.0f} %)"),
        (f.jain >= TARGET_JAIN,
         f"Jain's index between the batch tenants' tokens: {f.jain:.3f} (target ≥ {TARGET_JAIN})"),
        (limits.overshoot <= TARGET_OVERSHOOT,
         f"fleet-wide rpm {limits.config.rpm} over {limits.config.gateways} gateways: at most "
         f"{limits.max_in_minute} admitted in a sliding minute, overshoot "
         f"{100 * limits.overshoot:.1f} % (target ≤ {100 * TARGET_OVERSHOOT:.0f} %); "
         f"{limits.admitted:,} admitted of {limits.asked:,} asked, "
         f"{100 * limits.use:.1f} % of the budget used"),
    ]  # fmt: skip


def render(
    config: SimConfig, f: Figures, limits: LimitsOutcome, markdown: bool, took_s: float
) -> str:
    tenants = (config.interactive, *config.batch)
    rows = [
        [t.name, "interactive" if t.band == INTERACTIVE else "batch",
         f"{t.rate:g}/s" if t.rate else f"{t.backlog} outstanding", str(t.prompt_tokens),
         str(t.max_tokens), f"{f.per_tenant_tps.get(t.name, 0.0):,.0f}"]
        for t in tenants
    ]  # fmt: skip
    table = render_table(
        ["tenant", "band", "traffic", "prompt tokens", "answer tokens", "tokens/s loaded"],
        rows, markdown,
    )  # fmt: skip
    out: list[str] = []
    if markdown:
        out += [
            "## Tenants on a saturated fleet (bench/tenants.py)",
            "",
            "```",
            command_line(),
            "```",
            "",
        ]
        out += [f"- {k}: {v}" for k, v in machine_facts("").items()]
    else:
        out += [f"command: {command_line()}"]
    out += [
        f"{'- ' if markdown else ''}fleet: {config.engines} simulated engines × "
        f"{config.max_num_seqs} slots, {config.duration_s:g} simulated s per scenario "
        f"({config.warmup_s:g} s warmup), seed {config.seed}; wall {took_s:.1f} s",
        "",
        table,
        "",
    ]
    out += [f"{'- ' if markdown else ''}{_mark(ok)}: {text}." for ok, text in verdicts(f, limits)]
    return "\n".join(out)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.tenants", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--seconds", type=float, default=240.0, help="simulated seconds per scenario (240)"
    )
    p.add_argument("--quick", action="store_true", help="90 simulated seconds per scenario")
    p.add_argument("--markdown", action="store_true", help="also print a BENCHMARKS.md section")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    seconds = 90.0 if args.quick else args.seconds
    if not 30 < seconds <= 3600:
        raise SystemExit("--seconds: between 30 and 3600")
    config = SimConfig(duration_s=seconds, seed=args.seed)
    started = time.perf_counter()
    figures = measure(config)
    limits = run_limits(LimitsConfig(seed=args.seed))
    took = time.perf_counter() - started
    print(render(config, figures, limits, False, took))
    if args.markdown:
        print("\n" + render(config, figures, limits, True, took))
    return 0 if all(ok for ok, _ in verdicts(figures, limits)) else 1


if __name__ == "__main__":
    sys.exit(main())
