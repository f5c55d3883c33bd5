"""Node states, connections and telemetry in the pure inventory."""

from __future__ import annotations

from llmgw.api.llmgw.v1 import (
    Gpu,
    GpuHealth,
    GpuTelemetry,
    Heartbeat,
    Node,
    NodeInfo,
    NodeState,
    ShardState,
    ShardStatus,
)
from llmgw.server.state.inventory import Inventory, InventoryConfig


def _node(node_id: str = "n1") -> NodeInfo:
    gpus = [Gpu(index=i, uuid=f"GPU-{i}", health=GpuHealth()) for i in range(2)]
    return NodeInfo(node_id=node_id, gpus=gpus)


def test_registered_node_is_ready_until_grace_passes() -> None:
    inv = Inventory(InventoryConfig(grace_s=5))
    conn, record = inv.register(_node(), 1, peer="p", now_ms=1, now_mono=100.0)
    assert inv.state(record, 104.9) is NodeState.READY
    assert inv.state(record, 105.1) is NodeState.NOT_READY
    assert [r.info.node_id for r in inv.expire(105.1)] == ["n1"]
    assert inv.expire(106.0) == []  # reported once
    delta, changed = inv.heartbeat("n1", conn, Heartbeat(seq=1), now_ms=2, now_mono=106.0)
    assert delta is not None and changed
    assert inv.state(record, 106.0) is NodeState.READY


def test_cordon_shows_while_connected_and_not_ready_wins() -> None:
    inv = Inventory()
    conn, record = inv.register(_node(), 1, peer="p", now_ms=1, now_mono=0.0)
    inv.set_cordoned("n1", True)
    assert inv.state(record, 0.0) is NodeState.CORDONED
    inv.disconnect("n1", conn, "gone")
    assert inv.state(record, 0.0) is NodeState.NOT_READY
    assert inv.node_view(record, 0.0).state_reason == "gone"


def test_older_connection_cannot_touch_a_reconnected_node() -> None:
    inv = Inventory()
    old, _ = inv.register(_node(), 1, peer="a", now_ms=1, now_mono=0.0)
    new, record = inv.register(_node(), 1, peer="b", now_ms=2, now_mono=0.0)
    assert new != old
    assert inv.disconnect("n1", old, "old stream died") is None
    assert inv.heartbeat("n1", old, Heartbeat(), now_ms=3, now_mono=0.0) == (None, False)
    assert inv.state(record, 0.0) is NodeState.READY


def test_heartbeat_telemetry_updates_the_gpus() -> None:
    inv = Inventory()
    conn, record = inv.register(_node(), 1, peer="p", now_ms=1, now_mono=0.0)
    beat = Heartbeat(
        gpus=[
            GpuTelemetry(uuid="GPU-1", utilization_pct=77, temperature_c=61),
            GpuTelemetry(uuid="GPU-unknown", utilization_pct=5),
        ]
    )
    delta, _ = inv.heartbeat("n1", conn, beat, now_ms=5, now_mono=0.5)
    assert delta is not None and delta.last_heartbeat_unix_ms == 5
    telemetry = inv.node_view(record, 0.5).telemetry
    assert telemetry is not None and telemetry.last_heartbeat_unix_ms == 5
    assert [(t.uuid, t.utilization_pct, t.temperature_c) for t in telemetry.gpus] == [
        ("GPU-1", 77, 61)
    ]  # the unknown UUID is dropped
    assert record.info.gpus[1].utilization_pct == 0  # the registration stays as registered


def test_registration_encodes_once_and_round_trips() -> None:
    inv = Inventory()
    node = _node()
    _, record = inv.register(node, 1, peer="p", now_ms=1, now_mono=0.0)
    assert bytes(record.info) == bytes(node)
    view = inv.node_view(record, 0.0)
    parsed = Node.parse(bytes(view))
    assert parsed.info == node and parsed.state is NodeState.READY
    assert view.to_dict()["info"]["nodeId"] == "n1"


def test_restored_node_is_not_ready_until_it_registers() -> None:
    inv = Inventory()
    inv.restore("n1", NodeInfo(node_id="n1"), cordoned=True, first_seen_ms=7)  # type: ignore[arg-type]
    record = inv.nodes["n1"]
    assert inv.state(record, 0.0) is NodeState.NOT_READY
    _, record = inv.register(_node(), 1, peer="p", now_ms=9, now_mono=0.0)
    assert record.first_seen_ms == 7 and record.cordoned


def test_unknown_shard_state_reads_as_failed() -> None:
    inv = Inventory()
    shard = inv.report_shard("n1", ShardStatus(shard_id="s", state=ShardState(42)), now_ms=1)
    assert shard.status is not None and shard.status.state is ShardState.FAILED
    assert inv.cluster(revision=3, now_ms=1, now_mono=0.0).shards == [shard]
