"""PCI placement, NUMA nodes, NIC path classes and IMEX state from a fake filesystem root."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.agent.discovery.sysfs import (
    PciPath,
    imex_state,
    nic_path_class,
    pci_numa_node,
    pci_path,
    sysfs_bus_id,
)


def _device(root: Path, parts: str, numa: str = "0") -> Path:
    device = root / "sys/devices" / parts
    device.mkdir(parents=True)
    (device / "numa_node").write_text(numa + "\n")
    link = root / "sys/bus/pci/devices" / device.name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(device)
    return link


@pytest.mark.parametrize(
    ("nvml", "sysfs"),
    [
        ("00000000:1B:00.0", "0000:1b:00.0"),
        ("00000008:01:00.0", "0008:01:00.0"),
        ("00010000:C1:00.0", "10000:c1:00.0"),
        ("0000:1b:00.0", "0000:1b:00.0"),
    ],
)
def test_sysfs_bus_id_from_nvml_form(nvml: str, sysfs: str) -> None:
    assert sysfs_bus_id(nvml) == sysfs


def test_pci_numa_node_reads_sysfs_and_is_minus_one_when_unknown(tmp_path: Path) -> None:
    _device(tmp_path, "pci0000:97/0000:97:01.0/0000:9d:00.0", "1")
    _device(tmp_path, "pci0000:00/0000:00:02.0", "garbage")
    assert pci_numa_node("00000000:9D:00.0", tmp_path) == 1
    assert pci_numa_node("00000000:00:02.0", tmp_path) == -1
    assert pci_numa_node("00000000:AA:00.0", tmp_path) == -1


def test_pci_path_follows_the_links_and_keeps_only_pci_addresses(tmp_path: Path) -> None:
    link = _device(tmp_path, "pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:00.0/0000:1a:00.0")
    assert pci_path(link) == PciPath(
        "pci0000:17", ("0000:17:01.0", "0000:18:00.0", "0000:19:00.0"), "0000:1a:00.0"
    )
    hyperv = _device(tmp_path, "LNXSYSTM:00/VMBUS:00/abcd-12/pci7c1b:00/7c1b:00:00.0")
    assert pci_path(hyperv) == PciPath("pci7c1b:00", (), "7c1b:00:00.0")
    assert pci_path(tmp_path / "sys/bus/pci/devices/0000:ff:00.0") is None
    (tmp_path / "sys/devices/platform").mkdir()
    assert pci_path(tmp_path / "sys/devices/platform") is None


RP, USP = "0000:17:01.0", "0000:18:00.0"


@pytest.mark.parametrize(
    ("gpu", "hca", "numa", "expected"),
    [
        # one switch: each side one downstream port below the shared upstream port
        ((RP, USP, "0000:19:00.0"), (RP, USP, "0000:19:01.0"), (0, 0), "PIX"),
        # the HCA is behind a second switch nested under the first
        ((RP, USP, "0000:19:00.0"), (RP, USP, "0000:19:01.0", "0000:1c:00.0", "x"), (0, 0), "PXB"),
        # different root ports of one host bridge
        ((RP, USP), ("0000:17:02.0", "0000:30:00.0"), (0, 0), "PHB"),
    ],
)
def test_nic_path_class_on_one_host_bridge(
    gpu: tuple[str, ...], hca: tuple[str, ...], numa: tuple[int, int], expected: str
) -> None:
    a, b = PciPath("pci0000:17", gpu, "0000:1a:00.0"), PciPath("pci0000:17", hca, "0000:1b:00.0")
    assert nic_path_class(a, b, *numa) == expected
    assert nic_path_class(b, a, *reversed(numa)) == expected


def test_nic_path_class_across_host_bridges_goes_by_numa_node() -> None:
    a = PciPath("pci0000:17", (RP,), "0000:1a:00.0")
    b = PciPath("pci0000:3a", ("0000:3a:01.0",), "0000:3b:00.0")
    assert nic_path_class(a, b, 0, 0) == "NODE"
    assert nic_path_class(a, b, 0, 1) == "SYS"
    assert nic_path_class(a, b, -1, -1) == "SYS"  # unknown is not close
    assert nic_path_class(None, b, 1, 1) == "NODE"  # no PCI path: the NUMA nodes decide
    assert nic_path_class(a, None, -1, 0) == "SYS"


def test_imex_state_from_process_config_and_channels(tmp_path: Path) -> None:
    assert imex_state(tmp_path).state == "not_installed"
    channels = tmp_path / "dev/nvidia-caps-imex-channels"
    channels.mkdir(parents=True)
    for name in ("channel2", "channel0", "not-a-channel"):
        (channels / name).touch()
    (tmp_path / "etc/nvidia-imex").mkdir(parents=True)
    (tmp_path / "proc/42").mkdir(parents=True)
    (tmp_path / "proc/42/comm").write_text("bash\n")
    (tmp_path / "proc/self").mkdir()
    down = imex_state(tmp_path)
    assert (down.state, down.channels) == ("down", [0, 2])
    (tmp_path / "proc/77").mkdir()
    (tmp_path / "proc/77/comm").write_text("nvidia-imex\n")
    assert (imex_state(tmp_path).state, imex_state(tmp_path).channels) == ("up", [0, 2])


def test_imex_channels_alone_mean_installed_but_down(tmp_path: Path) -> None:
    (tmp_path / "dev/nvidia-caps-imex-channels").mkdir(parents=True)
    (tmp_path / "dev/nvidia-caps-imex-channels/channel0").touch()
    assert (imex_state(tmp_path).state, imex_state(tmp_path).channels) == ("down", [0])
