"""Simulated discovery: a node described by a topology fixture instead of NVML.

The shipped fixtures live in ``llmgw.sim.fixtures`` (``dgx-h100``, ``a100-mig``,
``gb200-nvl4``, ``l4-pcie``, ``cpu-only``); any ``.json`` file in the same format works
too (``--simulate ./my-node.json``). The format and how it expands are described in
``llmgw.agent.discovery.fixture``. ``SimulatedTelemetry`` makes the simulated GPUs look
busy in a reproducible way.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from llmgw.agent.discovery.errors import DiscoveryError, FixtureError
from llmgw.agent.discovery.fixture import expand_fixture
from llmgw.api.llmgw.v1 import Gpu, GpuHealth, GpuTelemetry, Health, NodeInfo

logger = logging.getLogger(__name__)

__all__ = ["SimulatedTelemetry", "available_fixtures", "load_fixture", "simulated_node"]

_PACKAGE = "llmgw.sim.fixtures"

# --- finding and loading fixtures --------------------------------------------------------


def available_fixtures() -> list[str]:
    """Names of the fixtures shipped in ``llmgw.sim.fixtures``, sorted."""
    root = resources.files(_PACKAGE)
    return sorted(p.name[: -len(".json")] for p in root.iterdir() if p.name.endswith(".json"))


def load_fixture(name_or_path: str) -> dict[str, Any]:
    """The validated contents of a fixture: a shipped name (``dgx-h100``) or a ``.json`` path.

    Raises ``DiscoveryError`` for an unknown name (naming those that exist) and
    ``FixtureError`` for a file that cannot be read or is malformed (naming the file and
    the key path).
    """
    name, source, data = _read(name_or_path)
    expand_fixture(name, source, data, node_id="validate", hostname="validate")
    return data


def simulated_node(
    name_or_path: str, *, node_id: str, hostname: str, labels: dict[str, str] | None = None
) -> NodeInfo:
    """A fully described node from a fixture, with GPU UUIDs unique to ``node_id``."""
    name, source, data = _read(name_or_path)
    node = expand_fixture(name, source, data, node_id=node_id, hostname=hostname)
    node.labels = dict(labels or {})
    logger.debug("simulated node %s from %s: %d GPU devices", node_id, source, len(node.gpus))
    return node


def _read(name_or_path: str) -> tuple[str, str, dict[str, Any]]:
    """(fixture name, source for messages, the parsed top-level object)."""
    if name_or_path.endswith(".json") or "/" in name_or_path:
        path = Path(name_or_path)
        return path.stem, str(path), _parse(str(path), lambda: path.read_text("utf-8"))
    resource = resources.files(_PACKAGE).joinpath(f"{name_or_path}.json")
    if not resource.is_file():
        known = ", ".join(available_fixtures())
        raise DiscoveryError(f"no simulated fixture named {name_or_path!r}; known: {known}")
    return name_or_path, str(resource), _parse(str(resource), lambda: resource.read_text("utf-8"))


def _parse(source: str, read: Callable[[], str]) -> dict[str, Any]:
    try:
        data = json.loads(read())
    except OSError as exc:
        raise FixtureError(f"{source}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise FixtureError(f"{source}: not UTF-8 text: {exc.reason}") from exc
    except json.JSONDecodeError as exc:
        raise FixtureError(f"{source}: line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
    if not isinstance(data, dict):
        raise FixtureError(f"{source}: (top level): expected an object")
    return data


# --- telemetry ---------------------------------------------------------------------------


# Board power at full load by GPU class, for the simulated power draw; others get 400 W.
_FULL_POWER_WATTS = {"H100": 700, "A100": 300, "GB200": 1200, "L4": 72}


@dataclass(slots=True)
class _Walk:
    """One device's simulated state between samples."""

    uuid: str
    total_bytes: int
    used_bytes: int
    util: int
    load: int  # the utilisation the walk is heading for
    temp: int
    idle_temp: int
    idle_watts: int
    full_watts: int
    health: Health
    problems: list[str]


class SimulatedTelemetry:
    """Plausible, slowly drifting telemetry for a simulated node, reproducible from a seed.

    Each device follows a seeded random walk: now and then its load changes (a burst of
    requests arrives, or the queue drains) and utilisation heads there at most three points
    a sample; otherwise it sits still or jitters by one. Memory changes in rare steps;
    temperature follows utilisation a degree per sample; power follows utilisation. MIG
    devices report their parent's temperature and no power (as NVML does). The walk mixes
    the node id into the seed, so nodes sharing a seed still differ.
    """

    def __init__(self, node: NodeInfo, seed: int) -> None:
        self._rng = random.Random(f"{seed}:{node.node_id}")
        self._walks = [_walk_for(gpu) for gpu in node.gpus]
        self._parent_of = {g.uuid: g.mig.parent_uuid for g in node.gpus if g.mig is not None}

    def sample(self) -> list[GpuTelemetry]:
        """Advance every device one step and return one reading per GPU and MIG device."""
        for walk in self._walks:
            _step(walk, self._rng)
        temps = {w.uuid: w.temp for w in self._walks}
        return [self._reading(w, temps) for w in self._walks]

    def _reading(self, w: _Walk, temps: Mapping[str, int]) -> GpuTelemetry:
        parent = self._parent_of.get(w.uuid)
        watts = 0 if parent else w.idle_watts + (w.full_watts - w.idle_watts) * w.util // 100
        return GpuTelemetry(
            uuid=w.uuid,
            memory_used_bytes=w.used_bytes,
            utilization_pct=w.util,
            temperature_c=temps.get(parent, w.temp) if parent else w.temp,
            health=w.health,
            problems=list(w.problems),
            power_watts=watts,
        )


def _walk_for(gpu: Gpu) -> _Walk:
    health = gpu.health or GpuHealth()
    idle_temp = health.temperature_c or 30
    idle_watts = gpu.power_watts or 30
    return _Walk(
        uuid=gpu.uuid,
        total_bytes=gpu.memory_total_bytes,
        used_bytes=gpu.memory_used_bytes,
        util=gpu.utilization_pct,
        load=gpu.utilization_pct,
        temp=idle_temp,
        idle_temp=idle_temp,
        idle_watts=idle_watts,
        full_watts=max(idle_watts, _FULL_POWER_WATTS.get(gpu.gpu_class, 400)),
        health=health.health,
        problems=list(health.problems),
    )


def _step(w: _Walk, rng: random.Random) -> None:
    if rng.random() < 0.02:  # a burst of requests arrives, or the queue drains
        w.load = rng.randint(0, 100)
    gap = w.load - w.util
    if gap:
        w.util += min(abs(gap), rng.randint(1, 3)) * (1 if gap > 0 else -1)
    elif rng.random() < 0.2:
        w.util = min(100, max(0, w.util + rng.choice((-1, 1))))
    if w.total_bytes and rng.random() < 0.05:
        step = rng.randint(-4, 4) * w.total_bytes // 100
        w.used_bytes = min(w.total_bytes, max(0, w.used_bytes + step))
    target = w.idle_temp + w.util * 45 // 100  # about 75 °C at full load from 30 idle
    w.temp += (target > w.temp) - (target < w.temp)
