"""OpenAI request bodies as the gateway reads them, and the error JSON it answers with.

The gateway reads only what routing needs (``model``, ``stream``, the prompt or messages,
the session key, and ``max_tokens`` for a tenant's token estimate) and forwards the body
it received byte for byte, so fields it does not know reach the engine unchanged and the
engine stays the judge of everything else. What it does
check, it refuses with a 400 naming the field, in vLLM's error shape
(spec/vllm-openai-server.md): ``{"error": {"message", "type", "param", "code"}}``.

The text the prefix tree sees for a chat request is the ChatML rendering of its messages
(what SmolLM2's template, and the simulated engine, produce), so one conversation's turns
share a growing prefix; a completions prompt is used as is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.gateway.errors import BadRequest

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
SESSION_HEADER = "x-session-id"
"""The affinity key a client may send; the body's ``user`` field is used when it is absent."""

_DUMPS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_LOADS = json.JSONDecoder().decode


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What routing needs from an OpenAI request."""

    model: str
    stream: bool
    text: str  # the prompt, or the rendered messages
    session: str  # header x-session-id, else the body's "user"; "" = none
    max_tokens: int = 0  # max_completion_tokens, else max_tokens; 0: neither (or not an int)


def parse_request(path: str, body: bytes, headers: Mapping[str, str]) -> ParsedRequest:
    """Read ``body`` (a completions or chat request to ``path``); BadRequest naming the fault.

    ``headers`` maps lower-case names to values.
    """
    document = _json_object(body)
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` is required and must be a non-empty string", param="model")
    stream = document.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("`stream` must be true or false", param="stream")
    if path == CHAT_PATH:
        text = render_messages(_messages(document))
    elif path == COMPLETIONS_PATH:
        text = _prompt_text(document)
    else:
        raise BadRequest(f"{path} takes no completion request")
    return ParsedRequest(model, stream, text, _session(document, headers), _max_tokens(document))


def _max_tokens(document: Mapping[str, Any]) -> int:
    """The completion tokens the request asks for at most (0: it does not say; the engine
    judges a bad value, this is only the tenant limits' estimate)."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = document.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def render_messages(messages: list[Any]) -> str:
    """ChatML of ``messages`` with the assistant's generation prompt: what the tree matches.

    Tolerant: a message that is not an object, or content that is neither a string nor a
    list of parts, renders as empty (``parse_request`` refuses those before calling this).
    """
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        parts.append(f"<|im_start|>{role if isinstance(role, str) else ''}\n")
        parts.append(_content_text(message.get("content")))
        parts.append("<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def error_body(
    message: str, type_: str, code: int | str | None = None, *, param: str | None = None
) -> bytes:
    """vLLM's OpenAI error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    error = {"message": message, "type": type_, "param": param, "code": code}
    return _DUMPS({"error": error}).encode()


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON, as the gateway answers."""
    return _DUMPS(value).encode()


def _json_object(body: bytes) -> dict[str, Any]:
    if not body:
        raise BadRequest("the request body is empty; a JSON object is expected")
    try:
        document = _LOADS(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not UTF-8: {exc.reason} at {exc.start}") from exc
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
    except ValueError as exc:  # an integer longer than sys.get_int_max_str_digits() allows
        raise BadRequest("the request body holds a number with too many digits") from exc
    except RecursionError as exc:  # the decoder recurses once per nested array or object
        raise BadRequest("the request body is nested too deeply") from exc
    if not isinstance(document, dict):
        raise BadRequest("the request body must be a JSON object")
    return document


def _messages(document: Mapping[str, Any]) -> list[Any]:
    messages = document.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` is required and must be a non-empty list", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{index}] must be an object", param="messages")
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{index}].role must be a string", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(
                f"messages[{index}].content must be a string or a list of parts",
                param="messages",
            )
    return messages


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = [
        part["text"]
        for part in content
        if isinstance(part, dict) and isinstance(part.get("text"), str)
    ]
    return "".join(texts)


def _prompt_text(document: Mapping[str, Any]) -> str:
    """The prompt as text; of a batch, the first prompt (a batch mostly shares its prefix)."""
    prompt = document.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str) and all(isinstance(p, str) for p in prompt):
            return first
        if _is_token_ids(prompt):
            return _tokens_text(prompt)
        if isinstance(first, list) and all(_is_token_ids(p) for p in prompt):
            return _tokens_text(first)
    raise BadRequest(
        "`prompt` is required: a string, a list of strings, or token ids", param="prompt"
    )


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _tokens_text(tokens: list[int]) -> str:
    """Token ids as text the tree can match: one prompt's ids share prefixes as the ids do."""
    return " ".join(map(str, tokens)) + " "


def _session(document: Mapping[str, Any], headers: Mapping[str, str]) -> str:
    session = headers.get(SESSION_HEADER)
    if session:
        return session
    user = document.get("user")
    return user if isinstance(user, str) else ""


__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "SESSION_HEADER",
    "ParsedRequest",
    "dumps",
    "error_body",
    "parse_request",
    "render_messages",
]
