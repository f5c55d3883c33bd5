"""An autoscale policy end to end, as an operator uses it: a real server (with
``--gpu-budget``), the CLI as a subprocess. Apply, refusals, the count an apply keeps,
``llmgw scale`` refused, and what get and describe print."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from procs import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROFILE = '[profiles.p]\nengine = "sim"\ngpu_class = "H100"\nmodel_path = "/models/chat"\n'


def policy_file(tmp_path: Path, policy: str, deployment: str = "") -> str:
    path = tmp_path / "chat.toml"
    path.write_text(
        f'{PROFILE}[deployments.chat]\nprofile = "p"\npriority = 7\n{deployment}'
        f"[deployments.chat.autoscale]\nttft_p90_ms = 800\n{policy}"
    )
    return str(path)


def chat(cluster: Cluster) -> dict[str, Any]:
    (deployment,) = json.loads(cluster.cli("get", "deployments", "-o", "json").stdout)[
        "deployments"
    ]
    return dict(deployment)


def test_an_autoscaled_deployment_through_the_cli(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_server("--gpu-budget", "gpu-a=8")
    refused = cluster.cli(
        "apply", "-f", policy_file(tmp_path, "max = 3\n", "replicas = 2\n"), check=False
    )
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "deployments.chat.replicas" in refused.stderr
    assert "[deployments.chat.autoscale]" in refused.stderr
    bad = cluster.cli("apply", "-f", policy_file(tmp_path, 'min = 4\nmax = 2\nmode = "x"\n'),
                      check=False)  # fmt: skip
    assert bad.returncode == 1
    assert "deployments.chat.autoscale.max: must be at least min (4), got 2" in bad.stderr
    assert "deployments.chat.autoscale.mode" in bad.stderr

    cluster.cli("apply", "-f", policy_file(tmp_path, "min = 0\nmax = 3\n"))
    stored = chat(cluster)
    assert stored.get("replicas", 0) == 0 and stored["priority"] == 7
    assert {"min": 0, **stored["autoscale"]} == {  # proto3 JSON leaves zeros out
        "min": 0, "max": 3, "ttftP90Ms": 800, "scaleDownAfterS": 300, "mode": "act",
    }  # fmt: skip

    scale = cluster.cli("scale", "chat", "2", check=False)
    assert scale.returncode == 1
    assert "chat is autoscaled (mode act, [0, 3])" in scale.stderr
    assert 'autoscale.mode = "advise"' in scale.stderr
    assert chat(cluster).get("replicas", 0) == 0

    # A new minimum raises the count; no node to place it on: apply says so and exits 1.
    raised = cluster.cli("apply", "-f", policy_file(tmp_path, "min = 2\nmax = 3\n"), check=False)
    assert "2 replicas" in raised.stdout and chat(cluster)["replicas"] == 2

    table = cluster.cli("get", "deployments").stdout.splitlines()
    assert table[0].split()[6:9] == ["AUTOSCALE", "SIGNAL", "REASON"]
    described = cluster.cli("describe", "deployment", "chat").stdout
    assert "act, 2 to 3 replicas, ttft p90 <= 800 ms, down after 300 s" in described
    assert "Priority:" in described

    advise = policy_file(tmp_path, 'min = 1\nmax = 3\nmode = "advise"\n', "replicas = 1\n")
    cluster.cli("apply", "-f", advise, check=False)
    cluster.cli("scale", "chat", "3", check=False)  # no node: exit 1, the count is stored
    assert chat(cluster)["replicas"] == 3
