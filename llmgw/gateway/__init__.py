"""The OpenAI gateway: routes each request by ``model`` to a READY replica and proxies it.

It runs alone (``llmgw gateway``, following a control server's router feed) or inside the
control server (``llmgw server``, fed in process from the plane). Two parts:

- ``llmgw.gateway.routing``: the pure routing core (table, load, policies, prefix tree, KV
  index, and ``explain``: why a decision went where it did), no I/O;
- the I/O edges, in this package: the HTTP server (``httpserver``: listening;
  ``httpconnection``: each connection; ``httprequest``: what handlers get and give) and its
  limits (``httplimits``), the upstream client (``upstream``), the proxy (``proxy``), the
  tokenize client (``tokenize``), the precise tier that uses it (``precise``), the engine
  poller (``engines``), the router feed follower (``feed``), the reporter (``reporter``, with
  the figures it sends: ``stats``, and the signals per model for the autoscaler:
  ``modelsignals``), the queues that hold requests for a model scaled to zero
  (``holding``), the OpenAI request reading (``openai``), client API keys (``apikeys``),
  tenants' keys with their models and limits (``tenants``) and their metering
  (``tenantmeter``),
  ``/metrics`` (``metrics``), the last decisions (``routelog``) and the precise tier's
  check of them (``reusecheck``), errors (``errors``), and ``app``: the :class:`Gateway`
  that puts them together;
- ``standalone``: ``run_gateway``, the gateway as a process of its own (``llmgw gateway``):
  a `Gateway` following a server's feed and reporting to it.

It imports the standard library, its dependencies, ``llmgw.api``, ``llmgw.protocol``,
``llmgw.kvcache`` and the neutral top-level modules (``llmgw.httpguard``...), never
``llmgw.server``, ``llmgw.agent``, ``llmgw.sim``, ``llmgw.tui`` nor ``llmgw.cli``
(import-linter holds it). The control server embeds the gateway through the names below
and only those.
"""

from llmgw.gateway.apikeys import ApiKeys
from llmgw.gateway.app import TOKENIZE_TIMEOUT_S, Gateway, GatewayConfig
from llmgw.gateway.feed import apply_feed_event, targets_from_snapshot
from llmgw.gateway.holding import HoldConfig
from llmgw.gateway.httpconnection import HttpConnection
from llmgw.gateway.httplimits import ServerLimits
from llmgw.gateway.httprequest import Request, status_line
from llmgw.gateway.httpserver import HttpServer
from llmgw.gateway.modelsignals import LATENCY_BOUNDS_MS
from llmgw.gateway.routing import (
    POLICIES,
    Decision,
    KvIndex,
    LeastLoadPolicy,
    LoadTracker,
    Policy,
    PrefixConfig,
    PrefixPolicy,
    PrefixTree,
    RoundRobinPolicy,
    RouteRequest,
    RoutingTable,
    SessionPolicy,
    Target,
    make_policy,
)
from llmgw.gateway.standalone import run_gateway
from llmgw.gateway.stats import model_signals, router_stats

__all__ = [
    "LATENCY_BOUNDS_MS",
    "POLICIES",
    "TOKENIZE_TIMEOUT_S",
    "ApiKeys",
    "Decision",
    "Gateway",
    "GatewayConfig",
    "HoldConfig",
    "HttpConnection",
    "HttpServer",
    "KvIndex",
    "LeastLoadPolicy",
    "LoadTracker",
    "Policy",
    "PrefixConfig",
    "PrefixPolicy",
    "PrefixTree",
    "Request",
    "RoundRobinPolicy",
    "RouteRequest",
    "RoutingTable",
    "ServerLimits",
    "SessionPolicy",
    "Target",
    "apply_feed_event",
    "make_policy",
    "model_signals",
    "router_stats",
    "run_gateway",
    "status_line",
    "targets_from_snapshot",
]
