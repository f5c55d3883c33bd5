"""``llmgw server``: the control server's process.

One event loop serves the same service objects on two ports: native gRPC (grpclib, HTTP/2)
for agents and operator clients, and gRPC-web plus ``/healthz`` (uvicorn, HTTP/1.1) for the
console, browsers and ``llmgw get``. The router feed (``llmgw.server.routersvc``, carrying
API keys) is on the native port only. Unless turned off, the OpenAI gateway
(``llmgw.server.router``) serves on a third port, fed in process from the plane. SIGINT and
SIGTERM stop every port, flush heartbeat times and close the database. The reconciler
(``llmgw.server.reconcile_loop``) runs in the same loop, unless turned off or test hooks are
on. The gRPC-web port also serves the server's own Prometheus metrics on ``/metrics``
(``llmgw.server.metrics``: agents' KV event counters, the KV block store).

Every call on the native and the gRPC-web port is checked by one
``llmgw.server.auth.Authenticator`` (off, and said so loudly, while there are no tokens).

With a certificate and its key (``ServerConfig.tls``, ``--tls-cert``/``--tls-key``) every
port serves TLS only (``llmgw.tls``: ALPN h2 on the native port, http/1.1 on the others);
a file that cannot be read or used is a ``ConfigError`` naming it, before anything binds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpclib.server
import uvicorn

from llmgw.engineports import DEFAULT_ENGINE_PORTS, PortRange
from llmgw.server.agentsvc import AgentService
from llmgw.server.auth import Authenticator, install
from llmgw.server.codec import CheckedProtoCodec, install_message_limit
from llmgw.server.controlsvc import ControlService
from llmgw.server.errors import ConfigError
from llmgw.server.grpcweb import GrpcWebApp
from llmgw.server.inventory import InventoryConfig
from llmgw.server.metrics import server_metrics
from llmgw.server.plane import ControlPlane
from llmgw.server.reconcile_loop import ReconcileLoop
from llmgw.server.router.apikeys import ApiKeys
from llmgw.server.router.gateway import TOKENIZE_TIMEOUT_S, Gateway, GatewayConfig
from llmgw.server.routerreports import RouterReports
from llmgw.server.routersvc import RouterService, ServedGateway, serve_gateway
from llmgw.server.store import Store
from llmgw.server.testhooks import AgentCommandHook
from llmgw.signals import stop_on_signals
from llmgw.tls import ALPN_GRPC, ALPN_HTTP1, TlsFileError, TlsFiles, server_context

log = logging.getLogger(__name__)

DEFAULT_GRPC_LISTEN = "127.0.0.1:50051"
DEFAULT_HTTP_LISTEN = "127.0.0.1:8080"
DEFAULT_GATEWAY_LISTEN = "127.0.0.1:8000"


def default_db_path() -> Path:
    """``$XDG_STATE_HOME/llmgw/server.db`` (``~/.local/state/llmgw/server.db``)."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "llmgw" / "server.db"


@dataclass(frozen=True, slots=True)
class Listen:
    """A host and port to listen on."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str, flag: str) -> Listen:
        """Parse ``HOST:PORT`` or ``[V6]:PORT``; a malformed value names the flag."""
        host, sep, port = text.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"{flag} {text!r} is not HOST:PORT (for example 127.0.0.1:8080)")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything ``llmgw server`` is told on its command line."""

    grpc_listen: Listen
    http_listen: Listen
    db_path: Path
    node_grace_s: float = 5.0
    prune_never_ready_s: float = 300.0  # a node that never sent a heartbeat is forgotten
    heartbeat_interval_ms: int = 1000
    max_message_bytes: int = 4 << 20
    tick_s: float = 0.5
    test_hooks: bool = False  # POST /debug/agents/{node}/command (llmgw.server.testhooks)
    reconcile: bool = True  # run the reconciler (off with test hooks: it would fence their shards)
    reconcile_every_s: float = 1.0  # a round at least this often, and after every change
    gateway_listen: Listen | None = None  # the in-server OpenAI gateway; None: none
    gateway_policy: str = "prefix"  # llmgw.server.router.policy.POLICIES
    gateway_tokenize_timeout_s: float = TOKENIZE_TIMEOUT_S  # the precise tier's /tokenize bound
    gateway_api_keys: ApiKeys = ApiKeys()  # clients' keys for the gateway's /v1; none: open
    join_token: str | None = field(default=None, repr=False)  # agents' token; never logged
    tls: TlsFiles | None = None  # --tls-cert/--tls-key: TLS on every port; None: plaintext
    engine_ports: PortRange = DEFAULT_ENGINE_PORTS  # --engine-ports: the engines' port range


@dataclass(frozen=True, slots=True)
class _PortTls:
    """One server context per kind of port (they differ in ALPN); all None: plaintext."""

    grpc: ssl.SSLContext | None = None
    http: ssl.SSLContext | None = None

    @classmethod
    def load(cls, files: TlsFiles | None) -> _PortTls:
        """Read the certificate and key; a ConfigError naming a file that will not do."""
        if files is None:
            return cls()
        try:
            return cls(server_context(files, ALPN_GRPC), server_context(files, ALPN_HTTP1))
        except TlsFileError as exc:
            raise ConfigError(str(exc)) from exc

    @property
    def scheme(self) -> str:
        return "http" if self.http is None else "https"


class _GatewaySlot:
    """The in-server gateway while it serves (``ControlService``'s gateway provider)."""

    def __init__(self) -> None:
        self.gateway: Gateway | None = None

    def __call__(self) -> Gateway | None:
        return self.gateway


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: this process handles signals once."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def run_server(config: ServerConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or ``stop`` is set)."""
    stop = stop or asyncio.Event()
    tls = _PortTls.load(config.tls)  # before anything binds or opens
    install_message_limit()
    async with Store(config.db_path) as store:
        inventory = InventoryConfig(
            grace_s=config.node_grace_s, never_ready_prune_s=config.prune_never_ready_s
        )
        plane = ControlPlane(store, inventory)
        await plane.load()
        slot = _GatewaySlot()
        reports = RouterReports()  # gateways' reports: RouterService in, GetRouterStats out
        control = ControlService(plane, gateway=slot, reports=reports)
        agents = AgentService(plane, heartbeat_interval_ms=config.heartbeat_interval_ms)
        router = RouterService(plane, reports)  # API keys: native gRPC only, never gRPC-web
        grpc = grpclib.server.Server(
            [agents, control, router],
            codec=CheckedProtoCodec(max_message_bytes=config.max_message_bytes),
        )
        auth = Authenticator(store, join_token=config.join_token)
        install(grpc, auth)
        await grpc.start(config.grpc_listen.host, config.grpc_listen.port, ssl=tls.grpc)
        web = _EmbeddedUvicorn(_uvicorn_config(config, control, agents, auth, tls.http))
        try:
            async with _gateway(config, plane, tls.http) as served, asyncio.TaskGroup() as tasks:
                slot.gateway = served.gateway if isinstance(served, ServedGateway) else None
                web_task = tasks.create_task(web.serve(), name="grpc-web")
                tick_task = tasks.create_task(_ticker(plane, config.tick_s), name="tick")
                loop = _reconcile_loop(config, plane, agents)
                reconcile_task = (
                    tasks.create_task(loop.run(config.reconcile_every_s), name="reconcile")
                    if loop is not None
                    else None
                )
                await _serving_message(config, auth, tls)
                with stop_on_signals(stop):
                    await _first_of(stop, web_task)
                web.should_exit = True
                tick_task.cancel()
                if reconcile_task is not None:
                    reconcile_task.cancel()
        finally:
            slot.gateway = None
            agents.shutdown()
            router.shutdown()
            await asyncio.sleep(0)  # let the streams send their trailers
            grpc.close()
            await grpc.wait_closed()
            await plane.flush()
    log.info("llmgw server stopped")


def _gateway(
    config: ServerConfig, plane: ControlPlane, tls: ssl.SSLContext | None
) -> contextlib.AbstractAsyncContextManager[object]:
    if config.gateway_listen is None:
        log.info("the in-server gateway is off")
        return contextlib.nullcontext()
    listen = config.gateway_listen
    gateway = GatewayConfig(
        host=listen.host,
        port=listen.port,
        policy=config.gateway_policy,
        tls=tls,
        api_keys=config.gateway_api_keys,
        tokenize_timeout_s=config.gateway_tokenize_timeout_s,
    )
    return serve_gateway(plane, gateway)


def _reconcile_loop(
    config: ServerConfig, plane: ControlPlane, agents: AgentService
) -> ReconcileLoop | None:
    if not config.reconcile:
        log.warning("the reconciler is off: deployments are stored but nothing is started")
        return None
    if config.test_hooks:
        log.warning("test hooks on: the reconciler is off (it would stop the hooks' shards)")
        return None
    return ReconcileLoop(plane, agents.send, port_range=config.engine_ports)


def _uvicorn_config(
    config: ServerConfig,
    control: ControlService,
    agents: AgentService,
    auth: Authenticator,
    tls: ssl.SSLContext | None,
) -> uvicorn.Config:
    app: GrpcWebApp | AgentCommandHook
    app = GrpcWebApp(
        services=[control],
        max_message_bytes=config.max_message_bytes,
        authorize=auth.check,
        guard=auth.guard,  # a revoked token's open calls end (llmgw.server.auth)
        metrics=lambda: server_metrics(agents.plane, len(agents.connections), agents.stats()),
    )
    if config.test_hooks:
        log.warning("test hooks on: POST /debug/agents/NODE/command sends commands to agents")
        app = AgentCommandHook(app, agents.send)
    return uvicorn.Config(
        app,
        host=config.http_listen.host,
        port=config.http_listen.port,
        lifespan="off",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=2,
        ssl_context_factory=None if tls is None else (lambda _config, _default: tls),
    )


async def _ticker(plane: ControlPlane, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        await plane.tick()


async def _first_of(stop: asyncio.Event, web_task: asyncio.Task[None]) -> None:
    stop_task = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({stop_task, web_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_task.cancel()
    if web_task.done() and not stop.is_set():
        raise ConfigError("the gRPC-web port stopped serving (is the address in use?)")


async def _serving_message(config: ServerConfig, auth: Authenticator, tls: _PortTls) -> None:
    if not await auth.enabled():
        log.warning(
            "authentication is off: no tokens (anyone who reaches these ports may act); "
            "create one with `llmgw token create --role admin --db %s` to turn it on",
            config.db_path,
        )
    log.info(
        "llmgw server: gRPC on %s (%s), gRPC-web on %s://%s, state in %s",
        config.grpc_listen,
        "plaintext" if tls.grpc is None else "TLS",
        tls.scheme,
        config.http_listen,
        config.db_path,
    )
