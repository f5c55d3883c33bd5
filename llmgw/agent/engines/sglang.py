"""SGLang: ``python3 -m sglang.launch_server --model-path MODEL …`` from an engine profile.

The command line, in order::

    BIN -m sglang.launch_server --model-path MODEL --host 127.0.0.1 --port PORT
        --tp-size TP [--pp-size PP]  --served-model-name NAME [--api-key KEY]
        [--lora-paths NAME=PATH …]
        [--nnodes N --node-rank R --dist-init-addr ADDR:PORT]
        [--device cpu]
        PROFILE ARGS

Every rank of a multi-node replica runs the same command with its own ``--node-rank``;
only rank 0 serves HTTP (``listens_http=False`` on the others). KV events are refused:
SGLang's block hashes are not vLLM's, so the gateway could not match them against its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType

from llmgw.agent.engines.base import (
    CPU_CLASS,
    LOOPBACK,
    LaunchSpec,
    Layout,
    ShardSpec,
    check_port,
    check_profile_args,
    device_env,
    fabric_env,
    merge_profile_env,
    model_path,
    refuse,
    served_model_name,
    shard_layout,
)

_MANAGED = (
    *("--model-path", "--model", "--host", "--port", "--served-model-name", "--api-key"),
    *("--tp-size", "--tp", "--pp-size", "--nnodes", "--node-rank", "--dist-init-addr"),
    *("--lora-paths", "--device"),
)


class SglangAdapter:
    """``sglang.launch_server`` for one shard."""

    name = "sglang"
    default_binary: tuple[str, ...] = ("python3",)

    def build(self, spec: ShardSpec, *, binary: Sequence[str], state_dir: Path) -> LaunchSpec:
        layout = shard_layout(spec)
        if spec.profile.kv_events:
            raise refuse(spec, "kv_events", "only the vllm and sim engines publish KV events")
        argv = (
            *binary,
            *("-m", "sglang.launch_server", "--model-path", model_path(spec)),
            *("--host", LOOPBACK, "--port", str(check_port(spec))),
            *("--tp-size", str(layout.tp)),
            *(("--pp-size", str(layout.pp)) if layout.pp > 1 else ()),
            *("--served-model-name", served_model_name(spec)),
            *(("--api-key", spec.api_key) if spec.api_key else ()),
            *_lora_args(spec),
            *_multinode_args(layout),
            *(("--device", "cpu") if spec.profile.gpu_class == CPU_CLASS else ()),
            *check_profile_args(spec, _MANAGED),
        )
        env = merge_profile_env(spec, {**device_env(spec), **fabric_env(spec)})
        return LaunchSpec(
            engine=self.name,
            argv=argv,
            env=MappingProxyType(env),
            port=spec.port,
            api_key=spec.api_key,
            listens_http=not layout.headless,
        )


def _lora_args(spec: ShardSpec) -> tuple[str, ...]:
    paths: list[str] = []
    for i, adapter in enumerate(spec.profile.adapters):
        if not adapter.name or "=" in adapter.name or not adapter.path:
            raise refuse(spec, f"adapters[{i}]", f"{adapter.name!r}={adapter.path!r}")
        paths.append(f"{adapter.name}={adapter.path}")
    return ("--lora-paths", *paths) if paths else ()


def _multinode_args(layout: Layout) -> tuple[str, ...]:
    if not layout.multinode:
        return ()
    host = f"[{layout.master_addr}]" if ":" in layout.master_addr else layout.master_addr
    return (
        *("--nnodes", str(layout.nnodes), "--node-rank", str(layout.node_rank)),
        *("--dist-init-addr", f"{host}:{layout.master_port}"),
    )
