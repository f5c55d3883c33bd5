"""Simulated discovery: the shipped topology fixtures, their validation, and telemetry."""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.discovery import (
    DiscoveryError,
    FixtureError,
    SimulatedTelemetry,
    available_fixtures,
    load_fixture,
    simulated_node,
)
from llmgw.api.llmgw.v1 import Gpu, Health, NodeInfo

GIB = 1 << 30
MIB = 1 << 20
UUID_RE = re.compile(r"^(GPU|MIG)-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
SHIPPED = ["a100-mig", "cpu-only", "dgx-h100", "gb200-nvl4", "l4-pcie"]


def _node(name: str, node_id: str = "node-a") -> NodeInfo:
    return simulated_node(name, node_id=node_id, hostname=f"{node_id}.example")


def _physical(node: NodeInfo) -> list[Gpu]:
    return [g for g in node.gpus if g.mig is None]


def test_available_fixtures_lists_the_shipped_ones() -> None:
    assert available_fixtures() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_fixture_round_trips_through_the_wire(name: str) -> None:
    node = simulated_node(name, node_id="n1", hostname="h1", labels={"pool": "a"})
    assert NodeInfo.parse(bytes(node)) == node
    assert node.node_id == "n1" and node.hostname == "h1" and node.labels == {"pool": "a"}
    assert node.discovery.startswith(f"simulated:{name}")
    assert node.host is not None and node.host.os_id and node.host.arch
    assert node.memory is not None and 0 < node.memory.available_bytes <= node.memory.total_bytes
    assert node.cpu_count > 0 and node.storage and node.imex is not None


@pytest.mark.parametrize("name", SHIPPED)
def test_uuids_are_well_formed_and_unique_per_node(name: str) -> None:
    a, b = _node(name, "node-a"), _node(name, "node-b")
    uuids_a = [g.uuid for g in a.gpus]
    assert all(UUID_RE.match(u) for u in uuids_a)
    assert len(set(uuids_a)) == len(uuids_a)
    assert set(uuids_a).isdisjoint(g.uuid for g in b.gpus)
    assert [g.uuid for g in _node(name, "node-a").gpus] == uuids_a  # stable across restarts


def test_dgx_h100_is_eight_h100_on_nvswitch() -> None:
    node = _node("dgx-h100")
    assert len(node.gpus) == 8 and node.discovery == "simulated:dgx-h100"
    assert [g.index for g in node.gpus] == list(range(8))
    assert len({g.pci_bus_id for g in node.gpus}) == 8
    for gpu in node.gpus:
        assert gpu.name == "NVIDIA H100 80GB HBM3" and gpu.gpu_class == "H100"
        assert gpu.memory_total_bytes == 81559 * MIB and gpu.compute_capability == "9.0"
        assert gpu.numa_node == (0 if gpu.index < 4 else 1)
        assert gpu.driver_version == "550.54.15" and gpu.cuda_version == "12.4"
        assert len(gpu.nvlinks) == 18
        assert all(n.remote_kind == "switch" and n.active for n in gpu.nvlinks)
        assert [n.link for n in gpu.nvlinks] == list(range(18))
        assert gpu.nvlink_peers == [i for i in range(8) if i != gpu.index]
        assert gpu.health is not None and gpu.health.health is Health.HEALTHY
        assert 20 <= gpu.health.temperature_c <= 50
        assert not gpu.mig_enabled and gpu.mig is None


def test_dgx_h100_nic_paths_follow_numa() -> None:
    node = _node("dgx-h100")
    numa_of = {f.hca: f.numa_node for f in node.fabrics}
    for gpu in node.gpus:
        paths = {p.hca: p.path for p in gpu.nic_paths}
        assert sorted(paths) == [f"mlx5_{i}" for i in range(8)]
        assert [h for h, p in paths.items() if p == "PIX"] == [f"mlx5_{gpu.index}"]
        for hca, path in paths.items():
            if path != "PIX":
                assert path == ("NODE" if numa_of[hca] == gpu.numa_node else "SYS")
        assert Counter(paths.values()) == {"PIX": 1, "NODE": 3, "SYS": 4}


def test_dgx_h100_host_and_fabrics() -> None:
    node = _node("dgx-h100")
    assert len(node.fabrics) == 8
    for i, fabric in enumerate(node.fabrics):
        assert fabric.hca == f"mlx5_{i}" and fabric.rate_gbps == 400.0
        assert fabric.link_layer == "InfiniBand" and fabric.state == "ACTIVE"
        assert fabric.fabric and fabric.numa_node == (0 if i < 4 else 1)
    host = node.host
    assert host is not None
    assert (host.os_id, host.os_version, host.os_codename) == ("ubuntu", "22.04", "jammy")
    assert host.arch == "x86_64" and "avx512f" in host.cpu_flags
    assert host.nvidia_driver_version == "550.54.15" and host.cuda_version == "12.4"
    assert node.cpu_count == 224
    assert node.memory is not None and node.memory.total_bytes > 1900 * GIB
    assert node.imex is not None and node.imex.state == "not_installed"


def test_a100_mig_devices_sit_beside_parents_that_exist() -> None:
    node = _node("a100-mig")
    by_uuid = {g.uuid: g for g in node.gpus}
    migs = [g for g in node.gpus if g.mig is not None]
    assert len(_physical(node)) == 4 and migs
    assert {m.mig.profile for m in migs} >= {"1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"}  # type: ignore[union-attr]
    for position, device in enumerate(node.gpus):
        if device.mig is None:
            continue
        parent = by_uuid[device.mig.parent_uuid]
        assert parent.mig is None and parent.mig_enabled
        assert device.uuid.startswith("MIG-") and parent.uuid.startswith("GPU-")
        assert device.index == parent.index == device.mig.parent_index
        assert device.memory_total_bytes < parent.memory_total_bytes
        assert not device.nvlinks and not device.nvlink_peers
        earlier = node.gpus[position - 1]
        assert earlier is parent or earlier.mig is not None  # right after the parent
    for parent in _physical(node):
        children = [m for m in migs if m.mig.parent_uuid == parent.uuid]  # type: ignore[union-attr]
        assert parent.mig_enabled == bool(children)
        assert sum(c.memory_total_bytes for c in children) <= parent.memory_total_bytes
        ids = [(c.mig.gpu_instance_id, c.mig.compute_instance_id) for c in children]  # type: ignore[union-attr]
        assert len(set(ids)) == len(ids)
    assert any(not g.mig_enabled for g in _physical(node))


def test_a100_nvlink_bridges_pair_gpus() -> None:
    physical = {g.index: g for g in _physical(_node("a100-mig"))}
    for a, b in [(0, 1), (1, 0), (2, 3), (3, 2)]:
        assert physical[a].nvlink_peers == [b]
        assert len(physical[a].nvlinks) == 12
        assert {n.remote_gpu_index for n in physical[a].nvlinks} == {b}
        assert {n.remote_pci_bus_id for n in physical[a].nvlinks} == {physical[b].pci_bus_id}
        assert {n.remote_kind for n in physical[a].nvlinks} == {"gpu"}


def test_gb200_has_fabric_clique_and_imex() -> None:
    node = _node("gb200-nvl4")
    assert node.host is not None and node.host.arch == "aarch64"
    assert "Grace" in node.host.cpu_model
    assert len(node.gpus) == 4
    for gpu in node.gpus:
        assert gpu.name == "NVIDIA GB200" and gpu.gpu_class == "GB200"
        assert gpu.fabric is not None
        assert (gpu.fabric.state, gpu.fabric.status) == ("completed", "success")
        assert gpu.fabric.cluster_uuid and gpu.fabric.clique_id > 0
        assert gpu.fabric.bandwidth_gbps > 0
        assert gpu.nvlink_peers == [i for i in range(4) if i != gpu.index]
    assert len({(g.fabric.cluster_uuid, g.fabric.clique_id) for g in node.gpus}) == 1  # type: ignore[union-attr]
    assert node.imex is not None
    assert node.imex.state == "up" and node.imex.channels == [0] and node.imex.domain


def test_l4_pcie_has_no_nvlink_and_only_ethernet() -> None:
    node = _node("l4-pcie")
    assert len(node.gpus) == 4
    for gpu in node.gpus:
        assert gpu.name == "NVIDIA L4" and gpu.gpu_class == "L4"
        assert gpu.memory_total_bytes == 23034 * MIB and gpu.compute_capability == "8.9"
        assert gpu.nvlinks == [] and gpu.nvlink_peers == []
        assert "PIX" not in {p.path for p in gpu.nic_paths}
    assert node.fabrics and {f.link_layer for f in node.fabrics} == {"Ethernet"}


def test_cpu_only_has_no_gpus_and_says_why() -> None:
    node = _node("cpu-only")
    assert node.gpus == []
    assert node.discovery == "simulated:cpu-only: no NVIDIA GPUs on this node"
    assert node.host is not None and node.host.nvidia_driver_version == ""


def test_labels_default_to_empty() -> None:
    assert _node("l4-pcie").labels == {}


def test_unknown_name_names_the_known_fixtures() -> None:
    with pytest.raises(DiscoveryError) as info:
        simulated_node("dgx-h1000", node_id="n", hostname="h")
    assert not isinstance(info.value, FixtureError)
    for name in SHIPPED:
        assert name in str(info.value)


def test_load_fixture_by_name_and_by_path_agree(tmp_path: Path) -> None:
    data = load_fixture("l4-pcie")
    path = tmp_path / "my-node.json"
    path.write_text(json.dumps(data))
    assert load_fixture(str(path)) == data
    node = simulated_node(str(path), node_id="n", hostname="h")
    assert node.discovery == "simulated:my-node"
    assert node.gpus == _node("l4-pcie", "n").gpus


def test_gpu_entries_override_gpu_defaults(tmp_path: Path) -> None:
    data = load_fixture("l4-pcie")
    data["gpus"][1] |= {"health": "unhealthy", "problems": ["ECC: 3 uncorrectable errors"]}
    path = tmp_path / "sick.json"
    path.write_text(json.dumps(data))
    gpus = simulated_node(str(path), node_id="n", hostname="h").gpus
    health = [g.health.health for g in gpus if g.health is not None]
    assert health == [Health.HEALTHY, Health.UNHEALTHY, Health.HEALTHY, Health.HEALTHY]
    assert gpus[1].health is not None and gpus[1].health.problems == ["ECC: 3 uncorrectable errors"]


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    target: Any = data
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    if value is _DELETE:
        del target[last]
    elif isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value


_DELETE = object()


@pytest.mark.parametrize(
    ("fixture", "change", "value", "expected"),
    [
        ("l4-pcie", "gpus.2.memory_mib", "lots", r"gpus\[2\]\.memory_mib: expected an integer"),
        ("l4-pcie", "gpus.0.memroy_mib", 1, r"gpus\[0\]\.memroy_mib: unknown key"),
        ("l4-pcie", "gpu_defaults.compute_capability", 8.9, r"gpu_defaults\.compute_capability"),
        ("l4-pcie", "gpu_defaults.name", _DELETE, r"gpus\[0\]\.name: missing"),
        ("l4-pcie", "gpus.3.index", 0, r"gpus\[3\]: duplicate index 0"),
        ("l4-pcie", "gpus.1.health", "sick", r"gpus\[1\]\.health: expected one of"),
        ("l4-pcie", "host", _DELETE, r"host: missing"),
        ("l4-pcie", "fabrics.1.rate_gbps", -5, r"fabrics\[1\]\.rate_gbps: must not be negative"),
        ("l4-pcie", "format", 2, r"format: unsupported version"),
        ("dgx-h100", "gpus.4.nearest_hca", "mlx5_9", r"gpus\[4\]\.nearest_hca: 'mlx5_9'"),
        ("dgx-h100", "gpu_defaults.nvlinks.0.remote_kind", "bus", r"nvlinks\[0\]\.remote_kind"),
        ("dgx-h100", "gpus.0.nvlink_peers", [9], r"gpus\[0\]\.nvlink_peers: no other GPU"),
        ("a100-mig", "gpus.0.nvlinks.0.remote_gpu_index", 0, r"remote_gpu_index: no other GPU"),
        ("a100-mig", "gpus.0.mig.2.gpu_instance_id", 7, r"gpus\[0\]\.mig\[2\]: duplicate"),
        ("a100-mig", "gpus.2.mig.0.memory_mib", 90000, r"gpus\[2\]\.mig: slices hold"),
        ("a100-mig", "gpus.1.mig_enabled", False, r"gpus\[1\]\.mig_enabled: is false"),
        ("a100-mig", "gpus.1.nic_paths.mlx5_0", "NEAR", r"gpus\[1\]\.nic_paths\.mlx5_0"),
        ("gb200-nvl4", "imex.channels", [0, "1"], r"imex\.channels\[1\]: expected an integer"),
    ],
)
def test_malformed_fixture_names_file_and_key(
    tmp_path: Path, fixture: str, change: str, value: Any, expected: str
) -> None:
    data = copy.deepcopy(load_fixture(fixture))
    _set(data, change, value)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FixtureError, match=expected) as info:
        simulated_node(str(path), node_id="n", hostname="h")
    assert str(info.value).startswith(str(path))
    with pytest.raises(FixtureError, match=expected):
        load_fixture(str(path))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"format": 1,', r"line 1 column 14"),
        ("[1, 2]", r"\(top level\): expected an object"),
        ("\udcff", r"not UTF-8"),
    ],
)
def test_unreadable_fixture_names_the_file(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(FixtureError, match=expected) as info:
        load_fixture(str(path))
    assert str(path) in str(info.value)


def test_missing_fixture_path_is_a_fixture_error(tmp_path: Path) -> None:
    with pytest.raises(FixtureError, match="cannot read"):
        load_fixture(str(tmp_path / "absent.json"))


# --- telemetry ---------------------------------------------------------------------------


def test_telemetry_has_one_reading_per_device() -> None:
    node = _node("a100-mig")
    readings = SimulatedTelemetry(node, seed=1).sample()
    assert [r.uuid for r in readings] == [g.uuid for g in node.gpus]
    assert SimulatedTelemetry(_node("cpu-only"), seed=1).sample() == []


def test_telemetry_is_reproducible_from_the_seed() -> None:
    node = _node("dgx-h100")
    a, b, c = (SimulatedTelemetry(node, seed=s) for s in (7, 7, 8))
    run_a = [a.sample() for _ in range(50)]
    assert run_a == [b.sample() for _ in range(50)]
    assert run_a != [c.sample() for _ in range(50)]


def test_telemetry_differs_between_nodes_with_one_seed() -> None:
    a = SimulatedTelemetry(_node("l4-pcie", "node-a"), seed=3)
    b = SimulatedTelemetry(_node("l4-pcie", "node-b"), seed=3)
    utils_a = [[r.utilization_pct for r in a.sample()] for _ in range(30)]
    utils_b = [[r.utilization_pct for r in b.sample()] for _ in range(30)]
    assert utils_a != utils_b


def test_telemetry_drifts_slowly_and_stays_plausible() -> None:
    node = _node("dgx-h100")
    total = {g.uuid: g.memory_total_bytes for g in node.gpus}
    sim = SimulatedTelemetry(node, seed=42)
    last = {r.uuid: r for r in sim.sample()}
    still = steps = 0
    seen: set[int] = set()
    for _ in range(500):
        for r in sim.sample():
            before = last[r.uuid]
            steps += 1
            still += r.utilization_pct == before.utilization_pct
            seen.add(r.utilization_pct)
            assert abs(r.utilization_pct - before.utilization_pct) <= 3
            assert abs(r.temperature_c - before.temperature_c) <= 1
            assert 0 <= r.utilization_pct <= 100 and r.memory_used_bytes <= total[r.uuid]
            assert 20 <= r.temperature_c <= 90 and 0 < r.power_watts <= 700
            assert r.health is Health.HEALTHY
            last[r.uuid] = r
    assert still / steps > 0.5  # mostly quiet: deltas stay small
    assert max(seen) - min(seen) > 40  # yet load comes and goes


def test_mig_devices_report_parent_temperature_and_no_power() -> None:
    node = _node("a100-mig")
    sim = SimulatedTelemetry(node, seed=5)
    for _ in range(20):
        readings = {r.uuid: r for r in sim.sample()}
    for gpu in node.gpus:
        if gpu.mig is not None:
            reading = readings[gpu.uuid]
            assert reading.power_watts == 0
            assert reading.temperature_c == readings[gpu.mig.parent_uuid].temperature_c
