"""What bench.gateway measures: the proxies and their policies, the cells, the run's settings."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

ROUTERS_DIR: Final = Path(
    os.environ.get("LLMGW_BENCH_ROUTERS_DIR", Path.home() / ".cache/llmgw/bench-routers")
)
ROUTERS_PYTHON: Final = ROUTERS_DIR / "venv/bin/python"
PEER_MODULES: Final = {
    "vllm-router": ("vllm_router.launch_router", "warning"),
    "sglang-router": ("sglang_router.launch_router", "warn"),
}
PEERS: Final = ", ".join(PEER_MODULES)
RENDER: Final = ("tokens", "forbidden")
KINDS: Final = ("rps", "lat", "stream")  # --conns connections; 1 connection; 1, streamed


@dataclass(frozen=True, slots=True)
class Proxy:
    name: str  # "llmgw round_robin"
    kind: str  # "direct" | "llmgw" | "vllm-router" | "sglang-router"
    policy: str  # as that proxy names it; "" for direct
    family: str  # "round_robin" | "prefix": the policies compared with each other
    keyed: bool = False  # every request carries a tenant key with limits (issue #18)


PROXIES: Final = (
    Proxy("direct", "direct", "", ""),
    Proxy("llmgw round_robin", "llmgw", "round_robin", "round_robin"),
    Proxy("vllm-router round_robin", "vllm-router", "round_robin", "round_robin"),
    Proxy("sglang-router round_robin", "sglang-router", "round_robin", "round_robin"),
    Proxy("llmgw prefix", "llmgw", "prefix", "prefix"),
    Proxy("vllm-router cache_aware", "vllm-router", "cache_aware", "prefix"),
    Proxy("sglang-router cache_aware", "sglang-router", "cache_aware", "prefix"),
    # "llmgw prefix" again with a tenant key and its limits checked on every request
    Proxy("llmgw prefix keyed", "llmgw", "prefix", "keyed", keyed=True),
)
BENCH_KEY: Final = "llmgw-bench-tenant-key"
"""The tenant key every request carries (the keyed gateway checks it; the others ignore it)."""


@dataclass(frozen=True, slots=True)
class Timing:
    seconds: float
    warmup_s: float


@dataclass(frozen=True, slots=True)
class Settings:
    timing: Timing
    reps: int
    conns: int
    replicas: int
    chunks: int
    token_ms: float
    render: str  # one of RENDER
    groups: int
    users: int
    prefix_chars: int
    question_chars: int
    proxy_cpu: int
    client_cpu: int
    max_others: float  # a cell where other processes used more of the proxy's CPU is re-run
    attempts: int
    kinds: tuple[str, ...]  # the proxy kinds measured besides direct
    profile: Path | None = None  # where py-spy's output goes; None: no profile


def family_names(family: str) -> tuple[str, str, str]:
    """The (llmgw, vllm-router, sglang-router) proxies of one family of policies."""
    by_kind = {p.kind: p.name for p in PROXIES if p.family == family and not p.keyed}
    return by_kind["llmgw"], by_kind["vllm-router"], by_kind["sglang-router"]
