"""The control benchmark's report: the table, the machine, the conclusion."""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Mapping, Sequence

from bench.controlkit.shared import CLIENT_LAG_NOTE_MS, FIXTURE, NOISY_OTHER_UTIL, RTT_LIMIT_MS
from bench.controlkit.step import Settings, Step
from bench.kit import REPO_ROOT, base_machine, command_line, git_query, load_average

# ======================================================================================
# Reporting
# ======================================================================================


COLUMNS = (
    "server",
    "agents",
    "reg s",
    "reg p99 ms",
    "hb/s",
    "RTT p50 ms",
    "RTT p99 ms",
    "srv CPU %",
    "srv CPU s/1k hb",
    "µs/msg",
    "× bare",
    "srv RSS MiB",
    "client CPU %",
    "client lag p99 ms",
    "other CPU %",
    "held",
)


def _fmt(value: float | int | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:,.{digits}f}"


def nearest_bare(baseline: Sequence[Step], agents: int) -> Step | None:
    """The measured baseline step closest in fleet size to ``agents``."""
    measured = [b for b in baseline if b.heartbeats]
    return min(measured, key=lambda b: (abs(b.agents - agents), b.agents), default=None)


def bare_ratio(step: Step, baseline: Sequence[Step]) -> float | None:
    bare = nearest_bare(baseline, step.agents)
    return step.us_per_heartbeat / bare.us_per_heartbeat if bare and step.heartbeats else None


def step_row(step: Step, baseline: Sequence[Step]) -> list[str]:
    ratio = bare_ratio(step, baseline)
    held = "yes" if step.held else _why_not(step)
    return [
        step.label,
        f"{step.agents:,}",
        _fmt(step.reg_wall_s, 1),
        _fmt(step.reg_p99_ms),
        _fmt(step.heartbeats / step.window_s if step.heartbeats else None, 0),
        _fmt(step.rtt_p50_ms),
        _fmt(step.rtt_p99_ms),
        _fmt(100 * step.server_util, 0),
        _fmt(step.us_per_heartbeat / 1000, 3),
        _fmt(step.us_per_message, 0),
        _fmt(ratio, 2),
        _fmt(step.server_rss_mib, 0),
        _fmt(100 * step.client_util, 0),
        _fmt(step.client_lag_p99_ms),
        _fmt(100 * step.other_util if step.heartbeats else None, 0),
        held,
    ]


def _why_not(step: Step) -> str:
    if step.registered < step.agents:
        return f"no: {step.registered}/{step.agents} registered"
    if step.connected < step.agents or step.reconnects:
        return f"no: {step.connected} connected, {step.reconnects} reconnects"
    return f"no: p99 ≥ {RTT_LIMIT_MS} ms"


def table(rows: Sequence[Sequence[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def machine() -> dict[str, str]:
    return {
        **base_machine(),
        "client loop": _client_loop_name(),
        "llmgw source": source_fingerprint(),
        "load average at start": load_average(),
    }


def source_fingerprint() -> str:
    """The commit, and a hash of every ``llmgw/**/*.py`` as it is on disk (it may be
    uncommitted work): which server and agent code the figures describe."""
    root = REPO_ROOT
    digest = hashlib.sha256()
    for path in sorted((root / "llmgw").rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    head = git_query("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git_query("status", "--porcelain", "--", "llmgw")
    state = f"{head} + uncommitted changes" if dirty else head
    return f"{state}; sha256 of llmgw/**/*.py {digest.hexdigest()[:12]}"


def _client_loop_name() -> str:
    try:
        import uvloop
    except ImportError:
        return "asyncio (default)"
    return f"uvloop {getattr(uvloop, '__version__', '?')}"


def conclusion(baseline: Sequence[Step], ramp: Sequence[Step]) -> list[str]:
    labels = list(dict.fromkeys(s.label for s in ramp))
    lines = [
        line for label in labels for line in _ramp_lines([s for s in ramp if s.label == label])
    ]
    if not ramp:
        lines.append(f"No step held with heartbeat RTT p99 < {RTT_LIMIT_MS} ms.")
    lines += [_bare_line(bare, ramp) for bare in baseline if bare.heartbeats]
    noisy = [s for s in [*baseline, *ramp] if s.heartbeats and s.other_util > NOISY_OTHER_UTIL]
    if noisy:
        worst = max(noisy, key=lambda s: s.other_util)
        lines.append(
            f"Other processes used up to {100 * worst.other_util:.0f}% of a core during a "
            f"window ({worst.label}, {worst.agents:,} agents): those figures are less reliable."
        )
    return lines


def _ramp_lines(ramp: Sequence[Step]) -> list[str]:
    """What one server's ramp (one label) held, and where it stopped."""
    held = [s for s in ramp if s.held]
    if not held:
        lines = [f"{ramp[0].label}: no step held with heartbeat RTT p99 < {RTT_LIMIT_MS} ms."]
    else:
        best = held[-1]
        lines = [
            f"{best.label}: largest fleet held with heartbeat RTT p99 < {RTT_LIMIT_MS} ms: "
            f"{best.agents:,} agents (p99 {best.rtt_p99_ms} ms, server CPU "
            f"{100 * best.server_util:.0f}% of one core; the agents' own event-loop lag p99 "
            f"{best.client_lag_p99_ms} ms with client CPU {100 * best.client_util:.0f}% of one "
            f"core{_client_note(best)}).",
            f"At that size the server spent {best.us_per_heartbeat:,.0f} µs of CPU per heartbeat "
            f"({best.us_per_heartbeat / 1000:.3f} CPU s per 1,000 heartbeats; "
            f"{best.us_per_message:,.0f} µs per message, heartbeat or ack).",
        ]
    stopped = [s for s in ramp if not s.held]
    if stopped:
        lines.append(
            f"{stopped[0].label}: the ramp stopped at {stopped[0].agents:,} agents: "
            f"{_why_not(stopped[0])}."
        )
    return lines


BACKEND_COLUMNS = (
    "agents",
    "SQLite RTT p99 ms",
    "PostgreSQL RTT p99 ms",
    "SQLite µs/hb",
    "PostgreSQL µs/hb",
    "PG/SQLite CPU per hb",
    "≤ 1.5× and p99 < 1 s",
)
PG_CPU_LIMIT = 1.5  # issue #17: PostgreSQL's server CPU per heartbeat at most 1.5× SQLite's


def backend_rows(ramp: Sequence[Step], sqlite: str, postgresql: str) -> list[list[str]]:
    """Per fleet size measured on both backends: RTT p99 each, and PostgreSQL's server CPU
    per heartbeat (server + cluster processes) over SQLite's (server process)."""
    lite = {s.agents: s for s in ramp if s.label == sqlite and s.heartbeats}
    rows = []
    for pg in (s for s in ramp if s.label == postgresql and s.heartbeats):
        base = lite.get(pg.agents)
        if base is None:
            continue
        ratio = pg.us_per_heartbeat / base.us_per_heartbeat
        ok = ratio <= PG_CPU_LIMIT and pg.held
        rows.append(
            [
                f"{pg.agents:,}",
                _fmt(base.rtt_p99_ms),
                _fmt(pg.rtt_p99_ms),
                _fmt(base.us_per_heartbeat),
                _fmt(pg.us_per_heartbeat),
                f"{ratio:.2f}×",
                "yes" if ok else "NO",
            ]
        )
    return rows


def backend_table(rows: Sequence[Sequence[str]], markdown: bool) -> str:
    if markdown:
        head = ["| " + " | ".join(BACKEND_COLUMNS) + " |", "|" + "---|" * len(BACKEND_COLUMNS)]
        return "\n".join([*head, *("| " + " | ".join(r) + " |" for r in rows)])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(BACKEND_COLUMNS)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(BACKEND_COLUMNS, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _client_note(step: Step) -> str:
    lag = step.client_lag_p99_ms or 0
    if lag < CLIENT_LAG_NOTE_MS:
        return ""
    return ", so part of that round trip is queueing in the load generator, not the server"


def _bare_line(bare: Step, ramp: Sequence[Step]) -> str:
    text = (
        f"Bare grpclib echo at {bare.agents:,} agents: {bare.us_per_heartbeat:,.0f} µs of server "
        f"CPU per heartbeat (p99 {bare.rtt_p99_ms} ms)"
    )
    same = [s for s in ramp if s.agents == bare.agents and s.heartbeats]
    if not same:
        return text + "."
    return (
        f"{text}; llmgw at the same size: {same[0].us_per_heartbeat:,.0f} µs, "
        f"{same[0].us_per_heartbeat / bare.us_per_heartbeat:.2f}× the bare cost."
    )


def render(
    settings: Settings,
    facts: Mapping[str, str],
    baseline: Sequence[Step],
    ramp: Sequence[Step],
    markdown: bool,
    backends: tuple[str, str] | None = None,
) -> str:
    """The report; ``backends`` (the SQLite and PostgreSQL ramps' labels) adds the table of
    one beside the other."""
    rows = [step_row(s, baseline) for s in [*baseline, *ramp]]
    pair = backend_rows(ramp, *backends) if backends else []
    extra = ["", backend_table(pair, markdown)] if pair else []
    out = []
    if markdown:
        out += [
            "## Control server: agents heartbeating (bench/control.py)",
            "",
            "```",
            command_line(),
            "```",
            "",
        ]
        out += [f"- {k}: {v}" for k, v in facts.items()]
        out += [f"- settings: {_settings_line(settings)}", "", table(rows, True), *extra, ""]
        out += [f"{line}" for line in conclusion(baseline, ramp)]
    else:
        out += [f"command: {command_line()}"]
        out += [f"{k}: {v}" for k, v in facts.items()]
        out += [f"settings: {_settings_line(settings)}", "", table(rows, False), *extra, ""]
        out += conclusion(baseline, ramp)
    return "\n".join(out)


def _settings_line(s: Settings) -> str:
    return (
        f"{FIXTURE} agents (8 GPUs each), heartbeat every 1 s, one gRPC connection per agent; "
        f"server pinned to CPU {s.server_cpu}, {s.workers} agent worker process(es) pinned to "
        f"CPU {s.client_cpu}; agents launched at up to {s.rate:g}/s with up to {s.inflight} "
        f"registrations in flight; each step held {s.hold_s:g} s "
        f"after a {s.settle_s:g} s settle; baseline at {_sizes_text(s.baseline_agents)} agents"
    )


def _sizes_text(sizes: Sequence[int]) -> str:
    return ", ".join(f"{n:,}" for n in sizes) or "no"


def progress(step: Step) -> None:
    print(
        f"  {step.label}: {step.agents:,} agents, p99 {_fmt(step.rtt_p99_ms)} ms, "
        f"server CPU {_fmt(100 * step.server_util if step.heartbeats else None)}%, "
        f"client CPU {_fmt(100 * step.client_util if step.heartbeats else None)}%, "
        f"other CPU {_fmt(100 * step.other_util if step.heartbeats else None)}%, "
        f"{'held' if step.held else _why_not(step)}",
        file=sys.stderr,
        flush=True,
    )
