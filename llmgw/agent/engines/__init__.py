"""Engine adapters: a shard and an engine profile in, the command line to run out.

``build_launch`` picks the adapter named by the profile's ``engine`` and the executable
configured for it (``--engine-bin ENGINE=CMD``, else the adapter's default), and returns a
:class:`LaunchSpec`. Nothing here starts a process: the supervisor does.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType

from llmgw.agent.engines.base import (
    EngineAdapter,
    EngineBinaries,
    EngineError,
    KvEventEndpoints,
    LaunchSpec,
    ShardSpec,
    refuse,
)
from llmgw.agent.engines.llamacpp import LlamaCppAdapter
from llmgw.agent.engines.sglang import SglangAdapter
from llmgw.agent.engines.sim import SimAdapter
from llmgw.agent.engines.vllm import VllmAdapter

__all__ = [
    "ADAPTERS",
    "EngineAdapter",
    "EngineBinaries",
    "EngineError",
    "KvEventEndpoints",
    "LaunchSpec",
    "ShardSpec",
    "adapter_for",
    "build_launch",
    "engine_binaries",
    "parse_engine_bin",
]

ADAPTERS: Mapping[str, EngineAdapter] = MappingProxyType(
    {a.name: a for a in (VllmAdapter(), SglangAdapter(), LlamaCppAdapter(), SimAdapter())}
)


def adapter_for(engine: str) -> EngineAdapter:
    """The adapter named ``engine``; an unknown name is refused with the known ones."""
    try:
        return ADAPTERS[engine]
    except KeyError:
        known = ", ".join(sorted(ADAPTERS))
        raise EngineError(f"engine {engine!r} is not one of {known}", field="engine") from None


def build_launch(spec: ShardSpec, *, binaries: EngineBinaries, state_dir: Path) -> LaunchSpec:
    """The command line for ``spec``; raises EngineError naming the field at fault."""
    if spec.profile.engine not in ADAPTERS:
        known = ", ".join(sorted(ADAPTERS))
        raise refuse(spec, "engine", f"{spec.profile.engine!r} is not one of {known}")
    adapter = ADAPTERS[spec.profile.engine]
    return adapter.build(spec, binary=binaries.for_engine(adapter), state_dir=state_dir)


def parse_engine_bin(text: str) -> tuple[str, tuple[str, ...]]:
    """``ENGINE=CMD`` → (engine, words of CMD split as a shell would).

    ``vllm="python -m vllm.entrypoints.openai.api_server"`` and
    ``vllm=/opt/venv/bin/python -m llmgw sim-engine`` both work.
    """
    engine, sep, command = text.partition("=")
    engine = engine.strip()
    if not sep or not engine:
        raise EngineError(f"--engine-bin {text!r} is not ENGINE=CMD", field="engine")
    adapter_for(engine)
    try:
        words = tuple(shlex.split(command))
    except ValueError as exc:
        raise EngineError(f"--engine-bin {text!r}: {exc}", field="engine") from None
    if not words:
        raise EngineError(f"--engine-bin {text!r} names no command", field="engine")
    return engine, words


def engine_binaries(texts: Iterable[str]) -> EngineBinaries:
    """Every ``--engine-bin`` flag, one per engine."""
    overrides: dict[str, tuple[str, ...]] = {}
    for text in texts:
        engine, words = parse_engine_bin(text)
        if engine in overrides:
            raise EngineError(f"--engine-bin {engine} is given twice", field="engine")
        overrides[engine] = words
    return EngineBinaries(MappingProxyType(overrides))
