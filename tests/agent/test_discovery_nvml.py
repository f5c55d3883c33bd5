"""NVML discovery and telemetry against a fake ``pynvml`` (and the real one, without a driver)."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import inspect
import uuid
from pathlib import Path

import pynvml
import pytest
from fake_pynvml import (
    ERROR_CLASSES,
    FUNCTIONS,
    FakeFabric,
    FakeGpu,
    FakeLink,
    FakeMachine,
    FakeMig,
    fake_nvml,
)

from llmgw.agent.daemon import Agent, AgentConfig, discover
from llmgw.agent.discovery import (
    NvmlTelemetry,
    gpu_class,
    nvml_gpus,
    nvml_node,
    simulated_node,
)
from llmgw.agent.discovery.nvml import cuda_version
from llmgw.api.llmgw.v1 import FabricAttachment, Gpu, Health, NodeInfo
from llmgw.cli.main import main

MIB = 1 << 20
NUMA_SPLIT = 4  # GPUs and HCAs 0-3 on NUMA node 0, 4-7 on node 1
DGX_BUSES = [0x1B, 0x43, 0x52, 0x61, 0x9D, 0xC3, 0xD1, 0xDF]  # as in the dgx-h100 fixture
SWITCHES = [f"00000000:{0x05 + k:02X}:00.0" for k in range(4)]
CLUSTER = "6f1d2c9e-4b7a-4e0d-9a51-3c2b8e7f0a14"
LOST = f"NVML error GPU is lost ({pynvml.NVML_ERROR_GPU_IS_LOST})"


def _uuid(prefix: str, n: int) -> str:
    return f"{prefix}-{uuid.UUID(int=n)}"


# --- a fake sysfs ---------------------------------------------------------------------------


def _pci_device(root: Path, host_bridge: str, chain: list[str], numa: int) -> Path:
    """/sys/devices/<host_bridge>/<chain…> with its numa_node, linked from /sys/bus/pci."""
    device = root / "sys/devices" / host_bridge / Path(*chain)
    device.mkdir(parents=True, exist_ok=True)
    (device / "numa_node").write_text(f"{numa}\n")
    link = root / "sys/bus/pci/devices" / chain[-1]
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(device)
    return device


def _hca(root: Path, name: str, device: Path, rate: str = "400 Gb/sec (4X NDR)") -> None:
    port = root / "sys/class/infiniband" / name / "ports/1"
    (port / "gids").mkdir(parents=True)
    (port / "rate").write_text(rate + "\n")
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("InfiniBand\n")
    (port / "gids/0").write_text("fe80:0000:0000:0000:0c42:a103:00d1:e2f0\n")
    (root / "sys/class/infiniband" / name / "device").symlink_to(device)


def _dgx_sysfs(root: Path) -> None:
    """Each GPU i and HCA mlx5_i behind one PCIe switch under their own host bridge, except:
    GPU 1 hangs off a second root port of GPU 0's host bridge, and mlx5_1 sits behind a
    second switch nested under GPU 1's."""
    for i, bus in enumerate(DGX_BUSES):
        numa, hb = int(i >= NUMA_SPLIT), bus - 3
        if i == 1:
            top = "pci0000:18"
            bridges = ["0000:18:02.0", "0000:40:00.0"]
            gpu_chain = [*bridges, "0000:41:00.0", "0000:43:00.0"]
            hca_chain = [*bridges, "0000:41:01.0", "0000:45:00.0", "0000:46:00.0", "0000:47:00.0"]
        else:
            top = f"pci0000:{hb:02x}"
            bridges = [f"0000:{hb:02x}:01.0", f"0000:{hb + 1:02x}:00.0"]
            gpu_chain = [*bridges, f"0000:{hb + 2:02x}:00.0", f"0000:{bus:02x}:00.0"]
            hca_chain = [*bridges, f"0000:{hb + 2:02x}:01.0", f"0000:{bus + 1:02x}:00.0"]
        _pci_device(root, top, gpu_chain, numa)
        _hca(root, f"mlx5_{i}", _pci_device(root, top, hca_chain, numa))


def _expected_path(gpu: int, hca: int) -> str:
    if gpu == hca:
        return "PXB" if gpu == 1 else "PIX"
    if {gpu, hca} == {0, 1}:
        return "PHB"
    return "NODE" if (gpu < NUMA_SPLIT) == (hca < NUMA_SPLIT) else "SYS"


def _fabrics(count: int) -> list[FabricAttachment]:
    return [
        FabricAttachment(hca=f"mlx5_{i}", port=1, numa_node=int(i >= NUMA_SPLIT))
        for i in range(count)
    ]


# --- fake machines ----------------------------------------------------------------------------


def _h100(i: int, bus: int) -> FakeGpu:
    links = [FakeLink(SWITCHES[k % 4]) for k in range(18)]
    if i == 7:
        links[17] = FakeLink(SWITCHES[1], active=False)
    return FakeGpu(
        uuid=_uuid("GPU", i + 1),
        name="NVIDIA H100 80GB HBM3",
        bus_id=f"00000000:{bus:02X}:00.0",
        memory_total=81559 * MIB,
        memory_used=(i + 1) * 1024 * MIB,
        utilization=10 * i,
        temperature=30 + i,
        power_mw=71_000 + 1000 * i,
        ecc=(i, 0, 0),
        retired_pages=None,  # Hopper remaps rows instead
        links=links,
    )


def _dgx() -> FakeMachine:
    return FakeMachine(gpus=[_h100(i, bus) for i, bus in enumerate(DGX_BUSES)])


A100_PROFILES = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (19, "MIG 1g.10gb"),
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: (14, "MIG 2g.20gb"),
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: (9, "MIG 3g.40gb"),
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: (5, "MIG 4g.40gb"),
    pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: (0, "MIG 7g.80gb"),
}


def _a100(i: int, bus: str, peer_bus: str, migs: list[FakeMig | None] | None) -> FakeGpu:
    return FakeGpu(
        uuid=_uuid("GPU", 100 + i),
        name="NVIDIA A100-SXM4-80GB",
        bus_id=bus,
        memory_total=81920 * MIB,
        utilization=None if migs else 5,  # NVML has no utilisation for a MIG-mode GPU
        compute_capability=(8, 0),
        retired_pages={0: [], 1: []},
        retired_pending=0,
        links=[
            FakeLink(peer_bus, pynvml.NVML_NVLINK_DEVICE_TYPE_GPU, version=4) for _ in range(12)
        ],
        mig_mode=pynvml.NVML_DEVICE_MIG_ENABLE if migs else pynvml.NVML_DEVICE_MIG_DISABLE,
        mig_slots=migs or [],
        mig_profiles=A100_PROFILES,
    )


def _a100_mig() -> FakeMachine:
    slices: list[FakeMig | None] = [
        FakeMig(_uuid("MIG", 1), 40192 * MIB, 2, 0, profile_id=9, memory_used=2048 * MIB),
        None,  # an empty slot between instances
        FakeMig(_uuid("MIG", 2), 19968 * MIB, 3, 0, profile_id=14),
        FakeMig(_uuid("MIG", 3), 9728 * MIB, 9, 0, profile_id=19, memory_used=512 * MIB),
    ]
    bus0, bus1 = "00000000:01:00.0", "00000000:41:00.0"
    gpus = [_a100(0, bus0, bus1, slices), _a100(1, bus1, bus0, None)]
    return FakeMachine(gpus=gpus, driver_version="535.161.08", cuda_version=12020)


def _gb200(fabrics: list[FakeFabric] | None = None) -> FakeMachine:
    fabrics = fabrics or [FakeFabric(cluster_uuid=CLUSTER, clique_id=1) for _ in range(4)]
    domains = [0x8, 0x9, 0x18, 0x19]
    gpus = [
        FakeGpu(
            uuid=_uuid("GPU", 200 + i),
            name="NVIDIA GB200",
            bus_id=f"{domain:08X}:01:00.0",
            memory_total=189471 * MIB,
            compute_capability=(10, 0),
            links=[
                FakeLink(f"{0x100 + k:08X}:00:00.0", version=pynvml.NVML_NVLINK_VERSION_5_0)
                for k in range(18)
            ],
            fabric=fabric,
        )
        for i, (domain, fabric) in enumerate(zip(domains, fabrics, strict=True))
    ]
    return FakeMachine(gpus=gpus, driver_version="570.124.06", cuda_version=12080)


def _physical(gpus: tuple[Gpu, ...] | list[Gpu]) -> list[Gpu]:
    return [g for g in gpus if g.mig is None]


def _health(gpu: Gpu) -> tuple[Health, list[str]]:
    assert gpu.health is not None
    return gpu.health.health, list(gpu.health.problems)


# --- the fake is faithful -------------------------------------------------------------------


def test_the_fake_offers_only_what_pynvml_has_with_the_same_parameters() -> None:
    module = fake_nvml(FakeMachine())
    for name in FUNCTIONS:
        real = inspect.signature(getattr(pynvml, name)).parameters
        fake = inspect.signature(getattr(module, name)).parameters
        assert list(fake) == list(real), name
    real_errors = {n: getattr(pynvml, n) for n in dir(pynvml) if n.startswith("NVMLError_")}
    assert set(ERROR_CLASSES) == set(real_errors)
    for name, cls in ERROR_CLASSES.items():
        assert type(cls(0)).__name__ == name  # a subclass keeps its own value, as in pynvml
        assert cls(0).value == real_errors[name](0).value
        assert str(cls(0)) == str(real_errors[name](0))


def test_fake_errors_are_made_as_pynvml_makes_them() -> None:
    module = fake_nvml(FakeMachine())
    for lib in (pynvml, module):
        exc = lib.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        assert type(exc).__name__ == "NVMLError_LibraryNotFound"
        assert isinstance(exc, lib.NVMLError_LibraryNotFound) and isinstance(exc, lib.NVMLError)
        assert exc.value == 12 and str(exc) == "NVML Shared Library Not Found"
        assert lib.NVMLError_NotSupported().value == pynvml.NVML_ERROR_NOT_SUPPORTED


# --- an 8 x H100 NVSwitch box -----------------------------------------------------------------


def test_dgx_h100_gpus_links_peers_numa_and_nic_paths(tmp_path: Path) -> None:
    _dgx_sysfs(tmp_path)
    machine = _dgx()
    found = nvml_gpus(fake_nvml(machine), fabrics=_fabrics(8), root=tmp_path)
    assert found.discovery == "nvml"
    assert (found.driver_version, found.cuda_version) == ("550.54.15", "12.4")
    assert [g.index for g in found.gpus] == list(range(8))
    for i, gpu in enumerate(found.gpus):
        assert gpu.uuid == _uuid("GPU", i + 1) and gpu.pci_bus_id.endswith(
            f"{DGX_BUSES[i]:02X}:00.0"
        )
        assert (gpu.name, gpu.gpu_class, gpu.compute_capability) == (
            "NVIDIA H100 80GB HBM3",
            "H100",
            "9.0",
        )
        assert gpu.memory_total_bytes == 81559 * MIB
        assert gpu.memory_used_bytes == (i + 1) * 1024 * MIB
        assert (gpu.utilization_pct, gpu.power_watts) == (10 * i, 71 + i)
        assert (gpu.driver_version, gpu.cuda_version) == ("550.54.15", "12.4")
        assert gpu.numa_node == int(i >= NUMA_SPLIT)
        assert gpu.nvlink_peers == [p for p in range(8) if p != i]
        assert [p.hca for p in gpu.nic_paths] == [f"mlx5_{h}" for h in range(8)]
        assert [p.path for p in gpu.nic_paths] == [_expected_path(i, h) for h in range(8)]
        assert gpu.fabric is not None and gpu.fabric.state == "not_supported"
        assert gpu.health is not None and gpu.health.temperature_c == 30 + i
        assert gpu.health.ecc_volatile_corrected == i  # corrected errors are not a problem
        assert _health(gpu) == (Health.HEALTHY, [])
    links = found.gpus[7].nvlinks
    assert [link.link for link in links] == list(range(18))
    assert {(n.remote_kind, n.version, n.remote_gpu_index) for n in links[:17]} == {
        ("switch", 4, -1)
    }
    assert links[3].remote_pci_bus_id == SWITCHES[3] and links[3].active
    assert not links[17].active and links[17].remote_kind == ""
    assert machine.started == 0 and machine.calls["nvmlShutdown"] == 1


def test_nvml_and_the_simulated_dgx_h100_fixture_agree(tmp_path: Path) -> None:
    _dgx_sysfs(tmp_path)
    real = nvml_gpus(fake_nvml(_dgx()), fabrics=_fabrics(8), root=tmp_path).gpus
    sim = simulated_node("dgx-h100", node_id="n", hostname="n").gpus
    assert len(real) == len(sim)
    for r, s in zip(real, sim, strict=True):
        assert (r.index, r.name, r.gpu_class, r.compute_capability, r.numa_node) == (
            s.index,
            s.name,
            s.gpu_class,
            s.compute_capability,
            s.numa_node,
        )
        assert r.pci_bus_id == s.pci_bus_id and r.nvlink_peers == s.nvlink_peers
        assert len(r.nvlinks) == len(s.nvlinks)
        assert {(n.remote_kind, n.version) for n in r.nvlinks if n.active} == {
            (n.remote_kind, n.version) for n in s.nvlinks
        }
        assert r.fabric == s.fabric
        nearest = [p.hca for p in r.nic_paths if p.path in ("PIX", "PXB")]
        assert nearest == [p.hca for p in s.nic_paths if p.path == "PIX"]


# --- MIG ------------------------------------------------------------------------------------


def test_a100_with_three_mig_slices_of_different_profiles(tmp_path: Path) -> None:
    found = nvml_gpus(fake_nvml(_a100_mig()), root=tmp_path)
    parent, *slices, other = found.gpus
    assert parent.mig is None and parent.mig_enabled and parent.uuid == _uuid("GPU", 100)
    assert other.mig is None and not other.mig_enabled and other.index == 1
    assert (parent.nvlink_peers, other.nvlink_peers) == ([1], [0])
    assert {(n.remote_kind, n.remote_gpu_index, n.version) for n in parent.nvlinks} == {
        ("gpu", 1, 3)
    }
    assert parent.utilization_pct == 0 and parent.health is not None
    assert [
        (s.uuid, s.mig.profile, s.mig.gpu_instance_id, s.mig.compute_instance_id)
        for s in slices
        if s.mig is not None
    ] == [
        (_uuid("MIG", 1), "3g.40gb", 2, 0),
        (_uuid("MIG", 2), "2g.20gb", 3, 0),
        (_uuid("MIG", 3), "1g.10gb", 9, 0),
    ]
    assert [(s.memory_total_bytes, s.memory_used_bytes) for s in slices] == [
        (40192 * MIB, 2048 * MIB),
        (19968 * MIB, 0),
        (9728 * MIB, 512 * MIB),
    ]
    for s in slices:
        assert s.mig is not None
        assert (s.mig.parent_uuid, s.mig.parent_index, s.index) == (parent.uuid, 0, 0)
        assert s.name == f"NVIDIA A100-SXM4-80GB MIG {s.mig.profile}"
        assert (s.gpu_class, s.compute_capability, s.pci_bus_id) == (
            "A100",
            "8.0",
            parent.pci_bus_id,
        )
        assert s.nvlink_peers == [] and _health(s) == (Health.HEALTHY, [])
    assert found.cuda_version == "12.2"


def test_a_sick_parent_makes_its_mig_slices_unhealthy_and_a_sick_slice_only_itself(
    tmp_path: Path,
) -> None:
    machine = _a100_mig()
    machine.gpus[0].errors["nvmlDeviceGetRemappedRows"] = pynvml.NVML_ERROR_GPU_IS_LOST
    gpus = nvml_gpus(fake_nvml(machine), root=tmp_path).gpus
    problem = f"remapped rows: {LOST}"
    assert [_health(g) for g in gpus[:4]] == [(Health.UNHEALTHY, [problem])] * 4
    assert _health(gpus[4]) == (Health.HEALTHY, [])

    machine = _a100_mig()
    machine.missing.add("nvmlDeviceGetComputeInstanceId")  # an old driver: not a problem
    machine.gpus[0].mig_slots[2].profile_id = 77  # type: ignore[union-attr]
    gpus = nvml_gpus(fake_nvml(machine), root=tmp_path).gpus
    assert all(_health(g) == (Health.HEALTHY, []) for g in gpus)
    assert [g.mig.profile for g in gpus[1:4] if g.mig] == ["3g.40gb", "", "1g.10gb"]


# --- GB200 and the NVLink fabric ---------------------------------------------------------------


def test_gb200_fabric_info_peers_and_sysfs_numa_of_wide_pci_domains(tmp_path: Path) -> None:
    for domain, numa in ((8, 0), (9, 0), (0x18, 1), (0x19, 1)):
        _pci_device(tmp_path, f"pci{domain:04x}:00", [f"{domain:04x}:01:00.0"], numa)
    found = nvml_gpus(fake_nvml(_gb200()), root=tmp_path)
    assert (found.driver_version, found.cuda_version) == ("570.124.06", "12.8")
    for i, gpu in enumerate(found.gpus):
        assert (gpu.gpu_class, gpu.compute_capability) == ("GB200", "10.0")
        assert gpu.numa_node == [0, 0, 1, 1][i]
        assert gpu.fabric is not None
        assert (gpu.fabric.state, gpu.fabric.status) == ("completed", "success")
        assert (gpu.fabric.cluster_uuid, gpu.fabric.clique_id) == (CLUSTER, 1)
        assert gpu.nvlink_peers == [p for p in range(4) if p != i]
        assert {(n.remote_kind, n.version) for n in gpu.nvlinks} == {("switch", 5)}
        assert _health(gpu) == (Health.HEALTHY, [])


def test_fabric_failures_are_health_problems_and_in_progress_is_not() -> None:
    route = (
        pynvml.NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_UNHEALTHY_TRUE
        << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY
    )
    degraded = (  # degraded bandwidth alone is not unhealthy
        pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE
        << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW
    )
    fabrics = [
        FakeFabric(cluster_uuid=CLUSTER, clique_id=1, health_mask=degraded),
        FakeFabric(cluster_uuid=CLUSTER, clique_id=1, health_mask=route),
        FakeFabric(state=pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, status=999, clique_id=5),
        FakeFabric(status=pynvml.NVML_ERROR_UNKNOWN, cluster_uuid=CLUSTER),
    ]
    gpus = nvml_gpus(fake_nvml(_gb200(fabrics))).gpus
    assert [g.fabric.state for g in gpus if g.fabric] == ["completed"] * 2 + [
        "in_progress",
        "completed",
    ]
    assert gpus[2].fabric is not None
    assert (gpus[2].fabric.status, gpus[2].fabric.clique_id, gpus[2].fabric.cluster_uuid) == (
        "",
        0,
        "",
    )
    assert gpus[3].fabric is not None and gpus[3].fabric.status == "NVML error Unknown Error (999)"
    assert [_health(g) for g in gpus] == [
        (Health.HEALTHY, []),
        (Health.UNHEALTHY, ["fabric: route unhealthy"]),
        (Health.HEALTHY, []),
        (Health.UNHEALTHY, ["fabric: registration failed: NVML error Unknown Error (999)"]),
    ]


# --- health fails closed --------------------------------------------------------------------


def test_a_lost_gpu_is_unhealthy_with_the_reason_and_the_others_stay_healthy(
    tmp_path: Path,
) -> None:
    machine = _dgx()
    machine.gpus[3].errors["nvmlDeviceGetTemperatureV"] = pynvml.NVML_ERROR_GPU_IS_LOST
    gpus = nvml_gpus(fake_nvml(machine), root=tmp_path).gpus
    assert _health(gpus[3]) == (Health.UNHEALTHY, [f"temperature: {LOST}"])
    assert gpus[3].health is not None and gpus[3].health.temperature_c == 0
    assert gpus[3].memory_total_bytes == 81559 * MIB  # what could be read still is
    assert [_health(g) for i, g in enumerate(gpus) if i != 3] == [(Health.HEALTHY, [])] * 7
    assert machine.started == 0


def test_not_supported_leaves_fields_empty_and_the_gpu_healthy(tmp_path: Path) -> None:
    machine = FakeMachine(
        gpus=[
            FakeGpu(
                uuid=_uuid("GPU", 9),
                name="NVIDIA L4",
                bus_id="00000000:82:00.0",
                memory_total=23034 * MIB,
                utilization=None,
                compute_capability=None,
                temperature=None,
                power_mw=None,
                ecc=None,
                remapped_rows=None,
            )
        ]
    )
    machine.gpus[0].errors["nvmlDeviceGetCudaComputeCapability"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    (gpu,) = nvml_gpus(fake_nvml(machine), fabrics=_fabrics(2), root=tmp_path).gpus
    assert (gpu.gpu_class, gpu.memory_total_bytes) == ("L4", 23034 * MIB)
    assert (gpu.utilization_pct, gpu.power_watts, gpu.compute_capability) == (0, 0, "")
    assert gpu.nvlinks == [] and gpu.nvlink_peers == [] and not gpu.mig_enabled
    assert gpu.numa_node == -1  # no sysfs entry
    assert [(p.hca, p.path) for p in gpu.nic_paths] == [("mlx5_0", "SYS"), ("mlx5_1", "SYS")]
    assert gpu.fabric is not None and gpu.fabric.state == "not_supported"
    assert gpu.health is not None and gpu.health.temperature_c == 0
    assert _health(gpu) == (Health.HEALTHY, [])


def test_ecc_errors_pending_retirement_and_row_remapping_are_problems(tmp_path: Path) -> None:
    machine = _a100_mig()
    machine.gpus[0].ecc = (12, 2, 5)
    machine.gpus[1].retired_pending = 1
    machine.gpus[1].retired_pages = {0: [0x1000, 0x2000], 1: [0x3000]}
    machine.gpus[1].remapped_rows = (3, 1, 1, 1)
    gpus = nvml_gpus(fake_nvml(machine), root=tmp_path).gpus
    parent, other = gpus[0], gpus[4]
    assert parent.health is not None and other.health is not None
    assert (parent.health.ecc_volatile_corrected, parent.health.ecc_volatile_uncorrected) == (12, 2)
    assert parent.health.ecc_aggregate_uncorrected == 5
    assert _health(parent) == (Health.UNHEALTHY, ["ecc: 2 volatile uncorrected errors"])
    assert other.health.retired_pages == 3
    assert _health(other) == (
        Health.UNHEALTHY,
        [
            "retired pages: a page retirement is pending (reset the GPU)",
            "remapped rows: a row remapping is pending (reset the GPU)",
            "remapped rows: a row remapping failed",
        ],
    )


def test_a_gpu_without_a_handle_is_reported_unhealthy_not_dropped(tmp_path: Path) -> None:
    machine = _a100_mig()
    machine.gpus[1].errors["nvmlDeviceGetHandleByIndex"] = pynvml.NVML_ERROR_NO_PERMISSION
    gpus = nvml_gpus(fake_nvml(machine), root=tmp_path).gpus
    assert len(gpus) == 5 and (gpus[4].index, gpus[4].uuid) == (1, "")
    assert _health(gpus[4]) == (
        Health.UNHEALTHY,
        ["handle: NVML error Insufficient Permissions (4)"],
    )
    assert gpus[0].nvlink_peers == []  # its peer has no bus id to resolve


def test_an_nvlink_read_error_is_a_problem_and_stops_the_link_scan(tmp_path: Path) -> None:
    machine = _dgx()
    machine.gpus[2].errors["nvmlDeviceGetNvLinkRemoteDeviceType"] = pynvml.NVML_ERROR_UNKNOWN
    gpus = nvml_gpus(fake_nvml(machine), root=tmp_path).gpus
    assert _health(gpus[2]) == (
        Health.UNHEALTHY,
        ["nvlink 0 remote type: NVML error Unknown Error (999)"],
    )
    assert gpus[2].nvlinks == []
    # the seven other GPUs' active links (GPU 7 has one inactive), then GPU 2's link 0 only
    assert machine.calls["nvmlDeviceGetNvLinkRemoteDeviceType"] == 7 * 18 - 1 + 1


def test_an_old_driver_without_temperature_v_falls_back(tmp_path: Path) -> None:
    machine = _dgx()
    machine.missing.add("nvmlDeviceGetTemperatureV")
    gpus = nvml_gpus(fake_nvml(machine), root=tmp_path).gpus
    assert [g.health.temperature_c for g in gpus if g.health] == [30 + i for i in range(8)]
    assert machine.calls["nvmlDeviceGetTemperature"] == 8


def test_shutdown_follows_init_even_when_a_read_raises_something_else(tmp_path: Path) -> None:
    machine = _dgx()
    module = fake_nvml(machine)

    def broken(handle: object) -> str:
        raise RuntimeError("a bug")

    vars(module)["nvmlDeviceGetName"] = broken
    with pytest.raises(RuntimeError):
        nvml_gpus(module, root=tmp_path)
    assert machine.started == 0 and machine.calls["nvmlShutdown"] == 1


# --- no driver --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (12, "NVIDIA driver not found (NVML: NVML Shared Library Not Found)"),
        (9, "NVIDIA driver not found (NVML: Driver Not Loaded)"),
        (18, "NVML cannot start (NVML error RM has detected an NVML/RM version mismatch. (18))"),
    ],
)
def test_no_usable_driver_means_no_gpus_and_says_why(code: int, reason: str) -> None:
    machine = FakeMachine(gpus=_dgx().gpus, init_error=code)
    found = nvml_gpus(fake_nvml(machine))
    assert (found.gpus, found.driver_version, found.discovery) == ((), "", f"none: {reason}")
    assert machine.calls["nvmlShutdown"] == 0  # nothing was started


def test_a_driver_that_sees_no_gpus_says_so() -> None:
    found = nvml_gpus(fake_nvml(FakeMachine()))
    assert (found.gpus, found.discovery) == ((), "none: NVML sees no GPUs")
    assert found.driver_version == "550.54.15"


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None, reason="an NVIDIA driver is installed"
)
def test_the_real_pynvml_here_has_no_driver() -> None:
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        pynvml.nvmlInit()
    found = nvml_gpus()
    assert found.gpus == ()
    assert found.discovery == "none: NVIDIA driver not found (NVML: NVML Shared Library Not Found)"
    node = discover(AgentConfig("127.0.0.1", 1, Path("/nonexistent")), "node-a")
    assert node.discovery == found.discovery and node.gpus == []
    assert node.host is not None and node.host.arch and node.cpu_count > 0


# --- the whole node -------------------------------------------------------------------------


def test_nvml_node_has_host_facts_fabrics_imex_weights_and_storage(tmp_path: Path) -> None:
    _dgx_sysfs(tmp_path)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/os-release").write_text('ID=ubuntu\nVERSION_ID="22.04"\n')
    (tmp_path / "proc/1").mkdir(parents=True)
    (tmp_path / "proc/1/comm").write_text("nvidia-imex\n")
    (tmp_path / "dev/nvidia-caps-imex-channels").mkdir(parents=True)
    (tmp_path / "dev/nvidia-caps-imex-channels/channel0").touch()
    models = tmp_path / "models"
    (models / "Qwen2.5-7B").mkdir(parents=True)
    (models / "Qwen2.5-7B/model.safetensors").write_bytes(b"x" * 100)
    node = nvml_node(
        node_id="n1",
        hostname="h1",
        labels={"pool": "a"},
        model_dirs=[models],
        storage_paths=[tmp_path],
        nvml=fake_nvml(_dgx()),
        root=tmp_path,
    )
    assert (node.node_id, node.hostname, node.labels, node.discovery) == (
        "n1",
        "h1",
        {"pool": "a"},
        "nvml",
    )
    assert node.host is not None
    assert (node.host.os_id, node.host.nvidia_driver_version, node.host.cuda_version) == (
        "ubuntu",
        "550.54.15",
        "12.4",
    )
    assert len(node.gpus) == 8 and [f.hca for f in node.fabrics] == [f"mlx5_{i}" for i in range(8)]
    assert [(f.rate_gbps, f.numa_node) for f in node.fabrics[3:5]] == [(400.0, 0), (400.0, 1)]
    assert node.imex is not None and (node.imex.state, node.imex.channels) == ("up", [0])
    assert [(w.model, w.size_bytes) for w in node.weights] == [("Qwen2.5-7B", 100)]
    assert [s.path for s in node.storage] == [str(tmp_path)]


def test_llmgw_agent_discover_prints_the_node_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    (models / "m/config.json").write_text("{}")
    argv = ["agent", "--discover", "-o", "json", "--state-dir", str(tmp_path / "state")]
    assert main([*argv, "--model-dir", str(models), "--node-id", "cli-node"]) == 0
    node = NodeInfo().from_json(capsys.readouterr().out)
    assert node.node_id == "cli-node" and "heartbeat-deltas" in node.features
    assert node.host is not None and node.host.arch and node.memory is not None
    assert [w.model for w in node.weights] == ["m"]
    assert [s.path for s in node.storage] == [str(models)]
    if ctypes.util.find_library("nvidia-ml") is None:
        assert node.gpus == [] and node.discovery.startswith("none: NVIDIA driver not found")


# --- telemetry ------------------------------------------------------------------------------


def _registered(machine: FakeMachine, root: Path) -> NodeInfo:
    return NodeInfo(node_id="n", gpus=list(nvml_gpus(fake_nvml(machine), root=root).gpus))


def test_telemetry_follows_the_gpus_and_closes_nvml(tmp_path: Path) -> None:
    machine = _a100_mig()
    node = _registered(machine, tmp_path)
    with NvmlTelemetry(node, fake_nvml(machine)) as sampler:
        first = sampler.sample()
        machine.gpus[1].utilization, machine.gpus[1].temperature = 77, 61
        machine.gpus[0].temperature = 52
        machine.gpus[0].mig_slots[3].memory_used = 4096 * MIB  # type: ignore[union-attr]
        second = sampler.sample()
        assert machine.started == 1
    assert machine.started == 0
    assert [t.uuid for t in first] == [g.uuid for g in node.gpus]
    by_uuid = {t.uuid: t for t in second}
    other = by_uuid[_uuid("GPU", 101)]
    assert (other.utilization_pct, other.temperature_c, other.health) == (77, 61, Health.HEALTHY)
    mig = by_uuid[_uuid("MIG", 3)]
    assert (mig.memory_used_bytes, mig.temperature_c, mig.power_watts) == (4096 * MIB, 52, 0)
    assert all(t.health == Health.HEALTHY and not t.problems for t in second)


def test_a_sampling_error_marks_the_gpu_and_its_slices_unhealthy_and_never_raises(
    tmp_path: Path,
) -> None:
    machine = _a100_mig()
    node = _registered(machine, tmp_path)
    with NvmlTelemetry(node, fake_nvml(machine)) as sampler:
        sampler.sample()
        machine.gpus[0].errors["nvmlDeviceGetPowerUsage"] = pynvml.NVML_ERROR_GPU_IS_LOST
        machine.gpus[1].ecc = (0, 3, 3)
        readings = sampler.sample()
        del machine.gpus[0].errors["nvmlDeviceGetPowerUsage"]
        machine.gpus[1].ecc = (0, 0, 3)
        recovered = sampler.sample()
    assert [(t.health, list(t.problems)) for t in readings] == [
        (Health.UNHEALTHY, [f"power: {LOST}"])
    ] * 4 + [(Health.UNHEALTHY, ["ecc: 3 volatile uncorrected errors"])]
    assert all(t.health == Health.HEALTHY for t in recovered)


def test_telemetry_keeps_discovery_problems_and_reports_an_unusable_driver(
    tmp_path: Path,
) -> None:
    machine = _dgx()
    machine.gpus[3].errors["nvmlDeviceGetTemperatureV"] = pynvml.NVML_ERROR_GPU_IS_LOST
    node = _registered(machine, tmp_path)
    del machine.gpus[3].errors["nvmlDeviceGetTemperatureV"]
    machine.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    with NvmlTelemetry(node, fake_nvml(machine)) as sampler:
        down = sampler.sample()
        machine.init_error = None
        up = sampler.sample()
    reason = "nvml: NVIDIA driver not found (NVML: Driver Not Loaded)"
    assert all(t.health == Health.UNHEALTHY and reason in t.problems for t in down)
    assert [t.health for t in up] == [Health.HEALTHY] * 3 + [Health.UNHEALTHY] + [
        Health.HEALTHY
    ] * 4
    assert list(up[3].problems) == [f"temperature: {LOST}"]
    assert machine.started == 0


async def test_an_agent_without_simulate_discovers_and_samples_through_nvml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    machine = _dgx()
    module = fake_nvml(machine)
    for where in ("nvml", "nvml_telemetry"):
        monkeypatch.setattr(f"llmgw.agent.discovery.{where}.load_pynvml", lambda: module)
    agent = Agent(AgentConfig("127.0.0.1", 1, tmp_path, node_id="gpu-node"))
    assert agent.node.discovery == "nvml" and len(agent.node.gpus) == 8
    assert [t.utilization_pct for t in agent.telemetry()] == [10 * i for i in range(8)]
    assert machine.started == 1  # the sampler keeps NVML started between heartbeats
    stop = asyncio.Event()
    stop.set()
    await agent.run(stop)
    assert machine.started == 0


# --- pure helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 NVL", "H100"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA GB200", "GB200"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("Tesla V100-SXM2-32GB", "V100"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA RTX A6000", "RTX A6000"),
        ("", ""),
    ],
)
def test_gpu_class_from_the_nvml_name(name: str, cls: str) -> None:
    assert gpu_class(name) == cls


def test_cuda_version_from_the_driver_number() -> None:
    assert [cuda_version(v) for v in (12040, 12080, 11080, 13000, 0, None)] == [
        "12.4",
        "12.8",
        "11.8",
        "13.0",
        "",
        "",
    ]
