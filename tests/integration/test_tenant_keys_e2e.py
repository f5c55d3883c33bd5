"""``llmgw key create|list|revoke`` against a real ``llmgw server`` with authentication on:
the key is printed alone on the first line, listed without it, stored only as its SHA-256,
revoked; a viewer's or operator's token is refused naming the admin role."""

from __future__ import annotations

import hashlib
import json
import sqlite3

import pytest
from procs import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_key_create_list_revoke_and_only_admins_may(cluster: Cluster) -> None:
    admin = cluster.create_token("admin", "root")
    viewer = cluster.create_token("viewer", "looks")
    operator = cluster.create_token("operator", "acts")
    cluster.start_server()
    cluster.token = admin

    made = cluster.cli(
        "key", "create", "--tenant", "team-a", "--models", "chat,code", "--rpm", "30",
        "--priority", "batch", "--expires", "30d", "--note", "evals",
    )  # fmt: skip
    key, said = made.stdout.split("\n", 1)
    assert key.startswith("llmgw_k_") and " " not in key
    assert "for tenant team-a" in said and "rpm 30" in said and key not in said

    listed = json.loads(cluster.cli("key", "list", "-o", "json").stdout)
    assert [(k["tenant"], k["models"], k["rpm"], k["priority"]) for k in listed] == [
        ("team-a", ["chat", "code"], 30, "batch")
    ]
    key_id = listed[0]["key_id"]
    table = cluster.cli("key", "list", "--tenant", "team-a").stdout
    assert key_id in table and key not in table
    assert cluster.cli("key", "list", "--tenant", "other", "-o", "json").stdout.strip() == "[]"

    with sqlite3.connect(cluster.root / "server.db") as conn:
        ((digest,),) = conn.execute("SELECT digest FROM tenant_keys").fetchall()
    conn.close()
    assert digest == hashlib.sha256(key.encode()).hexdigest()

    for token in (viewer, operator):
        cluster.token = token
        refused = cluster.cli("key", "list", check=False)
        assert refused.returncode == 1
        assert "PERMISSION_DENIED" in refused.stderr and "admin" in refused.stderr
        refused = cluster.cli("key", "revoke", key_id, check=False)
        assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr

    cluster.token = admin
    assert key_id in cluster.cli("key", "revoke", key_id).stdout
    assert json.loads(cluster.cli("key", "list", "-o", "json").stdout) == []
    again = cluster.cli("key", "revoke", key_id, check=False)
    assert again.returncode == 1 and "NOT_FOUND" in again.stderr and key_id in again.stderr
    assert key not in cluster.log("server")
