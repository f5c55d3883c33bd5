"""``llmgw server``: the control server's process.

One event loop serves the same service objects on two ports: native gRPC (grpclib, HTTP/2)
for agents and operator clients, and gRPC-web plus ``/healthz`` (HTTP/1.1, asgihttp.py) for the
console, browsers and ``llmgw get``. The router feed (``llmgw.server.wire.routersvc``, carrying
API keys) is on the native port only. Unless turned off, the OpenAI gateway
(``llmgw.gateway``) serves on a third port, fed in process from the plane. SIGINT and
SIGTERM stop every port, flush heartbeat times and the event history and close the
database. The reconciler (``llmgw.server.reconcile_loop``) runs in the same loop, unless
turned off or test hooks are on, and with it the autoscaler (``llmgw.server.autoscale_loop``),
over every gateway's signals (``RouterReports.signals``, the in-server gateway's included)
and replica rows. The gRPC-web port also serves the server's own Prometheus
metrics on ``/metrics`` (``llmgw.server.wire.metrics``: agents' KV event counters, the KV
block store).

The native port drops a connection that sends no HTTP/2 preface within a handshake timeout,
closes one with no open stream for an idle timeout, and caps connections in all and per
peer address (``llmgw.server.wire.grpcport``).

Every call on the native and the gRPC-web port is checked by one
``llmgw.server.wire.auth.Authenticator`` (off, and said so loudly, while there are no tokens).
While it is off the server refuses to listen on any address beyond loopback, before
anything binds, unless told ``--insecure-no-auth`` (:func:`unauthenticated_exposure`).

The gRPC-web and gateway ports answer no cross-origin page and no unknown Host (DNS
rebinding) unless opened with ``--cors-origin``/``--allowed-host`` (``llmgw.httpguard``).

A state database that cannot be written (full or read-only disk) does not stop the server:
``/healthz`` answers 503 with the reason, calls that write answer UNAVAILABLE on both ports,
and it recovers by itself (``llmgw.server.state.storehealth``).

With a certificate and its key (``ServerConfig.tls``, ``--tls-cert``/``--tls-key``) every
port serves TLS only (``llmgw.tls``: ALPN h2 on the native port, http/1.1 on the others);
a file that cannot be read or used is a ``ConfigError`` naming it, before anything binds.

An SQLite state database is held with an exclusive lock (``llmgw.server.state.statelock``)
taken before it opens and before any port binds: a second server on the same ``--db``
refuses, naming the first. A PostgreSQL one (``--db postgresql://…``) may be shared by
several servers: the leader lease (``llmgw.server.state.leadership``) makes one of them
lead, and ``llmgw.server.roles.take_turns`` serves as the leader or as a follower as
the lease turns, binding the ports anew at each turn. A follower tells agents and gateways
where the leader is (``llmgw.server.wire.follower``), relays operators' calls to it
(``llmgw.server.wire.relay``) and runs its gateway on the leader's router feed
(``llmgw.server.wire.followergateway``).

Both HTTP ports run under ``ServerConfig.http_limits`` (``llmgw.gateway.httplimits``:
head size, head/body/idle timeouts, connections in all and per peer, buffered body bytes);
the gRPC-web port's largest body follows from ``max_message_bytes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llmgw.addresses import AddressError, bracketed, parse_host_port, state_home
from llmgw.engineports import DEFAULT_ENGINE_PORTS, PortRange
from llmgw.gateway import (
    TOKENIZE_TIMEOUT_S,
    ApiKeys,
    Gateway,
    GatewayConfig,
    HoldConfig,
    HttpServer,
    ServerLimits,
)
from llmgw.httpguard import BrowserAccess, HttpGuard, is_loopback_host
from llmgw.server.autoscale_loop import (
    DEFAULT_INTERVAL_S,
    DEFAULT_WINDOW_S,
    AutoscaleConfig,
    AutoscaleLoop,
)
from llmgw.server.errors import ConfigError
from llmgw.server.reconcile_loop import ReconcileLoop
from llmgw.server.roles import take_turns
from llmgw.server.state.inventory import InventoryConfig
from llmgw.server.state.leadership import Leadership, LeaseTimes
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.scalein import InFlightFn, no_in_flight
from llmgw.server.state.statelock import hold_state_lock
from llmgw.server.state.store import Store
from llmgw.server.state.storebackend import DbTarget, parse_db
from llmgw.server.state.storehealth import install as install_store_health
from llmgw.server.state.storehealth import unavailable_when_unwritable
from llmgw.server.wire.agentsvc import AgentService
from llmgw.server.wire.asgihttp import AsgiHandler
from llmgw.server.wire.auth import Authenticator, install
from llmgw.server.wire.codec import CheckedProtoCodec, install_message_limit
from llmgw.server.wire.controlsvc import ControlService
from llmgw.server.wire.follower import follower_services
from llmgw.server.wire.followergateway import follow_leader_gateway
from llmgw.server.wire.grpcport import ConnectionLimits, LimitedServer
from llmgw.server.wire.grpcweb import BrowserGate, GrpcWebApp, most_body_bytes
from llmgw.server.wire.logrelay import LogRelay
from llmgw.server.wire.metrics import leader_metrics, server_metrics
from llmgw.server.wire.relay import LeaderRelay
from llmgw.server.wire.routerreports import RouterReports, fleet_rows, gateway_reports
from llmgw.server.wire.routersvc import RouterService, ServedGateway, serve_gateway
from llmgw.server.wire.testhooks import AgentCommandHook
from llmgw.signals import stop_on_signals
from llmgw.tls import (
    ALPN_GRPC,
    ALPN_HTTP1,
    TlsFileError,
    TlsFiles,
    client_context,
    server_context,
)

log = logging.getLogger(__name__)

DEFAULT_GRPC_LISTEN = "127.0.0.1:50051"
DEFAULT_HTTP_LISTEN = "127.0.0.1:8080"
DEFAULT_GATEWAY_LISTEN = "127.0.0.1:8000"
SWITCH_INTERVAL_S = 0.0005
"""The server's GIL switch interval (``sys.setswitchinterval``): short, so the event loop
answers while a worker thread parses (Python's default, 5 ms, stalls it per acquisition)."""


def default_db_path() -> Path:
    """``$XDG_STATE_HOME/llmgw/server.db`` (``~/.local/state/llmgw/server.db``)."""
    return state_home() / "llmgw" / "server.db"


def db_target(text: str | None) -> DbTarget:
    """``--db`` as given (``parse_db``: ConfigError when a URL will not do), or the default
    file when it is not."""
    return parse_db(text) if text else default_db_path()


@dataclass(frozen=True, slots=True)
class Listen:
    """A host and port to listen on."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str, flag: str) -> Listen:
        """Parse ``HOST:PORT`` or ``[V6]:PORT`` (port 0: the OS picks); a malformed value
        names the flag."""
        try:
            host, port = parse_host_port(text, port_zero=True)
        except AddressError as exc:
            raise ConfigError(
                f"{flag} {text!r} is not HOST:PORT (for example 127.0.0.1:8080): {exc}"
            ) from None
        return cls(host, port)

    def __str__(self) -> str:
        return f"{bracketed(self.host)}:{self.port}"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything ``llmgw server`` is told on its command line."""

    grpc_listen: Listen
    http_listen: Listen
    db_path: DbTarget  # --db: an SQLite file, or a PostgreSQL URL (shown with its password hidden)
    node_grace_s: float = 5.0
    prune_never_ready_s: float = 300.0  # a node that never sent a heartbeat is forgotten
    heartbeat_interval_ms: int = 1000
    max_message_bytes: int = 4 << 20
    tick_s: float = 0.5
    test_hooks: bool = False  # POST /debug/agents/{node}/command (llmgw.server.wire.testhooks)
    reconcile: bool = True  # run the reconciler (off with test hooks: it would fence their shards)
    reconcile_every_s: float = 1.0  # a round at least this often, and after every change
    gateway_listen: Listen | None = None  # the in-server OpenAI gateway; None: none
    gateway_policy: str = "prefix"  # llmgw.gateway.routing.policy.POLICIES
    gateway_tokenize_timeout_s: float = TOKENIZE_TIMEOUT_S  # the precise tier's /tokenize bound
    gateway_api_keys: ApiKeys = ApiKeys()  # clients' keys for the gateway's /v1; none: open
    gateway_explain_keys: ApiKeys = ApiKeys()  # keys that may see x-llmgw-route
    gateway_hold: HoldConfig = HoldConfig()  # requests held for a model scaled to zero
    join_token: str | None = field(default=None, repr=False)  # agents' token; never logged
    tls: TlsFiles | None = None  # --tls-cert/--tls-key: TLS on every port; None: plaintext
    engine_ports: PortRange = DEFAULT_ENGINE_PORTS  # --engine-ports: the engines' port range
    grpc_limits: ConnectionLimits = ConnectionLimits()  # the native port's timeouts and caps
    browsers: BrowserAccess = BrowserAccess()  # --cors-origin, --allowed-host (HTTP ports)
    insecure_no_auth: bool = False  # --insecure-no-auth: beyond loopback with no tokens
    http_limits: ServerLimits = ServerLimits()  # both HTTP ports' (flags: cli/httplimits.py)
    autoscale_interval_s: float = DEFAULT_INTERVAL_S  # --autoscale-interval
    autoscale_window_s: float = DEFAULT_WINDOW_S  # --autoscale-window
    # --gpu-budget POOL=N: the GPUs the autoscaler may give each pool's deployments together
    gpu_budgets: dict[str, int] = field(default_factory=dict)
    server_id: str | None = None  # --server-id: this server among its peers; None: advertise
    advertise: str | None = None  # --advertise: where agents reach this server; None: grpc_listen
    lease: LeaseTimes = LeaseTimes()  # --lease-ttl: the leader lease (PostgreSQL only)
    # --ca-file: what a follower trusts in the leader's certificate; None: its own --tls-cert
    peer_ca: Path | None = None


@dataclass(frozen=True, slots=True)
class _PortTls:
    """One server context per kind of port (they differ in ALPN); all None: plaintext."""

    grpc: ssl.SSLContext | None = None
    http: ssl.SSLContext | None = None
    peer: ssl.SSLContext | None = None  # a follower's client context to the leader

    @classmethod
    def load(cls, files: TlsFiles | None, peer_ca: Path | None = None) -> _PortTls:
        """Read the certificate and key (and the peers' CA: ``peer_ca``, else the
        certificate itself); a ConfigError naming a file that will not do."""
        if files is None:
            if peer_ca is not None:
                raise ConfigError(f"--ca-file {peer_ca}: needs --tls-cert (plaintext trusts no CA)")
            return cls()
        try:
            return cls(
                server_context(files, ALPN_GRPC),
                server_context(files, ALPN_HTTP1),
                client_context(peer_ca or files.cert, ALPN_GRPC),
            )
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


async def run_server(config: ServerConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or ``stop`` is set): as the leader while this server
    holds the lease, as a follower while it does not (``llmgw.server.roles.take_turns``)."""
    stop = stop or asyncio.Event()
    # a parse in a worker thread (a huge apply) holds the GIL for up to the switch interval
    # each time the event loop wants it back: 5 ms by default, many times per request
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    tls = _PortTls.load(config.tls, config.peer_ca)  # before anything binds or opens
    install_message_limit()
    with _state_lock(config.db_path):  # before the database opens and any port binds
        async with Store(config.db_path) as store:
            leadership = await _leadership(config, store)
            auth = Authenticator(store, join_token=config.join_token)  # for every turn
            # reads the tokens now: an unreadable row stops the start, named
            exposure = unauthenticated_exposure(config, auth_on=await auth.enabled())
            if exposure is not None:
                raise ConfigError(exposure)
            try:
                with stop_on_signals(stop):
                    await take_turns(
                        leadership,
                        stop,
                        lead=lambda over: _serve(config, over, tls, leadership, auth),
                        follow=lambda over: _follow(config, over, tls, leadership, auth),
                        first_claim_s=config.lease.follow_s * 2,
                    )
            finally:
                await leadership.release()
                await store.close()
    log.info("llmgw server stopped")


async def _leadership(config: ServerConfig, store: Store) -> Leadership:
    """An SQLite file's only server leads for good; a PostgreSQL database's servers take
    turns on its lease (``llmgw.server.state.leadership``)."""
    address = config.advertise or str(config.grpc_listen)
    server_id = config.server_id or address
    if isinstance(config.db_path, Path):
        return Leadership.sole(store, server_id, address)
    return Leadership(store, server_id, address, config.lease)


def _state_lock(db: DbTarget) -> contextlib.AbstractContextManager[object]:
    """An SQLite file's lock (``statelock``); a PostgreSQL database has the leader lease
    instead (several servers may share it)."""
    return hold_state_lock(db) if isinstance(db, Path) else contextlib.nullcontext()


async def _loaded_plane(store: Store, config: ServerConfig) -> ControlPlane:
    """The control plane over ``store``, with what the file holds loaded."""
    inventory = InventoryConfig(
        grace_s=config.node_grace_s, never_ready_prune_s=config.prune_never_ready_s
    )
    plane = ControlPlane(store, inventory)
    plane.engine_ports = config.engine_ports
    await plane.load()
    return plane


async def _serve(
    config: ServerConfig,
    stop: asyncio.Event,
    tls: _PortTls,
    leadership: Leadership,
    auth: Authenticator,
) -> None:
    """One term as the leader: the plane loaded afresh from the store, every port, the
    reconciler and the autoscaler, until ``stop`` (the term's end)."""
    plane = await _loaded_plane(leadership.store, config)
    await leadership.begin_term()
    slot = _GatewaySlot()
    # gateways' reports: RouterService in; GetRouterStats, the autoscaler's signals out
    reports = RouterReports(local=slot)
    logs = LogRelay()  # StreamLogs calls, relayed over the agents' streams
    control = ControlService(plane, gateway=slot, reports=reports, logs=logs)
    plane.leadership = leadership.message
    agents = AgentService(
        plane, heartbeat_interval_ms=config.heartbeat_interval_ms, logs=logs, leadership=leadership
    )
    router = RouterService(plane, reports)  # API keys: native gRPC only, never gRPC-web
    grpc = await _native_port(config, [agents, control, router], auth, tls, store_health=True)
    web = _grpc_web_server(config, control, agents, auth, tls.http)
    try:
        await _start_web(config, web, tls)
        async with _gateway(config, plane, tls.http) as served, asyncio.TaskGroup() as tasks:
            slot.gateway = served.gateway if isinstance(served, ServedGateway) else None
            rounds = {
                "tick": _ticker(plane, config.tick_s),
                "split": router.tenants_in_server(slot),
            }
            loop = _reconcile_loop(config, plane, agents, control.in_flight)
            if loop is not None:  # the autoscaler's counts need a reconciler to act on
                rounds["reconcile"] = loop.run(config.reconcile_every_s)
                rounds["autoscale"] = _autoscale_loop(config, plane, reports, slot).run()
            running = [tasks.create_task(r, name=name) for name, r in rounds.items()]
            await _serving_message(config, auth, tls, leadership)
            await stop.wait()
            for task in running:
                task.cancel()
    finally:
        slot.gateway = None
        await web.stop()
        agents.shutdown(leadership.term_end())
        router.shutdown()
        await asyncio.sleep(0)  # let the streams send their trailers
        grpc.close()
        await grpc.wait_closed()
        await plane.flush(now=True)  # the event history too


async def _follow(
    config: ServerConfig,
    stop: asyncio.Event,
    tls: _PortTls,
    leadership: Leadership,
    auth: Authenticator,
) -> None:
    """One turn as a follower until ``stop``: the agents' and the gateways' calls are told
    where the leader is (``llmgw.server.wire.follower``), the operators' calls, native and
    gRPC-web, are relayed to it (``llmgw.server.wire.relay``), and the in-server gateway
    follows the leader's router feed as a separate gateway does. ``/healthz`` answers 503
    naming the leader (a balancer sends nothing here that only a leader serves) and
    ``/metrics`` says who leads."""
    relay = LeaderRelay(leadership, ssl=tls.peer)
    services = [*follower_services(leadership), relay]
    grpc = await _native_port(config, services, auth, tls, store_health=False)
    browsers = HttpGuard(config.browsers, config.http_listen.host, tls=tls.http is not None)
    app = GrpcWebApp(
        services=[relay],
        browsers=browsers,
        max_message_bytes=config.max_message_bytes,
        authorize=auth.check,
        guard=auth.guard,
        metrics=lambda: leader_metrics(leadership.message()),
        health=_refusal(leadership),
    )
    limits = replace(config.http_limits, max_body_bytes=most_body_bytes(config.max_message_bytes))
    web = HttpServer(AsgiHandler(app, scheme=tls.scheme), limits, guard=browsers, cors=False)
    try:
        await _start_web(config, web, tls)
        log.info("llmgw server %s follows: %s", leadership.server_id, leadership.refusal())
        await _follower_gateway(config, stop, tls, leadership, auth)
    finally:
        await web.stop()
        grpc.close()
        await grpc.wait_closed()
        relay.close()


async def _follower_gateway(
    config: ServerConfig,
    stop: asyncio.Event,
    tls: _PortTls,
    leadership: Leadership,
    auth: Authenticator,
) -> None:
    """Until ``stop``: a follower's in-server gateway on the leader's router feed
    (``llmgw.server.wire.followergateway``); none without ``--gateway-listen``."""
    if config.gateway_listen is None:
        await stop.wait()
        return
    await follow_leader_gateway(
        _gateway_config(config, tls.http),
        stop,
        leadership,
        auth,
        feed_tls=tls.peer,
    )


def _refusal(leadership: Leadership) -> Callable[[], Awaitable[str | None]]:
    async def why() -> str | None:
        return leadership.refusal()

    return why


def unauthenticated_exposure(config: ServerConfig, *, auth_on: bool) -> str | None:
    """Why the server must not start: it would serve beyond loopback with authentication
    off and without ``--insecure-no-auth``; None when it may."""
    if auth_on or config.insecure_no_auth:
        return None
    listens = [
        (config.grpc_listen, "--grpc-listen"),
        (config.http_listen, "--http-listen"),
        (config.gateway_listen, "--gateway-listen"),
    ]
    exposed = [f"{flag} {listen}" for listen, flag in listens if _beyond_loopback(listen)]
    if not exposed:
        return None
    return (
        f"refusing to listen on {', '.join(exposed)} without authentication: no token "
        "exists, so anyone who reaches the port may act; create an admin token first "
        f"(`llmgw token create --role admin --db {config.db_path}`), or pass "
        "--insecure-no-auth to serve without authentication anyway"
    )


def _beyond_loopback(listen: Listen | None) -> bool:
    return listen is not None and not is_loopback_host(listen.host)


async def _native_port(
    config: ServerConfig,
    services: list[Any],
    auth: Authenticator,
    tls: _PortTls,
    *,
    store_health: bool,
) -> LimitedServer:
    """The native gRPC port serving ``services`` behind ``auth`` (and, for the leader, the
    store's health: ``store_health``), listening; a ConfigError when it cannot."""
    grpc = LimitedServer(
        services,
        codec=CheckedProtoCodec(max_message_bytes=config.max_message_bytes),
        limits=config.grpc_limits,
    )
    install(grpc, auth)
    if store_health:
        install_store_health(grpc)
    try:
        await grpc.start(config.grpc_listen.host, config.grpc_listen.port, ssl=tls.grpc)
    except OSError as exc:
        raise _cannot_listen(config.grpc_listen, "--grpc-listen", "native gRPC", exc) from exc
    return grpc


async def _start_web(config: ServerConfig, web: HttpServer, tls: _PortTls) -> None:
    """The gRPC-web port listening; a ConfigError when it cannot."""
    try:
        await web.start(config.http_listen.host, config.http_listen.port, ssl=tls.http)
    except OSError as exc:
        raise _cannot_listen(config.http_listen, "--http-listen", "gRPC-web", exc) from exc


def _cannot_listen(listen: Listen, flag: str, what: str, exc: OSError) -> ConfigError:
    reason = exc.strerror or str(exc)
    return ConfigError(f"{flag} {listen}: cannot listen for {what}: {reason}")


def _gateway(
    config: ServerConfig, plane: ControlPlane, tls: ssl.SSLContext | None
) -> contextlib.AbstractAsyncContextManager[object]:
    if config.gateway_listen is None:
        log.info("the in-server gateway is off")
        return contextlib.nullcontext()
    return serve_gateway(plane, _gateway_config(config, tls))


def _gateway_config(config: ServerConfig, tls: ssl.SSLContext | None) -> GatewayConfig:
    """The in-server gateway's configuration (``--gateway-*``), the leader's or a follower's."""
    listen = config.gateway_listen
    assert listen is not None
    return GatewayConfig(
        host=listen.host,
        port=listen.port,
        policy=config.gateway_policy,
        tls=tls,
        api_keys=config.gateway_api_keys,
        explain_keys=config.gateway_explain_keys,
        tokenize_timeout_s=config.gateway_tokenize_timeout_s,
        hold=config.gateway_hold,
        browsers=config.browsers,
        limits=config.http_limits,
    )


def _reconcile_loop(
    config: ServerConfig,
    plane: ControlPlane,
    agents: AgentService,
    in_flight: InFlightFn = no_in_flight,
) -> ReconcileLoop | None:
    if not config.reconcile:
        log.warning("the reconciler is off: deployments are stored but nothing is started")
        return None
    if config.test_hooks:
        log.warning("test hooks on: the reconciler is off (it would stop the hooks' shards)")
        return None
    return ReconcileLoop(plane, agents.send, port_range=config.engine_ports, in_flight=in_flight)


def _autoscale_loop(
    config: ServerConfig, plane: ControlPlane, reports: RouterReports, slot: _GatewaySlot
) -> AutoscaleLoop:
    """The autoscaler over every gateway's figures: the separate gateways' reports and
    the in-server gateway's, read at each round."""
    settings = AutoscaleConfig(
        interval_s=config.autoscale_interval_s,
        window_s=config.autoscale_window_s,
        budgets=dict(config.gpu_budgets),
    )
    return AutoscaleLoop(
        plane,
        reports=lambda: gateway_reports(reports),
        rows=lambda: fleet_rows(reports, slot()),
        config=settings,
    )


def _grpc_web_server(
    config: ServerConfig,
    control: ControlService,
    agents: AgentService,
    auth: Authenticator,
    tls: ssl.SSLContext | None,
) -> HttpServer:
    browsers = HttpGuard(config.browsers, config.http_listen.host, tls=tls is not None)
    app: GrpcWebApp | BrowserGate
    app = GrpcWebApp(
        services=[control],
        browsers=browsers,
        max_message_bytes=config.max_message_bytes,
        authorize=auth.check,
        guard=lambda func: unavailable_when_unwritable(auth.guard(func)),  # revoked: ends
        metrics=lambda: (
            server_metrics(agents.plane, len(agents.connections), agents.stats())
            + leader_metrics(agents.plane.leadership())
        ),
        health=agents.plane.store.health.reason,  # 503 while the database takes no writes
    )
    if config.test_hooks:
        log.warning("test hooks on: POST /debug/agents/NODE/command sends commands to agents")
        app = BrowserGate(AgentCommandHook(app, agents.send), browsers)
    largest = most_body_bytes(config.max_message_bytes)  # GrpcWebApp answers in gRPC terms
    limits = replace(config.http_limits, max_body_bytes=largest)
    handler = AsgiHandler(app, scheme="http" if tls is None else "https")
    return HttpServer(handler, limits, guard=browsers, cors=False)  # the app writes CORS


async def _ticker(plane: ControlPlane, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        await plane.tick()


async def _serving_message(
    config: ServerConfig, auth: Authenticator, tls: _PortTls, leadership: Leadership
) -> None:
    if not await auth.enabled():
        log.warning(
            "authentication is off: no tokens (anyone who reaches these ports may act); "
            "create one with `llmgw token create --role admin --db %s` to turn it on",
            config.db_path,
        )
    log.info(
        "llmgw server %s: gRPC on %s (%s), gRPC-web on %s://%s, state in %s, %s",
        leadership.server_id,
        config.grpc_listen,
        "plaintext" if tls.grpc is None else "TLS",
        tls.scheme,
        config.http_listen,
        config.db_path,
        f"leading at epoch {leadership.epoch}" if leadership.leading() else "following",
    )
