"""A profile's env, args and model path cannot run code on a node (issue 13, hole 2).

From outside, against real processes on loopback: ``llmgw apply -f`` and raw
``ApplyDeployment`` requests (which skip the CLI's own check) with ``LD_PRELOAD``,
``PYTHONPATH``, ``PYTHONWARNINGS``/``BROWSER``, ``BASH_ENV``, ``PATH`` or an abbreviated
``--port`` are refused naming the key, and nothing is stored; a ``StartShard`` sent straight
to the agent (the server's test hook, as a compromised or older server would) with a payload
that creates a file when Python starts is refused by the agent, and the engine never runs; a
hostile profile stored by an older server is kept, the server starts, and no shard of it is
started.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import grpc
import pytest
from procs import Cluster, wait_for
from shardops import ShardWatch, command, listed_shards

from llmgw.addresses import free_port
from llmgw.api.llmgw.v1 import (
    ApplyDeploymentRequest,
    Deployment,
    EngineProfile,
    ShardState,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

APPLY = "/llmgw.v1.ControlService/ApplyDeployment"
SIM_PROFILE = """
[profiles.p]
engine = "sim"
gpu_class = "H100"
model_path = "/models/tiny"
{extra}

[deployments.d]
profile = "p"
replicas = 1
"""
HOSTILE_ENV = {
    "LD_PRELOAD": "/tmp/evil.so",
    "PYTHONPATH": "/tmp/evil",
    "PYTHONWARNINGS": "all:0:antigravity.x:0:0",
    "BROWSER": "/bin/sh -c 'touch /tmp/pwned' #%s",
    "BASH_ENV": "/tmp/evil.sh",
    "PATH": "/tmp/evil:/usr/bin",
    "NCCL_NET_PLUGIN": "/tmp/evil.so",
    "VLLM_LOGGING_CONFIG_PATH": "/tmp/evil.json",
}


def _toml_env(env: dict[str, str]) -> str:
    return "env = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + " }"


def _stored(cluster: Cluster) -> tuple[list[object], list[object]]:
    profiles = json.loads(cluster.cli("get", "profiles", "-o", "json").stdout)["profiles"]
    deployments = json.loads(cluster.cli("get", "deployments", "-o", "json").stdout)
    return profiles, deployments["deployments"]


def _raw_apply(cluster: Cluster, request: ApplyDeploymentRequest) -> grpc.RpcError:
    """``request`` on the native port, no CLI between: the server's own answer."""
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        call = channel.unary_unary(APPLY)
        with pytest.raises(grpc.RpcError) as refused:
            call(bytes(request), timeout=10)
    return refused.value


def test_apply_refuses_env_that_runs_code_and_stores_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start_server()
    hostile = tmp_path / "hostile.toml"
    extra = _toml_env(HOSTILE_ENV) + '\nargs = ["--po", "1234", "--served_model_name=x"]'
    hostile.write_text(SIM_PROFILE.format(extra=extra))

    for dry in ((), ("--dry-run",)):
        refused = cluster.cli("apply", "-f", str(hostile), *dry, check=False)
        assert refused.returncode == 1, refused.stdout
        for key in HOSTILE_ENV:
            assert f"profiles.p.env.{key}:" in refused.stderr, key
        assert "profiles.p.args[0]: --po abbreviates --port" in refused.stderr
        assert "profiles.p.args[2]: --served-model-name is set by llmgw" in refused.stderr
        assert "Traceback" not in refused.stderr

    # The same profiles sent as the API takes them, skipping the CLI's check: the server
    # refuses each, naming the key, dry run or not.
    for key, value in HOSTILE_ENV.items():
        profile = EngineProfile(
            name="p", engine="sim", gpu_class="H100", model_path="/m", env={key: value}
        )
        for dry_run in (True, False):
            request = ApplyDeploymentRequest(
                deployment=Deployment(name="d", profile="p", replicas=1),
                profiles=[profile],
                dry_run=dry_run,
            )
            error = _raw_apply(cluster, request)
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert f"profiles.p.env.{key}:" in (error.details() or ""), (key, error.details())
    for field, value in (  # type: ignore[assignment]
        ("model_path", "--port=1"),
        ("args", ["--host=0.0.0.0"]),
        ("args", ["--max-model-len\n--port", "1"]),
    ):
        profile = EngineProfile(name="p", engine="vllm", gpu_class="H100", model_path="/m")
        setattr(profile, field, value)
        error = _raw_apply(cluster, ApplyDeploymentRequest(profiles=[profile]))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f"profiles.p.{field}" in (error.details() or "")

    assert _stored(cluster) == ([], [])
    assert cluster.procs["server"].poll() is None


def _python_payload(tmp_path: Path) -> tuple[Path, dict[str, dict[str, str]]]:
    """Environments that make any Python process create ``marker``, and the marker."""
    marker = tmp_path / "pwned"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    return marker, {
        "PYTHONPATH": {"PYTHONPATH": str(site)},
        # warnings imports the category's module; antigravity opens $BROWSER
        "PYTHONWARNINGS": {
            "PYTHONWARNINGS": "all:0:antigravity.x:0:0",
            "BROWSER": f"/bin/sh -c 'touch {marker}' #%s",
        },
    }


def test_the_payload_runs_code_when_python_starts(tmp_path: Path) -> None:
    """The control for the agent test below: without the check, each payload creates the
    marker (so that test's "no marker" means the check stopped it)."""
    import os
    import subprocess

    marker, payloads = _python_payload(tmp_path)
    for name, env in payloads.items():
        subprocess.run(
            [sys.executable, "-c", "pass"], env={**os.environ, **env}, check=True, timeout=30
        )
        wait_for(marker.exists, 10, f"the {name} payload's marker")
        marker.unlink()


def test_the_agent_refuses_a_hostile_start_shard_and_never_runs_the_engine(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start_server("--test-hooks")
    cluster.start_agent("n1", "dgx-h100")
    wait_for(lambda: cluster.node_states().get("n1") == "NODE_STATE_READY", 30, "n1 READY")
    gpus = [g["uuid"] for g in cluster.nodes()["n1"]["info"]["gpus"]]
    marker, payloads = _python_payload(tmp_path)
    with ShardWatch(cluster.url) as watch:
        for i, (name, env) in enumerate(payloads.items()):
            shard_id = f"r{i}-0"
            start = {
                "shardId": shard_id,
                "replicaId": f"r{i}",
                "profile": {
                    "name": "tiny-sim",
                    "engine": "sim",
                    "tp": 1,
                    "modelPath": "/models/tiny",
                    "env": env,
                },
                "profileFingerprint": "fp-hostile",
                "gpuUuids": gpus[:1],
                "port": free_port(),
                "apiKey": "key",
            }
            command(cluster, "n1", {"startShard": start})
            failed = watch.wait(shard_id, ShardState.FAILED)
            assert f"env.{name}:" in failed.reason, failed.reason
            assert failed.pid == 0, failed.reason
            assert ShardState.STARTING not in watch.states(shard_id)
            assert listed_shards(cluster)[shard_id]["status"]["state"] == "SHARD_STATE_FAILED"
    assert not marker.exists(), "an engine ran with the hostile environment"
    assert "Traceback" not in cluster.log("n1")


def test_a_stored_hostile_profile_is_kept_and_never_started(fleet: Cluster, tmp_path: Path) -> None:
    cluster = fleet
    cluster.start_server()
    cluster.start_agent("a1")
    wait_for(lambda: cluster.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY")
    good = tmp_path / "good.toml"
    good.write_text(
        SIM_PROFILE.format(extra='env = { VLLM_LOGGING_LEVEL = "INFO" }').replace(
            "replicas = 1", "replicas = 0"
        )
    )
    cluster.cli("apply", "-f", str(good))
    cluster.kill("server")

    # What an older server stored without the check: the same profile with LD_PRELOAD,
    # and its deployment at one replica.
    db = sqlite3.connect(cluster.root / "server.db")
    with db:
        (blob,) = db.execute("SELECT profile FROM profiles WHERE name = 'p'").fetchone()
        profile = EngineProfile.parse(blob)
        profile.env = {"LD_PRELOAD": "/tmp/evil.so"}
        db.execute("UPDATE profiles SET profile = ? WHERE name = 'p'", (bytes(profile),))
        (blob,) = db.execute("SELECT deployment FROM deployments WHERE name = 'd'").fetchone()
        deployment = Deployment.parse(blob)
        deployment.replicas = 1
        db.execute("UPDATE deployments SET deployment = ? WHERE name = 'd'", (bytes(deployment),))
    db.close()

    cluster.start_server()
    wait_for(lambda: cluster.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 back")

    def refused_event() -> str | None:
        lines = cluster.cli("events").stdout.splitlines()
        return next((e for e in lines if "env.LD_PRELOAD" in e), None)

    event = wait_for(refused_event, 30, "an event saying the stored profile is refused")
    assert "profile 'p' is refused" in event
    profiles, deployments = _stored(cluster)
    assert [p["name"] for p in profiles] == ["p"]  # type: ignore[index]
    assert [d["name"] for d in deployments] == ["d"]  # type: ignore[index]
    assert listed_shards(cluster) == {}
    assert cluster.procs["server"].poll() is None
