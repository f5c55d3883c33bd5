#!/usr/bin/env python3
"""Benchmark: the gRPC-web port under uvicorn and under another HTTP server (``--against``).

The same ``llmgw.server.wire.grpcweb.GrpcWebApp`` (a real ``ControlService`` over a real
``ControlPlane`` and SQLite ``Store``, with ``--nodes`` simulated ``dgx-h100`` nodes in its
inventory) is served in the same run by

* uvicorn (``http="httptools"``, uvloop), configured as ``llmgw server`` configures it, and
* ``--against llmgw`` (the default): our httptools ``HttpServer`` through
  ``llmgw.server.wire.asgihttp``, with its default ``ServerLimits``, as ``llmgw server`` now runs
  the port; or ``--against hypercorn``: hypercorn (its asyncio worker on uvloop, as
  ``--worker-class uvloop`` runs it; h11 is hypercorn's only HTTP/1.1 implementation),

each in its own child process (``_serve`` mode) pinned to ``--server-cpu``. This process is
the load generator, pinned to ``--client-cpu``: a raw asyncio HTTP/1.1 client on uvloop that
keeps its connections alive, writes one pre-encoded request per round trip and reads each
response by its content-length or chunked framing. The client is the same for both servers.

Cells (each run ``--reps`` times, servers alternating which goes first; medians reported):

* ``GetCluster`` (an empty gRPC-web frame in, a ``Cluster`` of ``--nodes`` nodes out) over one
  connection: latency p50/p99 and requests/s;
* ``GetCluster`` over ``--conns`` connections: requests/s and latency;
* ``GetCluster`` of an empty cluster (a second server process of each kind) over ``--conns``
  connections: HTTP plus the gRPC-web bridge with almost no message to build;
* ``GET /healthz`` over ``--conns`` connections: requests/s and latency;

and for every cell the server's CPU seconds (``utime + stime`` from ``/proc/PID/stat``) over
the measured window, per request, with this process's own CPU to show whether the load
generator, rather than the server, was the limit. Every reply is checked (HTTP 200 and
``grpc-status:0`` in the trailer frame, or ``ok`` for ``/healthz``). Other processes' use of
the server's CPU is measured from ``/proc/stat``; a cell where they took more than
``--max-others`` percent of it is run again (at most ``--attempts`` runs, the quietest kept).

Everything listens on 127.0.0.1 only; each cell is bounded in time and requests; every child
process is stopped on exit (Ctrl-C included) and also dies with this process.

    .venv/bin/python -m bench.http              # 3 reps x 4 cells x 2 servers, ~3 min
    .venv/bin/python -m bench.http --against hypercorn
    .venv/bin/python -m bench.http --quick      # 1 rep, 2 s cells
    .venv/bin/python -m bench.http --markdown   # also a BENCHMARKS.md section

This module holds the orchestration (the child servers, the cells in turn), the report and
the command line; the settings, the ``_serve`` mode, the workloads and a measured cell are in
``bench.httpkit``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TextIO

from bench.httpkit.cell import Cell, run_cell
from bench.httpkit.serve import parse_serve, run_serve
from bench.httpkit.settings import CHALLENGERS, FIXTURE, HYPERCORN_KEEPALIVE_REQUESTS, Settings
from bench.httpkit.workload import WORKLOADS, Workload, verify, workload, workload_label
from bench.kit import (
    Child,
    announced_ports,
    command_line,
    interrupt_on_sigterm,
    machine_facts,
    module_command,
    package_versions,
    progress_line,
    quietest,
    render_table,
    require_two_cpus,
    run_interruptible,
    spawn,
)

SERVERS: tuple[str, str] = ("uvicorn", "llmgw")  # the baseline first; main sets the other
START_TIMEOUT_S: Final = 30.0


# ======================================================================================
# Orchestration: child servers, the cells, the report
# ======================================================================================


def start_server(name: str, nodes: int, workdir: Path, settings: Settings) -> Child:
    argv = [*module_command("bench.http"), "_serve", "--server", name,
            "--db", str(workdir / f"{name}-{nodes}.db"), "--nodes", str(nodes)]  # fmt: skip
    log = workdir / f"{name}-{nodes}.log"
    child = spawn(name, argv, settings.server_cpu, log, announces=True)
    child.ports = announced_ports(child, "PORT", START_TIMEOUT_S)
    return child


Progress = Callable[[Cell], None]
RETRY_PAUSE_S: Final = 5.0


async def quietest_cell(
    name: str, child: Child, work: Workload, rep: int, settings: Settings, progress: Progress
) -> Cell:
    """Run a cell, again (up to ``settings.attempts``) while other processes used more than
    ``settings.max_others`` of the server's CPU; the quietest run is kept."""

    def run() -> Awaitable[Cell]:
        return run_cell(name, child.proc.pid, child.port, work, rep, settings)

    return await quietest(run, settings.attempts, settings.max_others, RETRY_PAUSE_S, progress)


async def run_bench(
    children: Mapping[tuple[str, int], Child], settings: Settings, progress: Progress
) -> tuple[list[Cell], dict[int, int]]:
    """Every cell ``settings.reps`` times; also the GetCluster reply size by cluster size."""
    sizes = {nodes: await verify(c.port, nodes) for (_, nodes), c in children.items()}
    cells = []
    for rep in range(settings.reps):
        order = SERVERS if rep % 2 == 0 else SERVERS[::-1]
        for key in WORKLOADS:
            for name in order:
                nodes = settings.nodes if key != "emptyN" else 0
                child = children[name, nodes]
                work = workload(key, settings, child.port)
                cell = await quietest_cell(name, child, work, rep, settings, progress)
                cells.append(cell)
                if child.proc.poll() is not None:
                    raise RuntimeError(f"{name} exited:\n{child.log_tail()}")
    return cells, sizes


def _client_loop() -> Callable[[], asyncio.AbstractEventLoop]:
    import uvloop

    return uvloop.new_event_loop


# --- the report --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Metric:
    workload: str
    label: str
    value: Callable[[Cell], float]
    fmt: str  # a format spec for one value
    lower_is_better: bool


def _p50(c: Cell) -> float:
    return c.latency_us(0.5)


def _p99(c: Cell) -> float:
    return c.latency_us(0.99)


def _rps(c: Cell) -> float:
    return c.rps


def _us_per_request(c: Cell) -> float:
    return c.server_us_per_request


def _server_pct(c: Cell) -> float:
    return 100 * c.server_util


def _client_pct(c: Cell) -> float:
    return 100 * c.client_util


# (workload, metric, value, format, lower is better); ``{n}`` is the connection count
_METRICS: Final = (
    ("cluster1", "latency p50 (µs)", _p50, ",.0f", True),
    ("cluster1", "latency p99 (µs)", _p99, ",.0f", True),
    ("cluster1", "requests/s", _rps, ",.0f", False),
    ("cluster1", "server CPU µs/request", _us_per_request, ",.0f", True),
    ("clusterN", "requests/s", _rps, ",.0f", False),
    ("clusterN", "latency p50 (µs)", _p50, ",.0f", True),
    ("clusterN", "latency p99 (µs)", _p99, ",.0f", True),
    ("clusterN", "server CPU µs/request", _us_per_request, ",.0f", True),
    ("clusterN", "server CPU (% of a core)", _server_pct, ".0f", False),
    ("clusterN", "client CPU (% of a core)", _client_pct, ".0f", True),
    ("emptyN", "requests/s", _rps, ",.0f", False),
    ("emptyN", "latency p99 (µs)", _p99, ",.0f", True),
    ("emptyN", "server CPU µs/request", _us_per_request, ",.0f", True),
    ("emptyN", "server CPU (% of a core)", _server_pct, ".0f", False),
    ("emptyN", "client CPU (% of a core)", _client_pct, ".0f", True),
    ("healthN", "requests/s", _rps, ",.0f", False),
    ("healthN", "latency p99 (µs)", _p99, ",.0f", True),
    ("healthN", "server CPU µs/request", _us_per_request, ",.0f", True),
    ("healthN", "server CPU (% of a core)", _server_pct, ".0f", False),
    ("healthN", "client CPU (% of a core)", _client_pct, ".0f", True),
)


def metrics(settings: Settings) -> list[Metric]:
    return [
        Metric(key, f"{workload_label(key, settings)}: {name}", value, spec, lower)
        for key, name, value, spec, lower in _METRICS
    ]


@dataclass(frozen=True, slots=True)
class Summary:
    metric: Metric
    values: Mapping[str, list[float]]  # server → one value per rep

    def median(self, server: str) -> float:
        values = self.values.get(server, [])
        return statistics.median(values) if values else math.nan

    def ratio(self) -> float:
        base = self.median(SERVERS[0])
        return self.median(SERVERS[1]) / base if base else math.nan

    def cell(self, server: str) -> str:
        values = self.values.get(server, [])
        if not values:
            return "–"
        spec = self.metric.fmt
        text = format(self.median(server), spec)
        low, high = format(min(values), spec), format(max(values), spec)
        if low != high:
            text += f" ({low}–{high})"
        return text

    def overlaps(self) -> bool:
        """Whether the two servers' ranges over the reps overlap."""
        a, b = (self.values.get(server, []) for server in SERVERS)
        return bool(a and b) and min(a) <= max(b) and min(b) <= max(a)


def summarize(cells: Sequence[Cell], settings: Settings) -> list[Summary]:
    out = []
    for metric in metrics(settings):
        mine = [c for c in cells if c.workload == metric.workload]
        values = {s: [metric.value(c) for c in mine if c.server == s] for s in SERVERS}
        out.append(Summary(metric, values))
    return out


def table(summaries: Sequence[Summary], markdown: bool) -> str:
    base, other = SERVERS
    columns = ("workload: metric", base, other, f"{other}/{base}")
    rows = [[s.metric.label, s.cell(base), s.cell(other), f"{s.ratio():.2f}×"] for s in summaries]
    return render_table(columns, rows, markdown)


def machine() -> dict[str, str]:
    names = (
        "uvicorn",
        "httptools",
        *(("hypercorn", "h11") if "hypercorn" in SERVERS else ()),
        "uvloop",
    )
    return machine_facts(", ".join(package_versions(names, mark_missing=True)))


def settings_line(s: Settings, sizes: Mapping[int, int]) -> str:
    bodies = ", ".join(f"{n} nodes {size:,} B" for n, size in sorted(sizes.items()))
    return (
        f"GetCluster of simulated {FIXTURE} nodes (gRPC-web reply body: {bodies}), "
        "an empty request frame; "
        f"each server in its own process pinned to CPU {s.server_cpu}, on uvloop "
        "(uvicorn: http=httptools, lifespan off, no access log, as `llmgw server`; "
        + (
            "hypercorn: asyncio worker on uvloop, h11, no access log, "
            f"keep_alive_max_requests={HYPERCORN_KEEPALIVE_REQUESTS:,}); "
            if "hypercorn" in SERVERS
            else "llmgw: llmgw.gateway.httpserver through llmgw.server.wire.asgihttp, its "
            "default limits, as `llmgw server` now runs the port); "
        )
        + f"client: raw asyncio HTTP/1.1 keep-alive on uvloop, pinned to CPU {s.client_cpu}, "
        f"one request in flight per connection; each cell {s.warmup_s:g} s warmup + "
        f"{s.seconds:g} s measured (at most {s.max_requests:,} requests), {s.reps} rep(s), "
        f"servers alternating first; a cell is re-run (at most {s.attempts} runs, the quietest "
        f"kept) while other processes use more than {100 * s.max_others:g}% of CPU "
        f"{s.server_cpu}; figures are medians (min–max over reps)"
    )


NOISE: Final = 0.05  # relative differences below this are not called a difference


def conclusion(summaries: Sequence[Summary], settings: Settings) -> str:
    by = {(s.metric.workload, s.metric.label.split(": ", 1)[1]): s for s in summaries}

    def get(key: str, name: str) -> Summary:
        return by[key, name]

    cpu = {key: get(key, "server CPU µs/request") for key in WORKLOADS}
    http_only = [cpu["emptyN"], cpu["healthN"]]  # where the HTTP server's own work shows
    base, challenger = SERVERS
    cheaper = {base if s.ratio() > 1 else challenger for s in http_only}
    clear = len(cheaper) == 1 and all(abs(s.ratio() - 1) >= NOISE for s in http_only)
    winner = cheaper.pop() if clear else base
    other = challenger if winner == base else base

    def pair(s: Summary, unit: str = "") -> str:
        text = f"{s.median(winner):,.0f}{unit} vs {s.median(other):,.0f}{unit}"
        return text + (" (the reps' ranges overlap)" if s.overlaps() else "")

    def factor(s: Summary) -> str:
        high, low = sorted((s.median(winner), s.median(other)), reverse=True)
        return f"{high / low:.2f}×" if low else "n/a"

    n, nodes = settings.conns, settings.nodes
    parts = [
        f"Choose {winner}: per request it spent less server CPU wherever the HTTP server's "
        "own work shows."
        if clear
        else f"The two are within noise of each other or split ({base} is the baseline).",
        f"Server CPU per request ({winner} vs {other}): /healthz {pair(cpu['healthN'], ' µs')} "
        f"({factor(cpu['healthN'])}); an empty GetCluster, i.e. HTTP plus the gRPC-web "
        f"bridge, {pair(cpu['emptyN'], ' µs')} ({factor(cpu['emptyN'])}); GetCluster of "
        f"{nodes} nodes {pair(cpu['clusterN'], ' µs')} ({factor(cpu['clusterN'])})"
        + (
            ", where building and serializing the Cluster message in llmgw, the same work "
            "under both servers, dominates."
            if min(cpu["clusterN"].median(s) for s in SERVERS)
            > 5 * max(cpu["emptyN"].median(s) for s in SERVERS)
            else "."
        ),
        f"Throughput over {n} connections (requests/s): /healthz "
        f"{pair(get('healthN', 'requests/s'))}, empty GetCluster "
        f"{pair(get('emptyN', 'requests/s'))}, GetCluster of {nodes} nodes "
        f"{pair(get('clusterN', 'requests/s'))}.",
        f"GetCluster latency over one connection: p50 "
        f"{pair(get('cluster1', 'latency p50 (µs)'), ' µs')}, p99 "
        f"{pair(get('cluster1', 'latency p99 (µs)'), ' µs')}.",
        _saturation(by),
    ]
    return " ".join(parts)


def _span(values: Sequence[float]) -> str:
    low, high = f"{min(values):.0f}", f"{max(values):.0f}"
    return low if low == high else f"{low}–{high}"


def _saturation(by: Mapping[tuple[str, str], Summary]) -> str:
    loaded = ("clusterN", "emptyN", "healthN")
    server = [by[k, "server CPU (% of a core)"].median(s) for k in loaded for s in SERVERS]
    client = [by[k, "client CPU (% of a core)"].median(s) for k in loaded for s in SERVERS]
    text = (
        f"In the loaded cells the server used {_span(server)}% of its core and the client "
        f"{_span(client)}% of its own"
    )
    if max(client) >= 85:
        return text + (
            "; the client was near its limit in at least one cell, so there the requests/s "
            "understate the faster server, while CPU per request is unaffected."
        )
    if min(server) < 85:
        return text + (
            "; where neither side is near 100%, the closed loop (one request in flight per "
            "connection, the two processes handing batches back and forth across CPUs) set "
            "the requests/s, not a saturated server, so CPU per request is the figure to "
            "compare."
        )
    return text + ", so the servers, not the load generator, set the requests/s."


def _others_line(cells: Sequence[Cell], settings: Settings) -> str:
    shares = sorted(100 * c.others_share for c in cells)
    rerun = sum(c.attempts > 1 for c in cells)
    noisy = sum(c.others_share > settings.max_others for c in cells)
    return (
        f"Other processes on CPU {settings.server_cpu} (the servers' CPU) during the kept "
        f"measurement windows: median {statistics.median(shares):.0f}% of it, at most "
        f"{shares[-1]:.0f}% (over {len(shares)} cells); {rerun} cell(s) were re-run because "
        f"others used more than {100 * settings.max_others:g}% of it, and {noisy} kept a "
        "noisier run after the last attempt."
    )


def render(
    settings: Settings,
    facts: Mapping[str, str],
    cells: Sequence[Cell],
    sizes: Mapping[int, int],
    markdown: bool,
) -> str:
    summaries = summarize(cells, settings)
    reconnects = sum(c.reconnects for c in cells)
    closed = [f"The servers closed {reconnects} keep-alive connection(s) mid-run.", ""]
    out = []
    if markdown:
        out += [
            f"## gRPC-web HTTP server: {SERVERS[0]} vs {SERVERS[1]} (bench/http.py)",
            "",
            "```",
            command_line(),
            "```",
            "",
        ]
        out += [f"- {k}: {v}" for k, v in facts.items()]
        out += [f"- settings: {settings_line(settings, sizes)}", ""]
        out += [table(summaries, True), ""]
    else:
        out += [f"command: {command_line()}"]
        out += [f"{k}: {v}" for k, v in facts.items()]
        out += [f"settings: {settings_line(settings, sizes)}", "", table(summaries, False), ""]
    out += closed if reconnects else []
    out += [_others_line(cells, settings), ""]
    out += [conclusion(summaries, settings)]
    return "\n".join(out)


def progress(cell: Cell) -> None:
    progress_line(
        f"  rep {cell.rep + 1} {cell.workload:8} {cell.server:9}: {cell.rps:8,.0f} req/s, "
        f"p50 {cell.latency_us(0.5):7,.0f} µs, p99 {cell.latency_us(0.99):7,.0f} µs, "
        f"server {cell.server_us_per_request:5,.0f} µs/req ({100 * cell.server_util:3.0f}%), "
        f"client {100 * cell.client_util:3.0f}%, others on the server CPU "
        f"{100 * cell.others_share:3.0f}%"
        + (f" (attempt {cell.attempts})" if cell.attempts > 1 else "")
    )


# ======================================================================================
# Command line
# ======================================================================================


def parse_main(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.http", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes in GetCluster (2)")
    p.add_argument("--conns", type=int, default=16, help="connections of the loaded cells (16)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every cell (3)")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per cell (5)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring (1)")
    p.add_argument("--max-requests", type=int, default=2_000_000, help="cap per cell")
    p.add_argument("--server-cpu", type=int, default=0)
    p.add_argument("--client-cpu", type=int, default=1)
    p.add_argument(
        "--max-others",
        type=float,
        default=10.0,
        help="re-run a cell where other processes used more than this %% of the server's CPU (10)",
    )
    p.add_argument("--attempts", type=int, default=4, help="most runs of one cell (4)")
    p.add_argument("--quick", action="store_true", help="1 rep of 2 s cells, 0.5 s warmup")
    p.add_argument("--markdown", action="store_true", help="also print a BENCHMARKS.md section")
    p.add_argument(
        "--against",
        choices=CHALLENGERS,
        default="llmgw",
        help="the server measured against uvicorn: llmgw (our HttpServer, as `llmgw server` "
        "runs the port) or hypercorn (llmgw)",
    )
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    reps, seconds, warmup = (1, 2.0, 0.5) if args.quick else (args.reps, args.seconds, args.warmup)
    if not (0 < seconds <= 600 and 0 <= warmup <= 60 and 1 <= reps <= 50):
        raise SystemExit("need 0 < --seconds <= 600, 0 <= --warmup <= 60, 1 <= --reps <= 50")
    if not (0 <= args.max_others <= 100 and 1 <= args.attempts <= 20):
        raise SystemExit("need 0 <= --max-others <= 100 and 1 <= --attempts <= 20")
    if not (1 <= args.conns <= 1024 and 0 <= args.nodes <= 10_000 and args.max_requests > 0):
        raise SystemExit("need 1 <= --conns <= 1024, 0 <= --nodes <= 10000, --max-requests > 0")
    require_two_cpus(args.server_cpu, args.client_cpu, "--server-cpu/--client-cpu")
    return Settings(
        nodes=args.nodes,
        conns=args.conns,
        reps=reps,
        seconds=seconds,
        warmup_s=warmup,
        max_requests=args.max_requests,
        server_cpu=args.server_cpu,
        client_cpu=args.client_cpu,
        max_others=args.max_others / 100,
        attempts=max(1, args.attempts),
    )


def main_orchestrator(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    global SERVERS
    args = parse_main(argv)
    SERVERS = ("uvicorn", args.against)
    settings = settings_from(args)
    facts = machine()  # before pinning: nproc counts the CPUs this process may use
    os.sched_setaffinity(0, {settings.client_cpu})
    interrupt_on_sigterm()
    progress_line(
        f"bench_http: {settings.reps} rep(s) x {len(WORKLOADS)} cells x 2 servers, "
        f"{settings.warmup_s:g}+{settings.seconds:g} s each"
    )
    children: dict[tuple[str, int], Child] = {}
    with tempfile.TemporaryDirectory(prefix="bench_http.") as tmp:
        try:
            for name in SERVERS:
                for nodes in sorted({settings.nodes, 0}):
                    children[name, nodes] = start_server(name, nodes, Path(tmp), settings)
            bench = run_bench(children, settings, progress)
            cells, sizes = run_interruptible(bench, _client_loop())
        except KeyboardInterrupt:
            progress_line("interrupted; every child process was stopped")
            return 130
        finally:
            for child in children.values():
                child.stop()
    print(render(settings, facts, cells, sizes, markdown=False), file=out)
    if args.markdown:
        print("\n" + render(settings, facts, cells, sizes, markdown=True), file=out)
    return 0


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["_serve"]:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(run_serve(parse_serve(argv[1:])))
        return 0
    return main_orchestrator(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
