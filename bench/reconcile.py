#!/usr/bin/env python3
"""Benchmark: planning a large fleet (placement as the reconciler runs it).

A fleet of ``--nodes`` simulated ``dgx-h100`` nodes (8 × H100 each, two NUMA halves on
NVSwitch, 8 InfiniBand HCAs) is built as the operator API's ``Node`` messages: half the
nodes on InfiniBand fabric ``ib-a`` and half on ``ib-b``, 1% cordoned, 0.5% NOT_READY,
one GPU in 200 unhealthy (by telemetry), a tenth of the nodes in pool ``batch``. Then a
mix of deployments (TP=8 × PP=2 over two nodes, TP=8, TP=4, TP=2, TP=1; ``--replicas`` in
all) is placed, largest first, each deployment seeing what the ones before it took, as a
reconciler would on a cold start.

Measured separately, each as the median of ``--repeat`` runs:

* ``node_capacity``: the placement view of every node, from its ``Node`` message;
* ``place_deployment``: every replica of every deployment;
* the baseline: a naive first-fit placement over the same views in the same run (first
  node in id order with enough free GPUs of the class, the first free GPUs by index,
  ignoring NUMA, NVLink, spread and pools), for the ratio.

Besides time, the quality of each plan: the share of multi-GPU shards whose GPUs are all
NVLink peers within one NUMA node (or, for a shard larger than a NUMA node, all NVLink
peers), and the most replicas of one deployment on one node. The same two placements are
also run (untimed) with the deployments in the opposite order, smallest TP first: spreading
small replicas over every node then leaves no node with 8 free GPUs for the TP=8 ones, so a
reconciler should place deployments largest shard first, as the timed run does.

Then **whole reconciliation rounds** as the server runs them: a real ``ControlPlane`` over a
SQLite file with every node registered (and the cordoned ones cordoned, the NOT_READY
ones disconnected), the deployments applied through ``ControlService.apply_deployment``,
and ``ReconcileLoop.round()`` with a sender that records commands:

* the cold round: decide (node views, placement of every replica, a START per shard),
  store every record in one transaction, hand every command to the sender, audit;
* the steady round, after every started shard is reported READY: it must send nothing;
* the idle round: the steady round again after ``--idle-deployments`` more deployments of
  ``replicas = 0`` were applied in one document (a huge apply): what every round costs
  the event loop for deployments with nothing to do, once a second; it must send nothing;
* a reprofile round: one deployment points at a new profile, and the round places its
  surge replica.

    .venv/bin/python -m bench.reconcile             # 1,000 nodes, 2,000 replicas
    .venv/bin/python -m bench.reconcile --markdown  # also a BENCHMARKS.md section
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.kit import base_machine, command_line
from bench.pgrun import BACKENDS, backends, postgres
from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    ApplyDeploymentRequest,
    ControlMessage,
    Deployment,
    EngineProfile,
    GpuTelemetry,
    Health,
    Heartbeat,
    Node,
    NodeState,
    NodeTelemetry,
    Register,
    ReprofileReplicaRequest,
    ShardState,
    ShardStatus,
)
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server.core.capacity import NodeCapacity, node_capacity
from llmgw.server.core.placement import Taken, place_deployment
from llmgw.server.core.plan import ReplicaPlan, ShardPlan, Unplaceable
from llmgw.server.core.reconcile_state import ReplicaRecord
from llmgw.server.reconcile_loop import ReconcileLoop
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.controlsvc import ControlService

TARGET_S = 1.0
PORTS = (20000, 29999)

# (deployment, tp, pp, nodes, share of the replicas); placed in this order
MIX = (
    ("train-tp8x2", 8, 2, 2, 0.004),
    ("big-tp8", 8, 1, 1, 0.075),
    ("mid-tp4", 4, 1, 1, 0.175),
    ("chat-tp2", 2, 1, 1, 0.30),
    ("small-tp1", 1, 1, 1, 0.446),
)


@dataclass(frozen=True, slots=True)
class Work:
    """One deployment to place: its profile, its deployment and how many replicas."""

    profile: EngineProfile
    deployment: Deployment
    replicas: int


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one planning run produced."""

    placed: int
    unplaceable: int
    nvlink_numa_share: float  # multi-GPU shards on NVLink peers of one NUMA node
    max_per_node: int  # most replicas of one deployment on one node


# --- the fleet and the work --------------------------------------------------------------


def fleet(count: int) -> list[Node]:
    nodes = []
    for i in range(count):
        node_id = f"dgx-{i:04d}"
        info = simulated_node("dgx-h100", node_id=node_id, hostname=node_id)
        for att in info.fabrics:
            att.fabric = "ib-a" if i < count // 2 else "ib-b"
        if i % 10 == 9:
            info.labels = {"pool": "batch"}
        sick = [
            GpuTelemetry(uuid=g.uuid, health=Health.UNHEALTHY, memory_used_bytes=0)
            for g in info.gpus
            if (i * 8 + g.index) % 200 == 7
        ]
        state = NodeState.READY
        if i % 100 == 42:
            state = NodeState.CORDONED
        elif i % 200 == 99:
            state = NodeState.NOT_READY
        nodes.append(
            Node(
                info=info,
                state=state,
                cordoned=state is NodeState.CORDONED,
                telemetry=NodeTelemetry(node_id=node_id, gpus=sick),
            )
        )
    return nodes


def workload(replicas: int) -> list[Work]:
    works = []
    left = replicas
    for n, (name, tp, pp, nodes, share) in enumerate(MIX):
        count = left if n == len(MIX) - 1 else round(replicas * share)
        left -= count
        profile = EngineProfile(
            name=f"{name}-p", engine="sim", gpu_class="H100", tp=tp, pp=pp,
            model_path=f"/models/{name}", served_model_name=name,
        )  # fmt: skip
        profile.nodes = nodes
        works.append(Work(profile, Deployment(name=name, profile=profile.name), count))
    return works


# --- ours and the baseline ---------------------------------------------------------------


def plan_ours(
    nodes: Sequence[NodeCapacity], works: Sequence[Work]
) -> list[ReplicaPlan | Unplaceable]:
    used: dict[str, frozenset[str]] = {}
    ports: dict[str, frozenset[int]] = {}
    results: list[ReplicaPlan | Unplaceable] = []
    for work in works:
        ids = [f"{work.deployment.name}-{i}" for i in range(work.replicas)]
        placed = place_deployment(
            nodes,
            work.profile,
            work.deployment,
            replica_ids=ids,
            fingerprint="bench",
            taken=Taken(devices=used, ports=ports),
            port_range=PORTS,
        )
        for plan in placed:
            if isinstance(plan, ReplicaPlan):
                for shard in plan.shards:
                    used[shard.node_id] = used.get(shard.node_id, frozenset()) | set(
                        shard.gpu_uuids
                    )
                    ports[shard.node_id] = ports.get(shard.node_id, frozenset()) | {shard.port}
                if plan.master_port:
                    leader = plan.leader.node_id
                    ports[leader] = ports[leader] | {plan.master_port}
        results.extend(placed)
    return results


def plan_first_fit(
    nodes: Sequence[NodeCapacity], works: Sequence[Work]
) -> list[ReplicaPlan | Unplaceable]:
    """First fit: the first nodes (by id) with enough free GPUs, their first free GPUs."""
    ordered = sorted(nodes, key=lambda n: n.node_id)
    free = {n.node_id: [d.uuid for d in n.devices if d.healthy] for n in ordered}
    next_port = dict.fromkeys(free, PORTS[0])
    results: list[ReplicaPlan | Unplaceable] = []
    for work in works:
        per_node = work.profile.tp * work.profile.pp // work.profile.nodes
        for i in range(work.replicas):
            shards: list[ShardPlan] = []
            for node in ordered:
                if node.schedulable and len(free[node.node_id]) >= per_node:
                    taken, free[node.node_id] = (
                        free[node.node_id][:per_node],
                        free[node.node_id][per_node:],
                    )
                    port = next_port[node.node_id]
                    next_port[node.node_id] += 1
                    shards.append(
                        ShardPlan(
                            f"r{i}.{len(shards)}", node.node_id, len(shards), tuple(taken), port
                        )
                    )
                    if len(shards) == work.profile.nodes:
                        break
            if len(shards) < work.profile.nodes:
                results.append(Unplaceable("no room"))
                continue
            results.append(
                ReplicaPlan(f"r{i}", work.deployment.name, work.profile.name, "", tuple(shards))
            )
    return results


# --- measuring ---------------------------------------------------------------------------


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    times = []
    result: object = None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def outcome(nodes: Sequence[NodeCapacity], results: Sequence[ReplicaPlan | Unplaceable]) -> Outcome:
    devices = {n.node_id: {d.uuid: d for d in n.devices} for n in nodes}
    half = {n.node_id: max(Counter(d.numa_node for d in n.devices).values()) for n in nodes}
    multi = tight = 0
    per_node: Counter[tuple[str, str]] = Counter()
    for plan in (r for r in results if isinstance(r, ReplicaPlan)):
        for shard in plan.shards:
            per_node[plan.deployment, shard.node_id] += 1
            if len(shard.gpu_uuids) > 1:
                multi += 1
                group = [devices[shard.node_id][u] for u in shard.gpu_uuids]
                one_numa = len({d.numa_node for d in group}) == 1
                linked = all(b.index in a.nvlink_peers for a in group for b in group if a is not b)
                tight += linked and (one_numa or len(group) > half[shard.node_id])
    placed = sum(isinstance(r, ReplicaPlan) for r in results)
    return Outcome(
        placed=placed,
        unplaceable=len(results) - placed,
        nvlink_numa_share=tight / multi if multi else 1.0,
        max_per_node=max(per_node.values(), default=0),
    )


# --- whole rounds, as the server runs them -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rounds:
    """Times of whole ``ReconcileLoop.round()`` calls and what each sent."""

    cold_s: float
    cold_commands: int
    placed: int
    steady_s: float
    steady_commands: int
    reprofile_s: float
    reprofile_commands: int
    idle_deployments: int
    idle_s: float
    idle_commands: int
    cold_writes: tuple[int, int, float]  # save_replicas in the cold round: calls, rows, s


class Recorder:
    """The agents' side of the stream: records each command; reports started shards."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, ControlMessage]] = []

    async def send(self, node_id: str, message: ControlMessage) -> bool:
        self.sent.append((node_id, message))
        return True

    def take(self) -> list[tuple[str, ControlMessage]]:
        sent, self.sent = self.sent, []
        return sent


Live = dict[str, tuple[int, Heartbeat]]  # node id → its connection and its heartbeat


async def registered(plane: ControlPlane, messages: Sequence[Node]) -> Live:
    """Every node registered as its agent would, then cordoned, lost or sick as set; the
    connection and heartbeat of each live node (:func:`beat`)."""
    live: Live = {}
    for i, node in enumerate(messages):
        info = node.info
        assert info is not None, node
        info.management_address = f"10.{i // 250}.{i % 250}.1"
        register = Register(protocol_version=PROTOCOL_VERSION, node=info)
        connection = await plane.register(info, register, peer=f"{info.management_address}:1")
        if node.state is NodeState.CORDONED:
            await plane.set_cordoned(info.node_id, True, actor="bench")
        if node.state is NodeState.NOT_READY:
            plane.disconnect(info.node_id, connection, "bench: lost")
            continue
        gpus = node.telemetry.gpus if node.telemetry is not None else []
        live[info.node_id] = connection, Heartbeat(seq=1, gpus=gpus)
    beat(plane, live)
    return live


def beat(plane: ControlPlane, live: Live) -> None:
    """A heartbeat from every live node, as their agents send one a second: a node silent
    for the inventory's grace (5 s: registering 1,000 nodes and applying takes longer) is
    NOT_READY, and the reconciler places nothing there."""
    for node_id, (connection, heartbeat) in live.items():
        plane.heartbeat(node_id, connection, heartbeat)


def report_ready(plane: ControlPlane, sent: Sequence[tuple[str, ControlMessage]]) -> None:
    for node_id, message in sent:
        start = message.start_shard
        if start is not None:
            status = ShardStatus(
                shard_id=start.shard_id,
                replica_id=start.replica_id,
                rank=start.rank,
                state=ShardState.READY,
                profile_fingerprint=start.profile_fingerprint,
            )
            plane.shard_status(node_id, status)


async def timed_round(loop: ReconcileLoop, agents: Recorder, live: Live) -> tuple[float, int]:
    beat(loop.plane, live)
    start = time.perf_counter()
    await loop.round()
    return time.perf_counter() - start, len(agents.sent)


def timed_writes(store: Store) -> list[tuple[int, float]]:
    """Wrap ``store.save_replicas`` (this instance only): each call's rows and seconds are
    appended to the list returned."""
    calls: list[tuple[int, float]] = []
    save = store.save_replicas

    async def save_timed(records: Iterable[ReplicaRecord]) -> None:
        rows, start = list(records), time.perf_counter()
        await save(rows)
        calls.append((len(rows), time.perf_counter() - start))

    store.save_replicas = save_timed  # type: ignore[method-assign]
    return calls


async def whole_rounds(
    messages: Sequence[Node], works: Sequence[Work], idle: int, db: Path | str
) -> Rounds:
    """Whole rounds on a new store at ``db``: an SQLite file's path or a PostgreSQL URL."""
    async with Store(db) as store:
        writes = timed_writes(store)
        plane = ControlPlane(store)
        live = await registered(plane, messages)
        service = ControlService(plane)
        for work in sorted(works, key=lambda w: -w.profile.tp * w.profile.pp):
            deployment = Deployment.parse(bytes(work.deployment))
            deployment.replicas = work.replicas
            request = ApplyDeploymentRequest(deployment=deployment, profiles=[work.profile])
            await service.apply_deployment(request)
        agents = Recorder()
        loop = ReconcileLoop(plane, agents.send)
        writes.clear()
        cold_s, cold_commands = await timed_round(loop, agents, live)
        cold_writes = len(writes), sum(n for n, _ in writes), sum(t for _, t in writes)
        placed = len(plane.replicas)
        report_ready(plane, agents.take())
        steady_s, steady_commands = await timed_round(loop, agents, live)
        applied = await service.apply_deployment(idle_apply(idle))
        assert applied.ok and len(plane.desired.deployments) == len(works) + idle, applied
        idle_s, idle_commands = await timed_round(loop, agents, live)
        small = works[-1]
        newer = EngineProfile.parse(bytes(small.profile))
        newer.name, newer.args = f"{small.profile.name}-v2", ["--max-model-len", "4096"]
        await service.apply_deployment(ApplyDeploymentRequest(profiles=[newer]))
        beat(plane, live)  # its placement check sees the nodes as the round will
        await service.reprofile_replica(
            ReprofileReplicaRequest(deployment=small.deployment.name, profile=newer.name)
        )
        reprofile_s, reprofile_commands = await timed_round(loop, agents, live)
        return Rounds(
            cold_s, cold_commands, placed, steady_s, steady_commands, reprofile_s,
            reprofile_commands, idle, idle_s, idle_commands, cold_writes,
        )  # fmt: skip


def idle_apply(count: int) -> ApplyDeploymentRequest:
    """``count`` deployments ``idle-N`` of ``replicas = 0`` on one CPU profile: one document,
    applied whole in one transaction, as ``llmgw apply -f`` sends a file."""
    text = '[profiles.idle]\nengine = "sim"\ngpu_class = "cpu"\ncpu_threads = 1\n'
    text += 'model_path = "tiny-sim"\n' + "".join(
        f'[deployments.idle-{i}]\nprofile = "idle"\nreplicas = 0\n' for i in range(count)
    )
    return ApplyDeploymentRequest(document=text)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.reconcile", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--replicas", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--idle-deployments", type=int, default=10_000, help="for the idle round")
    p.add_argument("--markdown", action="store_true", help="also print a BENCHMARKS.md section")
    p.add_argument("--db", choices=BACKENDS, default="sqlite", help="the whole rounds' store")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the fleet's cordons and losses are on purpose

    start = time.perf_counter()
    messages = fleet(args.nodes)
    works = workload(args.replicas)
    setup_s = time.perf_counter() - start

    cap_s, caps = timed(lambda: [node_capacity(n) for n in messages], args.repeat)
    assert isinstance(caps, list)
    ours_s, ours = timed(lambda: plan_ours(caps, works), args.repeat)
    base_s, base = timed(lambda: plan_first_fit(caps, works), args.repeat)
    assert isinstance(ours, list) and isinstance(base, list)
    small_first = (
        outcome(caps, plan_ours(caps, works[::-1])),
        outcome(caps, plan_first_fit(caps, works[::-1])),
    )
    rounds = {db: rounds_on(db, messages, works, args.idle_deployments) for db in backends(args.db)}
    report = Report(
        args, setup_s, cap_s, ours_s, base_s, outcome(caps, ours), outcome(caps, base), small_first,
        rounds,
    )  # fmt: skip
    print(report.render(markdown=False))
    if args.markdown:
        print("\n" + report.render(markdown=True))
    fast = all(r.cold_s < TARGET_S for r in rounds.values()) and cap_s + ours_s < TARGET_S
    quiet = all(r.steady_commands == 0 == r.idle_commands for r in rounds.values())
    return 0 if fast and report.ours.unplaceable == 0 and quiet else 1


def rounds_on(db: str, messages: Sequence[Node], works: Sequence[Work], idle: int) -> Rounds:
    """The whole rounds on a new SQLite file, or in a new private PostgreSQL cluster."""
    if db == "postgresql":
        with postgres() as cluster:
            return asyncio.run(whole_rounds(messages, works, idle, cluster.url()))
    with tempfile.TemporaryDirectory() as folder:
        return asyncio.run(whole_rounds(messages, works, idle, Path(folder) / "bench.db"))


@dataclass(frozen=True, slots=True)
class Report:
    args: argparse.Namespace
    setup_s: float
    capacity_s: float
    ours_s: float
    baseline_s: float
    ours: Outcome
    baseline: Outcome
    small_first: tuple[Outcome, Outcome]  # (ours, baseline) placing the smallest TP first
    rounds: dict[str, Rounds]  # backend → its whole rounds, SQLite first

    def rows(self) -> list[tuple[str, str, str, str]]:
        total = self.capacity_s + self.ours_s
        return [
            ("node_capacity, all nodes", _ms(self.capacity_s), "—", "—"),
            (
                "place_deployment, all replicas",
                _ms(self.ours_s),
                _ms(self.baseline_s),
                f"{self.ours_s / self.baseline_s:.2f}×",
            ),
            ("plan total (views + placement)", _ms(total), "—", "—"),
            ("replicas placed", f"{self.ours.placed:,}", f"{self.baseline.placed:,}", "—"),
            (
                "multi-GPU shards on NVLink, in one NUMA node if they fit",
                f"{100 * self.ours.nvlink_numa_share:.1f}%",
                f"{100 * self.baseline.nvlink_numa_share:.1f}%",
                "—",
            ),
            (
                "replicas placed, smallest TP first (not timed)",
                f"{self.small_first[0].placed:,}",
                f"{self.small_first[1].placed:,}",
                "—",
            ),
            (
                "multi-GPU shards on NVLink …, smallest TP first",
                f"{100 * self.small_first[0].nvlink_numa_share:.1f}%",
                f"{100 * self.small_first[1].nvlink_numa_share:.1f}%",
                "—",
            ),
            (
                "most replicas of one deployment on a node",
                str(self.ours.max_per_node),
                str(self.baseline.max_per_node),
                "—",
            ),
            *self.round_rows(),
        ]

    def round_rows(self) -> list[tuple[str, str, str, str]]:
        first = next(iter(self.rounds.values()))
        rows = []
        for db, r in self.rounds.items():
            ratio = f"{r.cold_s / first.cold_s:.2f}× {next(iter(self.rounds))}"
            calls, written, write_s = r.cold_writes
            rows += [
                (
                    f"whole cold round on {db}: {self.args.nodes:,} nodes × 8 GPUs, "
                    f"{r.placed:,} replicas, {r.cold_commands:,} commands",
                    _ms(r.cold_s), "—", ratio,
                ),
                (
                    f"… of which save_replicas on {db}: {written:,} rows in {calls} call(s)",
                    _ms(write_s), "—", "—",
                ),
                (f"whole steady round on {db}: {r.steady_commands} commands", _ms(r.steady_s),
                 "—", "—"),
                (
                    f"whole steady round on {db}, {r.idle_deployments:,} more deployments of 0 "
                    f"replicas: {r.idle_commands} commands",
                    _ms(r.idle_s), "—", "—",
                ),
                (
                    f"whole reprofile round on {db}: {r.reprofile_commands} commands",
                    _ms(r.reprofile_s), "—", "—",
                ),
            ]  # fmt: skip
        return rows

    def render(self, markdown: bool) -> str:
        head = ("measure", "llmgw placement", "first-fit baseline", "ratio")
        rows = self.rows()
        total = self.capacity_s + self.ours_s
        cold = max(r.cold_s for r in self.rounds.values())
        verdict = (
            f"Planning {self.args.nodes:,} nodes × 8 GPUs and {self.args.replicas:,} replicas took "
            f"{_ms(total)} ({'under' if total < TARGET_S else 'OVER'} the {TARGET_S:g} s target), "
            f"median of {self.args.repeat} runs; fleet setup (not timed) {self.setup_s:.1f} s. "
            f"The whole cold round (decide, store, send, audit) took at most {_ms(cold)} "
            f"({'under' if cold < TARGET_S else 'OVER'} the target), one run."
        )
        facts = [f"{k}: {v}" for k, v in base_machine().items()]
        if not markdown:
            widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
            lines = [f"command: {command_line()}", "; ".join(facts), ""]
            lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
            lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
            return "\n".join([*lines, "", verdict])
        out = [
            "## Placement: planning a fleet (bench/reconcile.py)",
            "",
            "```",
            command_line(),
            "```",
            "",
        ]
        out += [f"- {fact}" for fact in facts]
        out += ["", "| " + " | ".join(head) + " |", "|---|---|---|---|"]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join([*out, "", verdict])


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms"


if __name__ == "__main__":
    sys.exit(main())
