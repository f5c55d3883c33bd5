#!/usr/bin/env python3
"""Benchmark: the console on a large, busy fleet — time to apply each update, key latency.

A synthetic fleet of ``--nodes`` simulated ``dgx-h100`` nodes (8 GPUs each, the real
fixture) runs ``--replicas`` replicas (one shard each; TP1 and TP4 filling every GPU). At
``--hz`` updates a second a fake feed (``SyntheticFeed``, the console's ``Feed`` interface)
applies one tick of Watch deltas to a ``ClusterModel`` exactly as ``WatchSession`` does and
hands the snapshot to the running app (``ConsoleApp`` under ``App.run_test``, headless, at
``--size``). A tick is a heartbeat of every node (every GPU's utilisation, memory,
temperature and power change) and, for a ``--churn`` share of the replicas, a shard and a
replica state change (1.0: all of them, every tick). The feed yields to the event loop
every ``--batch`` events, as the real stream does between network reads.

Measured per view on screen (the app applies each snapshot to that view only):

* **apply**: the app's time to bring the view to a snapshot (``ConsoleApp.apply_seconds``:
  the keyed diff and its DataTable calls, inside one batch update), wall clock and CPU
  (the CPU figure leaves out time other processes held the CPU);
* **model**: the worker's time to apply a tick's deltas and take the snapshot;
* **key → screen**: from a key press (``j``/``k``) to the first screen update composed after
  the cursor moved (the app's ``_display``; headless, so the terminal write is not timed),
  with the fleet idle (baseline) and while the updates run.

The garbage collector runs with the thresholds ``llmgw console`` sets
(``llmgw.tui.app.GC_THRESHOLDS``; ``--default-gc`` keeps Python's), and the benchmark's own
fixtures are frozen out of its sight; the full collections and their longest pause are
reported per view. ``--wire`` also encodes each tick's events and has the feed parse
them back, as the real stream does on the same event loop, and reports that parse time.
Baseline for the apply figure, in the same run: clearing the view's table and adding every
row again (``clear`` + ``add_row``, what a keyed diff avoids).

    .venv/bin/python -m bench.console              # the default fleet, all views
    .venv/bin/python -m bench.console --quick      # fewer ticks
    .venv/bin/python -m bench.console --markdown   # also a BENCHMARKS.md section
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import RenderableType

from bench.kit import base_machine, command_line
from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    AuditEvent,
    Cluster,
    GpuTelemetry,
    Health,
    Node,
    NodeState,
    NodeTelemetry,
    Replica,
    Shard,
    ShardState,
    ShardStatus,
    WatchEvent,
)
from llmgw.tui.app import GC_THRESHOLDS, ConsoleApp
from llmgw.tui.model import ClusterModel
from llmgw.tui.stream import FeedSink, LinkPhase, LinkStatus
from llmgw.tui.views.table import TableView

T0 = 1_700_000_000_000
GiB = 1 << 30
TARGET_MS = 50.0
CYCLE = (ShardState.READY, ShardState.DRAINING, ShardState.LOADING)


# --- the fleet -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Placed:
    replica_id: str
    node_id: str
    gpus: tuple[str, ...]


def build_fleet(nodes: int, replicas: int) -> tuple[Cluster, list[Placed], dict[str, list[str]]]:
    """The fleet's first snapshot, where each replica sits, and each node's GPU UUIDs.

    The first nodes hold two TP4 replicas each, the others eight TP1 ones, so that
    ``replicas`` fill every GPU when they can (200 nodes, 1,000 replicas: 100 + 100 nodes).
    """
    fleet = [
        simulated_node("dgx-h100", node_id=f"n{i:03d}", hostname=f"n{i:03d}") for i in range(nodes)
    ]
    uuids = {info.node_id: [g.uuid for g in info.gpus] for info in fleet}
    tp4_nodes = min(nodes, max(0, (8 * nodes - replicas) // 6))
    placed: list[Placed] = []
    for n, info in enumerate(fleet):
        gpus = uuids[info.node_id]
        width = 4 if n < tp4_nodes else 1
        for start in range(0, len(gpus), width):
            if len(placed) < replicas:
                chunk = tuple(gpus[start : start + width])
                placed.append(Placed(f"chat-{len(placed)}", info.node_id, chunk))
    cluster = Cluster(
        nodes=[Node(info=info, state=NodeState.READY, connected=True) for info in fleet],
        shards=[_shard(p, ShardState.READY, 0) for p in placed],
        replicas=[_replica(p, ShardState.READY) for p in placed],
        events=[
            AuditEvent(
                at_unix_ms=T0 - 1000 * i,
                actor="operator",
                action="cordon",
                target=f"n{i:03d}",
                result="ok",
            )
            for i in range(100)
        ],  # fmt: skip
        revision=1,
    )
    return cluster, placed, uuids


def _shard(p: Placed, state: ShardState, tick: int) -> Shard:
    status = ShardStatus(
        shard_id=f"{p.replica_id}.0", replica_id=p.replica_id, state=state,
        gpu_uuids=list(p.gpus), since_unix_ms=T0 + tick * 500, engine="vllm", pid=1000 + tick,
        endpoint=f"http://{p.node_id}:8000",
    )  # fmt: skip
    return Shard(
        shard_id=status.shard_id, replica_id=p.replica_id, node_id=p.node_id, status=status
    )


def _replica(p: Placed, state: ShardState) -> Replica:
    return Replica(
        replica_id=p.replica_id, deployment="chat", profile="chat-h100", model="chat",
        state=state, shard_ids=[f"{p.replica_id}.0"], endpoint=f"http://{p.node_id}:8000",
    )  # fmt: skip


def tick_events(
    tick: int, placed: Sequence[Placed], uuids: dict[str, list[str]], churn: float
) -> list[WatchEvent]:
    """One update: every node's heartbeat, and state changes for ``churn`` of the replicas."""
    rng = random.Random(tick)
    events = [
        WatchEvent(
            node_telemetry=NodeTelemetry(
                node_id=node_id,
                last_heartbeat_unix_ms=T0 + tick * 500,
                gpus=[
                    GpuTelemetry(
                        uuid=u,
                        utilization_pct=rng.randrange(101),
                        memory_used_bytes=rng.randrange(80) * GiB,
                        temperature_c=rng.randrange(30, 90),
                        power_watts=rng.randrange(60, 700),
                        health=Health.HEALTHY,
                    )  # fmt: skip
                    for u in gpus
                ],
            )
        )
        for node_id, gpus in uuids.items()
    ]
    changing = int(len(placed) * churn)
    start = (tick * changing) % max(1, len(placed))
    for i in range(changing):
        p = placed[(start + i) % len(placed)]
        state = CYCLE[(tick + i) % len(CYCLE)]
        events.append(WatchEvent(shard=_shard(p, state, tick)))
        events.append(WatchEvent(replica=_replica(p, state)))
    return events


# --- the feed --------------------------------------------------------------------------------


@dataclass
class SyntheticFeed:
    """A ``Feed``: the first snapshot, then one tick of deltas every 1/hz seconds."""

    cluster: Cluster
    ticks: list[list[WatchEvent]]
    hz: float
    wire: bool
    batch: int
    go: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    model: ClusterModel = field(default_factory=ClusterModel)
    model_s: list[float] = field(default_factory=list)
    parse_s: list[float] = field(default_factory=list)
    late_s: list[float] = field(default_factory=list)
    sent: int = 0

    async def run(self, sink: FeedSink) -> None:
        self.model.reset(self.cluster, T0)
        sink.status_changed(LinkStatus().to(LinkPhase.LIVE, live_at=time.monotonic()))
        sink.snapshot_ready(self.model.snapshot(T0))
        encoded = [[bytes(e) for e in tick] for tick in self.ticks] if self.wire else []
        await self.go.wait()
        period = 1 / self.hz
        due = time.perf_counter()
        tick = 0
        while not self.stop.is_set():
            due += period
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            self.late_s.append(max(0.0, time.perf_counter() - due))
            events = self.ticks[tick % len(self.ticks)]
            wire = encoded[tick % len(encoded)] if self.wire else []
            now = T0 + (tick + 1) * 500
            spent = parsed = 0.0
            for start in range(0, len(events), self.batch):
                batch = events[start : start + self.batch]
                if self.wire:  # decode as the stream does, a read's worth at a time
                    started = time.perf_counter()
                    batch = [WatchEvent.parse(b) for b in wire[start : start + self.batch]]
                    parsed += time.perf_counter() - started
                started = time.perf_counter()
                for event in batch:
                    self.model.apply(event, now)
                spent += time.perf_counter() - started
                await asyncio.sleep(0)  # the stream yields between reads, as WatchSession does
            if self.wire:
                self.parse_s.append(parsed)
            started = time.perf_counter()
            snapshot = self.model.snapshot(now)
            self.model_s.append(spent + time.perf_counter() - started)
            sink.snapshot_ready(snapshot)
            self.sent += 1
            tick += 1


# --- key → screen ----------------------------------------------------------------------------


class KeyProbe:
    """Times a key press to the first composed screen update after the cursor moved."""

    def __init__(self, app: ConsoleApp) -> None:
        self._app = app
        self._pending: tuple[float, Callable[[], bool]] | None = None
        self._done = asyncio.Event()
        self.latency = 0.0
        original: Callable[..., None] = app._display

        def display(screen: Any, renderable: RenderableType | None) -> None:
            original(screen, renderable)
            if self._pending is not None and renderable is not None:
                started, moved = self._pending
                if moved():
                    self.latency = time.perf_counter() - started
                    self._pending = None
                    self._done.set()

        app._display = display  # type: ignore[method-assign]

    async def press(self, view: TableView[Any]) -> float:
        """``j`` (``k`` on the last row); the cursor may have moved since the last press."""
        before = view.table.cursor_row
        key = "k" if before >= view.table.row_count - 1 else "j"
        self._done.clear()
        self._pending = (time.perf_counter(), lambda: view.table.cursor_row != before)
        await self._app._press_keys([key])
        try:
            async with asyncio.timeout(10):
                await self._done.wait()
        except TimeoutError:
            table = view.table
            raise SystemExit(
                f"{view.id}: {key!r} did not move the cursor from row {before} "
                f"({table.cursor_row} of {table.row_count})"
            ) from None
        return self.latency


class GcPauses:
    """The garbage collector's full (generation 2) collections, timed, per view."""

    def __init__(self) -> None:
        self.current = ""
        self.ms: dict[str, list[float]] = {}
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            pause = (time.perf_counter() - self._started) * 1e3
            self.ms.setdefault(self.current, []).append(pause)


# --- one view --------------------------------------------------------------------------------


@dataclass
class ViewResult:
    view: str
    rows: int
    apply_ms: list[float]
    apply_cpu_ms: list[float]
    rebuild_ms: list[float]
    model_ms: list[float]
    parse_ms: list[float]
    key_idle_ms: list[float]
    key_load_ms: list[float]
    late_ms: list[float]
    updates_sent: int


async def measure_view(
    view: str, cluster: Cluster, ticks: list[list[WatchEvent]], args: argparse.Namespace
) -> ViewResult:
    feed = SyntheticFeed(cluster, ticks, args.hz, args.wire, args.batch)
    width, height = args.size
    app = ConsoleApp(feed, view=view, theme="textual-dark")
    async with app.run_test(size=(width, height)) as pilot:
        async with asyncio.timeout(60):
            while not app.apply_seconds:
                await pilot.pause(0.05)
        await pilot.pause(0.2)
        table_view = app.view()
        cpu_ms = cpu_of(table_view)
        probe = KeyProbe(app)
        idle: list[float] = []
        if isinstance(table_view, TableView):  # the overview has no cursor to move
            idle = [await probe.press(table_view) * 1e3 for _ in range(args.keys)]
        app.apply_seconds.clear()
        cpu_ms.clear()
        feed.go.set()
        load: list[float] = []
        rng = random.Random(7)
        deadline = time.perf_counter() + args.ticks / args.hz
        while time.perf_counter() < deadline:
            await asyncio.sleep(rng.uniform(0.05, 0.25))
            if isinstance(table_view, TableView):
                load.append(await probe.press(table_view) * 1e3)
        feed.stop.set()
        await pilot.pause(0.6)
        apply_ms = [s * 1e3 for s in app.apply_seconds]
        table = isinstance(table_view, TableView)
        rebuild = rebuild_times(app, args.rebuilds) if table else []
        rows = table_view.table.row_count if isinstance(table_view, TableView) else 0
    return ViewResult(
        view, rows, apply_ms, list(cpu_ms), rebuild, [s * 1e3 for s in feed.model_s],
        [s * 1e3 for s in feed.parse_s], idle, load, [s * 1e3 for s in feed.late_s], feed.sent,
    )  # fmt: skip


def cpu_of(view: Any) -> list[float]:
    """Record the CPU time (this thread's) of each ``view.show``: wall-clock figures on a
    shared machine include the time other processes held the CPU."""
    spent: list[float] = []
    show = view.show

    def timed(snapshot: Any) -> None:
        started = time.thread_time()
        show(snapshot)
        spent.append((time.thread_time() - started) * 1e3)

    view.show = timed
    return spent


def rebuild_times(app: ConsoleApp, times: int) -> list[float]:
    """The baseline: clear the table and add every row again (cells computed as the view
    does), for the snapshot on screen."""
    view = app.view()
    assert isinstance(view, TableView)
    rows = view.rows_of(view.snapshot)
    now = view.snapshot.taken_ms
    out = []
    for _ in range(times):
        started = time.perf_counter()
        with app.batch_update():
            view.table.clear()
            for key, row in rows.items():
                cells = [c.render(c.value(row, now)) for c in view.COLUMNS]
                view.table.add_row(*cells, key=key)
        out.append((time.perf_counter() - started) * 1e3)
    return out


# --- report ----------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def fmt(values: Sequence[float], q: float = 0.5) -> str:
    return "—" if not values else f"{pct(values, q):,.1f}"


def render(results: list[ViewResult], gc_ms: dict[str, list[float]], markdown: bool) -> str:
    header = [
        "view", "rows", "apply p50 (ms)", "apply p95", "apply max", "apply CPU p50 (ms)",
        "rebuild p50 (ms)",
        "rebuild/apply", "model p50 (ms)", "parse p50 (ms)", "key idle p50 (ms)",
        "key load p50", "key load p95", "key load max", "full GCs (max ms)", "updates",
    ]  # fmt: skip
    lines = []
    for r in results:
        ratio = (
            f"{pct(r.rebuild_ms, 0.5) / pct(r.apply_ms, 0.5):.1f}×"
            if r.rebuild_ms and r.apply_ms
            else "—"
        )
        lines.append([
            r.view, f"{r.rows:,}", fmt(r.apply_ms), fmt(r.apply_ms, 0.95), fmt(r.apply_ms, 1.0),
            fmt(r.apply_cpu_ms), fmt(r.rebuild_ms), ratio, fmt(r.model_ms), fmt(r.parse_ms),
            fmt(r.key_idle_ms),
            fmt(r.key_load_ms), fmt(r.key_load_ms, 0.95), fmt(r.key_load_ms, 1.0),
            f"{len(gc_ms.get(r.view, []))} ({fmt(gc_ms.get(r.view, []), 1.0)})",
            f"{len(r.apply_ms)}/{r.updates_sent}",
        ])  # fmt: skip
    if markdown:
        table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        table += ["| " + " | ".join(line) + " |" for line in lines]
    else:
        widths = [max(len(x) for x in col) for col in zip(header, *lines, strict=True)]
        table = [
            "  ".join(h.ljust(w) for h, w in zip(row, widths, strict=True))
            for row in [header, *lines]
        ]
    worst = max((pct(r.apply_ms, 0.5) for r in results if r.apply_ms), default=float("nan"))
    verdict = "meets" if worst < TARGET_MS else "MISSES"
    late = [x for r in results for x in r.late_ms]
    summary = (
        f"Worst view's median apply: {worst:.1f} ms — {verdict} the {TARGET_MS:.0f} ms target. "
        f"Ticks started late by the event loop: p50 {fmt(late)} ms, max {fmt(late, 1.0)} ms."
    )
    return "\n".join([*table, "", summary])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.console", description=__doc__.splitlines()[0] if __doc__ else None
    )
    p.add_argument("--nodes", type=int, default=200)
    p.add_argument("--replicas", type=int, default=1000)
    p.add_argument("--hz", type=float, default=2.0, help="updates a second (default 2)")
    p.add_argument(
        "--churn", type=float, default=1.0, help="share of replicas changing state per update"
    )
    p.add_argument("--ticks", type=int, default=20, help="updates per view (default 20)")
    p.add_argument("--variants", type=int, default=6, help="distinct ticks pre-built")
    p.add_argument("--keys", type=int, default=20, help="idle key presses per view")
    p.add_argument("--rebuilds", type=int, default=5, help="baseline rebuilds per view")
    p.add_argument("--size", type=lambda s: tuple(int(x) for x in s.split("x")), default=(160, 50))
    p.add_argument("--views", default="nodes,replicas,shards,events,overview")
    p.add_argument("--wire", action="store_true", help="also parse each tick from bytes")
    p.add_argument(
        "--batch",
        type=int,
        default=250,
        help="events applied between yields to the event loop (default 250: about what one "
        "64 KiB read of the Watch stream carries)",
    )
    p.add_argument(
        "--default-gc",
        action="store_true",
        help="keep Python's collector thresholds instead of the console's (GC_THRESHOLDS)",
    )
    p.add_argument("--quick", action="store_true", help="8 updates per view, 8 idle keys")
    p.add_argument("--markdown", action="store_true", help="also print a BENCHMARKS.md section")
    args = p.parse_args()
    if args.quick:
        args.ticks, args.keys, args.rebuilds = 8, 8, 2
    return args


def main() -> int:
    args = parse_args()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    started = time.perf_counter()
    cluster, placed, uuids = build_fleet(args.nodes, args.replicas)
    ticks = [tick_events(t + 1, placed, uuids, args.churn) for t in range(args.variants)]
    setup = time.perf_counter() - started
    # The fixtures above are the benchmark's, not the console's: keep the collector from
    # scanning them, so its pauses below are what the console's own objects cost.
    gc.collect()
    gc.freeze()
    if not args.default_gc:
        gc.set_threshold(*GC_THRESHOLDS)  # as `llmgw console` does
    pauses = GcPauses()
    results = []
    for view in args.views.split(","):
        pauses.current = view
        results.append(asyncio.run(measure_view(view, cluster, ticks, args)))
    machine = {**base_machine(), "load average at start": load}
    settings = (
        f"{args.nodes} nodes × 8 GPUs (simulated dgx-h100), {args.replicas} replicas, "
        f"{args.hz:g} updates/s, churn {args.churn:g} (replica state changes per update: "
        f"{int(args.replicas * args.churn)}), {args.ticks} updates per view, screen "
        f"{args.size[0]}×{args.size[1]}, wire parse {'on' if args.wire else 'off'}, "
        f"{args.batch} events between yields, collector thresholds {gc.get_threshold()}; "
        f"fleet setup {setup:.1f} s (not timed)"
    )
    print(f"command: {command_line()}")
    for key, value in machine.items():
        print(f"{key}: {value}")
    print(f"settings: {settings}\n")
    print(render(results, pauses.ms, markdown=False))
    if args.markdown:
        print("\n## Console: a large, busy fleet (bench/console.py)\n")
        print(f"```\n{command_line()}\n```\n")
        for key, value in machine.items():
            print(f"- {key}: {value}")
        print(f"- settings: {settings}\n")
        print(render(results, pauses.ms, markdown=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
