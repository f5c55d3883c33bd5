"""What ``llmgw sim-engine`` is told: frozen configs and the parsers of the structured flags.

The command line itself (the ``vllm serve`` flags and the ``--sim-*`` ones) is declared in
``llmgw.cli.simengine``; this module holds what it turns into, and the parsers of values
that have a grammar of their own (``--kv-events-config`` JSON, ``--lora-modules``, versions),
so they can be tested with plain strings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from llmgw.kvcache import HASH_ALGOS, UnsupportedVllmVersionError, parse_vllm_version
from llmgw.sim.engine.errors import SimConfigError

DEFAULT_VLLM_VERSION = "0.32.0"
EVENT_ENCODINGS = ("map", "array")
FIRST_MAP_ENCODING = (0, 24, 0)  # vLLM 0.24.0 moved events from arrays to maps
OLDEST_VERSION = (0, 10, 2)


def parse_version(text: str, flag: str = "--sim-vllm-version") -> tuple[int, ...]:
    """``"0.32.0"`` → ``(0, 32, 0)``; refuses what is not a version or predates 0.10.2."""
    try:
        version = parse_vllm_version(text)
    except UnsupportedVllmVersionError as exc:
        raise SimConfigError(f"{flag} {text!r} is not a version like 0.32.0") from exc
    if version < OLDEST_VERSION:
        raise SimConfigError(
            f"{flag} {text}: the simulator reproduces vLLM 0.10.2 and later "
            "(older releases hashed blocks to Python ints)"
        )
    return version


@dataclass(frozen=True, slots=True)
class LoraModule:
    """A static LoRA adapter from ``--lora-modules``; ``lora_int_id`` counts from 1."""

    name: str
    path: str
    lora_int_id: int
    base_model_name: str | None = None


def parse_lora_modules(values: list[str]) -> tuple[LoraModule, ...]:
    """Parse ``name=path`` or vLLM's JSON form ``{"name":…,"path":…,"base_model_name":…}``."""
    modules: list[LoraModule] = []
    for value in values:
        name, path, base = _one_lora_module(value)
        if any(m.name == name for m in modules):
            raise SimConfigError(f"--lora-modules names {name!r} twice")
        modules.append(LoraModule(name, path, len(modules) + 1, base))
    return tuple(modules)


def _one_lora_module(value: str) -> tuple[str, str, str | None]:
    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
        except json.JSONDecodeError as exc:
            raise SimConfigError(f"--lora-modules {value!r} is not valid JSON: {exc}") from exc
        name, path = spec.get("name"), spec.get("path")
        base = spec.get("base_model_name")
        if not (isinstance(name, str) and isinstance(path, str) and name and path):
            raise SimConfigError(f"--lora-modules {value!r} needs string 'name' and 'path'")
        if base is not None and not isinstance(base, str):
            raise SimConfigError(f"--lora-modules {value!r}: 'base_model_name' is not a string")
        return name, path, base
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise SimConfigError(f"--lora-modules {value!r} is not name=path or a JSON object")
    return name, path, None


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """vLLM's ``KVEventsConfig`` (``--kv-events-config`` JSON), with vLLM's defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None resolves to "zmq" when enabled (vLLM >= 0.11.1)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        """True when events are collected and sent over ZMQ."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    def as_json(self) -> dict[str, Any]:
        """The resolved config as vLLM reports it (``GET /kv_event_sources``)."""
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return {
            "enable_kv_cache_events": self.enable_kv_cache_events,
            "publisher": publisher,
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "buffer_steps": self.buffer_steps,
            "hwm": self.hwm,
            "max_queue_size": self.max_queue_size,
            "topic": self.topic,
        }


_KV_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str, type(None)),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
}


def parse_kv_events_config(text: str) -> KvEventsConfig:
    """Parse ``--kv-events-config``; unknown keys and wrong types are refused, as vLLM does."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SimConfigError(f"--kv-events-config is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise SimConfigError("--kv-events-config must be a JSON object")
    for key, value in raw.items():
        types = _KV_FIELD_TYPES.get(key)
        if types is None:
            raise SimConfigError(f"--kv-events-config has an unknown key {key!r}")
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise SimConfigError(f"--kv-events-config {key!r} has the wrong type: {value!r}")
    config = KvEventsConfig(**raw)
    if config.publisher not in (None, "zmq", "null"):
        raise SimConfigError(f"--kv-events-config publisher {config.publisher!r} is not zmq")
    if config.buffer_steps < 1 or config.hwm < 0:
        raise SimConfigError("--kv-events-config buffer_steps must be >= 1 and hwm >= 0")
    return config


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor, pipeline and multi-node layout: logged and checked, not simulated."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    headless: bool = False
    distributed_executor_backend: str | None = None
    data_parallel_backend: str = "mp"


@dataclass(frozen=True, slots=True)
class SimBehaviour:
    """The ``--sim-*`` knobs: timing and fault injection."""

    num_kv_blocks: int = 4096
    prefill_s_per_token: float = 0.0001
    decode_s_per_token: float = 0.01
    load_s: float = 0.0
    crash_after: int | None = None
    fail_start: bool = False
    test_hooks: bool = False  # the /sim/* fault routes (llmgw.sim.engine.testhooks)
    # /tokenize answers each token id + this: a /tokenize that disagrees with what
    # generation caches (as a chat template or tokenizer mismatch would); 0: they agree
    tokenize_skew: int = 0


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """The OpenAI server's listen address, keys and logging."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    uvicorn_log_level: str = "info"
    access_log: bool = True
    enable_log_requests: bool = False
    enable_server_load_tracking: bool = False
    enable_prompt_tokens_details: bool = False


@dataclass(frozen=True, slots=True)
class SimEngineConfig:
    """Everything the simulated engine runs with."""

    model: str
    served_model_names: tuple[str, ...]
    max_model_len: int = 4096
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    enable_lora: bool = False
    lora_modules: tuple[LoraModule, ...] = ()
    max_loras: int = 1
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    seed: int = 0
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    kv_event_encoding: str = "map"
    vllm_version: str = DEFAULT_VLLM_VERSION
    hash_seed: str | None = None  # PYTHONHASHSEED as the engine saw it
    int_block_hashes: bool = True  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    http: HttpConfig = field(default_factory=HttpConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sim: SimBehaviour = field(default_factory=SimBehaviour)

    @property
    def model_name(self) -> str:
        """The first served name: the ``model_name`` label of every metric."""
        return self.served_model_names[0]

    @property
    def version(self) -> tuple[int, ...]:
        return parse_version(self.vllm_version)

    def lora(self, name: str) -> LoraModule | None:
        return next((m for m in self.lora_modules if m.name == name), None)

    def validate(self) -> SimEngineConfig:
        """Refuse combinations vLLM refuses; returns self so it chains."""
        _check_positive(
            ("--max-model-len", self.max_model_len),
            ("--block-size", self.block_size),
            ("--sim-kv-blocks", self.sim.num_kv_blocks),
            ("--max-loras", self.max_loras),
            ("--max-num-seqs", self.max_num_seqs),
            ("--tensor-parallel-size", self.parallel.tensor_parallel_size),
            ("--pipeline-parallel-size", self.parallel.pipeline_parallel_size),
            ("--nnodes", self.parallel.nnodes),
        )
        self._check_ranges()
        if self.lora_modules and not self.enable_lora:
            raise SimConfigError("--lora-modules needs --enable-lora (LoRA is not enabled)")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise SimConfigError(f"--prefix-caching-hash-algo must be one of {HASH_ALGOS}")
        if self.kv_event_encoding not in EVENT_ENCODINGS:
            raise SimConfigError(f"--sim-kv-event-encoding must be one of {EVENT_ENCODINGS}")
        parse_version(self.vllm_version)
        return self

    def _check_ranges(self) -> None:
        par, sim = self.parallel, self.sim
        if not 0 <= par.node_rank < par.nnodes:
            raise SimConfigError(f"--node-rank {par.node_rank} is not in [0, {par.nnodes})")
        if sim.prefill_s_per_token < 0 or sim.decode_s_per_token < 0 or sim.load_s < 0:
            raise SimConfigError(
                "--sim-prefill-ms-per-token, --sim-decode-ms-per-token and "
                "--sim-load-seconds must not be negative"
            )
        if sim.crash_after is not None and sim.crash_after < 1:
            raise SimConfigError(f"--sim-crash-after must be >= 1, not {sim.crash_after}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise SimConfigError("--gpu-memory-utilization must be in (0, 1]")
        if not 0 <= self.http.port <= 65535:
            raise SimConfigError(f"--port {self.http.port} is not a TCP port")


def _check_positive(*checks: tuple[str, int]) -> None:
    for flag, value in checks:
        if value < 1:
            raise SimConfigError(f"{flag} must be >= 1, not {value}")
