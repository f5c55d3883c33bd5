#!/usr/bin/env python3
"""Chaos: a simulated cluster under steady load, killed and hung at random, then checked.

On 127.0.0.1, in a temporary directory: ``llmgw server`` (a state database, its gateway
off), ``llmgw gateway --debug-kv-index`` following it (a separate process, so a server
fault is not on any request's path), three ``llmgw agent --simulate dgx-h100`` nodes running
``llmgw sim-engine`` as their engine, and two deployments applied through the API: ``chat``
(3 replicas, KV events on) and ``code`` (2 replicas of TP 2, KV events off). A steady load of
chat completions (shared system prompts, streamed or not) goes through the gateway while,
for ``--duration`` seconds, a fault every few seconds SIGKILLs the server, an agent or an
engine, SIGSTOPs the server, an agent, an engine or the gateway for a few seconds, fills
the server's state disk (a small tmpfs the run mounts when it may: root; else that fault is
left out, saying so) and frees it (chaoskit.faults, chaoskit.disk), or runs a duplicate agent
(a copy of an agent's state dir and node id) for a few seconds. A sampler looks at the
cluster twice a second (chaoskit.observe).
Then the faults stop and the run checks (chaoskit.checks): desired state kept, never two
copies of a replica, every deployment back at its count within ``--bound`` seconds of the
last fault, no failed request but those on a faulted process, the gateway's KV index
equal to each engine's cache (the simulated engine's ``/debug/kv_cache``), no process
exited by itself, the server writable again after each fill of its disk, and every
duplicate agent refused. Exit status 0 only when every check passes.

    .venv/bin/python -m bench.chaos                      # 10 minutes of faults
    .venv/bin/python -m bench.chaos --duration 120 --seed 7
    .venv/bin/python -m bench.chaos --markdown           # a BENCHMARKS.md section
    .venv/bin/python -m bench.chaos --duration 90 --kinds duplicate-agent,kill-agent

With ``--servers N`` (N >= 2) the run has N servers on one private PostgreSQL
(bench/pgcluster.py) sharing its leader lease, two separate gateways (``--gateways K``,
1 to 4; one with a single server) that the load takes in turn, the agents and the gateways
given all the servers' gRPC addresses, the run's own reads asked of each server in turn (a
follower refuses: chaoskit.ha). ``kill-server``/``stop-server`` then aim at the leader most
of the time (each such fault's failover measured: the signal → another server says it leads
at a higher epoch; p50 and max in the report), at a follower sometimes; ``kill-postgres``
and ``stop-postgres`` are added, ``fill-disk`` (SQLite's state disk) is left out; and a check
more: no two servers said they lead at once (every sample reads each server's /metrics).
``stop-gateway`` hangs one of the gateways (drawn by the seed) and explains only failures of
requests that went through it; the KV check reads every gateway's index.

    .venv/bin/python -m bench.chaos --duration 60 --servers 3

Progress goes to stderr; the report to stdout (``--json FILE`` writes it as JSON too). Every
process the run started, engines included, is killed at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Final

import httpx

from bench.chaoskit.checks import (
    Check,
    check_convergence,
    check_copies,
    check_desired,
    check_disk,
    check_duplicates,
    check_kv,
    check_one_leader,
    check_requests,
    converged_at,
    recovery_times,
)
from bench.chaoskit.cluster import (
    MAX_GATEWAYS,
    RUN_ENV,
    AgentOptions,
    ChaosCluster,
    ServerOptions,
)
from bench.chaoskit.disk import SIZE as DISK_SIZE
from bench.chaoskit.disk import StateDisk
from bench.chaoskit.faults import ALL_KINDS, KINDS, PG_KINDS, FaultConfig, FaultLoop, FaultRecord
from bench.chaoskit.ha import LEADER_SHARE, LeaderClient, Postgres
from bench.chaoskit.load import Load, LoadConfig, RequestRecord, by_gateway, summarize
from bench.chaoskit.observe import KvReading, Sampler, read_kv, ready_by_deployment
from bench.chaoskit.report import ChaosReport, render_json, render_markdown, render_text
from bench.kit import command_line, interrupt_on_sigterm, progress_line
from bench.pgcluster import find_bindir, private_cluster
from llmgw.api.llmgw.v1 import (
    ApplyDeploymentRequest,
    Cluster,
    Deployment,
    EngineProfile,
    NodeState,
    ShardState,
)
from llmgw.cli.demo import state_dir
from llmgw.client import ClientError
from llmgw.client.channel import Timeouts
from llmgw.server.core.profiles import parse_document

log = logging.getLogger("chaos")

NODES: Final = ("node-a", "node-b", "node-c")
FRESH_GATEWAY: Final = "fresh-gateway"  # started at the end: the server's KV store as sent
DOCUMENT: Final = """\
[profiles.chat-sim]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/chat"
served_model_name = "chat"
kv_events = true
args = ["--sim-decode-ms-per-token", "5", "--sim-kv-blocks", "{kv_blocks}"]

[deployments.chat]
profile = "chat-sim"
replicas = 3

[profiles.code-sim]
engine = "sim"
gpu_class = "H100"
tp = 2
model_path = "/models/code"
served_model_name = "code"
kv_events = false
args = ["--sim-decode-ms-per-token", "5"]

[deployments.code]
profile = "code-sim"
replicas = 2
"""


@dataclass(frozen=True, slots=True)
class Options:
    duration_s: float
    seed: int
    rate: float
    bound_s: float
    slack_s: float
    kv_blocks: int
    kinds: tuple[str, ...]
    run_id: str
    in_turn: bool = False
    servers: int = 1
    lease_ttl_s: float = 3.0  # with several servers: their --lease-ttl
    gateways: int = 1  # separate gateways the load goes through


# -- phases --------------------------------------------------------------------------------


async def _until(what: str, timeout_s: float, check: Callable[[], Awaitable[bool]]) -> None:
    """Poll ``check`` until it says True; RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.3)
    raise RuntimeError(f"timed out after {timeout_s:g}s waiting for {what}")


async def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        async with httpx.AsyncClient(timeout=2.0) as http:
            return (await http.get(url)).status_code == 200
    return False


async def _cluster(client: LeaderClient) -> Cluster | None:
    with contextlib.suppress(ClientError, TimeoutError):
        async with asyncio.timeout(3.0):
            return await client.get_cluster()
    return None


async def _start(cluster: ChaosCluster, client: LeaderClient) -> None:
    for server in cluster.servers:
        cluster.start(server)

    async def leader_healthy() -> bool:  # a follower's /healthz is 503
        return any([await _answers(f"{web}/healthz") for web in cluster.server_web.values()])

    await _until("a server's /healthz (the leader's)", 60, leader_healthy)
    for gateway in cluster.load_gateways:
        cluster.start(gateway)
    for node in cluster.nodes:
        cluster.start(node)
    for gateway, url in cluster.load_gateway_urls.items():
        await _until(f"{gateway}'s /healthz", 30, partial(_answers, f"{url}/healthz"))

    async def nodes_ready() -> bool:
        found = await _cluster(client)
        ready = sum(n.state == NodeState.READY for n in found.nodes) if found else 0
        return ready == len(cluster.nodes)

    await _until("every node READY", 60, nodes_ready)


async def _apply(client: LeaderClient, document_text: str) -> dict[str, int]:
    document = parse_document(document_text, source="bench/chaos.py")
    for deployment in document.deployments.values():
        profile = document.profiles[deployment.profile]
        request = ApplyDeploymentRequest(
            deployment=deployment, profiles=[profile], document=document_text
        )
        result = await client.apply_deployment(request)
        progress_line(f"chaos: {result.message}")
    return {name: d.replicas for name, d in document.deployments.items()}


async def _at_count(client: LeaderClient, counts: dict[str, int]) -> bool:
    found = await _cluster(client)
    return found is not None and ready_by_deployment(found) == counts


async def _wait_at_count(client: LeaderClient, counts: dict[str, int], give_up_s: float) -> None:
    """Until every deployment is at its count READY, or ``give_up_s`` (the sampler's record
    says when it was, for the check)."""
    with contextlib.suppress(RuntimeError):
        await _until("every deployment at its count", give_up_s, lambda: _at_count(client, counts))


async def _kv_settled(
    client: LeaderClient, gateways: dict[str, str], kv_models: set[str]
) -> KvReading:
    """Both sides of the KV check, read again until they agree (at most 15 s)."""
    reading = KvReading({}, {})
    deadline = time.monotonic() + 15
    async with httpx.AsyncClient(timeout=5.0) as http:
        while time.monotonic() < deadline:
            found = await _cluster(client)
            replicas = [
                (r.replica_id, r.endpoint)
                for r in (found.replicas if found else [])
                if r.model in kv_models and r.state == ShardState.READY and r.endpoint
            ]
            reading = await read_kv(http, gateways, replicas)
            if replicas and not reading.differences():
                return reading
            await asyncio.sleep(1.0)
    return reading


# -- the run -------------------------------------------------------------------------------


async def _run(cluster: ChaosCluster, opts: Options, postgres: Postgres | None) -> ChaosReport:
    rng = random.Random(opts.seed)
    document_text = DOCUMENT.replace("{kv_blocks}", str(opts.kv_blocks))
    timeouts = Timeouts(connect=1.0, call=3.0)
    async with LeaderClient(list(cluster.server_web.values()), timeouts) as client:
        progress_line(f"chaos: starting the cluster under {cluster.root}")
        await _start(cluster, client)
        counts = await _apply(client, document_text)
        await _until("every deployment READY", 120, lambda: _at_count(client, counts))
        for gateway, url in cluster.load_gateway_urls.items():
            await _until(f"{gateway} serving", 30, partial(_serves, url, counts))
        progress_line(f"chaos: {sum(counts.values())} replicas READY; faults for "
                      f"{opts.duration_s:g}s")  # fmt: skip
        desired = (document_text, counts)
        return await _under_faults(cluster, client, opts, rng, desired, postgres)


async def _serves(gateway: str, counts: dict[str, int]) -> bool:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        async with httpx.AsyncClient(timeout=2.0) as http:
            models = (await http.get(f"{gateway}/v1/models")).json()["data"]
        return {m["id"] for m in models} >= set(counts)
    return False


async def _under_faults(
    cluster: ChaosCluster, client: LeaderClient, opts: Options, rng: random.Random,
    desired: tuple[str, dict[str, int]], postgres: Postgres | None,
) -> ChaosReport:  # fmt: skip
    document_text, counts = desired
    load = Load(cluster.load_gateway_urls, LoadConfig(rate=opts.rate), random.Random(rng.random()))
    several = len(cluster.servers) > 1
    sampler = Sampler(cluster, client, webs=cluster.server_web if several else None)
    config = FaultConfig(opts.duration_s, kinds=opts.kinds, in_turn=opts.in_turn)
    faults = FaultLoop(cluster, config, rng, postgres)
    stop_load, stop_sampler = asyncio.Event(), asyncio.Event()
    async with asyncio.TaskGroup() as tasks:
        sampling = tasks.create_task(sampler.run(stop_sampler))
        loading = tasks.create_task(load.run(stop_load))
        try:
            started = time.monotonic()
            await faults.run(asyncio.Event())
            last = max((f.ended for f in faults.records), default=started)
            progress_line(f"chaos: {len(faults.records)} faults; waiting for the counts")
            await _wait_at_count(client, counts, max(2 * opts.bound_s, 120.0))
            await asyncio.sleep(3.0)  # the load goes on a little on the healed cluster
        finally:
            stop_load.set()
            await loading
            stop_sampler.set()
            await sampling
    progress_line("chaos: checking")
    kv = await _kv_settled(client, await _fresh_gateway(cluster), _kv_models(document_text))
    held = await _held(client)
    checks = (
        check_desired(_applied(document_text), held),
        check_copies(sampler.samples, orphan_grace_s=15.0),
        check_convergence(last, converged_at(sampler.samples, last, counts), opts.bound_s),
        check_requests(load.records, faults.records, opts.slack_s),
        check_kv(
            kv.differences(), {r: len(k or ()) for r, k in kv.engines.items()}, tuple(kv.indexes)
        ),  # fmt: skip
        _check_exits(cluster),
        check_disk(faults.records, opts.bound_s),
        check_duplicates(
            {name: (cluster.logs / f"{name}.log").read_text() for name in cluster.duplicates()}
        ),
        *((check_one_leader(sampler.samples),) if several else ()),
    )
    settings = _settings(opts, len(sampler.samples), load.skipped, cluster.state_disk)
    settings["load"] += _through_line(load.records)
    if several:
        settings["leader failover"] = failover_line(faults.records)
    return ChaosReport(
        command=command_line(),
        settings=settings,
        faults=tuple(faults.records),
        recoveries=tuple(recovery_times(faults.records, sampler.samples, counts)),
        requests=summarize(load.records),
        checks=checks,
    )


async def _fresh_gateway(cluster: ChaosCluster) -> dict[str, str]:
    """The load's gateways and a new one: the new one's index is the server's KV store as a
    snapshot sends it, so a difference tells the server's store from the old gateways'."""
    url = cluster.add_gateway(FRESH_GATEWAY)
    cluster.start(FRESH_GATEWAY)
    await _until("a fresh gateway", 30, lambda: _answers(f"{url}/healthz"))
    return {**cluster.load_gateway_urls, FRESH_GATEWAY: url}


def _kv_models(document_text: str) -> set[str]:
    document = parse_document(document_text, source="bench/chaos.py")
    return {p.served_model_name for p in document.profiles.values() if p.kv_events}


def _applied(document_text: str) -> tuple[list[Deployment], list[EngineProfile]]:
    document = parse_document(document_text, source="bench/chaos.py")
    return list(document.deployments.values()), list(document.profiles.values())


async def _held(client: LeaderClient) -> tuple[list[Deployment], list[EngineProfile]] | None:
    with contextlib.suppress(ClientError, TimeoutError):
        async with asyncio.timeout(10.0):
            deployments = (await client.get_cluster()).deployments
            return list(deployments), await client.list_profiles()
    return None


def _check_exits(cluster: ChaosCluster) -> Check:
    exited = cluster.exited()
    details = tuple(f"{name} exited by itself with status {code}" for name, code in exited.items())
    summary = (
        f"{len(cluster.servers)} server(s), {len(cluster.gateways)} gateway(s) (the fresh one "
        f"included) and {len(cluster.nodes)} agents running at the end"
        if not exited
        else f"{len(exited)} exited by themselves (logs: {cluster.logs})"
    )
    return Check("no process crashed", not exited, summary, details)


def _settings(opts: Options, samples: int, skipped: int, disk: StateDisk | None) -> dict[str, str]:
    agents = AgentOptions()
    state = (
        f"the server's database on a {DISK_SIZE} tmpfs; fill-disk fills it for 2-6 s, frees "
        "it for 0.3-1 s, fills it for 1-3 s more and frees it"
        if disk is not None
        else "the server's database in the run's directory (no fill-disk)"
    )
    if opts.servers > 1:
        state = (
            f"{opts.servers} servers (--lease-ttl {opts.lease_ttl_s:g}) on one private "
            "PostgreSQL database (bench/pgcluster.py); fill-disk is SQLite-only: left out"
        )
    return {
        "state disk": state,
        "cluster": f"{opts.servers} server(s) (gateway off) + {_gateways_words(opts.gateways)}, "
        f"{len(NODES)} simulated "
        f"{agents.fixture} agents (engine restart backoff {agents.restart_backoff_s:g} s "
        f"doubling to {agents.restart_backoff_max_s:g} s), all on 127.0.0.1",
        "deployments": "chat: 3 replicas, TP 1, KV events on (sim engine, "
        f"{opts.kv_blocks} KV blocks of 16 tokens); code: 2 replicas, TP 2, KV events off",
        "faults": f"{opts.duration_s:g} s, one at a time every 2-6 s, kinds"
        f"{' in turn' if opts.in_turn else ''}: "
        f"{', '.join(opts.kinds)}; kills restart after 0.5-3 s, stops last 2-6 s, "
        "a duplicate agent runs 3-8 s"
        + (
            f"; server faults on the leader {LEADER_SHARE:.0%} of the time; kill-postgres "
            "restarts it after 2.5-5 s"
            if opts.servers > 1
            else ""
        ),
        "load": f"~{opts.rate:g} chat completions/s through "
        f"{'the gateway' if opts.gateways == 1 else f'{opts.gateways} gateways in turn'}, "
        "half streamed, "
        f"3 shared system prompts, 4-24 tokens ({skipped} arrivals skipped at 32 in flight)",
        "bounds": f"back at count within {opts.bound_s:g} s of the last fault; a failed request "
        f"is explained by a fault on its path it overlapped within {opts.slack_s:g} s",
        "sampler": f"{samples} samples of GetCluster and /proc, every 0.5 s",
        "seed": str(opts.seed),
    }


def _gateways_words(count: int) -> str:
    return "one separate `llmgw gateway`" if count == 1 else (
        f"{count} separate `llmgw gateway`s, each given every server"
    )  # fmt: skip


def _through_line(records: Sequence[RequestRecord]) -> str:
    """Per gateway, how many requests went through it and how many of those failed."""
    counts = by_gateway(records)
    if len(counts) < 2:
        return ""
    return "; through " + ", ".join(
        f"{name} {sent} ({failed} failed)" for name, (sent, failed) in counts.items()
    )


def failover_line(records: Sequence[FaultRecord]) -> str:
    """The failovers of the faults on the leader: how many, p50 and max, and how many saw
    no other server lead (within chaoskit.ha.FAILOVER_TIMEOUT_S)."""
    on_leader = [r for r in records if r.leader]
    took = sorted(r.failover_s for r in on_leader if r.failover_s is not None)
    if not on_leader:
        return "no fault hit the leader"
    figures = f"p50 {statistics.median(took):.2f} s, max {took[-1]:.2f} s" if took else "none seen"
    kinds = ", ".join(f"{k} {sum(r.kind == k for r in on_leader)}"
                      for k in ("kill-server", "stop-server"))  # fmt: skip
    return (
        f"{len(on_leader)} faults on the leader ({kinds}): the signal → another server "
        f"says llmgw_leader 1 at a higher epoch: {figures}; "
        f"{len(on_leader) - len(took)} with no other leader within 30 s"
    )


# -- the command line ----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.chaos", description=__doc__.split("\n\n")[0] if __doc__ else ""
    )
    p.add_argument("--duration", type=float, default=600.0, help="seconds of faults (600)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: from the time)")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (4)")
    p.add_argument("--bound", type=float, default=60.0,
                   help="seconds after the last fault to be back at count (60)")  # fmt: skip
    p.add_argument("--slack", type=float, default=1.0,
                   help="seconds a failure may trail the fault that explains it (1)")  # fmt: skip
    p.add_argument("--kv-blocks", type=int, default=512,
                   help="KV blocks per chat engine: few, so blocks get evicted (512)")  # fmt: skip
    p.add_argument("--kinds", default=None,
                   help="fault kinds, comma-separated (default: all that apply)")  # fmt: skip
    p.add_argument("--servers", type=int, default=1,
                   help="servers; 2 or more share one private PostgreSQL (1)")  # fmt: skip
    p.add_argument("--gateways", type=int, default=None,
                   help=f"separate gateways the load takes in turn, 1 to {MAX_GATEWAYS} "
                   "(default: 2 with --servers >= 2, else 1)")  # fmt: skip
    p.add_argument("--lease-ttl", type=float, default=3.0,
                   help="with --servers >= 2: the servers' --lease-ttl (3)")  # fmt: skip
    p.add_argument("--in-turn", action="store_true",
                   help="each kind in turn (a seeded shuffle) instead of at random")  # fmt: skip
    p.add_argument("--state-dir", type=Path, default=None,
                   help="keep the run's database and logs here (default: a temp dir)")  # fmt: skip
    p.add_argument("--run-id", default=None,
                   help=f"${RUN_ENV} of every process of the run (default: random)")  # fmt: skip
    p.add_argument("--markdown", action="store_true", help="print a BENCHMARKS.md section")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON")
    return p


def _options(args: argparse.Namespace) -> Options:
    if args.servers < 1:
        raise SystemExit(f"chaos: --servers {args.servers}: 1 or more")
    known = KINDS if args.servers == 1 else (*(k for k in KINDS if k != "fill-disk"), *PG_KINDS)
    text = args.kinds if args.kinds is not None else ",".join(known)
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown or not kinds:
        raise SystemExit(f"chaos: unknown fault kinds {unknown}; known: {', '.join(ALL_KINDS)}")
    misplaced = [k for k in kinds if k not in known]
    if misplaced:
        raise SystemExit(
            f"chaos: {', '.join(misplaced)} not with --servers {args.servers} "
            f"(fill-disk: one SQLite server only; *-postgres: --servers 2 or more)"
        )
    gateways = args.gateways if args.gateways is not None else (2 if args.servers > 1 else 1)
    if not 1 <= gateways <= MAX_GATEWAYS:
        raise SystemExit(f"chaos: --gateways {gateways}: 1 to {MAX_GATEWAYS}")
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    run_id = args.run_id or f"chaos-{uuid.uuid4().hex[:12]}"
    return Options(args.duration, seed, args.rate, args.bound, args.slack, args.kv_blocks,
                   kinds, run_id, args.in_turn, args.servers, args.lease_ttl,
                   gateways)  # fmt: skip


def _state_disk(root: Path, opts: Options) -> tuple[StateDisk | None, Options]:
    """The tmpfs for the server's database when fill-disk is among the kinds and it can be
    mounted; else none, and fill-disk left out (said on stderr)."""
    if "fill-disk" not in opts.kinds:
        return None, opts
    disk = StateDisk(root / "state-disk")
    why = disk.mount()
    if why is None:
        return disk, opts
    kinds = tuple(k for k in opts.kinds if k != "fill-disk")
    progress_line(f"chaos: fill-disk left out: cannot mount a tmpfs for the state ({why})")
    if not kinds:
        raise SystemExit("chaos: no fault kind left to run")
    return None, replace(opts, kinds=kinds)


def _run_on_postgres(root: Path, opts: Options) -> ChaosReport:
    """The run with ``opts.servers`` servers on a private PostgreSQL cluster."""
    bindir = find_bindir()
    if bindir is None:
        raise SystemExit("chaos: --servers >= 2 needs PostgreSQL (apt-get install postgresql)")
    with private_cluster(bindir) as pg:
        cluster = ChaosCluster(
            root, NODES, opts.run_id, AgentOptions(),
            servers=ServerOptions(opts.servers, pg.url("postgres"), opts.lease_ttl_s),
            gateways=opts.gateways,
        )  # fmt: skip
        try:
            return asyncio.run(_run(cluster, opts, Postgres(pg)))
        finally:
            cluster.close()


def main() -> int:
    args = _parser().parse_args()
    opts = _options(args)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    logging.getLogger("chaos").setLevel(logging.INFO)
    interrupt_on_sigterm()
    with state_dir(args.state_dir, prefix="llmgw-chaos-") as root:
        if opts.servers > 1:
            report = _run_on_postgres(root, opts)
        else:
            disk, opts = _state_disk(root, opts)
            cluster = ChaosCluster(root, NODES, opts.run_id, AgentOptions(), state_disk=disk,
                                   gateways=opts.gateways)  # fmt: skip
            try:
                report = asyncio.run(_run(cluster, opts, None))
            finally:
                cluster.close()
                if disk is not None:
                    disk.close()
    sys.stdout.write((render_markdown(report) if args.markdown else render_text(report)) + "\n")
    if args.json is not None:
        args.json.write_text(render_json(report))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
