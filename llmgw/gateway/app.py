"""The OpenAI gateway: routes each request by ``model`` to a READY replica and proxies it.

Routes: ``GET /v1/models`` (the models of READY replicas, OpenAI list shape),
``POST /v1/completions`` and ``POST /v1/chat/completions`` (proxied; server-sent events go
through as they arrive), ``GET /metrics`` (Prometheus text), ``GET /healthz``; with
``debug_kv_index`` (``llmgw gateway --debug-kv-index``, for tests and bench/chaos.py) also
``GET /debug/kv_index``: every replica's indexed block keys, ``{"replicas": {ID:
{"block_size": N, "keys": ["<16 hex>", …]}}}``, ascending (unauthenticated: a key tells
whether a guessed prompt is cached, so it is off by default).

Per proxied request: parse what routing needs (openai.py; 400 naming the fault), look up the
READY candidates (404 ``NotFoundError`` like vLLM when no replica of any state serves the
model, 503 when none is READY; a request for a scalable model with none READY is held
first, holding.py), let the policy choose (timed, counted by tier and outcome),
acquire the replica on the ``LoadTracker`` at once, write the request with the replica's API
key, and forward the response as it arrives (proxy.py, which also states the retry rule),
then release. The whole request is bounded by ``request_timeout_s`` (504 before any byte of
the answer; after one, the connection is closed). A client that goes away cancels the
request: the upstream connection is closed, never pooled. ``stop`` closes the listener,
every client connection and every upstream connection.

With client keys (``GatewayConfig.api_keys``, ``--api-key-file``; apikeys.py) or tenant keys
(the router feed's, ``Gateway.tenants``; tenants.py) a request for ``/v1`` or below without
``Authorization: Bearer`` one of them is answered 401 and counted, as soon as its head has
arrived, none of its body read (an expired tenant key: 401 saying so). A tenant key's
request is then held to the key's models (403), its limits (429 with Retry-After and
``x-ratelimit-*``, which its answers carry too) and metered (tenantmeter.py). ``/healthz``
and ``/metrics`` stay open, as vLLM leaves ``/health`` and ``/metrics``. What clients may
send and hold (head size, timeouts, connections per peer, bodies buffered) is
``GatewayConfig.limits``.

The HTTP server and the upstream client are llmgw's own (httpserver.py, upstream.py): in a
bare proxy they spent less CPU per request than an ASGI server under uvicorn or an aiohttp
client did. What the whole gateway costs per request, beside vllm-router and sglang-router,
is ``python -m bench.gateway`` (BENCHMARKS.md).

Why a request went there: a request with ``x-llmgw-explain: 1`` is answered with
``x-llmgw-route: tier=…; replica=…; matched=M/N; reason=…`` (``routing/explain.py``; in the
head, so a stream has it before its first byte) when its key may see it: with explain keys
(``GatewayConfig.explain_keys``, ``--explain-key-file``; also accepted as client keys) only
a request carrying one of them; without explain keys, any request of a gateway without
client keys (which already answers ``x-llmgw-replica`` to all), and none of a gateway with
client keys. A request that may not see it gets its answer without the header, never an
error. Every decision goes into a ring of the last 200 (routelog.py, for
``GetRouterStats``); every answer's reported cached tokens are checked against the
precise tier's prediction (reusecheck.py).

The precise tier (precise.py): with the ``prefix`` policy and ``precise`` on, a
request whose candidates publish KV events is tokenized by one of them (``/tokenize``,
bounded by ``tokenize_timeout_s``) before the policy runs, and decided on the replicas' KV
blocks (``kv_index``); otherwise, or when that fails, the approximate tree decides as
before. An ``EnginePoller`` (engines.py) reads every READY replica's ``/metrics`` each
``engine_poll_s``: the reuse its engine delivered, its block size, and its KV capacity,
which bounds the approximate tree for that replica.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from dataclasses import dataclass, field
from functools import partial

from llmgw.gateway.apikeys import ApiKeys
from llmgw.gateway.engines import EnginePoller, PollerConfig
from llmgw.gateway.errors import (
    GatewayTimeout,
    HoldRefused,
    ModelNotFound,
    NoReplica,
    RateLimited,
    RequestRefused,
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamRefused,
)
from llmgw.gateway.holding import HoldConfig, HoldingQueues
from llmgw.gateway.httpconnection import HttpConnection
from llmgw.gateway.httplimits import ServerLimits
from llmgw.gateway.httprequest import Refusal, Request
from llmgw.gateway.httpserver import HttpServer
from llmgw.gateway.metrics import CONTENT_TYPE, UNKNOWN_LABEL, GatewayMetrics, kv_index_lines
from llmgw.gateway.modelsignals import ModelSignalBook
from llmgw.gateway.openai import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    SESSION_HEADER,
    ParsedRequest,
    dumps,
    error_body,
    parse_request,
)
from llmgw.gateway.precise import Fallback, PreciseRequest, PreciseTier
from llmgw.gateway.proxy import Exchange, Outcome, encode_request
from llmgw.gateway.reusecheck import ReuseCheck
from llmgw.gateway.routelog import RouteLog, RouteRecord
from llmgw.gateway.routing.explain import explain, header_value, predicted_reuse
from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.gateway.routing.load import LoadTracker
from llmgw.gateway.routing.policy import Decision, Policy, PrefixPolicy, RouteRequest, make_policy
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.gateway.tenantmeter import Usage
from llmgw.gateway.tenants import (
    TenantRegistry,
    Ticket,
    admit_head,
    bind_registry,
    estimate_tokens,
)
from llmgw.gateway.tokenize import TokenizeClient, TokenizeConfig
from llmgw.gateway.upstream import Origin, UpstreamConnection, UpstreamPool
from llmgw.httpguard import BrowserAccess, HttpGuard

log = logging.getLogger(__name__)

TOKENIZE_TIMEOUT_S = 0.05  # the precise tier's default bound on a replica's /tokenize
CLIENT_GONE = 499
"""The status counted for a request whose client went away before its answer ended."""

BROKEN = 502
"""The status counted for a response the replica broke off after its first byte was sent."""

_SESSION_HEADER = SESSION_HEADER.encode()
EXPLAIN_HEADER = "x-llmgw-explain"
"""A request header: ``1`` asks for ``x-llmgw-route`` on the answer (the module docstring
says which keys may see it)."""
_EXPLAIN_HEADER = EXPLAIN_HEADER.encode()
_PROXIED = (COMPLETIONS_PATH, CHAT_PATH)
_DEBUG_KV_PATH = "/debug/kv_index"
_TEXT_TYPE = b"text/plain; charset=utf-8"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Where the gateway listens, how it routes, and its bounds."""

    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "prefix"
    request_timeout_s: float = 600.0  # whole request
    connect_timeout_s: float = 5.0
    retries: int = 2  # other replicas tried when one fails before its first byte
    limits: ServerLimits = ServerLimits()  # what clients may send and hold (httplimits.py)
    upstream_idle_s: float = 4.0  # an idle pooled upstream connection is closed after this
    precise: bool = True  # the precise tier (prefix policy only; needs replicas' KV events)
    tokenize_timeout_s: float = TOKENIZE_TIMEOUT_S  # a /tokenize call for the precise tier
    engine_poll_s: float = 5.0  # how often replicas' /metrics are read (0: never)
    api_keys: ApiKeys = ApiKeys()  # clients' keys for /v1 (apikeys.py); none: open to all
    explain_keys: ApiKeys = ApiKeys()  # keys that may also see x-llmgw-route (docstring)
    debug_kv_index: bool = False  # serve GET /debug/kv_index (see the module docstring)
    browsers: BrowserAccess = BrowserAccess()  # --cors-origin, --allowed-host (httpguard)
    hold: HoldConfig = HoldConfig()  # requests held for a scalable model (holding.py)
    tls: ssl.SSLContext | None = field(default=None, repr=False, compare=False)  # None: http


class Gateway:
    """The OpenAI gateway over a ``RoutingTable``; ``kv_index`` holds the KV blocks each
    replica holds, as the router feed says (``llmgw.gateway.feed``), for the precise
    tier."""

    def __init__(
        self,
        table: RoutingTable,
        config: GatewayConfig = GatewayConfig(),
        *,
        policy: Policy | None = None,
        kv_index: KvIndex | None = None,
        tenants: TenantRegistry | None = None,
    ) -> None:
        self.table = table
        self.tenants = tenants if tenants is not None else TenantRegistry()  # tenants.py
        bind_registry(table, self.tenants)  # the feed's tenant keys reach it
        self.kv_index = kv_index if kv_index is not None else KvIndex()
        self.config = config
        self.policy = policy if policy is not None else make_policy(config.policy)
        self.load = LoadTracker()
        self.metrics = GatewayMetrics()
        self.signals = ModelSignalBook()  # per model, for the autoscaler (modelsignals.py)
        self.started_at_unix_ms = int(time.time() * 1000)
        self.holding = HoldingQueues(table, config.hold, on_end=self.signals.held)
        self.metrics.add_collector(self.holding.lines)
        self.route_log = RouteLog()  # the last decisions (routelog.py)
        self.reuse = ReuseCheck()  # predicted against reported cached tokens (reusecheck.py)
        self.metrics.add_collector(self.reuse.lines)
        self.pool = UpstreamPool(
            connect_timeout_s=config.connect_timeout_s, idle_timeout_s=config.upstream_idle_s
        )
        self._server: HttpServer | None = None
        table.on_removed(self.policy.forget)
        table.on_removed(self.metrics.forget_replica)
        self.precise = self._precise_tier()
        self.engines = EnginePoller(
            table,
            self.pool,
            PollerConfig(interval_s=config.engine_poll_s or 5.0),
            metrics=self.metrics,
            on_capacity=self._kv_capacity,
        )
        self._poller: asyncio.Task[None] | None = None
        self.metrics.add_collector(
            lambda: kv_index_lines(self.kv_index.stats(), self._replica_blocks())
        )
        self.metrics.add_collector(self.engines.lines)
        self.metrics.add_collector(self.tenants.meter.lines)

    def _precise_tier(self) -> PreciseTier | None:
        if not self.config.precise or not isinstance(self.policy, PrefixPolicy):
            return None
        tokenizer = TokenizeClient(self.pool, TokenizeConfig(self.config.tokenize_timeout_s))
        return PreciseTier(
            self.kv_index,
            self.policy,
            tokenizer,
            metrics=self.metrics,
            block_size_of=lambda replica_id: self.engines.block_size(replica_id),
        )

    def _replica_blocks(self) -> dict[str, int]:
        """Blocks the KV index holds for each replica of the table with KV events."""
        index, targets = self.kv_index, self.table.targets()
        return {t.replica_id: index.blocks_of(t.replica_id) for t in targets if t.kv_events}

    def _kv_capacity(self, replica_id: str, kv_tokens: int | None) -> None:
        """An engine's KV capacity (tokens) bounds what the approximate tree claims for it."""
        if isinstance(self.policy, PrefixPolicy):
            per_token = self.precise.chars_per_token if self.precise else 4.0
            chars = None if kv_tokens is None else max(1, round(kv_tokens * per_token))
            self.policy.set_replica_capacity(replica_id, chars)

    async def start(self) -> tuple[str, int]:
        """Listen; the bound address (port 0 → the chosen one)."""
        guard = HttpGuard(self.config.browsers, self.config.host, tls=self.config.tls is not None)
        self._server = HttpServer(
            self._handle,
            self.config.limits,
            tick=self.pool.expire,
            refused=self.metrics.request_done,
            guard=guard,
            admit=self._admit,
        )
        address = await self._server.start(self.config.host, self.config.port, ssl=self.config.tls)
        if self.config.engine_poll_s > 0:
            self._poller = asyncio.create_task(self.engines.run(), name="engine-poller")
        scheme = "http" if self.config.tls is None else "https"
        log.info("gateway listening on %s://%s:%d (policy %s)", scheme, *address, self.policy.name)
        return address

    async def stop(self) -> None:
        """Stop listening; cancel requests in flight; close every connection."""
        server, self._server = self._server, None
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
        if server is not None:
            await server.stop()
        await self.pool.close()

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # routes

    def _admit(
        self, method: bytes, path: str, headers: tuple[tuple[bytes, bytes], ...]
    ) -> Refusal | None:
        """The API key, checked on the head alone: a keyless body is never read."""
        authorization = next((v for k, v in headers if k == b"authorization"), None)
        config = self.config
        return admit_head(path, authorization, config.api_keys, config.explain_keys, self.tenants)

    def _may_explain(self, request: Request) -> bool:
        """Whether ``request`` asks for ``x-llmgw-route`` with a key that may see it."""
        if (request.header(_EXPLAIN_HEADER) or b"").strip() != b"1":
            return False
        config = self.config
        if config.explain_keys.required:
            return config.explain_keys.allows(request.header(b"authorization"))
        return not (config.api_keys.required or self.tenants.required)  # an open gateway

    async def _handle(self, request: Request, conn: HttpConnection) -> None:
        path = request.path
        if path in _PROXIED:
            if request.method != b"POST":
                self._refuse(conn, 405, f"{path} takes POST")
            else:
                await self._proxy(request, conn)
        elif path == _DEBUG_KV_PATH and request.method == b"GET" and self.config.debug_kv_index:
            conn.respond(200, self._kv_index_body())
        elif request.method != b"GET" or path not in ("/v1/models", "/metrics", "/healthz"):
            known = path in ("/v1/models", "/metrics", "/healthz")
            self._refuse(conn, 405 if known else 404, f"{'GET' if known else 'no route'} {path}")
        elif path == "/v1/models":
            conn.respond(200, self._models_body(request))
        elif path == "/metrics":
            conn.respond(200, self.metrics.render(self._in_flight()), CONTENT_TYPE)
        else:
            conn.respond(200, b"ok", _TEXT_TYPE)

    def _refuse(self, conn: HttpConnection, status: int, message: str) -> None:
        type_ = "NotFoundError" if status == 404 else "MethodNotAllowedError"
        conn.respond(status, error_body(message, type_, status))

    def _models_body(self, request: Request) -> bytes:
        """The READY models; for a tenant key, those of them it may use."""
        created = int(time.time())
        key = self.tenants.lookup(request.header(b"authorization"))
        data = [
            {"id": model, "object": "model", "created": created, "owned_by": "llmgw"}
            for model in self.table.models()
            if key is None or key.may_use(model)
        ]
        return dumps({"object": "list", "data": data})

    def _kv_index_body(self) -> bytes:
        index = self.kv_index
        replicas = {
            replica_id: {
                "block_size": index.block_size(replica_id),
                "keys": [f"{key:016x}" for key in index.keys_of(replica_id)],
            }
            for replica_id in index.replicas()
        }
        return dumps({"replicas": replicas})

    def _in_flight(self) -> dict[str, int]:
        counts = {target.replica_id: 0 for target in self.table.targets()}
        counts.update(self.load.snapshot())
        return counts

    # proxying

    async def _proxy(self, request: Request, conn: HttpConnection) -> None:
        status, model = CLIENT_GONE, UNKNOWN_LABEL
        ticket: Ticket | None = None
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                session = request.header(_SESSION_HEADER)
                headers = {SESSION_HEADER: session.decode("latin-1")} if session else {}
                parsed = parse_request(request.path, request.body, headers)
                model = self._model_label(parsed.model)
                if model != UNKNOWN_LABEL:
                    self.signals.arrived(model)
                key = self.tenants.lookup(request.header(b"authorization"))
                if key is not None:  # a tenant's: its models, its limits (tenants.py)
                    estimate = estimate_tokens(parsed.text, parsed.max_tokens)
                    ticket = self.tenants.admit(key, parsed.model, model, estimate)
                status = await self._route(request, conn, parsed, ticket)
        except RequestRefused as exc:
            status = self._answer_refusal(conn, exc)
        except TimeoutError:
            message = f"the request took longer than {self.config.request_timeout_s} s"
            status = self._answer_refusal(conn, GatewayTimeout(message))
        finally:
            if ticket is not None:
                ticket.close()
            self.metrics.request_done(status, model, request.path)

    def _model_label(self, model: str) -> str:
        """``model`` when a replica of the table serves it or it is scalable, else
        ``UNKNOWN_LABEL``: the label's values stay the models this gateway serves,
        whatever clients ask for."""
        table = self.table
        if table.candidates(model) or table.scalable(model):
            return model
        if any(t.serves(model) for t in table.targets()):
            return model
        return UNKNOWN_LABEL

    def _answer_refusal(self, conn: HttpConnection, exc: RequestRefused) -> int:
        if conn.started:  # too late for an error answer: cut the response short
            conn.abort()
            return exc.status
        code = exc.status if exc.code is None else exc.code
        body = error_body(exc.message, exc.error_type, code, param=exc.param)
        retry = b""
        if isinstance(exc, HoldRefused | RateLimited):
            retry = b"retry-after: %d\r\n" % exc.retry_after_s
        if isinstance(exc, RateLimited):
            retry += exc.headers
        conn.respond(exc.status, body, headers=retry)
        return exc.status

    async def _route(
        self, request: Request, conn: HttpConnection, parsed: ParsedRequest, ticket: Ticket | None
    ) -> int:
        """Answer ``request``; the status sent. Raises RequestRefused to answer an error.
        A request for a scalable model with no READY replica waits first (holding.py).
        A tenant's ``ticket`` meters the answer."""
        if self.holding.should_hold(parsed.model):
            await self.holding.hold(parsed.model)
        route = RouteRequest(parsed.model, parsed.text, parsed.session)
        precise, fallback = await self._precise_request(request, parsed)
        explaining = self._may_explain(request)
        exclude: frozenset[str] = frozenset()
        failures: list[str] = []
        for attempt in range(self.config.retries + 1):
            candidates = self.table.candidates(parsed.model)
            decision = self._decide(route, candidates, exclude, precise)
            if decision is None:
                break
            replica_id = decision.target.replica_id
            others = any(
                c.replica_id not in exclude and c.replica_id != replica_id for c in candidates
            )
            may_retry = attempt < self.config.retries and others
            record = self.route_log.add(parsed.model, decision, fallback)
            why = header_value(explain(decision, fallback)) if explaining else ""
            exchange = await self._attempt(
                decision.target, request, conn, parsed, may_retry, why, ticket
            )
            if exchange.outcome is Outcome.DONE:
                self._check_reuse(record, exchange, precise)
                if ticket is not None:
                    usage = Usage(
                        exchange.prompt_tokens, exchange.completion_tokens, exchange.cached_tokens
                    )
                    ticket.answered(usage, exchange.upstream_s)
                return exchange.status
            if exchange.outcome is Outcome.BROKEN:
                log.warning("%s failed mid-response: %s", replica_id, exchange.error)
                conn.abort()
                return BROKEN  # the client saw a status, then a response cut short
            kind, words = _failure_kind(exchange.error)
            failures.append(f"{replica_id}: {words}")
            self.metrics.upstream_failed(kind)
            log.warning("%s not usable for a request: %s", replica_id, exchange.error)
            exclude = exclude | {replica_id}
        raise self._no_replica(parsed.model, failures)

    async def _precise_request(
        self, request: Request, parsed: ParsedRequest
    ) -> tuple[PreciseRequest | None, str]:
        """The request's tokens for the precise tier, or None and why (the approximate tier
        decides; "" when the precise tier is off or nothing serves the model)."""
        candidates = self.table.candidates(parsed.model)
        if self.precise is None or not candidates:
            return None, ""
        prepared = await self.precise.prepare(
            request.path, request.body, parsed.model, len(parsed.text), candidates, self.load
        )
        if isinstance(prepared, Fallback):
            return None, prepared.reason
        return prepared, ""

    def _check_reuse(
        self, record: RouteRecord, exchange: Exchange, precise: PreciseRequest | None
    ) -> None:
        """The engine's reported cached tokens against the decision's prediction."""
        cached = exchange.cached_tokens
        if cached is None:
            return
        record.cached_tokens = cached
        decision = record.decision
        prompt_tokens = len(precise.tokens) if precise is not None else 0
        self.reuse.answered(decision.tier, cached, predicted_reuse(decision), prompt_tokens)

    def _decide(
        self,
        route: RouteRequest,
        candidates: tuple[Target, ...],
        exclude: frozenset[str],
        precise: PreciseRequest | None = None,
    ) -> Decision | None:
        if not candidates:
            return None
        started = time.perf_counter()
        if precise is not None and self.precise is not None:
            decision = self.precise.choose(precise, route, candidates, self.load, exclude=exclude)
        else:
            decision = self.policy.choose(route, candidates, self.load, exclude=exclude)
        took = time.perf_counter() - started
        if decision is not None:
            self.load.acquire(decision.target.replica_id)  # counted at decision time
            self.metrics.decided(decision.tier, decision.outcome, took, decision.target.replica_id)
        return decision

    def _no_replica(self, model: str, failures: list[str]) -> RequestRefused:
        if failures:
            tried = "; ".join(failures)
            return NoReplica(f"no replica of model `{model}` could take the request ({tried})")
        if self.table.scalable(model) or any(t.serves(model) for t in self.table.targets()):
            return NoReplica(f"no replica of model `{model}` is ready")
        return ModelNotFound(model)

    async def _attempt(
        self,
        target: Target,
        request: Request,
        conn: HttpConnection,
        parsed: ParsedRequest,
        may_retry: bool,
        route: str = "",
        ticket: Ticket | None = None,
    ) -> Exchange:
        """One attempt on ``target`` (already acquired on the load tracker, released here);
        ``route``: the ``x-llmgw-route`` value to answer with ("" none); a tenant's
        ``ticket``: its x-ratelimit-* headers on the answer, whose usage is read.

        A pooled connection that turns out closed before any answer (the replica dropped it
        while idle) is not the replica's fault: the request goes once more on a fresh one.
        """
        new_exchange = partial(
            Exchange,
            conn,
            may_retry=may_retry,
            metrics=self.metrics,
            model=parsed.model,
            stream=parsed.stream,
            replica=target.replica_id,
            route=route,
            signals=self.signals,
            extra=ticket.headers if ticket is not None else b"",
            meter=ticket is not None,
        )
        self.signals.upstream(parsed.model, +1)
        try:
            origin = self.pool.origin(target.url)
            payload = encode_request(request, origin.host_header, target.api_key)
            exchange = await self._exchange(new_exchange(), origin, payload, conn)
            if _stale_connection(exchange, conn):
                exchange = await self._exchange(new_exchange(), origin, payload, conn, fresh=True)
            return exchange
        finally:
            self.load.release(target.replica_id)
            self.signals.upstream(parsed.model, -1)

    async def _exchange(
        self,
        exchange: Exchange,
        origin: Origin,
        payload: bytes,
        conn: HttpConnection,
        fresh: bool = False,
    ) -> Exchange:
        upstream: UpstreamConnection | None = None
        try:
            upstream = await self.pool.connection(origin, fresh=fresh)
            exchange.reused = upstream.requests > 0
            upstream.send(payload, exchange)
            exchange.sent()
            conn.set_producer(upstream)
            await exchange.result
        except UpstreamError as exc:
            exchange.upstream_failed(exc)
        finally:
            conn.set_producer(None)
            if upstream is not None:
                if exchange.outcome is Outcome.DONE:
                    self.pool.release(upstream)
                else:
                    upstream.close()
        return exchange


def _failure_kind(error: UpstreamError | None) -> tuple[str, str]:
    """A failure's metric label and its words for the client (no replica addresses)."""
    if isinstance(error, UpstreamRefused):
        return "status", str(error)
    if isinstance(error, UpstreamConnectError):
        return "connect", "no connection"
    if isinstance(error, UpstreamProtocolError):
        return "protocol", "an answer that is not HTTP/1.1"
    return "closed", "the connection closed before an answer"


def _stale_connection(exchange: Exchange, conn: HttpConnection) -> bool:
    """A reused connection that closed before any answer: the keep-alive race."""
    return (
        exchange.outcome is Outcome.RETRY
        and exchange.reused
        and not exchange.head_seen
        and isinstance(exchange.error, UpstreamClosed)
        and not conn.started
    )


__all__ = [
    "BROKEN",
    "CLIENT_GONE",
    "EXPLAIN_HEADER",
    "TOKENIZE_TIMEOUT_S",
    "Gateway",
    "GatewayConfig",
]
