"""The gateway's routing core: table, load, policies, approximate prefix tree (no I/O)."""

from llmgw.server.router.load import LoadTracker
from llmgw.server.router.policy import (
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
from llmgw.server.router.prefix_tree import PrefixTree
from llmgw.server.router.table import RoutingTable, Target

__all__ = [
    "POLICIES",
    "Decision",
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
