"""What the kernel's files say about GPUs: PCI placement, NUMA nodes, HCA paths and IMEX.

Every reader takes the filesystem root it reads from, so tests point it at a fake tree.
Nothing here raises for a missing or unreadable file: the answer is the unknown value
(``-1`` for a NUMA node, ``None`` for a PCI path) or the pessimistic one (``SYS``).

**NIC path classes** (nvidia-smi ``topo -m`` terms, closest first). An InfiniBand HCA is
never an NVML device, so ``nvmlDeviceGetTopologyCommonAncestor`` cannot compare it with a
GPU; the class is computed from the two devices' PCI paths under ``/sys/devices``
(``pci0000:17/0000:17:00.0/0000:18:00.0/0000:19:00.0/0000:1a:00.0``: the host bridge,
then the bridges down to the device):

- same host bridge, meeting below it at a bridge with at most one more bridge on either
  side (both behind one PCIe switch): ``PIX``;
- same host bridge, meeting at a bridge with more bridges on a side (nested switches):
  ``PXB``;
- same host bridge, meeting only at the host bridge (different root ports): ``PHB``;
- different host bridges on one NUMA node: ``NODE``;
- anything else, including a NUMA node or a PCI path that cannot be read: ``SYS``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from llmgw.api.llmgw.v1 import Imex

__all__ = ["PciPath", "imex_state", "nic_path_class", "pci_numa_node", "pci_path", "sysfs_bus_id"]

_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_IMEX_PROCESS = "nvidia-imex"


def sysfs_bus_id(bus_id: str) -> str:
    """sysfs's name for a PCI address: "00000000:1B:00.0" (NVML) → "0000:1b:00.0".

    NVML writes the domain with eight hex digits, the kernel with at least four.
    """
    domain, sep, rest = bus_id.strip().lower().partition(":")
    try:
        return f"{int(domain, 16):04x}:{rest}" if sep else bus_id.lower()
    except ValueError:
        return bus_id.lower()


def pci_numa_node(bus_id: str, root: Path = Path("/")) -> int:
    """The NUMA node sysfs gives a PCI device (NVML or sysfs form of ``bus_id``); -1 if unknown."""
    path = root / "sys/bus/pci/devices" / sysfs_bus_id(bus_id) / "numa_node"
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return -1


@dataclass(frozen=True, slots=True)
class PciPath:
    """Where a PCI device hangs: its host bridge and the bridges down to it."""

    host_bridge: str  # "pci0000:17"
    bridges: tuple[str, ...]  # ("0000:17:00.0", "0000:18:00.0", "0000:19:00.0")
    device: str  # "0000:1a:00.0"


def pci_path(device_dir: Path) -> PciPath | None:
    """The PCI path of a sysfs device directory (a link such as
    ``/sys/bus/pci/devices/0000:1a:00.0`` or ``/sys/class/infiniband/mlx5_0/device``);
    ``None`` when it cannot be resolved or is not under a PCI host bridge."""
    try:
        parts = device_dir.resolve(strict=True).parts
    except OSError:
        return None
    hosts = [i for i, part in enumerate(parts) if part.startswith("pci") and ":" in part]
    if not hosts:
        return None
    chain = [part for part in parts[hosts[-1] + 1 :] if _BDF.match(part)]
    if not chain:
        return None
    return PciPath(parts[hosts[-1]], tuple(chain[:-1]), chain[-1])


def nic_path_class(gpu: PciPath | None, hca: PciPath | None, gpu_numa: int, hca_numa: int) -> str:
    """PIX, PXB, PHB, NODE or SYS between a GPU and an HCA (the rule in the module docstring)."""
    if gpu is not None and hca is not None and gpu.host_bridge == hca.host_bridge:
        shared = 0
        for mine, theirs in zip(gpu.bridges, hca.bridges, strict=False):
            if mine != theirs:
                break
            shared += 1
        if shared == 0:
            return "PHB"
        below = max(len(gpu.bridges), len(hca.bridges)) - shared
        return "PIX" if below <= 1 else "PXB"
    return "NODE" if gpu_numa >= 0 and gpu_numa == hca_numa else "SYS"


def imex_state(root: Path = Path("/")) -> Imex:
    """Whether the IMEX daemon (multi-node NVLink memory export) runs here, and its channels.

    ``up`` when an ``nvidia-imex`` process runs; ``down`` when IMEX is installed
    (``/etc/nvidia-imex`` or ``/usr/bin/nvidia-imex``) or channel devices exist but no
    daemon runs; ``not_installed`` otherwise. Channels are the N of
    ``/dev/nvidia-caps-imex-channels/channelN``. The domain stays empty: IMEX's own
    configuration lists peer addresses, not a domain name (the GPUs' NVLink fabric
    cluster UUID and clique id say which domain a node is in).
    """
    channels = _imex_channels(root / "dev/nvidia-caps-imex-channels")
    if _process_running(root / "proc", _IMEX_PROCESS):
        return Imex(state="up", channels=channels)
    installed = (root / "etc/nvidia-imex").exists() or (root / "usr/bin/nvidia-imex").exists()
    return Imex(state="down" if installed or channels else "not_installed", channels=channels)


def _imex_channels(directory: Path) -> list[int]:
    try:
        names = [p.name for p in directory.iterdir()]
    except OSError:
        return []
    return sorted(
        int(name[len("channel") :])
        for name in names
        if name.startswith("channel") and name[len("channel") :].isdigit()
    )


def _process_running(proc: Path, name: str) -> bool:
    try:
        pids = [p for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            if (pid / "comm").read_text().strip() == name:
                return True
        except OSError:  # the process exited while we looked
            continue
    return False
