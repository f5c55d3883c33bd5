"""``llmgw describe``, ``scale`` and ``rollout history|undo``: what they print.

``describe`` prints the server's ``Description`` as kubectl describe does: a block of
``Key: value`` lines, then tables (replicas, shards, GPUs) and the events, oldest first.
Every value is escaped (``llmgw.printable.escape``, through ``render_table``), so a reason
an engine wrote cannot move the cursor. ``-o json`` prints the message's proto3 JSON.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime

from llmgw.api.llmgw.v1 import (
    ActionResult,
    DescribedNode,
    DescribedReplica,
    Description,
    HistoryEvent,
    RolloutHistoryResponse,
    Shard,
    ShardState,
)
from llmgw.cli.autoscale_text import autoscale_fields
from llmgw.cli.rollout_wait import wait_ready
from llmgw.cli.rpc import call
from llmgw.cli.tables import render_table
from llmgw.printable import escape

__all__ = ["render_description", "render_history", "run_describe", "run_rollout", "run_scale"]

GiB = 1 << 30


async def run_describe(server: str, kind: str, name: str, output: str) -> int:
    """``llmgw describe KIND NAME``."""
    description: Description = await call(server, lambda client: client.describe(kind, name))
    if output == "json":
        sys.stdout.write(json.dumps(description.to_dict(), indent=2) + "\n")
    else:
        sys.stdout.write(render_description(description) + "\n")
    return 0


async def run_scale(
    server: str, deployment: str, replicas: int, wait_s: float | None = None
) -> int:
    """``llmgw scale DEPLOYMENT N``: 1 when some replicas cannot be placed, or (``wait_s``)
    are not ready within it."""
    result = await call(server, lambda client: client.scale_deployment(deployment, replicas))
    return await _answered(server, deployment, result, wait_s)


async def run_rollout(
    server: str, verb: str, deployment: str, to_revision: int, wait_s: float | None = None
) -> int:
    """``llmgw rollout history DEPLOYMENT`` and ``llmgw rollout undo DEPLOYMENT``."""
    if verb == "history":
        reply = await call(server, lambda client: client.rollout_history(deployment))
        sys.stdout.write(render_history(reply) + "\n")
        return 0
    result = await call(
        server, lambda client: client.rollout_undo(deployment, to_revision=to_revision)
    )
    return await _answered(server, deployment, result, wait_s)


async def _answered(
    server: str, deployment: str, result: ActionResult, wait_s: float | None
) -> int:
    """Print an action's answer; 1 when replicas cannot be placed, else wait if asked."""
    sys.stdout.write(f"{result.message}\n")
    if result.placeable < result.desired:
        return 1
    if wait_s is None:
        return 0
    return int(await call(server, lambda client: wait_ready(client, [deployment], wait_s)))


def render_history(reply: RolloutHistoryResponse) -> str:
    """The revisions as a table, the current one marked ``*``."""
    rows = [["REVISION", "PROFILE", "FINGERPRINT", "WHEN", "BY", "CAUSE"]]
    for r in reply.revisions:
        mark = "*" if r.revision == reply.current else ""
        rows.append(
            [f"{r.revision}{mark}", r.profile, r.fingerprint, _when(r.at_unix_ms), r.actor, r.cause]
        )
    return f"deployment {escape(reply.deployment)}\n" + render_table(rows)


def render_description(d: Description) -> str:
    """A Description in kubectl describe's shape."""
    parts = [_fields(_head(d))]
    if d.node is not None:
        parts.append(_fields(_node_fields(d.node)))
        parts.append("GPUs:\n" + _indent(render_table(_gpu_rows(d.node))))
    if d.replicas or d.kind != "node":
        parts.append("Replicas:\n" + _indent(render_table(_replica_rows(d.replicas))))
    parts.append("Shards:\n" + _indent(render_table(_shard_rows(d.replicas, d.shards))))
    parts.append("Events:\n" + _indent(render_table(_event_rows(d.events))))
    return "\n".join(parts)


def _head(d: Description) -> list[tuple[str, str]]:
    fields = [("Name", d.name), ("Kind", d.kind)]
    dep, profile = d.deployment, d.profile
    if d.kind == "replica" and d.replicas:
        r = d.replicas[0]
        replica = r.replica
        fields += [
            ("Deployment", replica.deployment if replica else ""),
            ("Lifecycle", r.lifecycle),
            ("State", replica.state.name.removeprefix("SHARD_STATE_") if replica else "-"),
            ("Out of date", _yes(replica.out_of_date) if replica else "-"),
            ("Endpoint", replica.endpoint if replica else "-"),
            ("Replaces", r.replaces or "-"),
        ]
    if dep is not None and d.kind == "deployment":
        fields += [
            ("Replicas", f"{dep.replicas} desired, {len(d.replicas)} live"),
            ("Pool", dep.pool or "-"),
            ("Labels", ",".join(f"{k}={v}" for k, v in sorted(dep.labels.items())) or "-"),
            ("Updated", _when(dep.updated_unix_ms)),
            *autoscale_fields(dep, _when),
        ]
    if profile is not None:
        shape = f"{profile.engine}, {profile.gpu_class}, tp {profile.tp} pp {profile.pp}"
        fields += [
            ("Profile", f"{profile.name} ({d.fingerprint})"),
            ("Model", profile.served_model_name or profile.model_path),
            ("Engine", f"{shape}, {profile.nodes} node(s)"),
            ("Args", " ".join(profile.args) or "-"),
        ]
    if d.kind == "deployment":
        fields.append(("Revision", str(d.revision) if d.revision else "none recorded"))
    return fields


def _node_fields(n: DescribedNode) -> list[tuple[str, str]]:
    info = n.info
    return [
        ("State", n.state + (f" ({n.state_reason})" if n.state_reason else "")),
        ("Cordoned", _yes(n.cordoned)),
        ("Connected", _yes(n.connected) + (f" from {n.peer}" if n.connected and n.peer else "")),
        ("Host", f"{info.hostname} ({info.management_address})" if info else "-"),
        ("Discovery", info.discovery if info else "-"),
        ("Labels", ",".join(f"{k}={v}" for k, v in sorted(info.labels.items())) if info else "-"),
        ("First seen", _when(n.first_seen_unix_ms)),
        ("Last heartbeat", _when(n.last_heartbeat_unix_ms)),
    ]


def _gpu_rows(n: DescribedNode) -> list[list[str]]:
    rows = [["GPU", "NAME", "CLASS", "MEMORY", "UTIL", "TEMP", "HEALTH", "UUID"]]
    live = {t.uuid: t for t in n.telemetry}
    for gpu in n.info.gpus if n.info is not None else []:
        t = live.get(gpu.uuid)
        used = t.memory_used_bytes if t else gpu.memory_used_bytes
        index = f"{gpu.index}/{gpu.mig.profile}" if gpu.mig is not None else str(gpu.index)
        health = t.health.name if t else (gpu.health.health.name if gpu.health else "")
        rows.append(
            [
                index,
                gpu.name,
                gpu.gpu_class or "-",
                f"{used / GiB:.0f}/{gpu.memory_total_bytes / GiB:.0f}GiB",
                f"{t.utilization_pct if t else gpu.utilization_pct}%",
                f"{t.temperature_c}C" if t and t.temperature_c else "-",
                (health or "UNKNOWN").removeprefix("HEALTH_"),
                gpu.uuid,
            ]
        )
    return rows


def _replica_rows(replicas: Sequence[DescribedReplica]) -> list[list[str]]:
    rows = [["REPLICA", "LIFECYCLE", "STATE", "PROFILE", "OUT-OF-DATE", "ENDPOINT"]]
    for r in replicas:
        v = r.replica
        if v is None:
            continue
        state = v.state.name.removeprefix("SHARD_STATE_")
        rows.append([v.replica_id, r.lifecycle, state, v.profile, _yes(v.out_of_date), v.endpoint])
    return rows


def _shard_rows(replicas: Sequence[DescribedReplica], shards: Sequence[Shard]) -> list[list[str]]:
    """Each planned shard with where it runs and what its agent last said, then the
    reported shards of no replica shown (a node's other shards)."""
    reported = {s.shard_id: s for s in shards}
    rows = [["SHARD", "NODE", "GPUS", "PORT", "STATE", "REASON"]]
    planned = {p.shard_id for r in replicas for p in r.planned}
    for r in replicas:
        for p in r.planned:
            status = reported[p.shard_id].status if p.shard_id in reported else None
            threads = f"{p.cpu_threads} CPU threads" if p.cpu_threads else "-"
            state = _state(status.state) if status else "NOT REPORTED"
            reason = status.reason if status else ""
            rows.append([p.shard_id, p.node_id, ",".join(p.gpu_uuids) or threads, str(p.port),
                         state, reason])  # fmt: skip
    rows.extend(
        [s.shard_id, s.node_id, ",".join(s.status.gpu_uuids) or "-",
         s.status.endpoint.rpartition(":")[2] or "-", _state(s.status.state), s.status.reason]
        for s in shards
        if s.shard_id not in planned and s.status is not None
    )  # fmt: skip
    return rows


def _state(state: ShardState) -> str:
    return state.name.removeprefix("SHARD_STATE_") if state.name else str(int(state))


def _event_rows(events: Sequence[HistoryEvent]) -> list[list[str]]:
    rows = [["WHEN", "TYPE", "OBJECT", "BY", "REASON", "MESSAGE"]]
    for e in events:
        kind = "Warning" if e.warning else "Normal"
        rows.append([_when(e.at_unix_ms), kind, e.object, e.actor, e.reason, e.message])
    return rows


def _fields(fields: Sequence[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in fields) + 2
    return "\n".join(f"{(k + ':').ljust(width)}{escape(v)}" for k, v in fields)


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def _when(ms: int) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
