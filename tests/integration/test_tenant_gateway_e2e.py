"""Tenants' keys at real gateways (issue #18): a key made with ``llmgw key create`` opens the
in-server gateway and a separate ``llmgw gateway`` alike; without it both answer 401; a key
for other models gets 403; a key at rpm 30 gets 30 requests of a minute answered and its
31st refused with 429, Retry-After and OpenAI's x-ratelimit headers whichever gateway it
uses (the limit holds fleet-wide); its use is metered on /metrics; a revoked key is refused
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


def _thirty_then_refused_whichever_gateway(gateways: list[str], key: str) -> None:
    """A key at rpm 30, its requests alternating between the gateways: 30 answered in the
    minute, then the 31st refused with 429 on either. Each gateway holds a part of the 30
    (the server's split): a part used up while the other gateway still has room refuses
    with Retry-After at most 2 s (the next rebalance), and the retry is answered."""
    admitted = early_refusals = turn = 0
    deadline = time.monotonic() + 40
    while admitted < 30:
        assert time.monotonic() < deadline, f"only {admitted} of 30 answered"
        answer = _ask(gateways[turn % 2], key)
        turn += 1
        if answer.status_code == 200:
            admitted += 1
        else:
            assert answer.status_code == 429, answer.text
            assert 1 <= int(answer.headers["retry-after"]) <= 2, answer.headers
            early_refusals += 1
            time.sleep(int(answer.headers["retry-after"]))
        time.sleep(0.1)
    assert early_refusals <= 6, f"{early_refusals} refusals before the 30th"
    for _ in range(3):  # and it stays refused on both as the split rebalances
        for base in gateways:
            over = _ask(base, key)
            assert over.status_code == 429, f"{base}: {over.status_code} after 30 in a minute"
            assert int(over.headers["retry-after"]) >= 1
            assert over.json()["error"]["code"] == "rate_limit_exceeded"
            assert "x-ratelimit-limit-requests" in over.headers
        time.sleep(1.5)


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

    key, key_id = _make_key(fleet, "--models", "chat")
    for base in gateways:  # the key reached both through the router feed
        wait_for(partial(_answers, base, None, 401), 5, f"{base} closed")
        assert _status(base, key) == 200
        assert _status(base, "llmgw_k_not-a-key") == 401
        refused = _ask(base, key, model="other")
        assert refused.status_code == 403 and "other" in refused.text

    metrics = httpx.get(f"{fleet.gateway_url}/metrics", timeout=5).text
    served = f'llmgw_tenant_requests_total{{tenant="team-a",key="{key_id}",model="chat"}} 1'
    assert served in metrics, metrics

    limited, _ = _make_key(fleet, "--rpm", "30")
    time.sleep(5)  # it reaches both gateways, and each gets its part at its next report
    _thirty_then_refused_whichever_gateway(gateways, limited)
    other, other_id = _make_key(fleet)  # a second key of the tenant, no limits
    for base in gateways:
        wait_for(partial(_answers, base, other, 200), 5, f"{base} knows the 2nd key")
    fleet.cli("key", "revoke", other_id)
    revoked = time.monotonic()
    for base in gateways:
        wait_for(partial(_answers, base, other, 401), 5, f"{base} refusing it")
    took = time.monotonic() - revoked
    assert took < 1.0, f"a revoked key was refused everywhere after {took:.2f}s"
