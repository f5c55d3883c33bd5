"""Describe, scale, rollout history/undo and ``get --watch`` end to end: a real server, two
simulated DGX agents with ``llmgw sim-engine`` engines, and the CLI as a subprocess.

What must hold: describe shows a reconciler decision, a shard's state change and an
operator action, and still does after the server restarts; ``scale`` changes the replica
count both ways and is audited; ``rollout history`` lists a revision per profile applied;
``rollout undo`` restores the previous profile while every poll sees at least the count of
READY replicas (the reconciler's surge of one); ``get replicas --watch`` prints a replica
placed after it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
BACKOFF = ("--restart-backoff", "1", "--restart-backoff-max", "1")
READY = "SHARD_STATE_READY"

PROFILES = Path(__file__).parents[1] / "data" / "profiles" / "good-chat-a-b.toml"


def _file(tmp_path: Path, profile: str, replicas: int = 2) -> Path:
    path = tmp_path / f"chat-{profile}.toml"
    path.write_text(
        PROFILES.read_text()
        + f'\n[deployments.chat]\nprofile = "{profile}"\nreplicas = {replicas}\n'
    )
    return path


def _replicas(cluster: Cluster) -> list[dict[str, Any]]:
    out = cluster.cli("get", "replicas", "-o", "json", check=False)
    return list(json.loads(out.stdout)["replicas"]) if out.returncode == 0 else []


def _ready(cluster: Cluster, count: int, profile: str) -> bool:
    replicas = _replicas(cluster)
    ready = [r for r in replicas if r.get("state") == READY and r.get("profile") == profile]
    return len(replicas) == count == len(ready)


def _start(fleet: Cluster, tmp_path: Path) -> None:
    fleet.start_server()
    for node_id in ("a1", "a2"):
        fleet.start_agent(node_id, "dgx-h100", "--engine-bin", SIM_BIN, *BACKOFF)
    both = {"a1": "NODE_STATE_READY", "a2": "NODE_STATE_READY"}
    wait_for(lambda: fleet.node_states() == both, 30, "both agents READY")
    fleet.cli("apply", "-f", str(_file(tmp_path, "chat-a")))
    wait_for(lambda: _ready(fleet, 2, "chat-a"), 60, "2 READY replicas of chat-a")


def _describe_shows_history(fleet: Cluster) -> None:
    def shown() -> str | None:
        out = fleet.cli("describe", "deployment", "chat").stdout
        return out if "READY" in out.split("Events:")[1] else None  # flushed on a tick

    out = wait_for(shown, 20, "a shard's READY in chat's events")
    assert "Profile:" in out and "chat-a (" in out and "Revision:" in out
    events = out.split("Events:")[1]
    assert "reconciler" in events and "placed active replica chat-1 of chat on" in events
    assert "operator" in events and "apply" in events
    assert "node/a" in events


def _scale(fleet: Cluster) -> None:
    assert fleet.cli("scale", "chat", "3").stdout.strip() == (
        "deployment chat scaled from 2 to 3 replicas"
    )
    wait_for(lambda: _ready(fleet, 3, "chat-a"), 60, "3 READY replicas")
    out = fleet.cli("scale", "chat", "2").stdout
    assert out.strip() == "deployment chat scaled from 3 to 2 replicas"
    wait_for(lambda: _ready(fleet, 2, "chat-a"), 60, "2 READY replicas again")
    audit = fleet.cli("events").stdout
    assert audit.count("scale") >= 2 and "deployment/chat" in audit


def _watch_prints_a_later_change(fleet: Cluster) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    watch = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "get", "replicas", "--watch", "--server", fleet.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(watch.stdout or []), daemon=True)
    reader.start()
    try:
        wait_for(lambda: any(line.startswith("REPLICA") for line in lines), 20, "the table")
        first = len(lines)
        old = {line.split()[0] for line in lines[1:first]}
        fleet.cli("scale", "chat", "3")

        def new_ready() -> bool:
            rows = [line.split() for line in lines[first:]]
            return any(row[0] not in old and row[3] == "READY" for row in rows if len(row) > 3)

        wait_for(new_ready, 60, "a READY row of the new replica")
    finally:
        watch.send_signal(signal.SIGINT)
        try:
            watch.wait(timeout=10)
        except subprocess.TimeoutExpired:
            watch.kill()
            watch.wait()
        reader.join(timeout=10)
        if watch.stdout is not None:
            watch.stdout.close()
    fleet.cli("scale", "chat", "2")
    wait_for(lambda: _ready(fleet, 2, "chat-a"), 60, "2 READY replicas after the watch")


def _rollout(fleet: Cluster, tmp_path: Path) -> None:
    fleet.cli("apply", "-f", str(_file(tmp_path, "chat-b")))
    wait_for(lambda: _ready(fleet, 2, "chat-b"), 90, "2 READY replicas of chat-b")
    history = fleet.cli("rollout", "history", "chat").stdout.splitlines()
    rows = [line.split() for line in history[2:]]
    assert [(r[0], r[1]) for r in rows] == [("1", "chat-a"), ("2*", "chat-b")]
    out = fleet.cli("rollout", "undo", "chat").stdout
    assert out.startswith("deployment chat rolled back to revision 1: profile chat-a")
    lowest, deadline = 2, time.monotonic() + 90
    while not _ready(fleet, 2, "chat-a"):
        assert time.monotonic() < deadline, "the undo did not finish"
        lowest = min(lowest, len([r for r in _replicas(fleet) if r.get("state") == READY]))
        time.sleep(0.2)
    assert lowest >= 2  # never fewer READY than desired at any poll: a surge of one
    listed = fleet.cli("rollout", "history", "chat").stdout
    assert "rollout undo to revision 1" in listed and "3*" in listed
    refused = fleet.cli("rollout", "undo", "chat", "--to-revision", "9", check=False)
    assert refused.returncode == 1 and "has no revision 9" in refused.stderr


def test_describe_scale_watch_and_rollout(fleet: Cluster, tmp_path: Path) -> None:
    _start(fleet, tmp_path)
    _describe_shows_history(fleet)
    _scale(fleet)
    _watch_prints_a_later_change(fleet)
    _rollout(fleet, tmp_path)
    fleet.kill("server", signal.SIGTERM)
    fleet.start_server()
    out = fleet.cli("describe", "deployment", "chat").stdout
    events = out.split("Events:")[1]
    assert "rollout-undo" in events and "reconciler" in events and READY.split("_")[-1] in events
    node = fleet.cli("describe", "node", "a1").stdout
    assert "GPUs:" in node and "Registered" in node
    missing = fleet.cli("describe", "deployment", "nope", check=False)
    assert missing.returncode == 1
    assert missing.stderr.strip() == "llmgw: NOT_FOUND: no deployment named 'nope'"
