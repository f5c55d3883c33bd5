"""llama.cpp: ``llama-server -m MODEL.gguf --host 127.0.0.1 --port PORT …``.

The command line, in order::

    BIN -m MODEL.gguf --host 127.0.0.1 --port PORT --alias NAME
        [--threads N] --metrics  PROFILE ARGS

The API key goes in ``LLAMA_API_KEY``, never in argv: llama.cpp's ``--api-key`` option is
declared with ``set_env("LLAMA_API_KEY")`` (``common/arg.cpp``), so llama-server reads it
from there when the flag is absent. A profile may set neither.

``--threads`` comes from the profile's ``cpu_threads`` (left to llama.cpp when 0) and
``--metrics`` turns on ``/metrics``. llama-server binds its port at once and answers
``/health`` with 503 while it loads (spec/vllm-openai-server.md), so the supervisor's probe
(``/health``, then ``/v1/models``) tells LOADING from READY. One process, one GPU at most:
tp, pp and nodes above 1 are refused, and so are LoRA adapters (llama-server cannot name
them) and KV events. How many layers go to the GPU (``-ngl``) is the profile's args.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from llmgw.agent.engines.base import (
    AGENT_ENV,
    KEY_REASON,
    LOOPBACK,
    LaunchSpec,
    ShardSpec,
    api_key_env,
    check_engine,
    check_port,
    check_profile_args,
    device_env,
    merge_profile_env,
    model_path,
    refuse,
    served_model_name,
    shard_layout,
)

API_KEY_ENV = "LLAMA_API_KEY"
_OWNED_ENV: Mapping[str, str] = MappingProxyType({**AGENT_ENV, API_KEY_ENV: KEY_REASON})


class LlamaCppAdapter:
    """``llama-server`` for one shard."""

    name = "llamacpp"
    default_binary: tuple[str, ...] = ("llama-server",)

    def build(self, spec: ShardSpec, *, binary: Sequence[str], state_dir: Path) -> LaunchSpec:
        _refuse_unsupported(spec)
        shard_layout(spec)
        model = model_path(spec)
        threads = spec.profile.cpu_threads
        argv = (
            *binary,
            *("-m", model, "--host", LOOPBACK, "--port", str(check_port(spec))),
            *("--alias", served_model_name(spec)),
            *(("--threads", str(threads)) if threads else ()),
            "--metrics",
            *check_profile_args(spec),
        )
        env = merge_profile_env(spec, device_env(spec), _OWNED_ENV)
        return LaunchSpec(
            engine=self.name,
            argv=argv,
            env=MappingProxyType({**env, **api_key_env(spec, API_KEY_ENV)}),
            port=spec.port,
            api_key=spec.api_key,
            secret_env=frozenset({API_KEY_ENV}),
        )


def _refuse_unsupported(spec: ShardSpec) -> None:
    check_engine(spec)  # one process, of a GGUF file, no adapters, no KV events
    if spec.multinode is not None and spec.multinode.nnodes > 1:
        raise refuse(spec, "nodes", "llama-server runs on one node")
