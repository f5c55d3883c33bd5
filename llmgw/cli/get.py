"""``llmgw get …`` and node actions: operator reads and writes over gRPC-web.

Tables are for people (fixed columns, one row per thing, control characters escaped);
``-o json`` prints the proto3 JSON of the messages, for scripts.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import betterproto2

from llmgw.api.llmgw.v1 import Cluster, Gpu, GpuHealth, GpuTelemetry, Node, Shard
from llmgw.cli.main import CliError
from llmgw.client import (
    ClientError,
    ControlClient,
    GrpcWebChannel,
    RpcError,
    ServerUnreachable,
    Timeouts,
)
from llmgw.printable import escape

GiB = 1 << 30


async def run_get(server: str, kind: str, output: str) -> int:
    cluster = await _call(server, lambda client: client.get_cluster())
    if output == "json":
        sys.stdout.write(json.dumps(_as_json(cluster, kind), indent=2) + "\n")
    else:
        rows = _TABLES[kind](cluster)
        sys.stdout.write(render_table(rows) + "\n")
    return 0


async def run_node_action(server: str, verb: str, node_id: str) -> int:
    async def act(client: ControlClient) -> Any:
        if verb == "cordon":
            return await client.cordon_node(node_id)
        return await client.uncordon_node(node_id)

    result = await _call(server, act)
    sys.stdout.write(f"{result.message}\n")
    return 0


async def _call(
    server: str, fn: Callable[[ControlClient], Any], timeouts: Timeouts | None = None
) -> Any:
    try:
        async with GrpcWebChannel(server, timeouts=timeouts or Timeouts()) as channel:
            return await fn(ControlClient(channel))
    except ServerUnreachable as exc:
        raise CliError(f"cannot reach the control server at {server}: {exc}") from exc
    except RpcError as exc:
        raise CliError(f"{exc.status.name}: {exc.message}") from exc
    except ClientError as exc:
        raise CliError(str(exc)) from exc


def _as_json(cluster: Cluster, kind: str) -> dict[str, Any]:
    if kind == "gpus":
        return {
            "gpus": [
                {"nodeId": _node_id(node), "gpu": gpu.to_dict()}
                for node in cluster.nodes
                for gpu in _gpus(node)
            ]
        }
    lists: dict[str, Sequence[betterproto2.Message]] = {
        "nodes": cluster.nodes,
        "replicas": cluster.replicas,
        "shards": cluster.shards,
    }
    items = lists[kind]
    return {kind: [item.to_dict() for item in items]}


def _node_id(node: Node) -> str:
    return node.info.node_id if node.info is not None else ""


def _gpus(node: Node) -> list[Gpu]:
    return list(node.info.gpus) if node.info is not None else []


def render_table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces; the first row is the header.

    Every cell is escaped (``llmgw.printable.escape``): a newline or an escape sequence in a
    hostname, a label or a reason prints as ``\\n``/``\\x1b``, never as a row of its own.
    """
    rows = [[escape(cell) for cell in row] for row in rows]
    if len(rows) <= 1:
        return "\n".join("  ".join(r) for r in rows) + ("\n(none)" if len(rows) == 1 else "")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _node_rows(cluster: Cluster) -> list[list[str]]:
    rows = [["NODE", "STATE", "GPUS", "CLASS", "HCAS", "DISCOVERY", "LABELS", "REASON"]]
    for node in cluster.nodes:
        info = node.info
        if info is None:
            continue
        devices = [g for g in info.gpus if not g.mig_enabled]
        classes = sorted({g.gpu_class for g in devices if g.gpu_class})
        rows.append(
            [
                info.node_id,
                node.state.name or str(node.state),
                str(len(devices)),
                ",".join(classes) or "-",
                str(len(info.fabrics)),
                info.discovery or "-",
                ",".join(f"{k}={v}" for k, v in sorted(info.labels.items())) or "-",
                node.state_reason or "",
            ]
        )
    return rows


def _gpu_rows(cluster: Cluster) -> list[list[str]]:
    rows = [
        [
            "NODE",
            "GPU",
            "NAME",
            "MEMORY",
            "UTIL",
            "TEMP",
            "NUMA",
            "NVLINK PEERS",
            "NEAREST HCA",
            "HEALTH",
        ]
    ]
    for node in cluster.nodes:
        live = {t.uuid: t for t in node.telemetry.gpus} if node.telemetry else {}
        rows.extend(_gpu_row(node, gpu, live.get(gpu.uuid)) for gpu in _gpus(node))
    return rows


def _gpu_row(node: Node, gpu: Gpu, live: GpuTelemetry | None) -> list[str]:
    """One GPU as registered, with its latest telemetry where the agent sent some."""
    registered = gpu.health or GpuHealth()
    used = live.memory_used_bytes if live else gpu.memory_used_bytes
    util = live.utilization_pct if live else gpu.utilization_pct
    temp = live.temperature_c if live else registered.temperature_c
    health = live.health if live else registered.health
    index = str(gpu.index)
    if gpu.mig is not None:
        index = f"{gpu.index}/mig{gpu.mig.gpu_instance_id}:{gpu.mig.profile}"
    nearest = [p.hca for p in gpu.nic_paths if p.path == "PIX"]
    return [
        _node_id(node) or "-",
        index,
        gpu.name,
        f"{used / GiB:.0f}/{gpu.memory_total_bytes / GiB:.0f}GiB",
        f"{util}%",
        f"{temp}C" if temp else "-",
        str(gpu.numa_node),
        _ranges(gpu.nvlink_peers) or "-",
        ",".join(nearest) or "-",
        health.name or "UNKNOWN",
    ]


def _shard_rows(cluster: Cluster) -> list[list[str]]:
    rows = [["SHARD", "REPLICA", "NODE", "STATE", "ENDPOINT", "REASON"]]
    rows.extend(_shard_row(shard) for shard in cluster.shards)
    return rows


def _shard_row(shard: Shard) -> list[str]:
    status = shard.status
    state = status.state.name if status is not None else "UNKNOWN"
    return [
        shard.shard_id,
        shard.replica_id,
        shard.node_id,
        state,
        status.endpoint if status else "",
        status.reason if status else "",
    ]


def _replica_rows(cluster: Cluster) -> list[list[str]]:
    rows = [["REPLICA", "DEPLOYMENT", "MODEL", "STATE", "ENDPOINT", "SHARDS"]]
    rows.extend(
        [r.replica_id, r.deployment, r.model, r.state.name, r.endpoint, str(len(r.shard_ids))]
        for r in cluster.replicas
    )
    return rows


def _ranges(values: Iterable[int]) -> str:
    """[0,1,2,5] → "0-2,5"."""
    out: list[str] = []
    ordered = sorted(values)
    start = prev = None
    for v in [*ordered, None]:
        if v is not None and prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = v
    return ",".join(out)


_TABLES: dict[str, Callable[[Cluster], list[list[str]]]] = {
    "nodes": _node_rows,
    "gpus": _gpu_rows,
    "replicas": _replica_rows,
    "shards": _shard_rows,
}
