"""The precise tier's tokenizer: a replica's own ``POST /tokenize``, bounded in time.

What is tokenized (`tokenize_input`, from the OpenAI request body as the client sent it):

* a chat request: ``{"model", "messages", "add_generation_prompt": true}`` plus every field
  of the request that changes how the engine renders its chat template
  (``add_generation_prompt`` and ``continue_final_message`` as the client set them,
  ``add_special_tokens``, ``chat_template``, ``chat_template_kwargs``, ``tools``,
  ``documents``), so the tokens are exactly those the engine will prefill
  (spec/vllm-kv-events.md §4);
* a completions request: ``{"model", "prompt"}`` (and ``add_special_tokens`` if given); of a
  batch, the first prompt; a prompt of token ids needs no call at all;
* refused (``unsupported`` set, the approximate tier decides): multimodal message parts and
  prompt embeddings, whose blocks vLLM keys with hashes of the media that a gateway
  cannot compute.

``cache_salt`` is read too: it changes the first block's key (the precise tier applies it).
The body names the request's ``model`` as the client did: a LoRA adapter's name for a LoRA
request, which vLLM's ``/tokenize`` accepts (and tokenizes with the adapter's tokenizer when
it has one); the precise tier adds the adapter's extra key to every block
(``precise.lora_adapter``).

`TokenizeClient.tokenize` POSTs the body with the replica's API key over the gateway's own
pooled client (upstream.py) and returns the token ids as ``array('Q')``, or the reason it
could not within ``timeout_s`` (default 50 ms: a precise decision is worth a little latency,
not a stalled request): ``timeout``, ``connect``, ``closed``, ``protocol``, ``status`` (not
200) or ``malformed`` (not a JSON object with ``tokens``, a list of at most ``max_tokens``
unsigned 64-bit ints, agreeing with ``count`` when given). A recent answer is reused: an LRU
of request body → tokens, bounded in bytes. The client never raises for a replica's fault.
Tokens are ``array('Q')`` because block keys hash them as 8-byte words: copying such an
array is a memcpy, converting any other is a loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from llmgw.gateway.errors import (
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
)
from llmgw.gateway.openai import CHAT_PATH, COMPLETIONS_PATH
from llmgw.gateway.upstream import Origin, UpstreamConnection, UpstreamPool

log = logging.getLogger(__name__)

__all__ = [
    "TOKENIZE_PATH",
    "TokenizeClient",
    "TokenizeConfig",
    "TokenizeInput",
    "Tokenized",
    "failure_reason",
    "fetch",
    "parse_tokens",
    "tokenize_input",
]

TOKENIZE_PATH: Final = "/tokenize"
_PATH: Final = TOKENIZE_PATH.encode()
# ASCII: a lone surrogate ("\ud800" is valid JSON) is written as its escape, not encoded
_DUMPS = json.JSONEncoder(ensure_ascii=True, separators=(",", ":")).encode
_LOADS = json.JSONDecoder().decode
_CHAT_FIELDS: Final = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "documents",
)


@dataclass(frozen=True, slots=True)
class TokenizeConfig:
    """The tokenize client's bounds."""

    timeout_s: float = 0.05  # the whole call: connection, request, answer
    max_tokens: int = 1 << 20  # a longer token list is refused as malformed
    cache_bytes: int = 16 * 1024 * 1024  # the LRU of body → tokens (bodies + 8 B a token)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.max_tokens < 1 or self.cache_bytes < 0:
            raise ValueError("timeout_s and max_tokens must be > 0, cache_bytes >= 0")


@dataclass(frozen=True, slots=True)
class TokenizeInput:
    """What to tokenize for one request: a body to POST, or the token ids it carries."""

    body: bytes = b""  # the /tokenize JSON body ("" when `tokens` is given or unsupported)
    tokens: array[int] | None = None  # the prompt's own token ids (no call needed)
    cache_salt: str | None = None
    unsupported: str = ""  # why the precise tier cannot key this request ("" = it can)


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A tokenize call's result: ``tokens``, or the ``failure`` reason."""

    tokens: array[int] | None
    failure: str = ""
    seconds: float = 0.0
    cached: bool = False


def tokenize_input(path: str, body: bytes, model: str) -> TokenizeInput:
    """What the precise tier tokenizes for a request to ``path`` (its body already passed
    ``openai.parse_request``, so it is a JSON object naming ``model``)."""
    try:
        document = _LOADS(body.decode("utf-8"))
    except (ValueError, RecursionError):  # bad UTF-8 or JSON, too deep, an int too long
        return TokenizeInput(unsupported="malformed_request")
    if not isinstance(document, dict):
        return TokenizeInput(unsupported="malformed_request")
    salt = document.get("cache_salt")
    salt = salt if isinstance(salt, str) and salt else None
    if path == CHAT_PATH:
        return _chat_input(document, model, salt)
    if path == COMPLETIONS_PATH:
        return _completion_input(document, model, salt)
    return TokenizeInput(unsupported="path")


def _chat_input(document: Mapping[str, Any], model: str, salt: str | None) -> TokenizeInput:
    messages = document.get("messages")
    if not isinstance(messages, list) or not messages:
        return TokenizeInput(unsupported="malformed_request")
    if any(_has_media(message) for message in messages):
        return TokenizeInput(unsupported="multimodal")
    out: dict[str, Any] = {"model": model, "messages": messages, "add_generation_prompt": True}
    out.update((name, document[name]) for name in _CHAT_FIELDS if name in document)
    return TokenizeInput(body=_DUMPS(out).encode(), cache_salt=salt)


def _has_media(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return False
    return any(not isinstance(part, dict) or part.get("type", "text") != "text" for part in content)


def _completion_input(document: Mapping[str, Any], model: str, salt: str | None) -> TokenizeInput:
    if "prompt_embeds" in document:
        return TokenizeInput(unsupported="prompt_embeds")
    prompt = document.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt (a batch mostly shares its prefix)
    if isinstance(prompt, str):
        out: dict[str, Any] = {"model": model, "prompt": prompt}
        if "add_special_tokens" in document:
            out["add_special_tokens"] = document["add_special_tokens"]
        return TokenizeInput(body=_DUMPS(out).encode(), cache_salt=salt)
    if isinstance(prompt, list) and prompt:
        tokens = _token_array(prompt, 1 << 30)
        if tokens is not None:
            return TokenizeInput(tokens=tokens, cache_salt=salt)
    return TokenizeInput(unsupported="malformed_request")


def _token_array(values: list[Any], limit: int) -> array[int] | None:
    """``values`` as unsigned 64-bit token ids; None unless every one is an int in range."""
    if len(values) > limit:
        return None
    try:
        tokens = array("Q", values)
    except (TypeError, OverflowError):
        return None
    if any(type(value) is not int for value in values):  # array('Q') takes bools too
        return None
    return tokens


def parse_tokens(body: bytes, max_tokens: int) -> array[int] | None:
    """The ``tokens`` of a ``/tokenize`` answer; None when the answer is malformed."""
    try:
        document = _LOADS(body.decode("utf-8"))
    except (ValueError, RecursionError):  # bad UTF-8 or JSON, too deep, an int too long
        return None
    if not isinstance(document, dict):
        return None
    values = document.get("tokens")
    if not isinstance(values, list):
        return None
    count = document.get("count")
    if isinstance(count, int) and count != len(values):
        return None
    return _token_array(values, max_tokens)


class _Collector:
    """A ``ResponseSink`` that gathers one small response whole, up to ``limit`` bytes."""

    __slots__ = ("done", "failure", "limit", "parts", "size", "status")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.status = 0
        self.parts: list[bytes] = []
        self.size = 0
        self.failure: UpstreamError | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def upstream_head(
        self, status: int, headers: list[tuple[bytes, bytes]], content_length: int | None
    ) -> None:
        self.status = status
        if content_length is not None and content_length > self.limit:
            self.upstream_failed(UpstreamProtocolError(f"answer of {content_length} bytes"))

    def upstream_body(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            self.upstream_failed(UpstreamProtocolError(f"answer over {self.limit} bytes"))
        elif not self.done.done():
            self.parts.append(data)

    def upstream_flush(self) -> None:
        """Nothing to forward: the answer is read whole."""

    def upstream_done(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def upstream_failed(self, error: UpstreamError) -> None:
        if not self.done.done():
            self.failure = error
            self.done.set_result(None)


class _TokenCache:
    """Request body → tokens, least recently used first out, bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._size = 0
        self._items: OrderedDict[bytes, array[int]] = OrderedDict()

    def get(self, body: bytes) -> array[int] | None:
        tokens = self._items.get(body)
        if tokens is not None:
            self._items.move_to_end(body)
        return tokens

    def put(self, body: bytes, tokens: array[int]) -> None:
        cost = len(body) + 8 * len(tokens)
        if cost > self._max or body in self._items:
            return
        self._items[body] = tokens
        self._size += cost
        while self._size > self._max:
            old, dropped = self._items.popitem(last=False)
            self._size -= len(old) + 8 * len(dropped)


def failure_reason(error: UpstreamError) -> str:
    """A short label for a failed exchange: connect, closed or protocol."""
    if isinstance(error, UpstreamConnectError):
        return "connect"
    if isinstance(error, UpstreamClosed):
        return "closed"
    return "protocol"


class TokenizeClient:
    """``POST /tokenize`` to a replica within ``config.timeout_s``, with an answer cache."""

    def __init__(self, pool: UpstreamPool, config: TokenizeConfig = TokenizeConfig()) -> None:
        self.config = config
        self._pool = pool
        self._cache = _TokenCache(config.cache_bytes)
        self._limit = 64 + 12 * config.max_tokens  # bytes: ids of up to 10 digits and a comma

    async def tokenize(self, url: str, api_key: str, body: bytes) -> Tokenized:
        """The tokens of ``body`` (a `TokenizeInput.body`) from the replica at ``url``."""
        cached = self._cache.get(body)
        if cached is not None:
            return Tokenized(cached, cached=True)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.timeout_s):
                status, answer = await self._call(url, api_key, body)
        except TimeoutError:
            return Tokenized(None, "timeout", time.perf_counter() - started)
        except UpstreamError as exc:
            log.debug("tokenize on %s failed: %s", url, exc)
            return Tokenized(None, failure_reason(exc), time.perf_counter() - started)
        took = time.perf_counter() - started
        if status != 200:
            log.debug("tokenize on %s answered %d", url, status)
            return Tokenized(None, "status", took)
        tokens = parse_tokens(answer, self.config.max_tokens)
        if tokens is None:
            return Tokenized(None, "malformed", took)
        self._cache.put(body, tokens)
        return Tokenized(tokens, seconds=took)

    async def _call(self, url: str, api_key: str, body: bytes) -> tuple[int, bytes]:
        return await fetch(
            self._pool, url, b"POST", _PATH, api_key=api_key, body=body, limit=self._limit
        )


async def fetch(
    pool: UpstreamPool,
    url: str,
    method: bytes,
    path: bytes,
    *,
    api_key: str = "",
    body: bytes | None = None,
    limit: int = 1 << 20,
) -> tuple[int, bytes]:
    """One small request to the replica at ``url`` over ``pool``: its status and whole body
    (at most ``limit`` bytes). UpstreamError when it cannot be had; no timeout of its own
    (callers bound it). A pooled connection the replica closed while idle is retried once on
    a new one."""
    origin = pool.origin(url)
    payload = _request(origin, method, path, api_key, body)
    conn = await pool.connection(origin)
    reused = conn.requests > 0
    collector = await _exchange(pool, conn, payload, limit)
    failure = collector.failure
    if reused and isinstance(failure, UpstreamClosed) and not collector.status:
        conn = await pool.connection(origin, fresh=True)
        collector = await _exchange(pool, conn, payload, limit)
        failure = collector.failure
    if failure is not None:
        raise failure
    return collector.status, b"".join(collector.parts)


async def _exchange(
    pool: UpstreamPool, conn: UpstreamConnection, payload: bytes, limit: int
) -> _Collector:
    """One request on ``conn``; pooled again after a whole answer, else closed."""
    collector = _Collector(limit)
    try:
        conn.send(payload, collector)
        await collector.done
    except UpstreamError as exc:
        collector.upstream_failed(exc)
    finally:
        if collector.failure is None and collector.done.done():
            pool.release(conn)
        else:
            conn.close()
    return collector


def _request(origin: Origin, method: bytes, path: bytes, api_key: str, body: bytes | None) -> bytes:
    parts = [method, b" ", path, b" HTTP/1.1\r\nhost: ", origin.host_header, b"\r\n"]
    if body is not None:
        parts.append(b"content-type: application/json\r\n")
    parts.append(b"accept: */*\r\n")
    if api_key:
        parts += (b"authorization: Bearer ", api_key.encode("latin-1"), b"\r\n")
    if body is not None:
        parts += (b"content-length: %d\r\n\r\n" % len(body), body)
    else:
        parts.append(b"\r\n")
    return b"".join(parts)
