"""``llmgw server`` with a certificate, in this test's event loop: TLS on the native gRPC
port, the gRPC-web port and the in-server gateway; the agent's link, grpclib and the
gRPC-web client trust it through the test CA, and everything else is refused clearly."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpclib.client
import httpx
import pytest
from simserve import wait_listening
from tlspki import Pki

from llmgw.addresses import free_port
from llmgw.agent.backoff import BackoffPolicy
from llmgw.agent.link import AgentLink, LinkConfig
from llmgw.api.llmgw.v1 import Cluster, ControlServiceStub, Gpu, NodeInfo
from llmgw.cli.main import main
from llmgw.client import ClientError, ControlClient, GrpcWebChannel, ServerUnreachable
from llmgw.client.channel import trusted_ca
from llmgw.server.app import Listen, ServerConfig, run_server
from llmgw.server.errors import ConfigError
from llmgw.tls import ALPN_GRPC, ALPN_HTTP1, TlsFiles, client_context

FAST = BackoffPolicy(base_s=0.05, cap_s=0.2)


@dataclass(frozen=True, slots=True)
class Ports:
    grpc: int
    http: int
    gateway: int

    @property
    def web_url(self) -> str:
        return f"https://127.0.0.1:{self.http}"


def _config(root: Path, ports: Ports, tls: TlsFiles | None) -> ServerConfig:
    return ServerConfig(
        grpc_listen=Listen("127.0.0.1", ports.grpc),
        http_listen=Listen("127.0.0.1", ports.http),
        db_path=root / "server.db",
        gateway_listen=Listen("127.0.0.1", ports.gateway),
        tls=tls,
    )


async def _serving(config: ServerConfig, ports: Ports) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(run_server(config, stop))
    try:
        for port in (ports.grpc, ports.http, ports.gateway):
            await wait_listening(port)
        yield
    finally:
        stop.set()
        await task


@pytest.fixture
async def tls_server(pki: Pki, tmp_path: Path) -> AsyncIterator[Ports]:
    ports = Ports(free_port(), free_port(), free_port())
    async for _ in _serving(_config(tmp_path, ports, TlsFiles(pki.cert, pki.key)), ports):
        yield ports


def _node() -> NodeInfo:
    return NodeInfo(node_id="tls-node", gpus=[Gpu(index=0, uuid="GPU-0")])


async def _until(predicate: Callable[[], bool], limit_s: float = 10.0) -> None:
    async with asyncio.timeout(limit_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def _web_cluster_node_ids(url: str, ca: Path | None) -> list[str]:
    async with GrpcWebChannel(url, ca_file=ca) as channel:
        cluster = await ControlClient(channel, read_only=True).get_cluster()
    return [node.info.node_id for node in cluster.nodes if node.info is not None]


async def test_agent_grpc_web_and_gateway_work_over_tls(tls_server: Ports, pki: Pki) -> None:
    link = AgentLink(
        LinkConfig(
            "127.0.0.1", tls_server.grpc, backoff=FAST, tls=client_context(pki.ca, ALPN_GRPC)
        ),
        node=_node,
        telemetry=list,
    )
    task = asyncio.create_task(link.run())
    try:
        await _until(lambda: link.stats.connected)
        assert await _web_cluster_node_ids(tls_server.web_url, pki.ca) == ["tls-node"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    channel = grpclib.client.Channel(
        "127.0.0.1", tls_server.grpc, ssl=client_context(pki.ca, ALPN_GRPC)
    )
    try:
        cluster = await ControlServiceStub(channel).get_cluster(timeout=5)
    finally:
        channel.close()
    assert [n.info.node_id for n in cluster.nodes if n.info] == ["tls-node"]

    verify = client_context(pki.ca, ALPN_HTTP1)
    async with httpx.AsyncClient(verify=verify, timeout=5) as client:
        health = await client.get(f"https://localhost:{tls_server.gateway}/healthz")
        models = await client.get(f"https://127.0.0.1:{tls_server.gateway}/v1/models")
        web_health = await client.get(f"https://127.0.0.1:{tls_server.http}/healthz")
    assert health.status_code == 200 and web_health.status_code == 200
    assert models.json() == {"object": "list", "data": []}


async def test_grpcio_reaches_the_native_port_with_the_ca(tls_server: Ports, pki: Pki) -> None:
    import grpc  # another gRPC stack: it insists on ALPN h2 over TLS

    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
    async with grpc.aio.secure_channel(f"127.0.0.1:{tls_server.grpc}", credentials) as channel:
        call = channel.unary_unary("/llmgw.v1.ControlService/GetCluster")
        reply = await call(b"", timeout=5)  # raw bytes: GetClusterRequest is empty
    assert Cluster.parse(reply).server_time_unix_ms > 0


async def test_the_ca_comes_from_the_context_when_the_channel_has_none(
    tls_server: Ports, pki: Pki
) -> None:
    token = trusted_ca.set(pki.ca)  # as the CLI does with --ca-file or $LLMGW_CA_FILE
    try:
        assert await _web_cluster_node_ids(tls_server.web_url, None) == []
    finally:
        trusted_ca.reset(token)


async def test_grpc_web_clients_without_the_ca_are_refused_clearly(
    tls_server: Ports, pki: Pki
) -> None:
    for ca in (None, pki.other_ca):  # the system's trust store, then the wrong CA
        with pytest.raises(ServerUnreachable) as refused:
            await _web_cluster_node_ids(tls_server.web_url, ca)
        assert refused.value.reason == (
            "the server's TLS certificate was not accepted (unable to get local issuer "
            "certificate); give the CA that signed it (--ca-file or $LLMGW_CA_FILE)"
        )
    with pytest.raises(ServerUnreachable) as plaintext:
        await _web_cluster_node_ids(f"http://127.0.0.1:{tls_server.http}", None)
    assert plaintext.value.reason.endswith("; if the server uses TLS, use an https:// URL")
    with pytest.raises(ClientError, match=f"^--ca-file {pki.not_pem}: holds no PEM certificate"):
        await _web_cluster_node_ids(tls_server.web_url, pki.not_pem)


async def test_grpc_and_gateway_clients_without_the_ca_are_refused(
    tls_server: Ports, pki: Pki
) -> None:
    wrong = grpclib.client.Channel(
        "127.0.0.1", tls_server.grpc, ssl=client_context(pki.other_ca, ALPN_GRPC)
    )
    plain = grpclib.client.Channel("127.0.0.1", tls_server.grpc)
    try:
        with pytest.raises(ssl.SSLCertVerificationError):
            await ControlServiceStub(wrong).get_cluster(timeout=5)
        with pytest.raises((ConnectionError, OSError, grpclib.exceptions.StreamTerminatedError)):
            await ControlServiceStub(plain).get_cluster(timeout=5)
    finally:
        wrong.close()
        plain.close()
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(httpx.RemoteProtocolError):  # plaintext to the TLS gateway
            await client.get(f"http://127.0.0.1:{tls_server.gateway}/healthz")
    async with httpx.AsyncClient(verify=client_context(pki.other_ca), timeout=5) as client:
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await client.get(f"https://127.0.0.1:{tls_server.gateway}/healthz")


@pytest.mark.parametrize(
    ("ca", "said"),
    [
        ("other", "the server's TLS certificate was not accepted (unable to get local issuer"),
        (None, "before registering (if the server serves TLS, give the agent --ca-file)"),
    ],
)
async def test_an_agent_without_the_ca_never_registers_and_says_why(
    tls_server: Ports, pki: Pki, caplog: pytest.LogCaptureFixture, ca: str | None, said: str
) -> None:
    caplog.set_level(logging.WARNING, logger="llmgw.agent.backoff")
    tls = None if ca is None else client_context(pki.other_ca, ALPN_GRPC)
    link = AgentLink(
        LinkConfig("127.0.0.1", tls_server.grpc, backoff=FAST, tls=tls),
        node=_node,
        telemetry=list,
    )
    task = asyncio.create_task(link.run())
    try:
        await _until(lambda: link.backoff.failures >= 2)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert link.stats.sessions == 0
    assert said in caplog.text


async def test_the_host_name_is_checked(pki: Pki, tmp_path: Path) -> None:
    ports = Ports(free_port(), free_port(), free_port())
    elsewhere = TlsFiles(pki.wrong_name_cert, pki.key)  # signed by the CA, for elsewhere.test
    async for _ in _serving(_config(tmp_path, ports, elsewhere), ports):
        with pytest.raises(ServerUnreachable, match="IP address mismatch"):
            await _web_cluster_node_ids(ports.web_url, pki.ca)


async def test_a_plaintext_server_refuses_an_https_client_clearly(tmp_path: Path) -> None:
    ports = Ports(free_port(), free_port(), free_port())
    async for _ in _serving(_config(tmp_path, ports, None), ports):
        assert await _web_cluster_node_ids(f"http://127.0.0.1:{ports.http}", None) == []
        with pytest.raises(ServerUnreachable) as refused:
            await _web_cluster_node_ids(ports.web_url, None)
    assert refused.value.reason.startswith("the TLS handshake failed")
    assert refused.value.reason.endswith("does this port serve TLS? (an http:// URL is plaintext)")


async def test_bad_certificate_files_stop_the_server_before_it_binds(
    pki: Pki, tmp_path: Path
) -> None:
    ports = Ports(free_port(), free_port(), free_port())
    for files, named in (
        (TlsFiles(pki.cert, pki.stray_key), f"--tls-key {pki.stray_key}: this key does not"),
        (TlsFiles(tmp_path / "gone.pem", pki.key), f"--tls-cert {tmp_path / 'gone.pem'}:"),
    ):
        with pytest.raises(ConfigError, match=f"^{named}"):
            await run_server(_config(tmp_path, ports, files))
    assert not (tmp_path / "server.db").exists()  # nothing was opened, nothing bound
    for port in (ports.grpc, ports.http, ports.gateway):
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)


def test_the_cli_names_the_bad_flag(
    pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = str(tmp_path / "s.db")
    assert main(["server", "--db", db, "--tls-cert", str(pki.cert)]) == 1
    assert (
        capsys.readouterr().err
        == "llmgw: --tls-cert needs --tls-key too (a certificate and its key)\n"
    )
    listen = [
        "--grpc-listen",
        f"127.0.0.1:{free_port()}",
        "--http-listen",
        f"127.0.0.1:{free_port()}",
    ]
    argv = [
        "server",
        "--db",
        db,
        *listen,
        "--tls-cert",
        str(pki.not_pem),
        "--tls-key",
        str(pki.key),
    ]
    assert main(argv) == 1
    assert capsys.readouterr().err.startswith(f"llmgw: --tls-cert {pki.not_pem}: holds no PEM")
    assert main(["get", "nodes", "--server", "http://127.0.0.1:1", "--ca-file", str(pki.ca)]) == 1
    assert capsys.readouterr().err == (
        "llmgw: --ca-file is for an https:// server; http://127.0.0.1:1 is plaintext\n"
    )
    assert main(["agent", "--state-dir", str(tmp_path / "a"), "--ca-file", str(pki.not_pem)]) == 1
    assert capsys.readouterr().err.startswith(f"llmgw: --ca-file {pki.not_pem}: holds no PEM")
