"""Helpers for tests/sim: configs from real command lines, an in-memory client, parsers."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from functools import cache
from pathlib import Path
from typing import Any

import httpx

from llmgw.cli.main import build_parser
from llmgw.cli.simengine import config_from_args
from llmgw.sim.engine import SimEngineConfig, SimServer, running_engine

FAST = ("--sim-prefill-ms-per-token", "0", "--sim-decode-ms-per-token", "0")
GOLDEN = Path(__file__).parent.parent / "data" / "vllm_kv_golden.json"


def sim_config(
    *flags: str, env: Mapping[str, str] | None = None, model: str = "m", fast: bool = True
) -> SimEngineConfig:
    """The config ``llmgw sim-engine serve MODEL FLAGS`` runs with."""
    args = build_parser().parse_args(
        ["sim-engine", "serve", model, *(FAST if fast else ()), *flags]
    )
    return config_from_args(args, env or {})


@asynccontextmanager
async def sim_client(config: SimEngineConfig) -> AsyncIterator[tuple[SimServer, httpx.AsyncClient]]:
    """The engine running in this loop and an httpx client talking to its ASGI app."""
    async with running_engine(config) as server:
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            yield server, client


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text → {(name, labels): value}; fails on any malformed line."""
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            assert line == "" or re.match(r"^# (HELP|TYPE) [\w:]+ ", line), line
            continue
        match = _SAMPLE.match(line)
        assert match is not None, f"malformed sample line: {line!r}"
        labels = frozenset(_LABEL.findall(match.group(3) or ""))
        samples[(match.group(1), labels)] = float(match.group(4))
    return samples


def metric(
    samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    """One sample by name and the labels besides ``engine`` and ``model_name``."""
    wanted = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and wanted <= ls]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


@cache
def golden() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(GOLDEN.read_text())
    return data
