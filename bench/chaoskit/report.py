"""The chaos run's report: plain text, a BENCHMARKS.md section (``--markdown``), or JSON."""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from bench.chaoskit.checks import Check
from bench.chaoskit.faults import FaultRecord
from bench.kit import machine_facts, package_versions, render_table


@dataclass(frozen=True, slots=True)
class ChaosReport:
    """Everything the run found."""

    command: str
    settings: Mapping[str, str]
    faults: tuple[FaultRecord, ...]
    recoveries: tuple[float | None, ...]  # per fault: its end → back at count (None: no dip)
    requests: Mapping[str, int]
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)


FAULT_COLUMNS = ("fault", "count", "lasted s", "below count", "back after s: median", "max")


def _fault_rows(report: ChaosReport) -> list[list[str]]:
    rows = []
    for kind in sorted({f.kind for f in report.faults}):
        spans = [f.ended - f.started for f in report.faults if f.kind == kind]
        after = [r for f, r in zip(report.faults, report.recoveries, strict=True) if f.kind == kind]
        seen = [r for r in after if r is not None]
        median = f"{statistics.median(seen):.1f}" if seen else "-"
        worst = f"{max(seen):.1f}" if seen else "-"
        lasted = f"{min(spans):.1f}-{max(spans):.1f}"
        rows.append([kind, str(len(spans)), lasted, str(len(seen)), median, worst])
    return rows


def _requests_line(r: Mapping[str, int]) -> str:
    return (
        f"requests: {r['sent']} sent ({r['streamed']} streamed), {r['ok']} ok, "
        f"{r['failed']} failed; latency of the ok ones p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms"
    )


def render_text(report: ChaosReport) -> str:
    lines = [f"chaos: {'PASSED' if report.passed else 'FAILED'}", ""]
    lines += [f"  {k}: {v}" for k, v in report.settings.items()]
    lines += ["", render_table(FAULT_COLUMNS, _fault_rows(report), False)]
    lines += ["", _requests_line(report.requests), ""]
    for check in report.checks:
        lines.append(f"[{'PASS' if check.passed else 'FAIL'}] {check.name}: {check.summary}")
        lines += [f"    {d}" for d in check.details]
    return "\n".join(lines)


def render_markdown(report: ChaosReport) -> str:
    versions = package_versions(["grpclib", "httpx", "pyzmq", "uvloop"], mark_missing=True)
    facts = machine_facts(", ".join(versions))
    out = ["## Chaos: kills and hangs under load (bench/chaos.py)", "", "```", report.command]
    out += ["```", ""] + [f"- {k}: {v}" for k, v in {**facts, **report.settings}.items()]
    out += ["", "| check | verdict | what was seen |", "|---|---|---|"]
    out += [f"| {c.name} | {'PASS' if c.passed else 'FAIL'} | {c.summary} |" for c in report.checks]
    out += ["", render_table(FAULT_COLUMNS, _fault_rows(report), True)]
    out += ["", _requests_line(report.requests).capitalize() + "."]
    details = [f"- {c.name}: {d}" for c in report.checks for d in c.details]
    out += ["", *details] if details else []
    out.append(f"\nVerdict: {'every check passed' if report.passed else 'FAILED'}.")
    return "\n".join(out)


def render_json(report: ChaosReport) -> str:
    faults = [
        {**asdict(f), "back_at_count_after_s": r}
        for f, r in zip(report.faults, report.recoveries, strict=True)
    ]
    return json.dumps(
        {
            "passed": report.passed,
            "command": report.command,
            "settings": dict(report.settings),
            "faults": faults,
            "requests": dict(report.requests),
            "checks": [asdict(c) for c in report.checks],
        },
        indent=2,
    )
