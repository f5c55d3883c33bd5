"""``llmgw sim-engine [serve] MODEL``: a simulated vLLM that takes ``vllm serve``'s flags.

The flags the vLLM adapter emits are accepted with vLLM's names and meanings (those that
change nothing in a simulation are checked and logged); ``--sim-*`` flags set the timing,
the KV cache size and fault injection. An unknown flag is refused (exit 2) naming it. This
module imports only the standard library at import time; the engine is imported when the
command runs.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from llmgw.cli.errors import CliError

if TYPE_CHECKING:
    from asyncio import AbstractEventLoop

    from llmgw.sim.engine.config import HttpConfig, ParallelConfig, SimEngineConfig

CONFIG_ERROR_EXIT = 2
_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``sim-engine`` and its flags."""
    p = sub.add_parser(
        "sim-engine",
        help="run a simulated vLLM (OpenAI API, metrics, KV events)",
        description="A simulated vLLM for demos, tests and benchmarks: `llmgw sim-engine "
        "[serve] MODEL [vllm serve flags] [--sim-* flags]`.",
        allow_abbrev=False,
    )
    p.add_argument("words", nargs="*", metavar="[serve] MODEL", help="the model to serve")
    _add_server_flags(p)
    _add_model_flags(p)
    _add_parallel_flags(p)
    _add_cache_flags(p)
    _add_sim_flags(p)
    p.set_defaults(command=run_sim_engine_command)


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the model (instead of the positional)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names the API answers to (default: MODEL)",
    )
    p.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1 (or $VLLM_API_KEY)",
    )
    p.add_argument("--uvicorn-log-level", choices=_LOG_LEVELS, default="info")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted for compatibility (request logging is off by default)",
    )
    p.add_argument("--enable-log-requests", action="store_true")
    p.add_argument("--disable-log-stats", action="store_true", help="accepted; no effect")
    p.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="count in-flight requests for GET /load",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens",
    )


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-model-len",
        type=_token_count,
        default=4096,
        help="context length in tokens, like 4096 or 4k (default: 4096)",
    )
    p.add_argument("--dtype", choices=_DTYPES, default="auto", help="accepted; no effect")
    p.add_argument("--seed", type=int, default=0, help="seeds the simulated answers")
    p.add_argument(
        "-O",
        dest="optimization_level",
        default=None,
        metavar="LEVEL",
        help="compilation level (-O0 … -O3); accepted, no effect",
    )
    p.add_argument("--enforce-eager", action="store_true", help="accepted; no effect")
    p.add_argument("--trust-remote-code", action="store_true", help="accepted; no effect")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH|JSON")
    p.add_argument("--max-loras", type=int, default=1, help="LoRAs in one batch (default: 1)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="accepted; no effect")
    p.add_argument(
        "--max-num-seqs", type=int, default=256, help="most requests running at once (default: 256)"
    )


def _add_parallel_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--nnodes", "-n", type=int, default=1)
    p.add_argument("--node-rank", "-r", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29501)
    p.add_argument(
        "--headless", action="store_true", help="a worker node: no API server, wait for a signal"
    )
    p.add_argument(
        "--distributed-executor-backend",
        default=None,
        choices=("mp", "ray", "uni", "external_launcher"),
    )
    p.add_argument("--data-parallel-backend", "-dpb", default="mp", choices=("mp", "ray"))


def _add_cache_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--prefix-caching-hash-algo",
        default="sha256",
        choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
    )
    p.add_argument(
        "--kv-events-config", default=None, metavar="JSON", help="vLLM's KVEventsConfig as JSON"
    )


def _add_sim_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sim-kv-blocks",
        type=int,
        default=4096,
        help="KV cache capacity in blocks (default: 4096)",
    )
    p.add_argument(
        "--sim-prefill-ms-per-token",
        type=float,
        default=0.1,
        help="prefill time per uncached prompt token (default: 0.1 ms)",
    )
    p.add_argument(
        "--sim-decode-ms-per-token",
        type=float,
        default=10.0,
        help="time per engine step, i.e. per output token (default: 10 ms)",
    )
    p.add_argument(
        "--sim-load-seconds",
        type=float,
        default=0.0,
        help="the simulated model load: the HTTP port is bound only after it, so each "
        "start is a cold start this long, the shard STARTING meanwhile (default: 0)",
    )
    p.add_argument(
        "--sim-crash-after",
        type=int,
        default=None,
        metavar="N",
        help="exit 1 after answering N generation requests",
    )
    p.add_argument(
        "--sim-fail-start",
        action="store_true",
        help="exit 1 at the end of the load, as a failed engine start",
    )
    p.add_argument(
        "--sim-test-hooks",
        action="store_true",
        help="serve the test hooks under /sim/ (drop KV event batches on demand); "
        "never on an engine others can reach",
    )
    _add_sim_fault_flags(p)


def _add_sim_fault_flags(p: argparse.ArgumentParser) -> None:
    """The ``--sim-*`` flags of what the engine tells llmgw: /tokenize and KV event formats."""
    p.add_argument(
        "--sim-tokenize-skew",
        type=int,
        default=0,
        metavar="N",
        help="answer /tokenize with every token id + N, as a tokenizer or chat template "
        "that disagrees with generation would (a router's reuse check sees it; default: 0)",
    )
    p.add_argument(
        "--sim-kv-event-encoding",
        choices=("map", "array"),
        default=None,
        help="event encoding (default: what --sim-vllm-version used)",
    )
    p.add_argument(
        "--sim-vllm-version",
        default="0.32.0",
        help="the vLLM release to behave as (default: 0.32.0)",
    )


def _token_count(text: str) -> int:
    """vLLM's human-readable lengths: ``4096``, ``4k``, ``25.6k``, ``1m``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count like 4096 or 4k")
    scale = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3}[match.group(2).lower()]
    if match.group(2).isupper():
        scale = {"K": 1024, "M": 1024**2, "G": 1024**3}[match.group(2)]
    return int(float(match.group(1)) * scale)


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> SimEngineConfig:
    """The engine config for parsed flags and the environment; SimConfigError names a flag."""
    from llmgw.sim.engine import config as c

    model = _model_of(args.words, args.model)
    version = args.sim_vllm_version
    c.parse_version(version)
    kv_events = c.parse_kv_events_config(args.kv_events_config or "{}")
    encoding = args.sim_kv_event_encoding or (
        "map" if c.parse_version(version) >= c.FIRST_MAP_ENCODING else "array"
    )
    return c.SimEngineConfig(
        model=model,
        served_model_names=tuple(args.served_model_name or [model]),
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        enable_lora=args.enable_lora,
        lora_modules=c.parse_lora_modules(args.lora_modules),
        max_loras=args.max_loras,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype,
        seed=args.seed,
        kv_events=kv_events,
        kv_event_encoding=encoding,
        vllm_version=version,
        hash_seed=environ.get("PYTHONHASHSEED"),
        int_block_hashes=_int_hashes(environ),
        http=_http_config(args, environ),
        parallel=_parallel_config(args),
        sim=c.SimBehaviour(
            num_kv_blocks=args.sim_kv_blocks,
            prefill_s_per_token=args.sim_prefill_ms_per_token / 1000,
            decode_s_per_token=args.sim_decode_ms_per_token / 1000,
            load_s=args.sim_load_seconds,
            crash_after=args.sim_crash_after,
            fail_start=args.sim_fail_start,
            test_hooks=args.sim_test_hooks,
            tokenize_skew=args.sim_tokenize_skew,
        ),
    ).validate()


def _model_of(words: list[str], flag: str | None) -> str:
    from llmgw.sim.engine.errors import SimConfigError

    if words and words[0] == "serve":
        words = words[1:]
    if len(words) > 1:
        raise SimConfigError(f"unexpected arguments: {' '.join(words[1:])}")
    if words and flag and words[0] != flag:
        raise SimConfigError(f"two models given: {words[0]!r} and --model {flag!r}")
    model = words[0] if words else flag
    if not model:
        raise SimConfigError("no model given: llmgw sim-engine [serve] MODEL")
    return model


def _int_hashes(environ: Mapping[str, str]) -> bool:
    from llmgw.sim.engine.errors import SimConfigError

    raw = environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    try:
        return bool(int(raw))
    except ValueError as exc:
        raise SimConfigError(f"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES={raw!r} is not 0 or 1") from exc


def _http_config(args: argparse.Namespace, environ: Mapping[str, str]) -> HttpConfig:
    from llmgw.sim.engine.config import HttpConfig

    keys = args.api_key or ([environ["VLLM_API_KEY"]] if environ.get("VLLM_API_KEY") else [])
    return HttpConfig(
        host=args.host,
        port=args.port,
        api_keys=tuple(keys),
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        enable_log_requests=args.enable_log_requests,
        enable_server_load_tracking=args.enable_server_load_tracking,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
    )


def _parallel_config(args: argparse.Namespace) -> ParallelConfig:
    from llmgw.sim.engine.config import ParallelConfig

    return ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        headless=args.headless,
        distributed_executor_backend=args.distributed_executor_backend,
        data_parallel_backend=args.data_parallel_backend,
    )


def run_sim_engine_command(args: argparse.Namespace) -> int:
    """Run the simulated engine in the foreground; its exit code."""
    import asyncio

    from llmgw.sim.engine import SimConfigError, SimStartError, serve

    try:
        config = config_from_args(args, os.environ)
    except SimConfigError as exc:
        raise CliError(f"sim-engine: {exc}", CONFIG_ERROR_EXIT) from exc
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(serve(config))
    except SimStartError as exc:
        raise CliError(f"sim-engine: {exc}", 1) from exc


def _loop_factory() -> Callable[[], AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # uvicorn[standard] brings it; plain asyncio works too
        return None
    return uvloop.new_event_loop
