"""What ``llmgw describe`` and ``llmgw get --watch`` print, from messages made here."""

from __future__ import annotations

import io

from llmgw.api.llmgw.v1 import (
    Cluster,
    Deployment,
    DescribedReplica,
    Description,
    EngineProfile,
    HistoryEvent,
    PlannedShard,
    ProfileRevision,
    Replica,
    RolloutHistoryResponse,
    Shard,
    ShardState,
    ShardStatus,
    WatchEvent,
)
from llmgw.cli.describe import render_description, render_history
from llmgw.cli.getwatch import RowPrinter, apply_event


def _replica(rid: str, state: ShardState = ShardState.READY) -> Replica:
    return Replica(replica_id=rid, deployment="chat", profile="chat-a", state=state)


def _rows(cluster: Cluster) -> list[list[str]]:
    return [["REPLICA", "STATE"]] + [[r.replica_id, r.state.name] for r in cluster.replicas]


def test_describe_prints_fields_shards_and_events_escaped() -> None:
    description = Description(
        kind="deployment",
        name="chat",
        deployment=Deployment(name="chat", profile="chat-a", replicas=2),
        profile=EngineProfile(name="chat-a", engine="sim", gpu_class="H100", tp=2, pp=1, nodes=1),
        fingerprint="abc123",
        revision=3,
        replicas=[
            DescribedReplica(
                replica=_replica("chat-1"),
                lifecycle="active",
                planned=[
                    PlannedShard(shard_id="chat-1.0", node_id="a1", gpu_uuids=["GPU-1"], port=20001)
                ],  # fmt: skip
            )
        ],
        shards=[
            Shard(
                shard_id="chat-1.0",
                node_id="a1",
                status=ShardStatus(state=ShardState.FAILED, reason="exit 1\x1b[2J"),
            )
        ],  # fmt: skip
        events=[
            HistoryEvent(
                at_unix_ms=1_000,
                object="chat-1",
                actor="reconciler",
                reason="reconcile",
                message="placed active replica chat-1",
            ),
            HistoryEvent(
                at_unix_ms=2_000,
                object="chat-1.0",
                actor="node/a1",
                reason="FAILED",
                message="exit 1",
                warning=True,
            ),
        ],  # fmt: skip
    )
    text = render_description(description)
    assert "Profile:" in text and "chat-a (abc123)" in text and "Revision:" in text
    assert "2 desired, 1 live" in text
    shard = next(line for line in text.splitlines() if "chat-1.0" in line and "GPU-1" in line)
    assert "a1" in shard and "20001" in shard and "FAILED" in shard and "\\x1b" in shard
    assert "\x1b" not in text  # an engine's output never reaches the terminal raw
    events = text.split("Events:")[1].splitlines()
    assert "Normal" in events[2] and "placed active replica chat-1" in events[2]
    assert "Warning" in events[3] and "node/a1" in events[3]


def test_rollout_history_marks_the_current_revision() -> None:
    reply = RolloutHistoryResponse(
        deployment="chat",
        current=2,
        revisions=[
            ProfileRevision(revision=1, profile="chat-a", fingerprint="f1", cause="apply"),
            ProfileRevision(revision=2, profile="chat-b", fingerprint="f2", cause="reprofile"),
        ],
    )
    lines = render_history(reply).splitlines()
    assert lines[0] == "deployment chat"
    assert lines[2].split()[:2] == ["1", "chat-a"] and lines[3].split()[:2] == ["2*", "chat-b"]


def test_watch_prints_the_table_then_only_new_changed_and_removed_rows() -> None:
    out = io.StringIO()
    printer = RowPrinter(_rows, out)
    cluster = apply_event(None, WatchEvent(replica=_replica("chat-9")))
    assert cluster is None  # nothing before the first snapshot
    snapshot = Cluster(replicas=[_replica("chat-1"), _replica("chat-2")])
    cluster = apply_event(None, WatchEvent(snapshot=snapshot))
    assert cluster is not None
    printer.show(cluster)
    events = [
        WatchEvent(replica=_replica("chat-3", ShardState.PENDING)),
        WatchEvent(replica=_replica("chat-3")),
        WatchEvent(audit=None, node_removed="nowhere"),
        WatchEvent(replica=_replica("chat-1")),  # unchanged: no row
        WatchEvent(replica_removed="chat-2"),
    ]
    for event in events:
        cluster = apply_event(cluster, event)
        assert cluster is not None
        printer.show(cluster)
    assert [line.split() for line in out.getvalue().splitlines()] == [
        ["REPLICA", "STATE"],
        ["chat-1", "READY"],
        ["chat-2", "READY"],
        ["chat-3", "PENDING"],
        ["chat-3", "READY"],
        ["chat-2", "<removed>"],
    ]
