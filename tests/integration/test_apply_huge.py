"""A huge ``apply`` against the real server: its document is parsed off the event loop, so
every port keeps answering while it is checked."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import Cluster

from llmgw.api.llmgw.v1 import ActionResult, ApplyDeploymentRequest, Deployment, EngineProfile

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CLI_DEPLOYMENTS = 10_000
DEPLOYMENTS = 60_000  # ~2.9 MB of TOML, under the default 4 MiB message limit; ~6 s to parse
APPLY = "/llmgw.v1.ControlService/ApplyDeployment"
GRPC_WEB = {"content-type": "application/grpc-web+proto", "x-grpc-web": "1"}
PROFILE = """[profiles.p]
engine = "sim"
gpu_class = "cpu"
cpu_threads = 1
model_path = "tiny-sim"
"""


def _huge_document() -> str:
    deployments = (f'[deployments.d{i}]\nprofile = "p"\nreplicas = 0\n' for i in range(DEPLOYMENTS))
    return PROFILE + "".join(deployments)


async def _healthz_latencies(url: str, until: asyncio.Future[Any]) -> list[float]:
    """Seconds each /healthz took, asked one after another until ``until`` is done."""
    latencies = []
    async with httpx.AsyncClient(timeout=10) as http:
        while not until.done():
            started = time.monotonic()
            assert (await http.get(f"{url}/healthz")).status_code == 200
            latencies.append(time.monotonic() - started)
            await asyncio.sleep(0.05)
    return latencies


async def _apply(url: str, body: bytes) -> ActionResult:
    """One ApplyDeployment over gRPC-web, its frame encoded beforehand (by the caller), so
    this process spends nothing on it while /healthz is timed."""
    async with httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(f"{url}{APPLY}", content=body, headers=GRPC_WEB)
    assert reply.status_code == 200, reply.text
    data = reply.content
    assert data[:1] == b"\x00", data  # a message frame, then the trailers
    size = int.from_bytes(data[1:5], "big")
    return ActionResult.parse(data[5 : 5 + size])


async def test_a_huge_apply_leaves_healthz_answering(cluster: Cluster) -> None:
    cluster.start_server()
    profile = EngineProfile(name="p", engine="sim", gpu_class="cpu", cpu_threads=1,
                            model_path="tiny-sim", served_model_name="tiny-sim")  # fmt: skip
    request = ApplyDeploymentRequest(
        deployment=Deployment(name="d0", profile="p", replicas=0),
        profiles=[profile],
        document=_huge_document(),
    )
    message = bytes(request)
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    started = time.monotonic()
    apply = asyncio.ensure_future(_apply(cluster.url, body))
    latencies = await _healthz_latencies(cluster.url, apply)
    result = await apply
    took = time.monotonic() - started
    assert result.ok and "deployment d0 applied" in result.message
    assert took > 1.0, f"the apply took {took:.1f}s: too small to tell"
    assert len(latencies) >= 3
    assert max(latencies) < 1.0, f"/healthz took up to {max(latencies):.2f}s during the apply"


def test_llmgw_apply_sends_a_huge_file_in_one_request(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_server()
    path = tmp_path / "huge.toml"
    path.write_text(PROFILE + "".join(
        f'[deployments.d{i}]\nprofile = "p"\nreplicas = 0\n' for i in range(CLI_DEPLOYMENTS)
    ))  # fmt: skip
    started = time.monotonic()
    applied = cluster.cli("apply", "-f", str(path), timeout=90)  # ~20 s on a quiet 2-core machine
    took = time.monotonic() - started
    lines = applied.stdout.splitlines()
    assert lines[0].startswith("deployment d0 applied: profile p (")
    assert lines[-1] == f"… and {CLI_DEPLOYMENTS - len(lines) + 1} more"
    assert took < 60, f"llmgw apply took {took:.0f}s"  # one request per deployment: hours
    listed = cluster.cli("get", "deployments", "-o", "json", timeout=90).stdout
    assert len(json.loads(listed)["deployments"]) == CLI_DEPLOYMENTS
