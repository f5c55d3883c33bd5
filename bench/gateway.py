#!/usr/bin/env python3
"""Benchmark: what the gateway costs per proxied request, against vllm-router and sglang-router.

One fast upstream process (``_upstream`` mode: an asyncio protocol over httptools on uvloop,
``--replicas`` listening ports that stand for that many replicas) answers
``/v1/chat/completions`` and ``/v1/completions`` with a small fixed JSON body naming the
replica, or with ``"stream": true`` an SSE stream of ``--chunks`` events ``--token-ms`` apart,
then ``data: [DONE]``; keep-alive, TCP_NODELAY. In front of it, in the same run:

* ``direct``: no proxy, the baseline;
* ``llmgw``: our ``Gateway`` (``_gateway`` mode: a RoutingTable with one Target per upstream
  port, no control server), with ``round_robin`` and with ``prefix`` (the default policy),
  and ``llmgw prefix keyed``: ``prefix`` again with a tenant key (issue #18) whose every limit
  (rpm, tpm, concurrency) is checked and counted on every request, none reached: every
  request carries ``Authorization: Bearer`` that key, which the other proxies ignore;
* ``vllm-router`` 0.1.17 and ``sglang-router`` 0.3.2 (PyPI; ``scripts/setup-bench-routers``
  installs them) with ``round_robin`` and with ``cache_aware``, their approximate prefix tree.
  vllm-router's cache_aware tokenizes every request through vLLM's render endpoint on every
  worker before routing it; the upstream answers those with stand-in token ids, as
  ``vllm serve --enable-scale-out`` does, or with ``--render forbidden`` refuses them as plain
  ``vllm serve`` does (vllm-router then routes by load alone).

Every proxy runs in its own process pinned to ``--proxy-cpu``; this process (the load
generator: a raw asyncio HTTP/1.1 keep-alive client on uvloop) and the upstream run on
``--client-cpu``. The requests are chat completions with realistic text: ``--groups`` long
system prompts shared by ``--users`` users each, every user with a question of their own, sent
in a shuffled order. Cells, each ``--reps`` times, the proxies in a rotating order:

* ``rps``: ``--conns`` connections (32), one request in flight on each: requests/s, and the
  proxy's CPU time per request (``utime + stime`` of its process tree from ``/proc``);
* ``lat``: one connection: latency p50/p99 and what the proxy adds to direct's;
* ``stream``: one connection, ``stream: true``: first streamed byte (request written → first
  ``data:`` byte read) p50/p99 and what the proxy adds, and the proxy's CPU per stream.

The proxy's CPU is its own (user + system); the softirq time on its core, where much of
loopback TCP's receive path runs, is shown apart, per request.

Every reply is checked (status, framing, the replica's name, ``[DONE]`` at a stream's end),
and where each group's requests landed is counted: the busiest replica's share shows whether
round-robin spreads, the group stickiness how well a prefix policy keeps a group together.
Other processes' use of the proxy's CPU (of the client's, for direct) is measured from
``/proc/stat``; a cell where they took more than ``--max-others`` percent of it is run again
(the quietest run is kept). With
``--profile DIR``, py-spy then samples each of our gateways under the 32-connection load and
the report says which files and functions the time went to. Everything listens on 127.0.0.1;
every child dies with this process.

This file is the command line and the orchestration; the parts live beside it: gwbench.workload
(the prompts and requests), gwbench.upstream (the fast upstream), gwbench.settings (the proxies
and settings), gwbench.load (the load generator and its cells), gwbench.profile (py-spy), and
gwbench.report (tables, verdicts); what other benchmarks share too is in bench.kit.

    scripts/setup-bench-routers                            # once: the peer routers' venv
    .venv/bin/python -m bench.gateway              # 3 reps, 5-12 min (re-runs)
    .venv/bin/python -m bench.gateway --quick      # 1 rep of short cells, ~2 min
    .venv/bin/python -m bench.gateway --only llmgw # without the peers
    .venv/bin/python -m bench.gateway --markdown --profile /tmp/prof
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, TextIO

import uvloop

from bench.gwbench.load import Cell, Meter, Work, make_work, run_cell, stickiness
from bench.gwbench.profile import Profile, profile_gateways
from bench.gwbench.report import machine, render
from bench.gwbench.settings import (
    BENCH_KEY,
    KINDS,
    PEER_MODULES,
    PEERS,
    PROXIES,
    RENDER,
    ROUTERS_PYTHON,
    Proxy,
    Settings,
    Timing,
)
from bench.gwbench.upstream import run_upstream
from bench.gwbench.workload import MODEL, chat_request, make_prompts
from bench.kit import (
    HOST,
    Child,
    Connection,
    announced_ports,
    interrupt_on_sigterm,
    module_command,
    progress_line,
    quietest,
    require_two_cpus,
    run_interruptible,
    spawn,
)
from llmgw.addresses import free_port

if TYPE_CHECKING:
    from llmgw.gateway.tenants import TenantRegistry

START_TIMEOUT_S: Final = 60.0
RETRY_PAUSE_S: Final = 2.0

# ======================================================================================
# Mode `_gateway`: our Gateway in front of the upstream ports, without a control server
# ======================================================================================


async def run_gateway(args: argparse.Namespace) -> None:
    from llmgw.gateway.app import Gateway, GatewayConfig
    from llmgw.gateway.routing.table import RoutingTable, Target

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    table = RoutingTable()
    table.replace_all(
        Target(replica_id=f"r{i}", model=MODEL, url=f"http://{HOST}:{port}")
        for i, port in enumerate(args.upstreams)
    )
    tenants = keyed_registry() if args.keyed else None
    gateway = Gateway(table, GatewayConfig(host=HOST, port=0, policy=args.policy), tenants=tenants)
    _, port = await gateway.start()
    try:
        print(f"PORT {port}", flush=True)
        await stop.wait()
    finally:
        await gateway.stop()


def keyed_registry() -> TenantRegistry:
    """A registry holding BENCH_KEY, a tenant's key with every limit set (far above what
    the cells send, so none refuses: what is measured is checking and counting them)."""
    from llmgw.api.llmgw.v1 import TenantKey
    from llmgw.gateway.tenants import TenantRegistry

    registry = TenantRegistry()
    key = TenantKey(
        key_id="bench", tenant="bench", models=[MODEL], rpm=4_000_000_000,
        tpm=4_000_000_000, max_concurrency=100_000,
        digest=hashlib.sha256(BENCH_KEY.encode()).digest(),
    )  # fmt: skip
    registry.replace([key])
    return registry


# ======================================================================================
# Orchestration: the child processes and the order of the cells
# ======================================================================================


def _log(workdir: Path, name: str) -> Path:
    return workdir / (name.replace(" ", "-") + ".log")


def peer_argv(proxy: Proxy, port: int, metrics_port: int, upstreams: Sequence[int]) -> list[str]:
    module, log_level = PEER_MODULES[proxy.kind]
    urls = [f"http://{HOST}:{p}" for p in upstreams]
    return [
        str(ROUTERS_PYTHON), "-m", module, "--host", HOST, "--port", str(port),
        "--worker-urls", *urls, "--policy", proxy.policy, "--prometheus-host", HOST,
        "--prometheus-port", str(metrics_port), "--log-level", log_level,
    ]  # fmt: skip


def start_proxy(proxy: Proxy, upstreams: Sequence[int], s: Settings, workdir: Path) -> Child:
    if proxy.kind == "llmgw":
        argv = [*module_command("bench.gateway"), "_gateway", "--policy", proxy.policy,
                "--upstreams", ",".join(map(str, upstreams)),
                *(["--keyed"] if proxy.keyed else [])]  # fmt: skip
        child = spawn(proxy.name, argv, s.proxy_cpu, _log(workdir, proxy.name), announces=True)
        child.ports = announced_ports(child, "PORT", START_TIMEOUT_S)
        return child
    port = free_port()
    argv = peer_argv(proxy, port, free_port(), upstreams)
    child = spawn(proxy.name, argv, s.proxy_cpu, _log(workdir, proxy.name), announces=False)
    child.ports = (port,)
    return child


async def wait_ready(child: Child, probe: bytes) -> None:
    """Until a chat request through ``child`` answers 200 (a router checks its workers first)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    last: object = None
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            break
        try:
            conn = await Connection.open(child.ports[0])
            try:
                async with asyncio.timeout(5):
                    reply = await conn.request(probe)
                if reply.status == 200:
                    return
                last = f"{reply.status} {reply.body[:200]!r}"
            finally:
                conn.close()
        except (OSError, TimeoutError) as exc:
            last = exc
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{child.name} never answered 200 (last: {last}):\n{child.log_tail()}")


Progress = Callable[[Cell], None]


async def quietest_cell(
    proxy: str, ports: Sequence[int], work: Work, meter: Meter, rep: int, s: Settings,
    progress: Progress,
) -> Cell:  # fmt: skip
    """Run a cell, again (at most ``s.attempts`` runs) while others used more than
    ``s.max_others`` of the CPU that matters to it (``Cell.others_share``); the quietest run
    is kept."""

    def run() -> Awaitable[Cell]:
        return run_cell(proxy, ports, work, meter, rep, s.timing)

    return await quietest(run, s.attempts, s.max_others, RETRY_PAUSE_S, progress)


async def run_bench(
    children: Mapping[str, Child], upstream: Child, s: Settings, progress: Progress
) -> tuple[list[Cell], list[Profile]]:
    """Every (rep, kind, proxy) cell, the proxies' order rotating with the rep; then, with
    ``s.profile``, a profile of each of our gateways under the throughput cell's load."""
    prompts = make_prompts(s.groups, s.users, s.prefix_chars, s.question_chars)
    names = ["direct", *children]
    for name, child in children.items():
        await wait_ready(child, chat_request(child.ports[0], prompts[0], stream=False))
        progress_line(f"{name} ready on port {child.ports[0]}")
    cells = []
    for rep in range(s.reps):
        for kind in KINDS:
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                proxy = children.get(name)  # None: direct
                ports = proxy.ports if proxy is not None else upstream.ports
                work = make_work(kind, s, ports, prompts)
                pid = proxy.proc.pid if proxy is not None else None
                meter = Meter(pid, upstream.proc.pid, s.proxy_cpu, s.client_cpu)
                cells.append(await quietest_cell(name, ports, work, meter, rep, s, progress))
                for c in (upstream, *children.values()):
                    if c.proc.poll() is not None:
                        raise RuntimeError(f"{c.name} exited:\n{c.log_tail()}")
    return cells, await profile_gateways(children, s, prompts)


def progress(cell: Cell) -> None:
    extra = f", first data p50 {cell.first_data_us(0.5):7,.0f} µs" if cell.first_data_s else ""
    progress_line(
        f"  rep {cell.rep + 1} {cell.kind:6} {cell.proxy:26}: {cell.rps:7,.0f} req/s, "
        f"p50 {cell.latency_us(0.5):7,.0f} µs, p99 {cell.latency_us(0.99):7,.0f} µs{extra}, "
        f"proxy {cell.cpu_us_per_request:5,.0f} µs/req, sticky {stickiness(cell.routes):.2f}, "
        f"others {100 * cell.others_share:3.0f}%"
        + (f" (attempt {cell.attempts})" if cell.attempts > 1 else "")
    )


# ======================================================================================
# Command line
# ======================================================================================


def parse_main(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.gateway", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    add = p.add_argument
    add("--reps", type=int, default=3, help="repetitions of every cell (3)")
    add("--seconds", type=float, default=3.0, help="measured seconds per cell (3)")
    add("--warmup", type=float, default=1.0, help="seconds before measuring (1)")
    add("--conns", type=int, default=32, help="connections of the throughput cell (32)")
    add("--replicas", type=int, default=4, help="upstream ports, i.e. replicas (4)")
    add("--chunks", type=int, default=8, help="SSE events per streamed reply (8)")
    add("--token-ms", type=float, default=2.0, help="ms between SSE events (2)")
    add(
        "--render",
        choices=RENDER,
        default="tokens",
        help="how the upstream answers vLLM's render endpoints, which vllm-router's cache_aware "
        "calls for every request: tokens (as `vllm serve --enable-scale-out`), or forbidden "
        "(403, as plain `vllm serve`)",
    )
    add("--groups", type=int, default=8, help="shared system prompts (8)")
    add("--users", type=int, default=32, help="users (questions) per system prompt (32)")
    add("--prefix-chars", type=int, default=6000, help="system prompt length (6000)")
    add("--question-chars", type=int, default=600, help="question length (600)")
    add("--proxy-cpu", type=int, default=1)
    add("--client-cpu", type=int, default=0)
    add(
        "--max-others",
        type=float,
        default=10.0,
        help="re-run a cell where other processes used more than this %% of the proxy's CPU",
    )
    add("--attempts", type=int, default=3, help="most runs of one cell (3)")
    add(
        "--only",
        default="llmgw,vllm-router,sglang-router",
        help="proxy kinds to measure besides direct (comma-separated)",
    )
    add(
        "--profile",
        type=Path,
        metavar="DIR",
        help="after the cells, profile our gateway under load with py-spy; raw output in DIR",
    )
    add("--quick", action="store_true", help="1 rep of 1.5 s cells, 0.5 s warmup")
    add("--markdown", action="store_true", help="also print a BENCHMARKS.md section")
    return p.parse_args(argv)  # fmt: skip


def settings_from(args: argparse.Namespace) -> Settings:
    reps, seconds, warmup = (1, 1.5, 0.5) if args.quick else (args.reps, args.seconds, args.warmup)
    kinds = tuple(k for k in args.only.split(",") if k)
    if unknown := set(kinds) - {"llmgw", *PEER_MODULES}:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; choose from llmgw, {PEERS}")
    if set(kinds) & set(PEER_MODULES) and not ROUTERS_PYTHON.exists():
        raise SystemExit(
            f"vllm-router and sglang-router are not installed ({ROUTERS_PYTHON} is missing): "
            "run scripts/setup-bench-routers first, or pass --only llmgw"
        )
    checks = (0 < seconds <= 600, 0 <= warmup <= 60, 1 <= reps <= 50, 1 <= args.conns <= 1024,
              1 <= args.replicas <= 64, 1 <= args.chunks <= 1000, 0 <= args.token_ms <= 1000,
              args.groups >= 1, args.users >= 1, 1 <= args.attempts <= 20)  # fmt: skip
    if not all(checks):
        raise SystemExit("an argument is out of range (see --help)")
    if args.profile is not None:
        if not Path(sys.executable).with_name("py-spy").exists():
            raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy==0.4.3")
        args.profile.mkdir(parents=True, exist_ok=True)
    require_two_cpus(args.proxy_cpu, args.client_cpu, "--proxy-cpu/--client-cpu")
    return Settings(
        Timing(seconds, warmup), reps, args.conns, args.replicas, args.chunks, args.token_ms,
        args.render, args.groups, args.users, args.prefix_chars, args.question_chars,
        args.proxy_cpu, args.client_cpu, args.max_others / 100, args.attempts, kinds,
        args.profile,
    )  # fmt: skip


def start_children(s: Settings, workdir: Path) -> tuple[Child, dict[str, Child]]:
    argv = [*module_command("bench.gateway"), "_upstream", "--replicas", str(s.replicas),
            "--chunks", str(s.chunks), "--token-ms", str(s.token_ms),
            "--render", s.render]  # fmt: skip
    upstream = spawn("upstream", argv, s.client_cpu, _log(workdir, "upstream"), announces=True)
    upstream.ports = announced_ports(upstream, "PORTS", START_TIMEOUT_S)
    children: dict[str, Child] = {}
    try:
        for proxy in PROXIES:
            if proxy.kind in s.kinds:
                children[proxy.name] = start_proxy(proxy, upstream.ports, s, workdir)
    except BaseException:
        for child in (upstream, *children.values()):
            child.stop()
        raise
    return upstream, children


def main_orchestrator(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    args = parse_main(argv)
    s = settings_from(args)
    facts = machine()  # before pinning: nproc counts the CPUs this process may use
    os.sched_setaffinity(0, {s.client_cpu})
    interrupt_on_sigterm()
    cells_per_rep = len(KINDS) * (1 + sum(p.kind in s.kinds for p in PROXIES))
    progress_line(f"bench_gateway: {s.reps} rep(s) x {cells_per_rep} cells")
    with tempfile.TemporaryDirectory(prefix="bench_gateway.") as tmp:
        upstream, children = start_children(s, Path(tmp))
        try:
            bench = run_bench(children, upstream, s, progress)
            cells, profiles = run_interruptible(bench, uvloop.new_event_loop)
        except KeyboardInterrupt:
            progress_line("interrupted; every child process was stopped")
            return 130
        finally:
            for child in (*children.values(), upstream):
                child.stop()
            progress_line(upstream.log_tail(1))
    print(render(s, facts, cells, False, profiles), file=out)
    if args.markdown:
        print("\n" + render(s, facts, cells, True, profiles), file=out)
    return 0


def main(argv: Sequence[str]) -> int:
    if argv[:1] in (["_upstream"], ["_gateway"]):
        p = argparse.ArgumentParser(prog=f"python -m bench.gateway {argv[0]}")
        p.add_argument("--replicas", type=int, default=1)
        p.add_argument("--chunks", type=int, default=8)
        p.add_argument("--token-ms", type=float, default=2.0)
        p.add_argument("--render", choices=RENDER, default="tokens")
        p.add_argument("--policy", default="prefix")
        p.add_argument("--keyed", action="store_true")
        p.add_argument("--upstreams", type=lambda v: [int(x) for x in v.split(",")], default=[])
        args = p.parse_args(argv[1:])
        serve = run_upstream if argv[0] == "_upstream" else run_gateway
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(args))
        return 0
    return main_orchestrator(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
