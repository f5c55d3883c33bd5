"""``llmgw console --once``: the console's snapshot as JSON or as text tables, for scripts.

The JSON is the console's own view of the cluster (not the raw protos; ``llmgw get -o json``
gives those): ``overview`` (the counts the overview shows), ``router``, and one list per
view (``nodes``, ``gpus``, ``replicas``, ``shards``, ``events``, ``deployments``: ``replicas``
desired, the status the server computed beside it), keys in lowerCamelCase like
proto3 JSON, enums by name, values the server does not report as null.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from llmgw.tui.model import ConsoleSnapshot
from llmgw.tui.rows import GpuRow, NodeRow
from llmgw.tui.summary import gpu_counts, summarize
from llmgw.tui.widgets.cells import NOT_REPORTED, GiB, age

__all__ = ["snapshot_json", "snapshot_tables"]

Rows = list[list[str]]


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.capitalize() for word in rest)


def _plain(value: Any) -> Any:
    """Dataclasses to dicts (camelCase keys), enums to names, tuples to lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {_camel(f.name): _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def snapshot_json(snapshot: ConsoleSnapshot, server: str) -> dict[str, Any]:
    overview = _plain(summarize(snapshot))
    overview["replicasByState"] = dict(overview["replicasByState"])
    return {
        "server": server,
        "revision": snapshot.revision,
        "takenUnixMs": snapshot.taken_ms,
        "overview": overview,
        "router": _plain(snapshot.router),
        "nodes": [_node_json(n) for n in snapshot.nodes.values()],
        "gpus": [_gpu_json(g) for g in sorted(snapshot.gpus.values(), key=lambda g: g.order)],
        "replicas": [_plain(r) for r in snapshot.replicas.values()],
        "shards": [_plain(s) for s in snapshot.shards.values()],
        "events": [_plain(e) for e in snapshot.events.values()],
        "deployments": [_plain(d) for _, d in sorted(snapshot.deployments.items())],
    }


def _node_json(node: NodeRow) -> dict[str, Any]:
    out: dict[str, Any] = _plain(node)
    out["detail"]["labels"] = dict(node.detail.labels)
    out["detail"]["engineVersions"] = dict(node.detail.engine_versions)
    return out


def _gpu_json(gpu: GpuRow) -> dict[str, Any]:
    out: dict[str, Any] = _plain(gpu)
    out["info"]["nicPaths"] = [{"hca": hca, "path": path} for hca, path in gpu.info.nic_paths]
    return out


def snapshot_tables(snapshot: ConsoleSnapshot) -> list[tuple[str, Rows]]:
    """Titled tables (the first row of each is its header) for ``-o table``."""
    overview = summarize(snapshot)
    states = ", ".join(f"{s.name} {n}" for s, n in overview.replicas_by_state if n) or "none"
    pulse: Rows = [
        ["WHAT", "VALUE"],
        ["nodes", f"{overview.nodes_ready}/{overview.nodes_total} ready"],
        ["gpus", overview.gpus.words],
        ["replicas", f"{overview.replicas_total} ({states})"],
        ["out of date", str(overview.replicas_out_of_date)],
        ["router", _router_words(snapshot)],
    ]
    return [
        ("OVERVIEW", pulse),
        ("NODES", _node_rows(snapshot)),
        ("REPLICAS", _replica_rows(snapshot)),
        ("DEPLOYMENTS", _deployment_rows(snapshot)),
    ]


def _deployment_rows(snapshot: ConsoleSnapshot) -> Rows:
    rows: Rows = [["NAME", "PROFILE", "DESIRED", "READY", "UP-TO-DATE", "AVAILABLE", "REASON"]]
    for _, d in sorted(snapshot.deployments.items()):
        counts = (d.replicas, d.ready, d.up_to_date, d.available)
        rows.append([d.name, d.profile, *(str(n) for n in counts), d.reason])
    return rows


def _router_words(snapshot: ConsoleSnapshot) -> str:
    router = snapshot.router
    if router.reason:
        return router.reason
    return f"{router.decisions} decisions"


def _node_rows(snapshot: ConsoleSnapshot) -> Rows:
    rows: Rows = [["NODE", "STATE", "GPUS", "USED", "SLICES", "MEMORY", "REASON"]]
    by_node: dict[str, list[GpuRow]] = {}
    for gpu in snapshot.gpus.values():
        by_node.setdefault(gpu.node_id, []).append(gpu)
    for node in snapshot.nodes.values():
        gpus = by_node.get(node.node_id, [])
        devices = [g for g in gpus if not g.info.mig_enabled]  # memory: where engines run
        used = sum(g.memory_used_bytes for g in devices) / GiB
        total = sum(g.info.memory_total_bytes for g in devices) / GiB
        state = node.state.name + (" (cordoned)" if node.cordoned else "")
        counts = gpu_counts(gpus)
        slices = f"{counts.slices_used}/{counts.slices}" if counts.slices else "-"
        rows.append(
            [node.node_id, state, str(counts.gpus), str(counts.gpus_used), slices,
             f"{used:.0f}/{total:.0f}GiB", node.reason]
        )  # fmt: skip
    return rows


def _replica_rows(snapshot: ConsoleSnapshot) -> Rows:
    rows: Rows = [["REPLICA", "STATE", "MODEL", "PROFILE", "NODES", "GPUS", "AGE"]]
    now = snapshot.taken_ms
    for r in snapshot.replicas.values():
        when = age((now - r.since_ms) / 1000) if r.since_ms else NOT_REPORTED
        profile = r.profile + (" (out of date)" if r.out_of_date else "")
        rows.append(
            [r.replica_id, r.state.name, r.model, profile, ",".join(r.nodes), str(r.gpus), when]
        )
    return rows
