"""A replica whose engine fails at every start, end to end: a real server, a simulated DGX
agent and ``llmgw sim-engine --sim-fail-start``. The first failure is replaced elsewhere;
from the second on the replica is crash-looping: it keeps its id, shows FAILED, and is
restarted in place after a delay that doubles, instead of new replica ids forever."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
FILE = """
[profiles.broken]
engine = "sim"
gpu_class = "H100"
model_path = "/models/chat"
args = ["--sim-fail-start"]

[deployments.chat]
profile = "broken"
replicas = 1
"""


def test_a_crash_looping_replica_keeps_its_id_and_backs_off(fleet: Cluster, tmp_path: Path) -> None:
    fleet.start_server()
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN,
                      "--restart-backoff", "0.2", "--restart-backoff-max", "0.2")  # fmt: skip
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY")
    path = tmp_path / "broken.toml"
    path.write_text(FILE)
    fleet.cli("apply", "-f", str(path))

    def events() -> str:
        return fleet.cli("events").stdout

    wait_for(lambda: "is crash-looping (2 failures in a row)" in events(), 90, "a crash loop")
    text = events()
    assert "restarted in place in 10 s" in text
    wait_for(lambda: "is crash-looping (3 failures in a row)" in events(), 90, "a restart")
    started = time.monotonic()
    text = events()
    placed = set(re.findall(r"placed active replica (chat-\d+)", text))
    assert placed == {"chat-1", "chat-2"}  # no id churn
    assert len(re.findall(r"start shard chat-2\.0 on a1", text)) >= 2  # restarted in place
    assert "restarted in place in 20 s" in text
    out = json.loads(fleet.cli("get", "replicas", "-o", "json").stdout)["replicas"]
    assert [(r["replicaId"], r.get("state")) for r in out] == [("chat-2", "SHARD_STATE_FAILED")]
    time.sleep(max(0.0, 5 - (time.monotonic() - started)))  # within the 20 s: no new start
    assert len(re.findall(r"start shard chat-2\.0 on a1", events())) == len(
        re.findall(r"start shard chat-2\.0 on a1", text)
    )
