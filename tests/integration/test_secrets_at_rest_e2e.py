"""Secrets at rest and in logs (issue 13, hole 8): real ``llmgw`` processes on loopback.

- The server's state directory is 0700 and its database files 0600, whether it makes them
  or finds them looser (then it tightens them and says so); the agent's state directory
  likewise; another local user (``runuser -u nobody``) cannot read the database.
- At ``--log-level debug`` no log holds a bearer token, a replica's API key or a profile's
  env value (aiosqlite debugs every statement with its parameters, hpack every header).
- Only an admin token reads profiles' env values; viewer and operator tokens get the names
  with ``<redacted>`` values, over gRPC-web (``llmgw get profiles -o json``) and native gRPC.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpclib.client
import httpx
import pytest
from procs import Cluster, wait_for

from llmgw.addresses import free_port
from llmgw.api.llmgw.v1 import ControlServiceStub, ListProfilesRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
HF_TOKEN = "hf_" + secrets.token_hex(16)

PROFILE = f"""
[profiles.chat]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/chat"
served_model_name = "chat"
env = {{ HF_TOKEN = "{HF_TOKEN}", VLLM_LOGGING_LEVEL = "INFO" }}

[deployments.chat]
profile = "chat"
replicas = 1
"""


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A folder every local user may enter (0755, as a home directory often is), unlike
    pytest's own tmp_path: whether another user reads a file then rests on llmgw alone."""
    root = Path(tempfile.mkdtemp(prefix="llmgw-secrets-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _nobody_reads(path: Path) -> bool:
    """Whether the unprivileged user ``nobody`` can read ``path``."""
    run = subprocess.run(
        ["runuser", "-u", "nobody", "--", "cat", str(path)], capture_output=True, timeout=30
    )
    return run.returncode == 0


def _spawn_server(cluster: Cluster, db: Path, *global_flags: str) -> None:
    """``llmgw [FLAGS] server`` on the cluster's ports with ``db``, waited for."""
    cluster.spawn(
        "server",
        *global_flags,
        "server",
        "--grpc-listen",
        f"127.0.0.1:{cluster.grpc_port}",
        "--http-listen",
        f"127.0.0.1:{cluster.http_port}",
        "--gateway-listen",
        f"127.0.0.1:{cluster.gateway_port}",
        "--db",
        str(db),
    )
    wait_for(cluster.healthy, 60, "the server's /healthz")


def _db_files(db: Path) -> list[Path]:
    return [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]


def test_state_files_are_owner_only_and_looser_ones_are_tightened(shared_root: Path) -> None:
    if shutil.which("runuser") is None or os.geteuid() != 0:
        pytest.skip("needs root and runuser, to read as the user nobody")
    # A state folder from before: made 0755 with a 0644 database, readable by anyone.
    old = shared_root / "old" / "server.db"
    old.parent.mkdir()
    subprocess.run(  # a real llmgw file (it turns authentication on; /healthz stays open)
        [sys.executable, "-m", "llmgw", "token", "create", "--role", "admin", "--db", str(old)],
        capture_output=True,
        timeout=60,
        check=True,
    )
    old.parent.chmod(0o755)
    old.chmod(0o644)
    assert _nobody_reads(old)  # the hole, as found

    for name, db in (("fresh", shared_root / "fresh" / "state" / "server.db"), ("old", old)):
        cluster = Cluster(shared_root / f"{name}-logs")
        cluster.root.mkdir()
        try:
            _spawn_server(cluster, db)
            files = _db_files(db)
            wait_for(lambda f=files: all(p.exists() for p in f), 10, "the database's -wal and -shm")  # type: ignore[misc]
            assert _mode(db.parent) == 0o700, name
            assert {p.name: _mode(p) for p in files} == {p.name: 0o600 for p in files}, name
            assert not [p for p in files if _nobody_reads(p)], name
        finally:
            cluster.stop_all()
        if name == "old":
            log = cluster.log("server")
            assert f"{db.parent} was readable by others (mode 0755): tightened to 0700" in log
            assert f"{db} was readable by others (mode 0644): tightened to 0600" in log


def test_agent_state_is_owner_only(shared_root: Path) -> None:
    fresh, old = shared_root / "fresh-agent", shared_root / "old-agent"
    (old / "engines").mkdir(parents=True)
    key = old / "engines" / "r1-0.key"
    key.write_text("sk-left-readable")
    for path, mode in ((old, 0o755), (old / "engines", 0o755), (key, 0o644)):
        path.chmod(mode)
    for state in (fresh, old):
        subprocess.run(
            [sys.executable, "-m", "llmgw", "agent", "--discover", "--simulate", "cpu-only"]
            + ["--state-dir", str(state)],
            capture_output=True,
            timeout=60,
            check=True,
        )
        assert _mode(state) == 0o700
        assert _mode(state / "node-id") == 0o600
    assert (_mode(old / "engines"), _mode(key)) == (0o700, 0o600)


def _secrets_in(root: Path, secret_values: dict[str, str]) -> dict[str, list[str]]:
    """For each secret that some log under ``root`` holds, the logs that hold it."""
    logs = {str(p.relative_to(root)): p.read_text(errors="replace") for p in root.rglob("*.log")}
    found = {
        what: [name for name, text in logs.items() if value in text]
        for what, value in secret_values.items()
    }
    return {what: names for what, names in found.items() if names}


def _serves(base: str) -> bool:
    """Whether a completion through the gateway at ``base`` answers 200 (the gateway adds
    the replica's key upstream: the header the debug log must not show)."""
    body = {"model": "chat", "prompt": "hi", "max_tokens": 2}
    try:
        return httpx.post(f"{base}/v1/completions", json=body, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _replica_keys(db: Path) -> list[str]:
    with sqlite3.connect(db) as conn:
        records = [json.loads(row[0]) for row in conn.execute("SELECT record FROM replicas")]
    return [str(r["api_key"]) for r in records if r.get("api_key")]


def test_debug_logs_hold_no_key_token_or_env_value(fleet: Cluster, tmp_path: Path) -> None:
    db = fleet.root / "server.db"
    tokens = {role: fleet.create_token(role, role) for role in ("admin", "agent", "gateway")}
    fleet.token = tokens["admin"]
    _spawn_server(fleet, db, "--log-level", "debug")
    for role in ("agent", "gateway"):
        (tmp_path / role).write_text(tokens[role] + "\n")
        (tmp_path / role).chmod(0o600)
    fleet.spawn(
        "a1",
        "--log-level",
        "debug",
        "agent",
        "--server",
        f"127.0.0.1:{fleet.grpc_port}",
        "--node-id",
        "a1",
        "--simulate",
        "dgx-h100",
        "--state-dir",
        str(fleet.root / "a1"),
        "--engine-bin",
        SIM_BIN,
        "--token-file",
        str(tmp_path / "agent"),
    )
    gateway = f"127.0.0.1:{free_port()}"
    fleet.spawn(
        "gw",
        "--log-level",
        "debug",
        "gateway",
        "--server",
        f"127.0.0.1:{fleet.grpc_port}",
        "--listen",
        gateway,
        "--token-file",
        str(tmp_path / "gateway"),
    )
    wait_for(lambda: fleet.node_states() == {"a1": "NODE_STATE_READY"}, 30, "the agent READY")
    (tmp_path / "chat.toml").write_text(PROFILE)
    fleet.cli("apply", "-f", str(tmp_path / "chat.toml"))
    keys = wait_for(lambda: _replica_keys(db), 60, "the replica's API key stored")
    wait_for(lambda: "READY" in fleet.cli("get", "replicas").stdout, 60, "the replica READY")
    fleet.cli("get", "profiles", "-o", "json")
    wait_for(lambda: _serves(f"http://{gateway}"), 30, "the gateway routing to the replica")
    secret_values = {f"{role} token": token for role, token in tokens.items()}
    secret_values |= {"HF_TOKEN": HF_TOKEN, "replica key": keys[0]}
    assert "DEBUG" in fleet.log("server") and "DEBUG" in fleet.log("a1")  # debug took
    assert _secrets_in(fleet.root, secret_values) == {}


async def _native_profiles(port: int, token: str) -> dict[str, str]:
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        reply = await ControlServiceStub(channel).list_profiles(
            ListProfilesRequest(), metadata={"authorization": f"Bearer {token}"}
        )
    finally:
        channel.close()
    (profile,) = reply.profiles
    return dict(profile.env)


def test_only_admins_read_profile_env_values(cluster: Cluster, tmp_path: Path) -> None:
    tokens = {r: cluster.create_token(r, r) for r in ("viewer", "operator", "admin")}
    cluster.start_server()
    cluster.token = tokens["admin"]
    (tmp_path / "chat.toml").write_text(PROFILE)
    applied = cluster.cli("apply", "-f", str(tmp_path / "chat.toml"), check=False)
    # stored; no node is registered, so its replica cannot be placed: exit 1, saying so
    assert applied.returncode == 1 and "0 of 1 replicas can be placed" in applied.stdout
    shown = {"HF_TOKEN": HF_TOKEN, "VLLM_LOGGING_LEVEL": "INFO"}
    redacted = {"HF_TOKEN": "<redacted>", "VLLM_LOGGING_LEVEL": "<redacted>"}
    for role, token in tokens.items():
        cluster.token = token
        web = json.loads(cluster.cli("get", "profiles", "-o", "json").stdout)
        (profile,) = web["profiles"]
        native = asyncio.run(_native_profiles(cluster.grpc_port, token))
        expected = shown if role == "admin" else redacted
        assert (profile["env"], native) == (expected, expected), role
        assert profile["name"] == "chat" and profile["modelPath"] == "/models/chat"
        table = cluster.cli("get", "profiles").stdout.splitlines()[1].split()
        assert (table[-1] == "<redacted>") == (role != "admin"), table  # no made-up fingerprint
