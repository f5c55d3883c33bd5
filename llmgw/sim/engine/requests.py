"""Reading OpenAI request bodies the way vLLM validates them.

Pure functions from a decoded JSON body to frozen values, raising `RequestError` with
vLLM's status, type and wording; no I/O, so every refusal is tested with plain dicts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmgw.sim.engine.config import LoraModule, SimEngineConfig
from llmgw.sim.engine.core import RequestOptions
from llmgw.sim.engine.errors import RequestError
from llmgw.sim.engine.generation import SamplingSpec
from llmgw.sim.engine.tokenizer import SimTokenizer, render_chat

COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest.max_tokens default
MAX_PROMPT_TOKEN_ID = 2**31 - 1
"""Prompt ids are accepted up to int32 (not just the sim tokenizer's 49,152), so prompts
tokenized for real models (Qwen's 151k vocabulary, say) replay unchanged."""


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """The model a request names: the name to echo and the LoRA adapter, if any."""

    name: str
    lora: LoraModule | None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated completion or chat request."""

    model: ModelChoice
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    options: RequestOptions
    stream: bool
    include_usage: bool


def resolve_model(config: SimEngineConfig, name: Any) -> ModelChoice:
    """vLLM's model check: a served name, a LoRA name, or absent (the first served name)."""
    if name is None or name == "":
        return ModelChoice(config.model_name, None)
    if isinstance(name, str):
        if name in config.served_model_names:
            return ModelChoice(name, None)
        lora = config.lora(name)
        if lora is not None:
            return ModelChoice(name, lora)
    raise RequestError(404, f"The model `{name}` does not exist.", "model")


def completion_prompt(body: Mapping[str, Any], tokenizer: SimTokenizer) -> list[int]:
    """``prompt``: a string, token ids, or a one-element list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not _is_token_list(prompt):
        if len(prompt) != 1:
            raise RequestError(400, "the simulated engine serves one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and _is_token_list(prompt):
        highest = max(prompt)
        if highest > MAX_PROMPT_TOKEN_ID:
            raise RequestError(400, f"Token id {highest} is out of vocabulary", "prompt")
        return list(prompt)
    raise RequestError(400, "prompt must be a non-empty string or a list of token ids", "prompt")


def _is_token_list(items: Sequence[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in items)


def chat_prompt(body: Mapping[str, Any], tokenizer: SimTokenizer) -> list[int]:
    """``messages`` through the ChatML template (with the generation prompt by default)."""
    return tokenizer.encode(chat_text(body))


def chat_text(body: Mapping[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list", "messages")
    try:
        return render_chat(
            messages,
            add_generation_prompt=_bool(body, "add_generation_prompt", True),
            continue_final_message=_bool(body, "continue_final_message", False),
        )
    except ValueError as exc:
        raise RequestError(400, str(exc), "messages") from exc


def generation_request(
    body: Mapping[str, Any],
    config: SimEngineConfig,
    prompt_token_ids: list[int],
    *,
    chat: bool,
) -> GenerationRequest:
    """Validate a completion (``chat=False``) or chat request whose prompt is tokenized."""
    model = resolve_model(config, body.get("model"))
    _check_n(body)
    max_tokens = _max_tokens(body, config.max_model_len, len(prompt_token_ids), chat=chat)
    sampling = SamplingSpec(
        max_tokens=max_tokens,
        min_tokens=_int(body, "min_tokens", 0, minimum=0),
        ignore_eos=_bool(body, "ignore_eos", False),
        seed=_optional_int(body, "seed"),
    )
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(400, "stream_options must be an object", "stream_options")
    if options and not stream:
        raise RequestError(
            400, "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    return GenerationRequest(
        model=model,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        options=RequestOptions(
            lora=model.lora,
            cache_salt=_optional_str(body, "cache_salt"),
            session_id=_optional_str(body, "session_id"),
        ),
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
    )


def _check_n(body: Mapping[str, Any]) -> None:
    n = _int(body, "n", 1, minimum=1)
    if n != 1:
        raise RequestError(400, "the simulated engine generates one choice per request (n=1)", "n")


def _max_tokens(body: Mapping[str, Any], max_model_len: int, prompt_len: int, *, chat: bool) -> int:
    if prompt_len > max_model_len:
        raise RequestError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input "
            "messages.",
        )
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") else "max_tokens"
    default = None if chat else COMPLETION_DEFAULT_MAX_TOKENS
    requested = _optional_int(body, key) if key in body else default
    room = max_model_len - prompt_len
    if requested is None:
        return max(room, 1)
    if requested < 1:
        raise RequestError(400, f"max_tokens must be at least 1, got {requested}.", key)
    if requested > room:
        raise RequestError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's "
            f"maximum context length is {max_model_len} tokens and your request has "
            f"{prompt_len} input tokens ({requested} > {max_model_len} - {prompt_len}).",
            key,
        )
    return requested


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(400, f"{key} must be a boolean", key)
    return value


def _int(body: Mapping[str, Any], key: str, default: int, *, minimum: int) -> int:
    value = _optional_int(body, key)
    if value is None:
        return default
    if value < minimum:
        raise RequestError(400, f"{key} must be at least {minimum}, got {value}", key)
    return value


def _optional_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(400, f"{key} must be an integer", key)
    return value


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestError(400, f"{key} must be a string", key)
    return value
