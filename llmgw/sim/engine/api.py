"""The simulated vLLM OpenAI server: every route, as an ASGI app over one `EngineCore`.

``/health``, ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``,
``/detokenize``, ``/version``, ``/load``, ``/metrics``, ``/reset_prefix_cache`` and, from
vLLM 0.31, ``/kv_event_sources``; shapes as in spec/vllm-openai-server.md. With API keys
only ``/v1/*`` needs ``Authorization: Bearer KEY``, as in vLLM.

Not in vLLM: ``GET /debug/kv_cache``, read-only, what the prefix cache holds as llmgw block
keys (``{"kv_events": bool, "block_size": N, "cached_blocks": N, "keys": ["<16 hex>", …]}``,
ascending; no keys unless KV events are on), so a test can compare a gateway's KV index
with the engine's own cache (bench/chaos.py does).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from llmgw.promtext import CONTENT_TYPE
from llmgw.sim.engine.completions import CHAT, COMPLETION, Flavor, GenerationEndpoint
from llmgw.sim.engine.config import SimEngineConfig
from llmgw.sim.engine.core import EngineCore
from llmgw.sim.engine.errors import RequestError
from llmgw.sim.engine.http import Handler, HttpRequest, Response, Router, StreamResponse
from llmgw.sim.engine.metrics import render_metrics
from llmgw.sim.engine.requests import (
    chat_prompt,
    chat_text,
    completion_prompt,
    generation_request,
    resolve_model,
)

log = logging.getLogger(__name__)


class SimServer:
    """Handlers for one engine; `app` is the ASGI application."""

    def __init__(
        self,
        engine: EngineCore,
        *,
        kv_endpoints: Callable[[], Mapping[str, Any]] | None = None,
        hooks: Mapping[str, dict[str, Handler]] | None = None,
    ) -> None:
        self.config: SimEngineConfig = engine.config
        self.engine = engine
        self.requests_done = 0
        self.in_flight = 0
        self._on_crash: Callable[[], None] | None = None
        self.engine_dead = False
        self._kv_endpoints = kv_endpoints
        self._generation = GenerationEndpoint(
            engine,
            fingerprint=f"vllm-{self.config.vllm_version}-sim",
            prompt_details=self.config.http.enable_prompt_tokens_details,
            on_done=self._request_done,
        )
        self.app = Router({**self._routes(), **(hooks or {})}, self.config.http.api_keys)

    def set_on_crash(self, callback: Callable[[], None]) -> None:
        """What ends the process: ``--sim-crash-after``, or the engine task dying."""
        self._on_crash = callback

    def engine_died(self) -> None:
        """The step loop ended unexpectedly: ``/health`` answers 503 and the process ends."""
        self.engine_dead = True
        if self._on_crash is not None:
            self._on_crash()

    def _routes(self) -> dict[str, dict[str, Handler]]:
        routes: dict[str, dict[str, Handler]] = {
            "/health": {"GET": self.health},
            "/v1/models": {"GET": self.models},
            "/v1/completions": {"POST": self.completions},
            "/v1/chat/completions": {"POST": self.chat_completions},
            "/tokenize": {"POST": self.tokenize},
            "/detokenize": {"POST": self.detokenize},
            "/version": {"GET": self.version},
            "/load": {"GET": self.load},
            "/metrics": {"GET": self.metrics},
            "/reset_prefix_cache": {"POST": self.reset_prefix_cache},
            "/debug/kv_cache": {"GET": self.debug_kv_cache},
        }
        if self.config.version >= (0, 31, 0):
            routes["/kv_event_sources"] = {"GET": self.kv_event_sources}
        return routes

    async def health(self, request: HttpRequest) -> Response:
        return Response(503 if self.engine_dead else 200, b"", None)

    async def version(self, request: HttpRequest) -> Response:
        return Response.json({"version": self.config.vllm_version})

    async def load(self, request: HttpRequest) -> Response:
        tracked = self.config.http.enable_server_load_tracking
        return Response.json({"server_load": self.in_flight if tracked else 0})

    async def models(self, request: HttpRequest) -> Response:
        now = int(time.time())
        cards = [
            _model_card(name, self.config.model, None, self.config.max_model_len, now)
            for name in self.config.served_model_names
        ]
        cards += [
            _model_card(m.name, m.path, m.base_model_name or self.config.model_name, None, now)
            for m in self.config.lora_modules
        ]
        return Response.json({"object": "list", "data": cards})

    async def completions(self, request: HttpRequest) -> Response | StreamResponse:
        body = request.json()
        prompt = completion_prompt(body, self.engine.tokenizer)
        return await self._generate(request, body, prompt, COMPLETION)

    async def chat_completions(self, request: HttpRequest) -> Response | StreamResponse:
        body = request.json()
        prompt = chat_prompt(body, self.engine.tokenizer)
        return await self._generate(request, body, prompt, CHAT)

    async def _generate(
        self, request: HttpRequest, body: dict[str, Any], prompt: list[int], flavor: Flavor
    ) -> Response | StreamResponse:
        generation = generation_request(body, self.config, prompt, chat=flavor.chat)
        if self.config.http.enable_log_requests:
            log.info(
                "Received request: %d prompt tokens, max_tokens=%d, model=%s",
                len(prompt),
                generation.sampling.max_tokens,
                generation.model.name,
            )
        self.in_flight += 1
        return await self._generation.run(request, generation, flavor)

    def _request_done(self) -> None:
        self.in_flight -= 1
        self.requests_done += 1
        crash_after = self.config.sim.crash_after
        if crash_after is not None and self.requests_done == crash_after:
            log.error("simulated engine crash after %d requests (--sim-crash-after)", crash_after)
            if self._on_crash is not None:
                self._on_crash()

    async def tokenize(self, request: HttpRequest) -> Response:
        body = request.json()
        resolve_model(self.config, body.get("model"))
        tokenizer = self.engine.tokenizer
        if "messages" in body:
            text = chat_text(body)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise RequestError(400, "prompt must be a string", "prompt")
            text = prompt
        tokens = tokenizer.encode(text)
        skew = self.config.sim.tokenize_skew
        if skew:  # --sim-tokenize-skew: a /tokenize that disagrees with generation
            tokens = [max(0, t + skew) for t in tokens]
        strs = [tokenizer.piece(t) for t in tokens] if body.get("return_token_strs") else None
        return Response.json(
            {
                "count": len(tokens),
                "max_model_len": self.config.max_model_len,
                "tokens": tokens,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: HttpRequest) -> Response:
        body = request.json()
        resolve_model(self.config, body.get("model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise RequestError(400, "tokens must be a list of integers", "tokens")
        return Response.json({"prompt": self.engine.tokenizer.decode(tokens)})

    async def metrics(self, request: HttpRequest) -> Response:
        text = render_metrics(
            self.engine.stats,
            self.engine.gauges(),
            model_name=self.config.model_name,
            cache_info=self._cache_info(),
        )
        return Response(200, text.encode(), CONTENT_TYPE.encode())

    async def reset_prefix_cache(self, request: HttpRequest) -> Response:
        self.engine.reset_prefix_cache()
        return Response(200, b"", None)

    async def debug_kv_cache(self, request: HttpRequest) -> Response:
        pool = self.engine.pool
        return Response.json(
            {
                "kv_events": pool.records_events,
                "block_size": pool.block_size,
                "cached_blocks": pool.num_cached_blocks,
                "keys": [f"{key:016x}" for key in pool.cached_keys()],
            }
        )

    async def kv_event_sources(self, request: HttpRequest) -> Response:
        resolved = dict(self.config.kv_events.as_json())
        if self._kv_endpoints is not None:
            resolved.update(self._kv_endpoints())
        return Response.json({"0": resolved})

    def _cache_info(self) -> dict[str, str]:
        config = self.config
        return {
            "block_size": str(config.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "kv_cache_size_tokens": str(config.sim.num_kv_blocks * config.block_size),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(config.sim.num_kv_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_caching_hash_algo": config.prefix_caching_hash_algo,
            "sliding_window": "None",
        }


def _model_card(
    name: str, root: str, parent: str | None, max_model_len: int | None, created: int
) -> dict[str, Any]:
    permission = {
        "id": "modelperm-" + uuid.uuid4().hex,
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [permission],
    }
