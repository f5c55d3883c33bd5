"""``llmgw sim-engine``: a simulated vLLM for demos, tests and benchmarks.

It speaks vLLM's OpenAI API, metrics and KV events (spec/vllm-openai-server.md,
spec/vllm-kv-events.md) over a deterministic tokenizer, a block-level KV cache with prefix
reuse and LRU eviction, and a step loop whose simulated time grows with uncached prompt
tokens and output tokens. `serve` runs the process; `running_engine` gives tests the ASGI
app with the engine running.
"""

from llmgw.sim.engine.api import SimServer
from llmgw.sim.engine.config import (
    HttpConfig,
    KvEventsConfig,
    LoraModule,
    ParallelConfig,
    SimBehaviour,
    SimEngineConfig,
    parse_kv_events_config,
    parse_lora_modules,
)
from llmgw.sim.engine.core import EngineCore, RequestOptions
from llmgw.sim.engine.errors import RequestError, SimConfigError, SimEngineError, SimStartError
from llmgw.sim.engine.kvpublisher import KvEventPublisher
from llmgw.sim.engine.process import running_engine, serve
from llmgw.sim.engine.tokenizer import SimTokenizer, render_chat

__all__ = [
    "EngineCore",
    "HttpConfig",
    "KvEventPublisher",
    "KvEventsConfig",
    "LoraModule",
    "ParallelConfig",
    "RequestError",
    "RequestOptions",
    "SimBehaviour",
    "SimConfigError",
    "SimEngineConfig",
    "SimEngineError",
    "SimServer",
    "SimStartError",
    "SimTokenizer",
    "parse_kv_events_config",
    "parse_lora_modules",
    "render_chat",
    "running_engine",
    "serve",
]
