"""TLS end to end with a certificate made in the test: a real ``llmgw server`` with
``--tls-cert``/``--tls-key``, an agent with ``--ca-file`` whose simulated engine gets READY,
the CLI and the console reading over https with the CA, completions through the in-server
gateway and a separate ``llmgw gateway`` (its feed over TLS too) over https; without the CA,
with the wrong CA, or in plaintext, each is refused with a clear error; a bad certificate
file stops ``llmgw server`` and ``llmgw gateway`` at once, naming the file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from procs import Cluster, wait_for
from tlspki import Pki

from llmgw.addresses import free_port
from llmgw.tls import client_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
READY = "SHARD_STATE_READY"
FILE = """
[profiles.chat-sim]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/chat"
served_model_name = "chat"

[deployments.chat]
profile = "chat-sim"
replicas = 1
"""


def _answers(url: str, ca: Path) -> bool:
    try:
        return httpx.get(url, timeout=1, verify=client_context(ca)).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class TlsCluster(Cluster):
    """The integration cluster with TLS on every port; clients trust ``ca``."""

    ca: Path = Path()
    cert: Path = Path()
    key: Path = Path()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.http_port}"

    @property
    def gateway_url(self) -> str:
        return f"https://127.0.0.1:{self.gateway_port}"

    def start_server(self, *extra: str, follower: bool = False) -> subprocess.Popen[bytes]:
        tls = ("--tls-cert", str(self.cert), "--tls-key", str(self.key))
        return super().start_server(*tls, *extra, follower=follower)

    def start_gateway_tls(self) -> str:
        """``llmgw gateway`` with its feed and its OpenAI port over TLS; its https URL."""
        url = f"https://127.0.0.1:{free_port()}"
        self.spawn(
            "gateway",
            "gateway",
            "--server",
            f"127.0.0.1:{self.grpc_port}",
            "--listen",
            url.removeprefix("https://"),
            "--ca-file",
            str(self.ca),
            "--tls-cert",
            str(self.cert),
            "--tls-key",
            str(self.key),
        )
        wait_for(lambda: _answers(f"{url}/healthz", self.ca), 20, "the gateway's /healthz")
        return url

    def healthy(self) -> bool:
        return _answers(f"{self.url}/healthz", self.ca)

    def cli(
        self, *args: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return run_cli(
            *args, "--server", self.url, env={"LLMGW_CA_FILE": str(self.ca)}, check=check
        )


def run_cli(
    *args: str, env: dict[str, str] | None = None, check: bool = False
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "LLMGW_CA_FILE"}
    return subprocess.run(
        [sys.executable, "-m", "llmgw", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=check,
        env={**environ, **(env or {})},
    )


@pytest.fixture
def tls_fleet(fleet: Cluster, pki: Pki) -> TlsCluster:
    return TlsCluster(fleet.root, procs=fleet.procs, ca=pki.ca, cert=pki.cert, key=pki.key)


def _replicas(cluster: Cluster) -> list[dict[str, Any]]:
    out = cluster.cli("get", "replicas", "-o", "json", check=False)
    return list(json.loads(out.stdout)["replicas"]) if out.returncode == 0 else []


@contextmanager
def _openai(base: str, ca: Path) -> Iterator[openai.OpenAI]:
    with (
        httpx.Client(verify=client_context(ca), timeout=30) as http,
        openai.OpenAI(
            base_url=f"{base}/v1",
            api_key="k",
            max_retries=0,
            http_client=http,  # type: ignore[arg-type]
        ) as client,
    ):
        yield client


def _complete(base: str, ca: Path) -> str:
    with _openai(base, ca) as client:
        done = client.completions.create(model="chat", prompt="Once upon a time", max_tokens=4)
    assert done.usage is not None and done.usage.completion_tokens == 4
    return done.choices[0].text


def test_tls_end_to_end(tls_fleet: TlsCluster, pki: Pki, tmp_path: Path) -> None:
    c = tls_fleet
    c.start_server()
    c.start_agent("a1", "dgx-h100", "--engine-bin", SIM_BIN, "--ca-file", str(pki.ca))
    c.start_agent("plain", "l4-pcie")  # no CA: plaintext to a TLS port
    c.start_agent("wrongca", "l4-pcie", "--ca-file", str(pki.other_ca))
    wait_for(lambda: c.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY over TLS")
    assert f"registered with 127.0.0.1:{c.grpc_port} over TLS" in c.log("a1")
    path = tmp_path / "chat.toml"
    path.write_text(FILE)
    assert "deployment chat applied" in c.cli("apply", "-f", str(path)).stdout
    wait_for(lambda: [r.get("state") for r in _replicas(c)] == [READY], 60, "the replica READY")

    assert _complete(c.gateway_url, pki.ca)  # the in-server gateway, over https
    gateway = c.start_gateway_tls()
    wait_for(lambda: _has_models(gateway, pki.ca), 20, "the gateway's feed over TLS")
    assert _complete(gateway, pki.ca)
    assert f"following 127.0.0.1:{c.grpc_port} over TLS" in c.log("gateway")

    flag = run_cli("console", "--once", "-o", "json", "--server", c.url, "--ca-file", str(pki.ca))
    assert flag.returncode == 0, flag.stderr
    assert "a1" in flag.stdout and "chat" in flag.stdout

    wait_for(lambda: "not accepted" in c.log("wrongca"), 20, "the wrong-CA agent refused")
    assert "the server's TLS certificate was not accepted (unable to get local issuer" in (
        c.log("wrongca")
    )
    assert "if the server serves TLS, give the agent --ca-file" in c.log("plain")
    assert set(c.node_states()) == {"a1"}  # neither got in
    _clients_without_the_ca_are_refused(c, pki)


def _has_models(base: str, ca: Path) -> bool:
    try:
        body = httpx.get(f"{base}/v1/models", timeout=2, verify=client_context(ca)).json()
    except httpx.HTTPError:
        return False
    return [m["id"] for m in body.get("data", [])] == ["chat"]


def _clients_without_the_ca_are_refused(c: TlsCluster, pki: Pki) -> None:
    none = run_cli("get", "nodes", "--server", c.url)
    assert none.returncode == 1
    assert none.stderr == (
        f"llmgw: cannot reach the control server at {c.url}: {c.url}: the server's TLS "
        "certificate was not accepted (unable to get local issuer certificate); give the CA "
        "that signed it (--ca-file or $LLMGW_CA_FILE)\n"
    ), none.stderr
    wrong = run_cli("get", "nodes", "--server", c.url, "--ca-file", str(pki.other_ca))
    assert wrong.returncode == 1 and "certificate was not accepted" in wrong.stderr
    plain_url = c.url.replace("https://", "http://")
    plain = run_cli("get", "nodes", "--server", plain_url)
    assert plain.returncode == 1
    assert plain.stderr.rstrip().endswith("if the server uses TLS, use an https:// URL")
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.get(c.gateway_url.replace("https://", "http://") + "/healthz", timeout=5)


def test_bad_certificate_files_stop_the_processes_at_once(pki: Pki, tmp_path: Path) -> None:
    listen = [
        "--grpc-listen",
        f"127.0.0.1:{free_port()}",
        "--http-listen",
        f"127.0.0.1:{free_port()}",
    ]
    server = ["server", "--db", str(tmp_path / "s.db"), *listen, "--gateway-listen", "off"]
    mismatch = run_cli(*server, "--tls-cert", str(pki.cert), "--tls-key", str(pki.stray_key))
    assert mismatch.returncode == 1
    assert mismatch.stderr.strip().endswith(
        f"llmgw: --tls-key {pki.stray_key}: this key does not belong to the certificate in "
        f"--tls-cert {pki.cert}"
    )
    missing = tmp_path / "missing.pem"
    gone = run_cli(*server, "--tls-cert", str(missing), "--tls-key", str(pki.key))
    assert gone.returncode == 1
    assert f"llmgw: --tls-cert {missing}: cannot read it (No such file or directory)" in gone.stderr
    assert not (tmp_path / "s.db").exists()
    gateway = run_cli(
        "gateway",
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--tls-cert",
        str(pki.cert),
        "--tls-key",
        str(pki.not_pem),
    )
    assert gateway.returncode == 1
    assert f"llmgw: --tls-key {pki.not_pem}: holds no usable PEM private key" in gateway.stderr


ROOT = Path(__file__).resolve().parents[2]
BUF_AT = ROOT / ".ci" / "node" / "node_modules" / ".bin" / "buf"


def _buf() -> str:
    """``buf`` on PATH or where .ci/run installs it; missing: skipped, a failure in CI."""
    found = shutil.which("buf") or (str(BUF_AT) if os.access(BUF_AT, os.X_OK) else None)
    if found is None:
        why = f"buf is neither on PATH nor at {BUF_AT} (bash .ci/run installs it with npm)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return found


def test_buf_curl_reaches_both_ports_with_the_ca(tls_fleet: TlsCluster, tmp_path: Path) -> None:
    buf, c = _buf(), tls_fleet
    c.start_server()
    path = "llmgw.v1.ControlService/GetCluster"
    env = {**os.environ, "BUF_CACHE_DIR": str(tmp_path / "buf-cache")}
    base = [buf, "curl", "--schema", str(ROOT / "protos")]
    for url, protocol in ((f"https://127.0.0.1:{c.grpc_port}", "grpc"), (c.url, "grpcweb")):
        args = [*base, "--protocol", protocol, f"{url}/{path}"]
        trusted = subprocess.run(
            [*args, "--cacert", str(c.ca)], capture_output=True, text=True, timeout=30, env=env
        )
        assert trusted.returncode == 0, trusted.stderr
        assert int(json.loads(trusted.stdout)["serverTimeUnixMs"]) > 0
        untrusted = subprocess.run(args, capture_output=True, text=True, timeout=30, env=env)
        assert untrusted.returncode != 0 and "certificate" in untrusted.stderr, untrusted.stderr
