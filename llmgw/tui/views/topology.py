"""Topology: node → NUMA → GPU → MIG slice, one row per GPU, a row per node above its GPUs.

A node's row carries its state (glyph + word) and its physical GPUs with their MIG slices
counted apart (``4×A100 (12 MIG slices)``); each GPU row its NUMA node,
index (a MIG slice as ``└1g.10gb`` under its parent), utilisation, memory, temperature,
health and the shard holding it. Enter opens the detail: NVLink peers and links, NIC paths,
the NVLink fabric clique, MIG placement; on a node row, the host, fabrics and IMEX.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, ClassVar

from rich.cells import cell_len
from rich.console import RenderableType
from rich.text import Text

from llmgw.api.llmgw.v1 import Health, NodeState
from llmgw.tui.model import ConsoleSnapshot
from llmgw.tui.rows import GpuRow, NodeRow
from llmgw.tui.views.details import gpu_detail, node_detail
from llmgw.tui.views.table import Column, TableView
from llmgw.tui.widgets.cells import (
    gib,
    health_cell,
    node_state_cell,
    percent,
    plain,
    temperature,
)

__all__ = ["TopologyView"]

TopologyRow = NodeRow | GpuRow
NODE_PREFIX = "n:"
GPU_PREFIX = "g:"


def _node(row: TopologyRow, now_ms: int) -> Hashable:
    return (isinstance(row, NodeRow), row.node_id)


def _render_node(value: tuple[bool, str]) -> RenderableType:
    is_node, node_id = value
    return plain(node_id, "bold" if is_node else "dim")


def _numa(row: TopologyRow, now_ms: int) -> Hashable:
    if isinstance(row, NodeRow):
        return ""
    return "?" if row.info.numa_node < 0 else str(row.info.numa_node)


def _gpu(row: TopologyRow, now_ms: int) -> Hashable:
    if isinstance(row, NodeRow):
        return row.gpu_words
    info = row.info
    if info.is_mig:
        return f"└{info.mig_profile}"
    return f"{info.index} MIG" if info.mig_enabled else str(info.index)


def _util(row: TopologyRow, now_ms: int) -> Hashable:
    return None if isinstance(row, NodeRow) else row.utilization_pct


def _render_util(value: int | None) -> RenderableType:
    return Text("") if value is None else percent(value, width=3)


def _memory(row: TopologyRow, now_ms: int) -> Hashable:
    if isinstance(row, NodeRow):
        return None
    return (row.memory_used_bytes, row.info.memory_total_bytes)


def _render_memory(value: tuple[int, int] | None) -> RenderableType:
    return Text("") if value is None else gib(*value)


def _temperature(row: TopologyRow, now_ms: int) -> Hashable:
    return None if isinstance(row, NodeRow) else row.temperature_c


def _render_temperature(value: int | None) -> RenderableType:
    return Text("") if value is None else temperature(value)


def _health(row: TopologyRow, now_ms: int) -> Hashable:
    if isinstance(row, NodeRow):
        return (row.state, row.cordoned)
    return row.health


def _render_health(value: Health | tuple[NodeState, bool]) -> RenderableType:
    if isinstance(value, tuple):
        return node_state_cell(*value)
    return health_cell(value)


def _shard(row: TopologyRow, now_ms: int) -> Hashable:
    if isinstance(row, NodeRow):
        return row.reason
    return row.shard_id


def _health_order(row: TopologyRow) -> int:
    """Worst first when sorted ascending: failed, unknown, healthy."""
    if isinstance(row, NodeRow):
        return {NodeState.NOT_READY: 0, NodeState.CORDONED: 1}.get(row.state, 2)
    return {Health.UNHEALTHY: 0, Health.UNKNOWN: 1}.get(row.health, 2)


class TopologyView(TableView[TopologyRow]):
    """``:nodes`` — every node and its GPUs."""

    TITLE = "Nodes"
    COLUMNS: ClassVar = (
        Column(
            "node",
            "NODE",
            12,
            _node,
            _render_node,
            sort=lambda r: r.node_id,
            flex=True,
            measure=lambda v: cell_len(v[1]),
        ),
        Column("numa", "N", 1, _numa),
        Column("gpu", "GPU", 9, _gpu, flex=True),
        Column("util", "UTIL", 8, _util, _render_util),
        Column("memory", "MEM", 8, _memory, _render_memory, sort=lambda r: _memory(r, 0)),
        Column("temp", "TEMP", 4, _temperature, _render_temperature),
        Column("health", "HEALTH", 11, _health, _render_health, sort=_health_order),
        Column("shard", "SHARD", 12, _shard, flex=True),
    )

    def rows_of(self, snapshot: ConsoleSnapshot) -> Mapping[str, TopologyRow]:
        rows: dict[str, TopologyRow] = {NODE_PREFIX + k: n for k, n in snapshot.nodes.items()}
        rows.update((GPU_PREFIX + k, g) for k, g in snapshot.gpus.items())
        return rows

    def order(self, key: str, row: TopologyRow) -> Any:
        if isinstance(row, NodeRow):
            return (row.node_id, -2, 0, 0, 0)
        return row.order

    def id_of(self, key: str) -> str:
        """A node row copies the node id, a GPU row its UUID."""
        if key.startswith(GPU_PREFIX):
            return key.rpartition("/")[2]
        return key.removeprefix(NODE_PREFIX)

    def node_of(self, key: str) -> str:
        """The node a row stands for (what ``C``, ``U`` and ``D`` act on): a GPU's node."""
        if key.startswith(GPU_PREFIX):
            gpu = self.snapshot.gpus.get(key.removeprefix(GPU_PREFIX))
            return gpu.node_id if gpu is not None else key.removeprefix(GPU_PREFIX).split("/")[0]
        return key.removeprefix(NODE_PREFIX)

    def detail(self, key: str, snapshot: ConsoleSnapshot) -> tuple[str, RenderableType] | None:
        if key.startswith(GPU_PREFIX):
            gpu = snapshot.gpus.get(key.removeprefix(GPU_PREFIX))
            return None if gpu is None else gpu_detail(gpu, snapshot)
        node = snapshot.nodes.get(key.removeprefix(NODE_PREFIX))
        return None if node is None else node_detail(node, snapshot)

    def described(self, key: str) -> tuple[str, str] | None:
        return None if key.startswith(GPU_PREFIX) else ("node", key.removeprefix(NODE_PREFIX))
