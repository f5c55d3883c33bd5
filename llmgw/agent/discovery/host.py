"""This machine's host facts: OS, CPU, memory, storage, InfiniBand HCAs and local weights.

Every reader takes the filesystem root (or the paths) it reads from, so tests point it at
a fake tree. Nothing here raises for a missing or unreadable file: the fields it would
have filled stay empty (zero, ``""``, ``-1`` for an unknown NUMA node), because an agent
on an odd host must still register and say what it does know.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path

from llmgw.api.llmgw.v1 import FabricAttachment, HostFacts, LocalWeights, Memory, Storage

logger = logging.getLogger(__name__)

__all__ = [
    "cpu_count",
    "host_facts",
    "host_memory",
    "infiniband_hcas",
    "local_weights",
    "storage",
]

_ROOT = Path("/")
_WEIGHT_SUFFIXES = (".safetensors", ".gguf")
# Arm core names by (implementer, part) from /proc/cpuinfo, for hosts without "model name".
_ARM_CORES = {
    ("0x41", "0xd0c"): "Neoverse-N1",
    ("0x41", "0xd40"): "Neoverse-V1",
    ("0x41", "0xd49"): "Neoverse-N2",
    ("0x41", "0xd4f"): "Neoverse-V2",
    ("0x41", "0xd8e"): "Neoverse-N3",
}
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")


def host_facts(root: Path = _ROOT) -> HostFacts:
    """OS release, architecture, kernel and CPU model and flags of this machine.

    The NVIDIA driver and CUDA versions stay empty: GPU discovery fills them.
    """
    release = _os_release(root)
    cpu = _first_cpu(root / "proc/cpuinfo")
    return HostFacts(
        os_id=release.get("ID", ""),
        os_version=release.get("VERSION_ID", ""),
        os_codename=release.get("VERSION_CODENAME", ""),
        arch=platform.machine(),
        cpu_flags=(cpu.get("flags") or cpu.get("Features") or "").split(),
        kernel=platform.release(),
        cpu_model=_cpu_model(cpu),
    )


def host_memory(root: Path = _ROOT) -> Memory:
    """Total and available memory from /proc/meminfo (zero when unreadable)."""
    fields = _key_values(_read(root / "proc/meminfo"))
    return Memory(
        total_bytes=_kib(fields.get("MemTotal", "")),
        available_bytes=_kib(fields.get("MemAvailable", "")),
    )


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's total)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 0


def storage(paths: list[Path]) -> list[Storage]:
    """Size and free space of each path's filesystem; a missing path is skipped."""
    found: list[Storage] = []
    for path in paths:
        try:
            usage = shutil.disk_usage(path)
        except OSError as exc:
            logger.warning("storage: skipping %s: %s", path, exc.strerror or exc)
            continue
        found.append(Storage(path=str(path), total_bytes=usage.total, free_bytes=usage.free))
    return found


def infiniband_hcas(root: Path = _ROOT) -> list[FabricAttachment]:
    """One attachment per port of each RDMA device under /sys/class/infiniband.

    ``fabric`` is the port's subnet prefix (the first half of GID 0), which is what two
    nodes on one InfiniBand subnet share; empty when GID 0 cannot be read.
    """
    base = root / "sys/class/infiniband"
    return [_port(hca, port) for hca in _dirs(base) for port in _dirs(hca / "ports")]


def local_weights(model_dirs: list[Path]) -> list[LocalWeights]:
    """Model directories found directly under each of ``model_dirs``.

    A subdirectory counts when it holds a ``config.json``, ``*.safetensors`` or ``*.gguf``
    file; its size is the sum of the files under it (symlinks followed, as in a Hugging
    Face snapshot). The model name is the directory's name.
    """
    found: list[LocalWeights] = []
    for model_dir in model_dirs:
        if not model_dir.is_dir():
            logger.warning("weights: skipping %s: not a directory", model_dir)
            continue
        found.extend(
            LocalWeights(path=str(d), model=d.name, size_bytes=_tree_size(d))
            for d in _dirs(model_dir)
            if _holds_weights(d)
        )
    return found


# --- readers -----------------------------------------------------------------------------


def _read(path: Path) -> str:
    """The file's text, or "" when it is missing or unreadable."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        logger.debug("cannot read %s: %s", path, exc.strerror or exc)
        return ""


def _os_release(root: Path) -> dict[str, str]:
    text = _read(root / "etc/os-release") or _read(root / "usr/lib/os-release")
    fields: dict[str, str] = {}
    for line in text.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote: skip the line, keep the rest
            continue
        if len(words) == 1 and "=" in words[0]:
            key, _, value = words[0].partition("=")
            fields[key] = value
    return fields


def _key_values(text: str) -> dict[str, str]:
    """``key: value`` lines (/proc/meminfo, /proc/cpuinfo); the first occurrence wins."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _first_cpu(path: Path) -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo (blocks are separated by a blank line)."""
    return _key_values(_read(path).strip().split("\n\n", 1)[0])


def _cpu_model(cpu: dict[str, str]) -> str:
    if cpu.get("model name"):
        return cpu["model name"]
    core = _ARM_CORES.get((cpu.get("CPU implementer", ""), cpu.get("CPU part", "")))
    return core or cpu.get("Hardware", "") or cpu.get("Model", "")


def _kib(value: str) -> int:
    """Bytes from a meminfo value such as "2113464412 kB"."""
    number, _, unit = value.partition(" ")
    if not number.isdigit():
        return 0
    return int(number) * 1024 if unit.strip().lower() == "kb" else int(number)


def _dirs(path: Path) -> Iterator[Path]:
    """Subdirectories of ``path`` in name order; nothing when it cannot be listed."""
    try:
        children = sorted(path.iterdir())
    except OSError:
        return iter(())
    return (child for child in children if child.is_dir())


# --- InfiniBand ----------------------------------------------------------------------------


def _port(hca: Path, port: Path) -> FabricAttachment:
    return FabricAttachment(
        fabric=_subnet_prefix(_read(port / "gids/0")),
        hca=hca.name,
        port=int(port.name) if port.name.isdigit() else 0,
        rate_gbps=_rate_gbps(_read(port / "rate")),
        link_layer=_read(port / "link_layer").strip(),
        state=_port_state(_read(port / "state")),
        numa_node=_numa_node(_read(hca / "device/numa_node")),
    )


def _rate_gbps(text: str) -> float:
    """400.0 from "400 Gb/sec (4X NDR)"; 0.0 when unreadable."""
    match = _RATE.match(text)
    return float(match.group(1)) if match else 0.0


def _port_state(text: str) -> str:
    """ "ACTIVE" from "4: ACTIVE"."""
    return text.partition(":")[2].strip() or text.strip()


def _numa_node(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        return -1


def _subnet_prefix(gid: str) -> str:
    """ "fe80:0000:0000:0000" from GID "fe80:0000:0000:0000:0c42:a103:00d1:e2f0"."""
    groups = gid.strip().split(":")
    return ":".join(groups[:4]) if len(groups) == 8 else ""


# --- local weights -------------------------------------------------------------------------


def _holds_weights(directory: Path) -> bool:
    try:
        names = [p.name for p in directory.iterdir() if p.is_file()]
    except OSError:
        return False
    return "config.json" in names or any(n.endswith(_WEIGHT_SUFFIXES) for n in names)


def _tree_size(directory: Path) -> int:
    total = 0
    for path in directory.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:  # a dangling symlink or a file removed while we walk
            continue
    return total
