"""Replica records as JSON: how ``llmgw.server.state.store`` keeps a ``ReplicaRecord`` in
the ``replicas`` table (its plan's fields, its profile's bytes in base64, its lifecycle,
serial, API key, the replica it replaces and whether it was ever READY), and reads one
back (a record written before ``was_ready`` existed reads as never READY).
"""

from __future__ import annotations

import base64
import json
from typing import Any

from llmgw.api.llmgw.v1 import EngineProfile
from llmgw.server.core.plan import ReplicaPlan, ShardPlan
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord

# --- replica records as JSON ----------------------------------------------------------------


def encode_replica(record: ReplicaRecord) -> str:
    """``record`` as JSON text: the plan's fields, the profile's bytes in base64."""
    plan = record.plan
    return json.dumps(
        {
            "replica_id": plan.replica_id,
            "deployment": plan.deployment,
            "profile_name": plan.profile,
            "fingerprint": plan.fingerprint,
            "master_port": plan.master_port,
            "shards": [_shard_json(s) for s in plan.shards],
            "profile": base64.b64encode(bytes(record.profile)).decode(),
            "lifecycle": record.lifecycle.value,
            "serial": record.serial,
            "api_key": record.api_key,
            "replaces": record.replaces,
            "was_ready": record.was_ready,
        },
        sort_keys=True,
    )


def _shard_json(shard: ShardPlan) -> dict[str, Any]:
    return {
        "shard_id": shard.shard_id,
        "node_id": shard.node_id,
        "rank": shard.rank,
        "gpu_uuids": list(shard.gpu_uuids),
        "port": shard.port,
        "hcas": list(shard.hcas),
        "cpu_threads": shard.cpu_threads,
    }


def decode_replica(text: str) -> ReplicaRecord:
    """The record :func:`encode_replica` wrote; ValueError, KeyError or TypeError if not one."""
    data = json.loads(text)
    plan = ReplicaPlan(
        replica_id=str(data["replica_id"]),
        deployment=str(data["deployment"]),
        profile=str(data["profile_name"]),
        fingerprint=str(data["fingerprint"]),
        shards=tuple(_shard_plan(s) for s in data["shards"]),
        master_port=int(data["master_port"]),
    )
    if not plan.shards:
        raise ValueError("a replica record without shards")
    return ReplicaRecord(
        plan=plan,
        profile=EngineProfile.parse(base64.b64decode(data["profile"], validate=True)),
        lifecycle=Lifecycle(data["lifecycle"]),
        serial=int(data["serial"]),
        api_key=str(data["api_key"]),
        replaces=str(data["replaces"]),
        was_ready=data.get("was_ready", False) is True,
    )


def _shard_plan(data: dict[str, Any]) -> ShardPlan:
    return ShardPlan(
        shard_id=str(data["shard_id"]),
        node_id=str(data["node_id"]),
        rank=int(data["rank"]),
        gpu_uuids=tuple(str(u) for u in data["gpu_uuids"]),
        port=int(data["port"]),
        hcas=tuple(str(h) for h in data["hcas"]),
        cpu_threads=int(data["cpu_threads"]),
    )
