"""``llmgw apply`` end to end: a real server and one simulated DGX agent, driven by the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# The example, shared with the profile tests.
EXAMPLE = (Path(__file__).parents[1] / "data" / "profiles" / "good-issue-example.toml").read_text()

BAD = """
[profiles.p]
engine = "vllm"
gpu_class = "H100"
tp = 0
model_path = "/m"

[deployments.d]
profile = "nope"
replicas = -1
"""


def _deployments(cluster: Cluster) -> list[dict[str, object]]:
    out = cluster.cli("get", "deployments", "-o", "json")
    return list(json.loads(out.stdout)["deployments"])


def test_apply_dry_run_refuse_restart_and_events(fleet: Cluster, tmp_path: Path) -> None:
    cluster = fleet  # the fixture that also kills the engines the reconciler started
    cluster.start_server()
    cluster.start_agent("a1")
    wait_for(lambda: cluster.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY")
    good, bad = tmp_path / "chat.toml", tmp_path / "bad.toml"
    good.write_text(EXAMPLE)
    bad.write_text(BAD)

    refused = cluster.cli("apply", "-f", str(bad), check=False)
    assert refused.returncode == 1
    for path in ("profiles.p.tp", "deployments.d.profile", "deployments.d.replicas"):
        assert path in refused.stderr
    assert "Traceback" not in refused.stderr

    plan = cluster.cli("apply", "-f", str(good), "--dry-run")
    rows = [line.split()[:5] for line in plan.stdout.splitlines()[1:3]]
    assert rows == [
        ["chat", "add", "chat-1", "chat-tp2", "a1"],
        ["chat", "add", "chat-2", "chat-tp2", "a1"],
    ]
    assert "2 add; every replica can be placed; nothing was changed" in plan.stdout
    assert _deployments(cluster) == []  # nothing changed

    applied = cluster.cli("apply", "-f", str(good))
    assert "deployment chat applied" in applied.stdout
    table = cluster.cli("get", "deployments").stdout.splitlines()
    assert table[0].split()[:4] == ["NAME", "PROFILE", "DESIRED", "READY"]
    assert table[1].split()[:3] == ["chat", "chat-tp2", "2"]

    cluster.kill("server")  # kill -9 right after the answer
    cluster.start_server()
    (deployment,) = _deployments(cluster)
    assert (deployment["name"], deployment["profile"], deployment["replicas"]) == (
        "chat",
        "chat-tp2",
        2,
    )
    profiles = cluster.cli("get", "profiles").stdout.splitlines()
    assert profiles[1].split()[:4] == ["chat-tp2", "sim", "H100", "2/1/1"]

    events = [e for e in cluster.cli("events").stdout.splitlines() if "reconciler" not in e]
    assert len(events) == 2 and events[1].split()[1:4] == ["operator", "apply", "deployment/chat"]

    follow = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "events", "--follow", "--server", cluster.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert follow.stdout is not None
        lines = iter(follow.stdout.readline, "")
        assert " apply  deployment/chat" in next(ln for ln in lines if " operator " in ln)
        cluster.cli("delete", "deployment", "chat")
        assert " delete  deployment/chat  ok" in next(ln for ln in lines if " operator " in ln)
    finally:
        follow.terminate()
        follow.wait(timeout=10)
        if follow.stdout is not None:
            follow.stdout.close()
    assert _deployments(cluster) == []
    missing = cluster.cli("delete", "deployment", "chat", check=False)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
