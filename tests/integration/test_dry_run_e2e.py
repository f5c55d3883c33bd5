"""``llmgw apply --dry-run`` as the server's diff, and answers that say what can be placed,
against a real server, two simulated DGX agents (8 H100 each) and ``llmgw sim-engine``
engines on loopback, with the CLI as a subprocess."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
BACKOFF = ("--restart-backoff", "1", "--restart-backoff-max", "1")
READY = "SHARD_STATE_READY"
KEYS = {"action", "deployment", "replica", "profile", "from_profile", "node", "gpus", "port",
        "reason"}  # fmt: skip

PROFILES = (Path(__file__).parents[1] / "data" / "profiles" / "good-chat-a-b.toml").read_text()
OTHERS = """
[profiles.phi]
engine = "sim"
gpu_class = "H100"
tp = 2
model_path = "/models/phi"

[profiles.huge]
engine = "sim"
gpu_class = "H100"
tp = 16
model_path = "/models/chat"
served_model_name = "chat"
"""


def _file(profile: str = "chat-a", replicas: int = 2, extra: str = "") -> str:
    deployment = f'\n[deployments.chat]\nprofile = "{profile}"\nreplicas = {replicas}\n'
    return PROFILES + OTHERS + deployment + extra


def _ready(cluster: Cluster, count: int) -> list[dict[str, Any]] | None:
    out = cluster.cli("get", "replicas", "-o", "json", check=False)
    replicas = json.loads(out.stdout)["replicas"] if out.returncode == 0 else []
    ready = [r for r in replicas if r.get("state") == READY]
    return replicas if len(replicas) == count == len(ready) else None


def _plan(cluster: Cluster, path: Path) -> tuple[int, dict[str, Any]]:
    out = cluster.cli("apply", "-f", str(path), "--dry-run", "-o", "json", check=False)
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, json.loads(out.stdout)


def test_a_dry_run_is_a_diff_against_what_runs(fleet: Cluster, tmp_path: Path) -> None:
    fleet.start_server()
    for node_id in ("a1", "a2"):
        fleet.start_agent(node_id, "dgx-h100", "--engine-bin", SIM_BIN, *BACKOFF)
    both = {"a1": "NODE_STATE_READY", "a2": "NODE_STATE_READY"}
    wait_for(lambda: fleet.node_states() == both, 30, "both agents READY")
    path = tmp_path / "chat.toml"
    path.write_text(_file())
    fleet.cli("apply", "-f", str(path))
    running = wait_for(lambda: _ready(fleet, 2), 60, "2 READY replicas")
    names = sorted(r["replicaId"] for r in running)
    assert names == ["chat-1", "chat-2"]

    # the file already applied: only keep, the running replicas by name, exit 0
    code, plan = _plan(fleet, path)
    assert code == 0 and plan["placeable"] is True and set(plan) == {"placeable", "changes"}
    assert all(set(c) == KEYS for c in plan["changes"])
    assert [(c["action"], c["replica"]) for c in plan["changes"]] == [
        ("keep", "chat-1"),
        ("keep", "chat-2"),
    ]
    low, high = fleet.engine_ports or (0, 0)
    assert all(low <= c["port"] <= high and len(c["gpus"]) == 2 for c in plan["changes"])
    table = fleet.cli("apply", "-f", str(path), "--dry-run").stdout
    assert table.splitlines()[0].split() == [
        "DEPLOYMENT", "ACTION", "REPLICA", "PROFILE", "NODE", "GPUS", "PORT", "REASON",
    ]  # fmt: skip
    assert "2 keep; every replica can be placed; nothing was changed" in table

    # another profile: each replica rolls old → new under the ids the reconciler gives next
    rolled = tmp_path / "rolled.toml"
    rolled.write_text(_file("chat-b"))
    code, plan = _plan(fleet, rolled)
    assert code == 0
    moves = [(c["action"], c["replica"], c["from_profile"], c["profile"]) for c in plan["changes"]]
    assert moves == [
        ("roll", "chat-3", "chat-a", "chat-b"),
        ("roll", "chat-4", "chat-a", "chat-b"),
    ]  # fmt: skip
    assert all(low <= c["port"] <= high for c in plan["changes"])
    running_ports = {(c["node"], c["port"]) for c in _plan(fleet, path)[1]["changes"]}
    assert not running_ports & {(c["node"], c["port"]) for c in plan["changes"]}
    assert "chat-a → chat-b" in fleet.cli("apply", "-f", str(rolled), "--dry-run").stdout

    # TP=16 on 8-GPU nodes: exit 1, the reason named; applying it stores it and exits 1 too
    big = tmp_path / "big.toml"
    big.write_text(_file(extra='\n[deployments.big]\nprofile = "huge"\nreplicas = 1\n'))
    code, plan = _plan(fleet, big)
    assert code == 1 and plan["placeable"] is False
    (unplaceable,) = [c for c in plan["changes"] if c["action"] == "unplaceable"]
    assert unplaceable["replica"] == "big-1" and "16 free H100 GPUs" in unplaceable["reason"]
    text = fleet.cli("apply", "-f", str(big), "--dry-run", check=False)
    assert text.returncode == 1 and "16 free H100 GPUs" in text.stdout
    applied = fleet.cli("apply", "-f", str(big), check=False)
    assert applied.returncode == 1 and "2 of 3 replicas can be placed" in applied.stdout
    started = fleet.cli("start", "big", check=False)
    assert started.returncode == 1 and "0 of 2 replicas can be placed" in started.stdout

    # reprofile guards: another model refused without the flag; an unplaceable one refused
    other = fleet.cli("reprofile", "chat", "--profile", "phi", check=False)
    assert other.returncode == 1 and "--allow-model-change" in other.stderr
    assert "serves model 'phi'" in other.stderr
    huge = fleet.cli("reprofile", "chat", "--profile", "huge", check=False)
    assert huge.returncode == 1 and "cannot be placed" in huge.stderr
    stored = json.loads(fleet.cli("get", "deployments", "-o", "json").stdout)["deployments"]
    assert {d["name"]: d["profile"] for d in stored}["chat"] == "chat-a"  # nothing changed

    # a live scale, then the file: the dry run says the file undoes it
    assert "scaled up to 3 replicas" in fleet.cli("start", "chat").stdout
    code, plan = _plan(fleet, big)
    (removed,) = [c for c in plan["changes"] if c["action"] == "remove"]
    assert removed["deployment"] == "chat" and "undoes a live scale to 3" in removed["reason"]


def test_engine_args_the_adapter_refuses_are_refused_at_apply(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start_server()
    path = tmp_path / "tp.toml"
    path.write_text(
        PROFILES.replace(
            'args = ["--max-model-len", "4096"]', 'args = ["--tensor-parallel-size", "4"]'
        )
        + '\n[deployments.chat]\nprofile = "chat-b"\nreplicas = 1\n'
    )
    for dry in ((), ("--dry-run",)):
        refused = cluster.cli("apply", "-f", str(path), *dry, check=False)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert "profiles.chat-b.args[0]: --tensor-parallel-size is set by llmgw" in refused.stderr
    assert json.loads(cluster.cli("get", "deployments", "-o", "json").stdout)["deployments"] == []
