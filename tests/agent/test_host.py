"""Host facts read from a fake filesystem root."""

from __future__ import annotations

import logging
import os
import platform
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.agent.discovery.host import (
    cpu_count,
    host_facts,
    host_memory,
    infiniband_hcas,
    local_weights,
    storage,
)

OS_RELEASE = """\
PRETTY_NAME="Ubuntu 22.04.4 LTS"
NAME="Ubuntu"
VERSION_ID="22.04"
VERSION="22.04.4 LTS (Jammy Jellyfish)"
VERSION_CODENAME=jammy
ID=ubuntu
ID_LIKE=debian
# a comment
BROKEN="unbalanced
"""

X86_CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480C
flags\t\t: fpu vme sse sse2 avx avx2 avx512f amx_tile

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Something Else
flags\t\t: fpu
"""

ARM_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics sve sve2 bf16
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x0
CPU part\t: 0xd4f
CPU revision\t: 0
"""

MEMINFO = """\
MemTotal:       2113464412 kB
MemFree:        2001234567 kB
MemAvailable:   2057512345 kB
Buffers:          123456 kB
"""


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _hca(root: Path, name: str, files: dict[str, str]) -> None:
    for relative, text in files.items():
        _write(root, f"sys/class/infiniband/{name}/{relative}", text)


def test_host_facts_from_a_fake_x86_root(tmp_path: Path) -> None:
    _write(tmp_path, "etc/os-release", OS_RELEASE)
    _write(tmp_path, "proc/cpuinfo", X86_CPUINFO)
    facts = host_facts(tmp_path)
    assert (facts.os_id, facts.os_version, facts.os_codename) == ("ubuntu", "22.04", "jammy")
    assert facts.cpu_model == "Intel(R) Xeon(R) Platinum 8480C"
    assert facts.cpu_flags == ["fpu", "vme", "sse", "sse2", "avx", "avx2", "avx512f", "amx_tile"]
    assert facts.arch == platform.machine() and facts.kernel == platform.release()
    assert facts.nvidia_driver_version == "" and facts.cuda_version == ""


def test_host_facts_from_a_fake_arm_root(tmp_path: Path) -> None:
    _write(
        tmp_path, "usr/lib/os-release", 'ID=ubuntu\nVERSION_ID="24.04"\nVERSION_CODENAME=noble\n'
    )
    _write(tmp_path, "proc/cpuinfo", ARM_CPUINFO)
    facts = host_facts(tmp_path)
    assert (facts.os_id, facts.os_version, facts.os_codename) == ("ubuntu", "24.04", "noble")
    assert facts.cpu_model == "Neoverse-V2"
    assert "sve2" in facts.cpu_flags and facts.cpu_flags[0] == "fp"


def test_host_facts_with_nothing_to_read(tmp_path: Path) -> None:
    facts = host_facts(tmp_path)
    assert (facts.os_id, facts.os_version, facts.os_codename, facts.cpu_model) == ("",) * 4
    assert facts.cpu_flags == []
    assert facts.arch == platform.machine()


def test_host_memory(tmp_path: Path) -> None:
    assert host_memory(tmp_path).total_bytes == 0  # missing: empty, not an error
    _write(tmp_path, "proc/meminfo", MEMINFO)
    memory = host_memory(tmp_path)
    assert memory.total_bytes == 2113464412 * 1024
    assert memory.available_bytes == 2057512345 * 1024


def test_host_memory_of_this_machine() -> None:
    memory = host_memory()
    if Path("/proc/meminfo").exists():
        assert 0 < memory.available_bytes <= memory.total_bytes


def test_cpu_count_is_this_process_affinity() -> None:
    count = cpu_count()
    assert 0 < count <= (os.cpu_count() or count)


def test_storage_skips_missing_paths(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "absent"
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.discovery.host"):
        found = storage([tmp_path, missing])
    assert [s.path for s in found] == [str(tmp_path)]
    assert 0 < found[0].free_bytes <= found[0].total_bytes
    assert str(missing) in caplog.text


def test_infiniband_hcas(tmp_path: Path) -> None:
    _hca(
        tmp_path,
        "mlx5_0",
        {
            "ports/1/rate": "400 Gb/sec (4X NDR)\n",
            "ports/1/state": "4: ACTIVE\n",
            "ports/1/link_layer": "InfiniBand\n",
            "ports/1/gids/0": "fe80:0000:0000:0000:a088:c203:0045:1e2a\n",
            "device/numa_node": "1\n",
        },
    )
    _hca(tmp_path, "mlx5_1", {"ports/1/rate": "25 Gb/sec (1X EDR)\n", "ports/1/state": "1: DOWN"})
    _hca(tmp_path, "mlx5_1", {"ports/1/link_layer": "Ethernet"})
    first, second = infiniband_hcas(tmp_path)
    assert (first.hca, first.port, first.rate_gbps) == ("mlx5_0", 1, 400.0)
    assert (first.state, first.link_layer, first.numa_node) == ("ACTIVE", "InfiniBand", 1)
    assert first.fabric == "fe80:0000:0000:0000"
    assert (second.hca, second.rate_gbps, second.state) == ("mlx5_1", 25.0, "DOWN")
    assert (second.link_layer, second.numa_node, second.fabric) == ("Ethernet", -1, "")


@pytest.mark.parametrize(
    ("rate", "gbps"),
    [
        ("400 Gb/sec (4X NDR)", 400.0),
        ("200 Gb/sec (4X HDR)", 200.0),
        ("2.5 Gb/sec (1X SDR)", 2.5),
        ("", 0.0),
        ("fast", 0.0),
    ],
)
def test_infiniband_rates(tmp_path: Path, rate: str, gbps: float) -> None:
    _hca(tmp_path, "mlx5_0", {"ports/1/rate": rate})
    (attachment,) = infiniband_hcas(tmp_path)
    assert attachment.rate_gbps == gbps and attachment.state == ""


def test_no_infiniband(tmp_path: Path) -> None:
    assert infiniband_hcas(tmp_path) == []


def test_local_weights(tmp_path: Path) -> None:
    models = tmp_path / "models"
    _write(models, "llama/config.json", "{}")
    _write(models, "llama/model-00001.safetensors", "x" * 1000)
    _write(models, "llama/nested/tokenizer.json", "y" * 24)
    _write(models, "qwen-gguf/qwen.Q4_K_M.gguf", "z" * 500)
    _write(models, "notes/README.md", "not a model")
    _write(models, "stray.safetensors", "not in a subdirectory")
    found = local_weights([models, tmp_path / "absent"])
    assert [(w.model, w.size_bytes) for w in found] == [("llama", 1026), ("qwen-gguf", 500)]
    assert found[0].path == str(models / "llama")


def test_local_weights_follow_snapshot_symlinks(tmp_path: Path) -> None:
    blob = tmp_path / "blobs" / "abc"
    _write(tmp_path, "blobs/abc", "w" * 300)
    snapshot = tmp_path / "models" / "m"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(blob)
    (snapshot / "dangling.bin").symlink_to(tmp_path / "gone")
    (weights,) = local_weights([tmp_path / "models"])
    assert weights.size_bytes == 300


@settings(max_examples=60, deadline=None)
@given(st.text(), st.text(), st.text())
def test_readers_never_raise_on_any_text(os_release: str, cpuinfo: str, meminfo: str) -> None:
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        _write(root, "etc/os-release", os_release)
        _write(root, "proc/cpuinfo", cpuinfo)
        _write(root, "proc/meminfo", meminfo)
        _hca(root, "mlx5_0", {"ports/1/rate": cpuinfo, "ports/1/state": meminfo})
        _hca(root, "mlx5_0", {"device/numa_node": os_release, "ports/1/gids/0": meminfo})
        host_facts(root)
        host_memory(root)
        infiniband_hcas(root)
