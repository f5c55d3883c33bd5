"""``llmgw get …`` and ``llmgw cordon|uncordon``: operator reads and writes over gRPC-web.

Tables are for people (fixed columns, one row per thing, control characters escaped);
``-o json`` prints the proto3 JSON of the messages, for scripts; ``--watch`` prints the
table and then a row for each change (``llmgw.cli.getwatch``). ``get deployments`` and
``get profiles`` are the desired state's (``llmgw.cli.apply``, imported when they run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import betterproto2

from llmgw.api.llmgw.v1 import Cluster, Gpu, GpuHealth, GpuTelemetry, Node, Shard
from llmgw.cli.errors import CliError
from llmgw.cli.rpc import add_client_flags, call
from llmgw.cli.tables import render_table
from llmgw.client import ControlClient

__all__ = ["register", "run_get", "run_node_action"]

GiB = 1 << 30


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``get``, ``cordon`` and ``uncordon``."""
    p = sub.add_parser(
        "get",
        help="list nodes, GPUs, replicas, shards, deployments, profiles or routes",
        description="List what the control server knows, over gRPC-web.",
    )
    p.add_argument(
        "kind",
        choices=["nodes", "gpus", "replicas", "shards", "deployments", "profiles", "routes"],
        help="routes: the last routing decisions, why each request went where it went",
    )
    p.add_argument(
        "-o",
        "--output",
        choices=["table", "json"],
        default="table",
        help="table (default) or the proto3 JSON of the messages",
    )
    p.add_argument(
        "-w",
        "--watch",
        action="store_true",
        help="(nodes, replicas, shards, deployments) print the table, then a row for each "
        "change, until Ctrl-C",
    )
    add_client_flags(p)
    p.set_defaults(command=_run_get)
    for verb, text in (
        ("cordon", "place nothing new on a node"),
        ("uncordon", "let placement use a node again"),
    ):
        p = sub.add_parser(verb, help=text, description=f"{text[0].upper()}{text[1:]}.")
        p.add_argument("node_id", metavar="NODE")
        add_client_flags(p)
        p.set_defaults(command=_run_node_action, verb=verb)


def _run_get(args: argparse.Namespace) -> int:
    if args.watch:
        from llmgw.cli.getwatch import WATCHED, run_watch

        if args.kind not in WATCHED or args.output != "table":
            raise CliError(f"--watch prints tables of {', '.join(WATCHED)} only")
        return asyncio.run(run_watch(args.server, args.kind, _TABLES.get(args.kind)))
    if args.kind == "routes":
        from llmgw.cli.routes import run_get_routes

        return asyncio.run(run_get_routes(args.server, args.output))
    if args.kind in ("deployments", "profiles"):
        from llmgw.cli.apply import run_get_desired

        return asyncio.run(run_get_desired(args.server, args.kind, args.output))

    return asyncio.run(run_get(args.server, args.kind, args.output))


def _run_node_action(args: argparse.Namespace) -> int:
    return asyncio.run(run_node_action(args.server, args.verb, args.node_id))


async def run_get(server: str, kind: str, output: str) -> int:
    cluster = await call(server, lambda client: client.get_cluster())
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

    result = await call(server, act)
    sys.stdout.write(f"{result.message}\n")
    return 0


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


def _node_rows(cluster: Cluster) -> list[list[str]]:
    rows = [["NODE", "STATE", "GPUS", "CLASS", "HCAS", "DISCOVERY", "LABELS", "REASON"]]
    for node in cluster.nodes:
        info = node.info
        if info is None:
            continue
        physical = [g for g in info.gpus if g.mig is None]  # MIG slices counted apart
        slices = len(info.gpus) - len(physical)
        classes = sorted({g.gpu_class for g in physical if g.gpu_class})
        rows.append(
            [
                info.node_id,
                node.state.name or str(node.state),
                f"{len(physical)} ({slices} MIG slices)" if slices else str(len(physical)),
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
