"""Tokens as the store keeps them: each one's role and hash, never the token itself.

The roles and what each may call are ``llmgw.server.wire.auth``'s; the rows are
``llmgw.server.state.store``'s (``tokens``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(enum.Enum):
    """What a token may do."""

    VIEWER = "viewer"  # read the cluster, watch it, list profiles, router stats
    OPERATOR = "operator"  # viewer + start, drain, reprofile replicas; cordon, drain nodes
    ADMIN = "admin"  # operator + apply and delete deployments; token management
    AGENT = "agent"  # join as a node (AgentService.Connect)
    GATEWAY = "gateway"  # follow the router feed, report its figures (RouterService)


@dataclass(frozen=True, slots=True)
class StoredToken:
    """A token as the store keeps it: never the token itself."""

    token_id: int
    role: Role
    hash: str
    created_ms: int
    note: str
    nodes: frozenset[str] = frozenset()  # an agent token bound to these node ids; empty: any
