"""Detail pages (Enter on a row): every fact the row stands for, as label/value lines."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from llmgw.api.llmgw.v1 import HistoryEvent
from llmgw.printable import escape
from llmgw.tui.model import ConsoleSnapshot
from llmgw.tui.rows import EventRow, GpuRow, NodeRow, ReplicaRow, ShardRow
from llmgw.tui.widgets.cells import (
    NOT_REPORTED,
    GiB,
    age,
    clock,
    health_cell,
    node_state_cell,
    percent,
    ranges,
    shard_state_cell,
    shown,
    temperature,
)

__all__ = [
    "event_detail", "gpu_detail", "history_section", "node_detail", "replica_detail",
    "shard_detail",
]  # fmt: skip

_EVENTS_SHOWN = 15  # the newest events under a detail (`llmgw describe` shows more)

Line = tuple[str, RenderableType]


def _grid(lines: Iterable[Line]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    for label, value in lines:
        grid.add_row(label, value)
    return grid


def _text(value: object) -> Text:
    """A value as plain text (never markup); – when empty."""
    word = str(value) if value not in ("", None) else NOT_REPORTED
    return shown(word)


def gpu_detail(gpu: GpuRow, snapshot: ConsoleSnapshot) -> tuple[str, RenderableType]:
    info = gpu.info
    holder = snapshot.shards.get(gpu.shard_id)
    lines: list[Line] = [
        ("GPU", _text(f"{info.label} of {gpu.node_id}: {info.name} ({info.gpu_class})")),
        ("UUID", _text(info.uuid)),
        ("PCI / NUMA", _text(f"{info.pci_bus_id or NOT_REPORTED} / NUMA {info.numa_node}")),
        (
            "compute",
            _text(
                f"cc {info.compute_capability}, driver {info.driver_version}, "
                f"CUDA {info.cuda_version}"
            ),
        ),  # fmt: skip
        (
            "memory",
            _text(f"{gpu.memory_used_bytes / GiB:.1f} / {info.memory_total_bytes / GiB:.1f} GiB"),
        ),  # fmt: skip
        ("utilisation", percent(gpu.utilization_pct, width=10)),
        ("temperature", temperature(gpu.temperature_c)),
        ("power", _text(f"{gpu.power_watts} W" if gpu.power_watts else "")),
        ("health", _health_line(gpu)),
        ("shard", _holder(gpu, holder)),
        ("NVLink peers", _text(ranges(info.nvlink_peers))),
        ("NVLinks", _nvlinks(gpu)),
        ("NIC paths", _text(", ".join(f"{hca} {path}" for hca, path in info.nic_paths))),
        ("fabric", _fabric(gpu)),
    ]
    if info.is_mig or info.mig_enabled:
        lines.append(("MIG", _text(_mig(gpu))))
    return f"GPU {info.label} · {gpu.node_id}", _grid(lines)


def _health_line(gpu: GpuRow) -> Text:
    text = health_cell(gpu.health)
    if gpu.problems:
        text.append(escape(": " + "; ".join(gpu.problems)))
    if gpu.info.ecc_uncorrected:
        text.append(f" (ECC uncorrected {gpu.info.ecc_uncorrected})")
    return text


def _holder(gpu: GpuRow, shard: ShardRow | None) -> RenderableType:
    if shard is None:
        return _text("free")
    text = shown(f"{shard.shard_id} (replica {shard.replica_id}) ")
    text.append_text(shard_state_cell(shard.state))
    return text


def _nvlinks(gpu: GpuRow) -> Text:
    info = gpu.info
    if not info.nvlinks:
        return _text("")
    versions = "/".join(str(v) for v in info.nvlink_versions)
    summary = f"{info.nvlinks_active}/{len(info.nvlinks)} active, NVLink v{versions}"
    return shown(f"{summary} → {', '.join(info.nvlink_remotes)}")


def _fabric(gpu: GpuRow) -> Text:
    info = gpu.info
    if not info.fabric_state:
        return _text("")
    clique = f"clique {info.fabric_clique}" if info.fabric_clique else "no clique"
    speed = f", {info.fabric_gbps:g} Gb/s" if info.fabric_gbps else ""
    return shown(f"{info.fabric_state}, {clique}{speed}")


def _mig(gpu: GpuRow) -> str:
    info = gpu.info
    if info.mig_enabled:
        return "MIG mode on: its slices are listed under it and placed on by themselves"
    return f"slice {info.mig_profile} of GPU {info.index}, GPU instance {info.mig_instance}"


def node_detail(node: NodeRow, snapshot: ConsoleSnapshot) -> tuple[str, RenderableType]:
    d = node.detail
    state = node_state_cell(node.state, node.cordoned)
    if node.reason:
        state.append(f": {node.reason}")
    gpus = [g for g in snapshot.gpus.values() if g.node_id == node.node_id]
    held = sorted({g.shard_id for g in gpus if g.shard_id})
    lines: list[Line] = [
        ("node", _text(f"{node.node_id} ({d.hostname})")),
        ("state", state),
        ("address", _text(f"{d.management_address or NOT_REPORTED}, agent from {node.peer}")),
        ("agent", _text(f"{d.agent_version}, discovery {node.discovery}")),
        ("host", _text(f"{d.os}, kernel {d.kernel}")),
        ("CPU", _text(f"{d.cpu_model} ×{d.cpu_count}")),
        (
            "memory",
            _text(
                f"{node.memory_available_bytes / GiB:.0f} GiB available of "
                f"{d.memory_total_bytes / GiB:.0f} GiB"
            ),
        ),  # fmt: skip
        ("driver", _text(f"{d.driver_version or 'none'}, CUDA {d.cuda_version or NOT_REPORTED}")),
        (
            "GPUs",
            _text(f"{node.gpu_words}, {len(held)} shards on them"),
        ),  # fmt: skip
        ("shards", _text(", ".join(held))),
        ("labels", _text(", ".join(f"{k}={v}" for k, v in d.labels))),
        ("engines", _text(", ".join(f"{k} {v}" for k, v in d.engine_versions))),
        ("IMEX", _text(d.imex)),
    ]
    lines.extend(
        (
            "fabric" if i == 0 else "",
            _text(
                f"{f.hca} port {f.port}: {f.fabric} {f.link_layer} {f.rate_gbps:g} Gb/s "
                f"{f.state}, NUMA {f.numa_node}"
            ),  # fmt: skip
        )
        for i, f in enumerate(d.fabrics)
    )
    return f"Node {node.node_id}", _grid(lines)


def replica_detail(replica: ReplicaRow, snapshot: ConsoleSnapshot) -> tuple[str, RenderableType]:
    state = shard_state_cell(replica.state)
    if replica.since_ms:
        state.append(f" for {age((snapshot.taken_ms - replica.since_ms) / 1000)}")
    profile = replica.profile + (
        " (out of date: reprofile to update)" if replica.out_of_date else ""
    )
    lines: list[Line] = [
        ("replica", _text(replica.replica_id)),
        ("state", state),
        ("deployment", _text(replica.deployment)),
        ("model", _text(replica.model)),
        ("profile", _text(profile)),
        ("endpoint", _text(replica.endpoint)),
        ("nodes", _text(", ".join(replica.nodes))),
        ("GPUs", _text(replica.gpus)),
        ("in flight", _text("not reported by the server yet")),
        ("KV usage", _text("not reported by the server yet")),
        ("prefix hit", _text("not reported by the server yet")),
    ]
    shards = [snapshot.shards[s] for s in replica.shard_ids if s in snapshot.shards]
    table = Table("SHARD", "NODE", "RANK", "STATE", "REASON", box=None, padding=(0, 1))
    for shard in shards:
        table.add_row(
            shown(shard.shard_id), shown(shard.node_id), str(shard.rank),
            shard_state_cell(shard.state), shown(shard.reason),
        )  # fmt: skip
    return f"Replica {replica.replica_id}", Group(_grid(lines), Text(""), table)


def shard_detail(shard: ShardRow, snapshot: ConsoleSnapshot) -> tuple[str, RenderableType]:
    state = shard_state_cell(shard.state)
    if shard.gave_up:
        state.append(" (given up: its agent will not restart it)")
    exit_text = "" if shard.exit_code is None else f"exited with {shard.exit_code}"
    lines: list[Line] = [
        ("shard", _text(shard.shard_id)),
        ("state", state),
        (
            "since",
            _text(_since(shard.since_ms, snapshot.taken_ms)),
        ),
        ("reason", _text(shard.reason)),
        ("replica", _text(shard.replica_id)),
        ("node / rank", _text(f"{shard.node_id} / {shard.rank}")),
        ("engine", _text(f"{shard.engine} pid {shard.pid or NOT_REPORTED}")),
        ("endpoint", _text(shard.endpoint)),
        ("GPUs", _text(", ".join(shard.gpu_uuids))),
        ("restarts", _text(shard.restarts)),
        ("exit", _text(exit_text)),
        ("fingerprint", _text(shard.fingerprint)),
    ]
    return f"Shard {shard.shard_id}", _grid(lines)


def _since(since_ms: int, now_ms: int) -> str:
    if not since_ms:
        return ""
    return f"{clock(since_ms)} ({age((now_ms - since_ms) / 1000)} ago)"


def event_detail(event: EventRow, snapshot: ConsoleSnapshot) -> tuple[str, RenderableType]:
    lines: list[Line] = [
        ("when", _text(clock(event.at_ms))),
        ("kind", _text(event.kind)),
        ("actor", _text(event.actor)),
        ("action", _text(event.action)),
        ("target", _text(event.target)),
        ("result", _text(event.result)),
    ]
    return f"Event {event.seq}", _grid(lines)


def history_section(events: Sequence[HistoryEvent]) -> RenderableType:
    """The object's newest events (``Describe``), oldest first: time, who, what, message."""
    table = Table(title="Recent events", title_justify="left", box=None, padding=(0, 1),
                  show_edge=False, expand=True)  # fmt: skip
    table.add_column("WHEN", no_wrap=True)
    table.add_column("BY", no_wrap=True, max_width=14, overflow="ellipsis")
    table.add_column("WHAT", no_wrap=True, max_width=12, overflow="ellipsis")
    table.add_column("MESSAGE", overflow="fold", ratio=1)
    for e in events[-_EVENTS_SHOWN:]:
        what = Text(("! " if e.warning else "") + escape(e.reason))
        if e.warning:
            what.stylize("bold yellow")
        table.add_row(clock(e.at_unix_ms), shown(e.actor), what, shown(f"{e.object}: {e.message}"))
    if not events:
        return Text("Recent events: none kept")
    return table
