"""SGLang: ``python3 -m sglang.launch_server --model-path MODEL …`` from an engine profile.

The command line, in order::

    BIN -m sglang.launch_server --model-path MODEL --host 127.0.0.1 --port PORT
        --tp-size TP [--pp-size PP]  --served-model-name NAME
        [--lora-paths NAME=PATH …]
        [--nnodes N --node-rank R --dist-init-addr ADDR:PORT]
        [--device cpu]
        PROFILE ARGS

**The API key.** SGLang takes it only as ``--api-key`` (``ServerArgs.api_key``; no
environment variable), and a command-line argument is readable by every user in
``/proc/PID/cmdline``. So a shard with a key runs ``BIN -c LAUNCHER`` in place of
``BIN -m sglang.launch_server``, with the same arguments and the key in
``LLMGW_ENGINE_API_KEY``: the launcher (:data:`LAUNCHER`, a few lines of standard-library
Python run by the SGLang interpreter) removes the variable from its environment (so SGLang's
own child processes do not inherit it), appends ``--api-key KEY`` to ``sys.argv`` inside the
process (which ``/proc/PID/cmdline`` never shows) and runs ``sglang.launch_server`` as
``__main__``. SGLang logs its whole ``ServerArgs`` at start, key included, so the launcher
also replaces the key with ``***`` in everything the server process writes through
``sys.stdout`` and ``sys.stderr``; what its child processes write straight to the inherited
file descriptors is not filtered (none of them prints the arguments). A rank that serves no
HTTP gets no key.

Every rank of a multi-node replica runs the same command with its own ``--node-rank``;
only rank 0 serves HTTP (``listens_http=False`` on the others). KV events are refused:
SGLang's block hashes are not vLLM's, so the gateway could not match them against its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from llmgw.agent.engines.base import (
    AGENT_ENV,
    CPU_CLASS,
    KEY_REASON,
    LOOPBACK,
    LaunchSpec,
    Layout,
    ShardSpec,
    api_key_env,
    check_engine,
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

MODULE = "sglang.launch_server"
API_KEY_ENV = "LLMGW_ENGINE_API_KEY"
_OWNED_ENV: Mapping[str, str] = MappingProxyType({**AGENT_ENV, API_KEY_ENV: KEY_REASON})

LAUNCHER = f"""\
import os, runpy, sys
key = os.environ.pop({API_KEY_ENV!r}, "")
class Redacting:
    def __init__(self, stream):
        self.stream = stream
    def write(self, text):
        self.stream.write(text.replace(key, "***"))
        return len(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)
if key:
    sys.stdout, sys.stderr = Redacting(sys.stdout), Redacting(sys.stderr)
sys.argv = [{MODULE!r}, *sys.argv[1:], *(["--api-key", key] if key else [])]
runpy.run_module({MODULE!r}, run_name="__main__", alter_sys=True)
"""
"""Run by the SGLang interpreter as ``-c``: the key from the environment into ``sys.argv``."""


class SglangAdapter:
    """``sglang.launch_server`` for one shard."""

    name = "sglang"
    default_binary: tuple[str, ...] = ("python3",)

    def build(self, spec: ShardSpec, *, binary: Sequence[str], state_dir: Path) -> LaunchSpec:
        layout = shard_layout(spec)
        check_engine(spec)  # no KV events
        key = api_key_env(spec, API_KEY_ENV, serves_http=not layout.headless)
        argv = (
            *binary,
            *(("-c", LAUNCHER) if key else ("-m", MODULE)),
            *("--model-path", model_path(spec)),
            *("--host", LOOPBACK, "--port", str(check_port(spec))),
            *("--tp-size", str(layout.tp)),
            *(("--pp-size", str(layout.pp)) if layout.pp > 1 else ()),
            *("--served-model-name", served_model_name(spec)),
            *_lora_args(spec),
            *_multinode_args(layout),
            *(("--device", "cpu") if spec.profile.gpu_class == CPU_CLASS else ()),
            *check_profile_args(spec),
        )
        env = merge_profile_env(spec, {**device_env(spec), **fabric_env(spec)}, _OWNED_ENV)
        return LaunchSpec(
            engine=self.name,
            argv=argv,
            env=MappingProxyType({**env, **key}),
            port=spec.port,
            api_key=spec.api_key,
            listens_http=not layout.headless,
            secret_env=frozenset({API_KEY_ENV}),
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
