"""``--wait`` and ``llmgw rollout status`` against a real server, a simulated DGX agent (8
H100) and ``llmgw sim-engine`` engines, with the CLI as a subprocess: a wait ends when the
server says every replica is available on the current profile, and ends early, exit 1,
naming the reason, when the server says the deployment cannot progress."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
BACKOFF = ("--restart-backoff", "1", "--restart-backoff-max", "1")
PROFILES = (Path(__file__).parents[1] / "data" / "profiles" / "good-chat-a-b.toml").read_text()
HUGE = """
[profiles.huge]
engine = "sim"
gpu_class = "H100"
tp = 16
model_path = "/models/chat"
served_model_name = "chat"

[deployments.big]
profile = "huge"
replicas = 1
"""


def _status(cluster: Cluster, name: str) -> dict[str, Any]:
    out = cluster.cli("get", "deployments", "-o", "json")
    deployments = {d["name"]: d for d in json.loads(out.stdout)["deployments"]}
    status: dict[str, Any] = deployments[name]["status"]
    return status


def _profiles(cluster: Cluster) -> list[str]:
    out = cluster.cli("get", "replicas", "-o", "json")
    return sorted(r["profile"] for r in json.loads(out.stdout)["replicas"])


def test_waits_end_on_the_servers_word(fleet: Cluster, tmp_path: Path) -> None:
    fleet.start_server()
    fleet.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN, *BACKOFF)
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "the agent READY")
    path = tmp_path / "chat.toml"
    path.write_text(PROFILES + '\n[deployments.chat]\nprofile = "chat-a"\nreplicas = 2\n')

    # apply --wait returns once both replicas are available, and says so
    out = fleet.cli("apply", "-f", str(path), "--wait", "--timeout", "120s", timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "deployment chat: 2 of 2 replicas available" in out.stdout
    status = _status(fleet, "chat")
    assert status["available"] == status["ready"] == 2  # it told the truth

    # past capacity (5 TP-2 replicas on 8 GPUs): scale says so at once; rollout status gives
    # up once the server has said for STALLED_S that it cannot progress, naming why
    scale = fleet.cli("scale", "chat", "5", check=False)
    assert scale.returncode == 1, scale.stdout + scale.stderr
    started = time.monotonic()
    stuck = fleet.cli("rollout", "status", "chat", "--timeout", "120s", check=False, timeout=150)
    took = time.monotonic() - started
    assert stuck.returncode == 1, stuck.stdout + stuck.stderr
    assert "deployment chat cannot progress (Unplaceable)" in stuck.stderr
    assert took < 100, f"rollout status took {took:.0f}s to give up"
    assert "4 of 5 replicas available" in stuck.stdout

    # back within capacity: a reprofile --wait returns with every replica on the new profile
    fleet.cli("scale", "chat", "2", "--wait", "--timeout", "60s", timeout=90)
    wait_for(lambda: len(_profiles(fleet)) == 2, 60, "the two replicas past the count gone")
    rolled = fleet.cli(
        "reprofile", "chat", "--profile", "chat-b", "--wait", "--timeout", "180s",
        check=False, timeout=210,
    )  # fmt: skip
    assert rolled.returncode == 0, rolled.stdout + rolled.stderr
    assert _profiles(fleet) == ["chat-b", "chat-b"]

    # rollout undo --wait: back on chat-a, and rollout status agrees at once
    undone = fleet.cli("rollout", "undo", "chat", "--wait", "--timeout", "180s", timeout=210)
    assert undone.returncode == 0, undone.stdout + undone.stderr
    assert _profiles(fleet) == ["chat-a", "chat-a"]
    done = fleet.cli("rollout", "status", "chat", "--timeout", "10s", timeout=40)
    assert done.returncode == 0 and "2 of 2 replicas available" in done.stdout

    # a TP-16 profile on 8-GPU nodes: apply --wait exits 1 naming the reason, without waiting
    path.write_text(PROFILES + '\n[deployments.chat]\nprofile = "chat-a"\nreplicas = 2\n' + HUGE)
    started = time.monotonic()
    big = fleet.cli("apply", "-f", str(path), "--wait", "--timeout", "120s", check=False)
    assert big.returncode == 1, big.stdout + big.stderr
    assert "2 of 3 replicas can be placed" in big.stdout
    assert "deployment big: no schedulable node has 16 free H100 GPUs" in big.stdout
    assert time.monotonic() - started < 30
