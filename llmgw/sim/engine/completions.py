"""``/v1/completions`` and ``/v1/chat/completions``: vLLM's response and SSE chunk shapes.

Non-streaming answers carry vLLM 0.32's fields (``stop_reason``, ``prompt_logprobs``,
``kv_transfer_params`` …); streams send one chunk per token, the finish reason on the last
token's chunk, a usage chunk with ``"choices":[]`` when ``stream_options.include_usage`` is
set, and ``data: [DONE]``. A client that goes away aborts its request in the engine.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from llmgw.sim.engine.core import EngineCore, RequestStream
from llmgw.sim.engine.http import HttpRequest, Response, StreamResponse, dumps
from llmgw.sim.engine.requests import GenerationRequest
from llmgw.sim.engine.scheduler import TokenOutput

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Flavor:
    """What differs between the two endpoints."""

    chat: bool
    id_prefix: str
    object_name: str
    chunk_object_name: str


COMPLETION = Flavor(False, "cmpl-", "text_completion", "text_completion")
CHAT = Flavor(True, "chatcmpl-", "chat.completion", "chat.completion.chunk")


@dataclass(frozen=True, slots=True)
class ResponseContext:
    """Fixed parts of every chunk of one response."""

    flavor: Flavor
    response_id: str
    created: int
    model: str
    fingerprint: str
    prompt_details: bool


def _sse(value: Any) -> bytes:
    return b"data: " + dumps(value) + b"\n\n"


def _usage(last: TokenOutput, ctx: ResponseContext, *, whole: bool) -> dict[str, Any]:
    """vLLM's ``UsageInfo``; a stream's usage chunk leaves unset details out."""
    usage: dict[str, Any] = {
        "prompt_tokens": last.prompt_tokens,
        "total_tokens": last.prompt_tokens + last.output_tokens,
        "completion_tokens": last.output_tokens,
    }
    if ctx.prompt_details:
        usage["prompt_tokens_details"] = {"cached_tokens": last.cached_tokens}
    elif whole:
        usage["prompt_tokens_details"] = None
    return usage


class GenerationEndpoint:
    """Runs one generation request against the engine and shapes its answer."""

    def __init__(
        self,
        engine: EngineCore,
        *,
        fingerprint: str,
        prompt_details: bool,
        on_done: Callable[[], None],
    ) -> None:
        self._engine = engine
        self._fingerprint = fingerprint
        self._prompt_details = prompt_details
        self._on_done = on_done

    async def run(
        self, http: HttpRequest, request: GenerationRequest, flavor: Flavor
    ) -> Response | StreamResponse:
        ctx = ResponseContext(
            flavor=flavor,
            response_id=flavor.id_prefix + uuid.uuid4().hex,
            created=int(time.time()),
            model=request.model.name,
            fingerprint=self._fingerprint,
            prompt_details=self._prompt_details,
        )
        stream = self._engine.submit(request.prompt_token_ids, request.sampling, request.options)
        http.on_disconnect(lambda: self._engine.abort(stream.request_id))
        http.after_response(self._on_done)
        if request.stream:
            return StreamResponse(self._chunks(stream, ctx, request.include_usage))
        try:
            return await self._whole(stream, ctx)
        finally:
            self._end(stream)

    def _end(self, stream: RequestStream) -> None:
        if not stream.finished:
            self._engine.abort(stream.request_id)

    async def _whole(self, stream: RequestStream, ctx: ResponseContext) -> Response:
        tokens: list[int] = []
        last: TokenOutput | None = None
        async for output in stream:
            if output.token_id is not None:
                tokens.append(output.token_id)
            last = output
        assert last is not None  # a stream always ends with a finish reason
        if last.finish_reason == "abort":
            return Response(499)  # the client is gone; nobody reads this
        text = self._engine.tokenizer.decode(tokens, skip_special_tokens=True)
        choice = _final_choice(ctx, text, last.finish_reason)
        body = {
            "id": ctx.response_id,
            "object": ctx.flavor.object_name,
            "created": ctx.created,
            "model": ctx.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": ctx.fingerprint,
            "usage": _usage(last, ctx, whole=True),
        }
        if ctx.flavor.chat:
            body["prompt_logprobs"] = None
            body["prompt_token_ids"] = None
        body["kv_transfer_params"] = None
        return Response.json(body)

    async def _chunks(
        self, stream: RequestStream, ctx: ResponseContext, include_usage: bool
    ) -> AsyncGenerator[bytes, None]:
        try:
            last: TokenOutput | None = None
            first = True
            async for output in stream:
                if output.finish_reason == "abort":
                    return
                if first and ctx.flavor.chat:
                    yield _sse(_chunk(ctx, _role_choice()))
                first = False
                yield _sse(_chunk(ctx, self._delta_choice(ctx, output)))
                last = output
            if include_usage and last is not None:
                yield _sse(
                    {**_chunk(ctx, None), "choices": [], "usage": _usage(last, ctx, whole=False)}
                )
            yield DONE
        finally:
            self._end(stream)

    def _delta_choice(self, ctx: ResponseContext, output: TokenOutput) -> dict[str, Any]:
        token = output.token_id
        tokenizer = self._engine.tokenizer
        text = "" if token is None else tokenizer.decode([token], skip_special_tokens=True)
        choice: dict[str, Any] = {"index": 0}
        if ctx.flavor.chat:
            choice["delta"] = {"content": text}
            choice["logprobs"] = None
            choice["finish_reason"] = output.finish_reason
            if output.finish_reason is not None:
                choice["stop_reason"] = None
            return choice
        choice.update(
            text=text, logprobs=None, finish_reason=output.finish_reason, stop_reason=None
        )
        return choice


def _role_choice() -> dict[str, Any]:
    """The first chunk of a chat stream: the role, with empty content."""
    return {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


def _chunk(ctx: ResponseContext, choice: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "id": ctx.response_id,
        "object": ctx.flavor.chunk_object_name,
        "created": ctx.created,
        "model": ctx.model,
        "choices": [] if choice is None else [choice],
    }


def _final_choice(ctx: ResponseContext, text: str, reason: str | None) -> dict[str, Any]:
    if ctx.flavor.chat:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning_content": None,
        }
        return {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": None,
        }
    return {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": reason,
        "stop_reason": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
    }
