"""Tenants' keys at real gateways (issue #18): a key made with ``llmgw key create`` opens the
in-server gateway and a separate ``llmgw gateway`` alike; without it both answer 401; a key
for other models gets 403; the key's rpm refuses the request past it with 429, Retry-After
and OpenAI's x-ratelimit headers; its use is metered on /metrics; a revoked key is refused
on both gateways within a second."""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

import httpx
import pytest
from procs import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
DEPLOYMENT = """
[profiles.one-gpu]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/chat"
served_model_name = "chat"

[deployments.chat]
profile = "one-gpu"
replicas = 1
"""


def _ask(base: str, key: str | None, model: str = "chat") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "prompt": "hello", "max_tokens": 4}
    return httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=10)


def _status(base: str, key: str | None) -> int:
    try:
        return _ask(base, key).status_code
    except httpx.HTTPError:
        return 0


def _answers(base: str, key: str | None, status: int) -> bool:
    return _status(base, key) == status


def _make_key(fleet: Cluster, *flags: str) -> tuple[str, str]:
    """``llmgw key create``: the key (its first line) and its id (``key k_… for tenant``)."""
    key, said = fleet.cli("key", "create", "--tenant", "team-a", *flags).stdout.split("\n", 1)
    return key, said.split()[1]


def test_a_tenant_key_opens_every_gateway_is_limited_metered_and_revoked_everywhere(
    fleet: Cluster, tmp_path: Path
) -> None:
    fleet.start_server()
    fleet.start_agent("n1", "dgx-h100", "--engine-bin", SIM_BIN)
    wait_for(lambda: fleet.node_states().get("n1") == "NODE_STATE_READY", 30, "n1 READY")
    document = tmp_path / "chat.toml"
    document.write_text(DEPLOYMENT)
    assert "deployment chat applied" in fleet.cli("apply", "-f", str(document)).stdout
    separate = fleet.start_gateway()
    gateways = [fleet.gateway_url, separate]
    for base in gateways:
        wait_for(partial(_answers, base, None, 200), 60, f"{base} open, serving")

    key, key_id = _make_key(fleet, "--models", "chat", "--rpm", "5")
    for base in gateways:  # the key reached both through the router feed
        wait_for(partial(_answers, base, None, 401), 5, f"{base} closed")
        assert _status(base, key) == 200
        assert _status(base, "llmgw_k_not-a-key") == 401
        refused = _ask(base, key, model="other")
        assert refused.status_code == 403 and "other" in refused.text

    for _ in range(4):  # the in-server gateway has now had 5 of the key's 5 a minute
        assert _ask(fleet.gateway_url, key).status_code == 200
    over = _ask(fleet.gateway_url, key)
    assert over.status_code == 429, over.text
    assert int(over.headers["retry-after"]) >= 1
    assert over.headers["x-ratelimit-limit-requests"] == "5"
    assert over.headers["x-ratelimit-remaining-requests"] == "0"
    assert over.json()["error"]["code"] == "rate_limit_exceeded"

    metrics = httpx.get(f"{fleet.gateway_url}/metrics", timeout=5).text
    served = f'llmgw_tenant_requests_total{{tenant="team-a",key="{key_id}",model="chat"}} 5'
    assert served in metrics, metrics

    other, other_id = _make_key(fleet)  # a second key of the tenant, no limits
    for base in gateways:
        wait_for(partial(_answers, base, other, 200), 5, f"{base} knows the 2nd key")
    fleet.cli("key", "revoke", other_id)
    revoked = time.monotonic()
    for base in gateways:
        wait_for(partial(_answers, base, other, 401), 5, f"{base} refusing it")
    took = time.monotonic() - revoked
    assert took < 1.0, f"a revoked key was refused everywhere after {took:.2f}s"
