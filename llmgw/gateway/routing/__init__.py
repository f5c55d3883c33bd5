"""The gateway's routing core: what a request may reach and which replica it goes to.

The routing table (``table``: READY replicas per model), the load on each (``load``), the
policies that choose (``policy``), the approximate prefix tree (``prefix_tree``) and the
precise tier's KV index (``kvindex``: which replica holds which block), and why a decision
went where it did (``explain``). Plain data and
decisions on one event loop: no I/O. These modules import the standard library,
``llmgw.kvcache`` and each other only, never the gateway's I/O edges (``llmgw.gateway``'s
other modules) nor sockets, asyncio, HTTP or gRPC; import-linter holds it (pyproject.toml).
"""

from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.gateway.routing.load import LoadTracker
from llmgw.gateway.routing.policy import (
    POLICIES,
    Decision,
    LeastLoadPolicy,
    Policy,
    PrefixConfig,
    PrefixPolicy,
    RoundRobinPolicy,
    RouteRequest,
    SessionPolicy,
    make_policy,
)
from llmgw.gateway.routing.prefix_tree import PrefixTree
from llmgw.gateway.routing.table import RoutingTable, Target

__all__ = [
    "POLICIES",
    "Decision",
    "KvIndex",
    "LeastLoadPolicy",
    "LoadTracker",
    "Policy",
    "PrefixConfig",
    "PrefixPolicy",
    "PrefixTree",
    "RoundRobinPolicy",
    "RouteRequest",
    "RoutingTable",
    "SessionPolicy",
    "Target",
    "make_policy",
]
