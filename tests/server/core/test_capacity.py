"""The placement view of a node, built from the operator API's ``Node`` message."""

from __future__ import annotations

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    GpuTelemetry,
    Health,
    Node,
    NodeInfo,
    NodeState,
    NodeTelemetry,
)
from llmgw.server.core.capacity import Device, choose_group, node_capacity


def _node(
    fixture: str = "dgx-h100",
    node_id: str = "dgx-1",
    *,
    state: NodeState = NodeState.READY,
    cordoned: bool = False,
    telemetry: list[GpuTelemetry] | None = None,
    labels: dict[str, str] | None = None,
) -> Node:
    info = simulated_node(fixture, node_id=node_id, hostname=f"{node_id}.lab", labels=labels)
    return Node(
        info=info,
        state=state,
        cordoned=cordoned,
        telemetry=NodeTelemetry(node_id=node_id, gpus=telemetry or []),
    )


def test_dgx_devices_topology_and_fabric() -> None:
    cap = node_capacity(_node(labels={"pool": "chat", "zone": "a"}))
    assert cap.node_id == "dgx-1"
    assert cap.address == "dgx-1.lab"  # no management address: the hostname
    assert cap.schedulable and cap.status == "READY"
    assert cap.pool == "chat" and cap.labels["zone"] == "a"
    assert [d.index for d in cap.devices] == list(range(8))
    assert {d.numa_node for d in cap.devices[:4]} == {0}
    assert {d.numa_node for d in cap.devices[4:]} == {1}
    assert cap.devices[0].nvlink_peers == frozenset(range(1, 8))
    assert all(d.gpu_class == "H100" and d.healthy for d in cap.devices)
    assert cap.ib_fabrics == frozenset({"ib-compute"})
    assert cap.ib_hcas["ib-compute"] == frozenset(f"mlx5_{i}" for i in range(8))
    assert cap.nvlink_domain is None  # no NVLink fabric, no IMEX
    assert cap.cpu_count == 224
    assert cap.devices[5].nearest_hca() == "mlx5_5"  # PIX


def test_management_address_wins_over_hostname() -> None:
    node = _node()
    assert node.info is not None
    node.info.management_address = "10.0.0.7"
    assert node_capacity(node).address == "10.0.0.7"


def test_cordoned_and_not_ready_nodes_are_not_schedulable() -> None:
    cordoned = node_capacity(_node(state=NodeState.CORDONED, cordoned=True))
    assert not cordoned.schedulable and cordoned.status == "CORDONED"
    # cordoned while the state still reads READY (the flag alone is enough)
    flagged = node_capacity(_node(cordoned=True))
    assert not flagged.schedulable and flagged.status == "CORDONED"
    lost = node_capacity(_node(state=NodeState.NOT_READY))
    assert not lost.schedulable and lost.status == "NOT_READY"
    unknown = node_capacity(_node(state=NodeState.UNSPECIFIED))
    assert not unknown.schedulable and unknown.status == "NOT_READY"


def test_telemetry_gives_free_memory_and_health() -> None:
    base = node_capacity(_node())
    uuid0, uuid1 = base.devices[0].uuid, base.devices[1].uuid
    total = base.devices[0].memory_total_bytes
    live = [
        GpuTelemetry(uuid=uuid0, memory_used_bytes=30 << 30, health=Health.HEALTHY),
        GpuTelemetry(uuid=uuid1, memory_used_bytes=0, health=Health.UNHEALTHY),
    ]
    cap = node_capacity(_node(telemetry=live))
    assert cap.devices[0].memory_free_bytes == total - (30 << 30)
    assert cap.devices[0].healthy
    assert not cap.devices[1].healthy
    assert cap.devices[2].memory_free_bytes == total and cap.devices[2].healthy


def test_unknown_health_fails_closed() -> None:
    node = _node()
    assert node.info is not None and node.info.gpus[3].health is not None
    node.info.gpus[3].health.health = Health.UNKNOWN
    assert not node_capacity(node).devices[3].healthy


def test_mig_parent_is_not_a_device_its_slices_are() -> None:
    cap = node_capacity(_node("a100-mig", "a100-1"))
    parents = {d.parent_uuid for d in cap.devices if d.parent_uuid}
    assert parents and not parents & {d.uuid for d in cap.devices}
    profiles = sorted(d.mig_profile for d in cap.devices if d.mig_profile)
    assert profiles.count("1g.10gb") == 9 and "3g.40gb" in profiles and "7g.80gb" in profiles
    whole = [d for d in cap.devices if d.mig_profile is None]
    assert [d.index for d in whole] == [3]  # the one GPU not in MIG mode
    assert whole[0].nearest_hca() == "mlx5_1"  # NODE when no PIX or PXB


def test_unhealthy_parent_makes_its_slices_unhealthy() -> None:
    node = _node("a100-mig", "a100-1")
    assert node.info is not None
    parent = next(g for g in node.info.gpus if g.index == 2 and g.mig_enabled)
    assert parent.health is not None
    parent.health.health = Health.UNHEALTHY
    cap = node_capacity(node)
    assert [d.healthy for d in cap.devices if d.index == 2] == [False]
    assert all(d.healthy for d in cap.devices if d.index != 2)


def test_nvlink_domain_needs_completed_fabric_and_imex() -> None:
    cap = node_capacity(_node("gb200-nvl4", "tray-1"))
    assert cap.nvlink_domain == "6f1d2c9e-4b7a-4e0d-9a51-3c2b8e7f0a14/1"
    down = _node("gb200-nvl4", "tray-2")
    assert down.info is not None and down.info.imex is not None
    down.info.imex.state = "down"
    assert node_capacity(down).nvlink_domain is None
    partial = _node("gb200-nvl4", "tray-3")
    assert partial.info is not None and partial.info.gpus[1].fabric is not None
    partial.info.gpus[1].fabric.state = "in_progress"
    assert node_capacity(partial).nvlink_domain is None


def test_only_active_infiniband_attachments_count() -> None:
    assert node_capacity(_node("l4-pcie", "l4-1")).ib_fabrics == frozenset()  # Ethernet
    node = _node()
    assert node.info is not None
    for att in node.info.fabrics[:4]:
        att.state = "DOWN"
    cap = node_capacity(node)
    assert cap.ib_hcas["ib-compute"] == frozenset({"mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"})


def test_cpu_only_node_has_no_devices() -> None:
    cap = node_capacity(_node("cpu-only", "cpu-1"))
    assert cap.devices == () and cap.cpu_count == 192


def test_empty_node_message_reads_as_not_ready() -> None:
    cap = node_capacity(Node(info=NodeInfo(node_id="ghost")))
    assert cap.node_id == "ghost" and not cap.schedulable and cap.devices == ()


def _dev(index: int, numa: int, peers: set[int]) -> Device:
    return Device(
        uuid=f"GPU-{index}",
        index=index,
        gpu_class="X",
        memory_total_bytes=1,
        memory_free_bytes=1,
        numa_node=numa,
        nvlink_peers=frozenset(peers),
        nic_paths=(),
        healthy=True,
    )


def test_choose_group_tiers() -> None:
    # 0-1 NVLink pair on NUMA 0, 2-3 pair across NUMA 0/1, 4 alone on NUMA 1
    devices = [
        _dev(0, 0, {1}),
        _dev(1, 0, {0}),
        _dev(2, 0, {3}),
        _dev(3, 1, {2}),
        _dev(4, 1, set()),
    ]
    tier, group = choose_group(devices, 2) or (9, ())
    assert tier == 0 and [d.index for d in group] == [0, 1]
    tier, group = choose_group(devices[2:], 2) or (9, ())
    assert tier == 1 and [d.index for d in group] == [2, 3]
    tier, group = choose_group([devices[0], devices[2], devices[4]], 2) or (9, ())
    assert tier == 2 and [d.index for d in group] == [0, 2]
    tier, group = choose_group([devices[0], devices[4]], 2) or (9, ())
    assert tier == 3 and [d.index for d in group] == [0, 4]
    assert choose_group(devices[:1], 2) is None


def test_choose_group_prefers_the_tightest_numa_node() -> None:
    # NUMA 0 has three free, NUMA 1 one: a single device comes from NUMA 1 (best fit)
    devices = [_dev(0, 0, set()), _dev(1, 0, set()), _dev(2, 0, set()), _dev(5, 1, set())]
    assert choose_group(devices, 1) == (0, (devices[3],))
