"""`llmgw demo` as a user runs it: three simulated nodes READY, the cluster printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_demo_starts_prints_and_stops(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "llmgw", "demo", "--duration", "1", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    )
    lines = out.stdout.splitlines()
    rows = [line.split() for line in lines]
    states = ("READY", "NOT_READY", "CORDONED")
    nodes = {row[0]: row[1] for row in rows if len(row) > 2 and row[1] in states}
    assert nodes == {"dgx-1": "READY", "l4-1": "READY", "mig-1": "READY"}
    assert any("3g.40gb" in line for line in lines)  # MIG slices in the GPU table
    assert (tmp_path / "server.db").exists()
    server_log = (tmp_path / "logs" / "server.log").read_text()
    assert "node dgx-1 registered" in server_log and "Traceback" not in server_log
