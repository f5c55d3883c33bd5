#!/usr/bin/env python3
"""Benchmark: how many heartbeating agents one control server holds.

Many simulated agents (``dgx-h100``, 8 GPUs each) register with a real ``llmgw server``
and heartbeat once a second, each over its own gRPC connection, exactly as
``llmgw.agent.link.AgentLink`` does in a real agent. The fleet grows in steps; each step is
held for ``--hold`` seconds once every agent registered, and measured:

* heartbeat round trip p50/p99, from the agents' own measurements (``link.stats.rtt_ms``);
* messages the server handled (heartbeats in + acks out, counted at the agents);
* server CPU (``utime + stime`` from ``/proc/PID/stat``) per 1,000 heartbeats and per message;
* server RSS, registration time, client CPU and client event-loop lag (to tell a slow server
  from a saturated load generator).

The largest step whose p99 stays under 1 s with every agent connected is the result. A bare
grpclib bidi-stream server that only acknowledges heartbeats (``_echo``) is measured
in the same run under the same client, as the baseline for CPU-per-heartbeat ratios.

New agents are launched at most ``--rate`` a second with at most ``--inflight``
registrations outstanding: a registration costs the server milliseconds (an 8 KB
``NodeInfo`` to check, parse and store), and an uncapped storm of them on top of a large
fleet can outrun the agents' 10 s register timeout (try ``--inflight 10000``). Each window
also reports the CPU every other process used, since a shared machine is noisy.

The server (and the baseline) run pinned to ``--server-cpu``; the agents run in
``--workers`` child processes of this module (``_agents`` mode) pinned to ``--client-cpu``.
Everything listens on 127.0.0.1 only; every loop is bounded and every child process is
stopped on exit, Ctrl-C included.

    .venv/bin/python -m bench.control            # full ramp, a few minutes
    .venv/bin/python -m bench.control --quick    # 50 and 100 agents, 5 s holds
    .venv/bin/python -m bench.control --markdown # also a BENCHMARKS.md section

This module holds the two phases (the baseline, then the ramp) and the command line; the
worker modes, the child processes, a measured step and the report are in ``bench.controlkit``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Final, TextIO

from bench.controlkit.children import Child, Children, Worker, wait_listening
from bench.controlkit.report import machine, progress, render
from bench.controlkit.shared import HOST, REGISTER_STALL_S
from bench.controlkit.step import Rig, Settings, Step
from bench.controlkit.workers import run_agents_worker, run_echo_server
from bench.kit import module_command
from bench.pgcluster import PrivateCluster
from bench.pgrun import BACKENDS, backends, cluster_cpu_seconds, pin_cluster, postgres
from llmgw.addresses import free_port

DEFAULT_STEPS: tuple[int, ...] = (250, 500, 1000, 1500, 2000)
QUICK_STEPS: tuple[int, ...] = (50, 100)
QUICK_BASELINE: tuple[int, ...] = (50,)

log = logging.getLogger("bench_control")


# ======================================================================================
# Orchestrator: the two phases
# ======================================================================================


SELF: Final = module_command("bench.control")


async def start_workers(children: Children, settings: Settings, port: int) -> list[Worker]:
    workers = []
    for index in range(settings.workers):
        argv = [
            *SELF,
            "_agents",
            "--host",
            HOST,
            "--port",
            str(port),
            "--index",
            str(index),
            "--of",
            str(settings.workers),
            "--seed",
            str(settings.seed),
            "--max-seconds",
            str(settings.max_seconds),
        ]
        child = await children.spawn(f"agents-{index}", argv, settings.client_cpu, pipes=True)
        workers.append(Worker(child))
    return workers


async def start_llmgw_server(
    children: Children, settings: Settings, db: str | None = None
) -> tuple[Child, int]:
    """``llmgw server`` on a new SQLite file in the work folder, or on ``db`` (a URL)."""
    grpc_port, http_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "llmgw",
        "server",
        "--grpc-listen",
        f"{HOST}:{grpc_port}",
        "--http-listen",
        f"{HOST}:{http_port}",
        "--gateway-listen",
        "off",
        "--db",
        db or str(children.workdir / "server.db"),
        "--node-grace",
        "10",
        "--heartbeat-interval",
        "1",
        "--grpc-max-connections",  # every simulated agent connects from 127.0.0.1
        "1000000",
        "--grpc-max-connections-per-peer",
        "1000000",
    ]
    child = await children.spawn("llmgw-server", argv, settings.server_cpu)
    await wait_listening(child, grpc_port)
    return child, grpc_port


async def start_echo_server(children: Children, settings: Settings) -> tuple[Child, int]:
    port = free_port()
    argv = [
        *SELF,
        "_echo",
        "--host",
        HOST,
        "--port",
        str(port),
        "--max-seconds",
        str(settings.max_seconds),
    ]
    child = await children.spawn("echo-server", argv, settings.server_cpu)
    await wait_listening(child, port)
    return child, port


ServerStarter = Callable[[Children, Settings], Awaitable[tuple[Child, int]]]


def on_postgres(cluster: PrivateCluster) -> ServerStarter:
    """A starter of ``llmgw server --db postgresql://…`` on ``cluster``'s own database."""

    async def start(children: Children, settings: Settings) -> tuple[Child, int]:
        return await start_llmgw_server(children, settings, cluster.url())

    return start


async def run_phase(
    children: Children,
    settings: Settings,
    label: str,
    start: ServerStarter,
    sizes: Sequence[int],
    report: Callable[[Step], None],
    extra_cpu: Callable[[], float] | None = None,
) -> list[Step]:
    """Start a server and fresh workers, hold each size in turn, stop at the first failure.
    ``extra_cpu`` (CPU seconds so far) is counted as the server's: its database's."""
    server, port = await start(children, settings)
    workers = await start_workers(children, settings, port)
    rig = Rig(label, server, workers, settings, extra_cpu=extra_cpu)
    steps: list[Step] = []
    try:
        for size in sizes:
            step = await rig.step(size)
            steps.append(step)
            report(step)
            if not step.held:
                break
    finally:
        await asyncio.gather(*(w.stop() for w in workers))
        await server.stop()
    return steps


async def run_bench(
    settings: Settings,
    workdir: Path,
    report: Callable[[Step], None],
    dbs: Sequence[str] = ("sqlite",),
) -> tuple[list[Step], list[Step]]:
    """The baseline, then a ramp on each backend of ``dbs`` in turn; SIGTERM cancels the
    run like Ctrl-C does."""
    children = Children(workdir)
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    try:
        baseline = await run_phase(
            children,
            settings,
            "bare grpclib echo",
            start_echo_server,
            settings.baseline_agents,
            report,
        )
        ramp: list[Step] = []
        for db in dbs:
            ramp += await ramp_on(children, settings, db, report)
    finally:
        await children.close()
    return baseline, ramp


SQLITE_LABEL: Final = "llmgw server"  # the label of today's (SQLite) ramp, kept
POSTGRES_LABEL: Final = "llmgw server + postgresql"


async def ramp_on(
    children: Children, settings: Settings, db: str, report: Callable[[Step], None]
) -> list[Step]:
    """The ramp with the server on SQLite, or on a private PostgreSQL cluster pinned to the
    server's CPU, whose processes' CPU is counted as the server's."""
    if db == "sqlite":
        return await run_phase(
            children, settings, SQLITE_LABEL, start_llmgw_server, settings.steps, report
        )
    with postgres() as cluster:
        pin_cluster(cluster, settings.server_cpu)
        return await run_phase(
            children,
            settings,
            POSTGRES_LABEL,
            on_postgres(cluster),
            settings.steps,
            report,
            extra_cpu=lambda: cluster_cpu_seconds(cluster),
        )


# ======================================================================================
# Command line
# ======================================================================================


def parse_main(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.control", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("--max-agents", type=int, default=2000, help="largest step (default 2000)")
    p.add_argument(
        "--steps",
        default=None,
        metavar="N,N,...",
        help="explicit fleet sizes (default 250,500,1000,1500,2000, then +500)",
    )
    p.add_argument("--hold", type=float, default=20.0, help="seconds measured per step")
    p.add_argument("--settle", type=float, default=3.0, help="seconds before measuring a step")
    p.add_argument(
        "--baseline-agents",
        default="500",
        metavar="N,N,...",
        help="fleet sizes for the bare baseline (default 500; 0 skips it)",
    )
    p.add_argument(
        "--logs",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the server's and workers' logs (and the database) in DIR",
    )
    p.add_argument("--workers", type=int, default=2, help="agent worker processes")
    p.add_argument("--rate", type=float, default=40.0, help="most agents launched per second")
    p.add_argument("--inflight", type=int, default=8, help="most registrations at a time")
    p.add_argument("--server-cpu", type=int, default=0)
    p.add_argument("--client-cpu", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="steps 50,100, hold 5 s, baseline 50")
    p.add_argument("--markdown", action="store_true", help="also print a BENCHMARKS.md section")
    p.add_argument(
        "--db",
        choices=BACKENDS,
        default="sqlite",
        help="the server's database: an SQLite file (default), a private PostgreSQL cluster, "
        "or both in turn in one run (with a PostgreSQL/SQLite table)",
    )
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    if args.quick:
        steps, hold, settle, baseline = QUICK_STEPS, 5.0, 1.0, QUICK_BASELINE
    else:
        steps, hold, settle = _steps(args), args.hold, args.settle
        baseline = _sizes(args.baseline_agents)
    if not 0 < hold <= 3600 or not steps or min(steps) <= 0 or args.rate <= 0:
        raise SystemExit("need 0 < --hold <= 3600, positive --steps and a positive --rate")
    cpus = os.sched_getaffinity(0)
    if {args.server_cpu, args.client_cpu} - cpus:
        raise SystemExit(f"--server-cpu/--client-cpu must be among the CPUs {sorted(cpus)}")
    worst = sum(hold + settle + 2 * REGISTER_STALL_S + s for s in steps) + 600
    return Settings(
        steps=steps,
        hold_s=hold,
        settle_s=settle,
        baseline_agents=baseline,
        workers=max(1, args.workers),
        rate=args.rate,
        inflight=max(1, args.inflight),
        server_cpu=args.server_cpu,
        client_cpu=args.client_cpu,
        seed=args.seed,
        max_seconds=worst + 600,
    )


def _steps(args: argparse.Namespace) -> tuple[int, ...]:
    if args.steps:
        return _sizes(args.steps)
    extra = range(DEFAULT_STEPS[-1] + 500, args.max_agents + 1, 500)
    return tuple(n for n in (*DEFAULT_STEPS, *extra) if n <= args.max_agents)


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(",") if n.strip() and int(n) > 0)


def parse_worker(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.control _agents")
    p.add_argument("--host", default=HOST)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--of", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-seconds", type=float, default=3600)
    return p.parse_args(argv)


def _agent_loop() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


@contextlib.contextmanager
def _workdir(keep: Path | None) -> Iterator[Path]:
    """``keep`` (created, left in place) or a temporary directory removed afterwards."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        print(f"bench_control: logs in {keep}", file=sys.stderr)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="bench_control.") as tmp:
        yield Path(tmp)


def main_orchestrator(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    args = parse_main(argv)
    settings = settings_from(args)
    facts = machine()  # before pinning: nproc counts the CPUs this process may use
    os.sched_setaffinity(0, {settings.client_cpu})  # keep our own bookkeeping off the server
    print(
        f"bench_control: steps {list(settings.steps)}, hold {settings.hold_s:g}s",
        file=sys.stderr,
        flush=True,
    )
    with _workdir(args.logs) as workdir:
        try:
            baseline, ramp = asyncio.run(run_bench(settings, workdir, progress, backends(args.db)))
        except (KeyboardInterrupt, asyncio.CancelledError):
            print("interrupted; every child process was stopped", file=sys.stderr)
            return 130
    pair = (SQLITE_LABEL, POSTGRES_LABEL) if args.db == "both" else None
    print(render(settings, facts, baseline, ramp, markdown=False, backends=pair), file=out)
    if args.markdown:
        print("\n" + render(settings, facts, baseline, ramp, True, backends=pair), file=out)
    return 0


def main(argv: Sequence[str]) -> int:
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if argv[:1] == ["_agents"]:
        with asyncio.Runner(loop_factory=_agent_loop()) as runner:
            runner.run(run_agents_worker(parse_worker(argv[1:])))
        return 0
    if argv[:1] == ["_echo"]:
        asyncio.run(run_echo_server(parse_worker(argv[1:])))  # the default loop, as the server
        return 0
    return main_orchestrator(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
