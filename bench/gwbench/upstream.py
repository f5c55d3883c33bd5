"""bench.gateway's fast upstream (mode ``_upstream``): several ports, the replicas, in one
process, an asyncio protocol over httptools.

Each port answers ``/v1/chat/completions`` and ``/v1/completions`` with a small fixed JSON body
naming its replica, or with ``"stream": true`` an SSE stream of ``--chunks`` events ``--token-ms``
apart, then ``data: [DONE]``; and ``/tokenize`` and vLLM's render endpoints with stand-in token
ids (or 403, as plain ``vllm serve`` does), the health and model-info routes the routers probe.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import re
import signal
import socket
import sys
from collections import Counter, deque
from dataclasses import dataclass
from typing import Final, cast

import httptools

from bench.gwbench.workload import MODEL
from bench.kit import HOST


@dataclass(frozen=True, slots=True)
class Replies:
    """One replica's pre-encoded answers."""

    chat: bytes
    completion: bytes
    events: tuple[bytes, ...]  # chunked-encoded SSE events, [DONE] last
    token_s: float

    @classmethod
    def build(cls, replica: int, chunks: int, token_ms: float) -> Replies:
        name = f"r{replica}"
        common = {"id": "bench-1", "created": 0, "model": MODEL, "system_fingerprint": name}
        usage = {"prompt_tokens": 1, "completion_tokens": chunks, "total_tokens": chunks + 1}
        chat = {
            **common,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": usage,
        }
        completion = {
            **common,
            "object": "text_completion",
            "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "stop"}],
            "usage": usage,
        }
        events = [
            _sse(
                {
                    **common,
                    "object": "chat.completion.chunk",
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": f"t{i} "},
                            "finish_reason": None if i < chunks - 1 else "stop",
                        }
                    ],
                }
            )
            for i in range(chunks)
        ]
        events.append(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return cls(_json_reply(chat), _json_reply(completion), tuple(events), token_ms / 1000)


def _sse(obj: object) -> bytes:
    return _chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _json_reply(obj: object, status: str = "200 OK") -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


_MODELS: Final = _json_reply(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "b"}]}
)
_INFO: Final = _json_reply({"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True})
_OK: Final = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
_NOT_FOUND: Final = _json_reply({"error": {"message": "no such route"}}, "404 Not Found")
_STREAM_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
_GET_ROUTES: Final = {
    b"/health": _OK,
    b"/healthz": _OK,
    b"/health_generate": _OK,
    b"/v1/models": _MODELS,
    b"/get_model_info": _INFO,
    b"/get_server_info": _INFO,
    b"/model_info": _INFO,
    b"/server_info": _INFO,
}
_STREAM_TRUE: Final = re.compile(rb'"stream"\s*:\s*true')


# vLLM 0.32 `vllm serve` without --enable-scale-out answers its render endpoints so. vllm-router's
# cache_aware renders (tokenizes) every request through a worker before routing it: refused, it
# asks every worker in turn and then routes by load alone.
_FORBIDDEN: Final = _json_reply(
    {"error": {"message": "Scale-out endpoints are disabled. Restart vllm serve with "
               "--enable-scale-out to enable them.", "type": "PermissionDeniedError",
               "param": None, "code": 403}},
    "403 Forbidden",
)  # fmt: skip
_BAD_REQUEST: Final = _json_reply({"error": {"message": "bad JSON"}}, "400 Bad Request")
_MEMO_ENTRIES: Final = 10_000


def stand_in_tokens(body: bytes) -> list[int] | None:
    """Token ids for a request's text, one per 4 bytes (no real tokenizer: the upstream must
    stay cheap); None for a body that is not a completion or chat request."""
    try:
        request = json.loads(body)
        text = request.get("prompt") or "\n".join(
            str(m.get("content", "")) for m in request.get("messages", [])
        )
    except (ValueError, AttributeError, TypeError):
        return None
    raw = str(text).encode()
    return [int.from_bytes(raw[i : i + 4], "little") % 151_000 for i in range(0, len(raw), 4)]


def tokenize_reply(path: bytes, body: bytes) -> bytes:
    """vLLM's answer to ``/tokenize`` or to a render endpoint (``--enable-scale-out``)."""
    tokens = stand_in_tokens(body)
    if tokens is None:
        return _BAD_REQUEST
    if path == b"/tokenize":
        return _json_reply({"count": len(tokens), "max_model_len": 32768, "tokens": tokens})
    rendered = {"request_id": "render-1", "token_ids": tokens, "sampling_params": {}}
    return _json_reply([rendered] if path == b"/v1/completions/render" else rendered)


class Upstream:
    """What the upstream's connections share: request counts, memoized ``/tokenize`` answers."""

    def __init__(self, render: bool) -> None:
        self.render = render  # answer the render endpoints, else 403 as `vllm serve` does
        self.seen: Counter[bytes] = Counter()
        self._tokenized: dict[tuple[bytes, bytes], bytes] = {}

    def tokenize(self, path: bytes, body: bytes) -> bytes:
        if path != b"/tokenize" and not self.render:
            return _FORBIDDEN
        reply = self._tokenized.get((path, body))
        if reply is None:
            if len(self._tokenized) >= _MEMO_ENTRIES:
                self._tokenized.clear()
            reply = self._tokenized[path, body] = tokenize_reply(path, body)
        return reply


class UpstreamProtocol(asyncio.Protocol):
    """One client connection to the upstream: requests answered in order, keep-alive."""

    def __init__(self, replies: Replies, upstream: Upstream) -> None:
        self.replies, self.upstream = replies, upstream
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url, self.body = b"", bytearray()
        self.queue: deque[tuple[bytes, bytes, bytes, bool]] = deque()
        self.streaming: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.streaming is not None:
            self.streaming.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:  # malformed: answer nothing more on this connection
            if self.transport is not None:
                self.transport.close()

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        self.queue.append((method, self.url, bytes(self.body), self.parser.should_keep_alive()))
        self.url, self.body = b"", bytearray()
        if self.streaming is None:
            self._answer_next()

    def _answer_next(self) -> None:
        while self.queue and self.streaming is None and self.transport is not None:
            method, url, body, keep_alive = self.queue.popleft()
            path = url.split(b"?", 1)[0]
            self.upstream.seen[path] += 1
            if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
                if _STREAM_TRUE.search(body):
                    self.transport.write(_STREAM_HEAD)
                    self._stream(0, keep_alive)
                    return
                chat = path == b"/v1/chat/completions"
                self.transport.write(self.replies.chat if chat else self.replies.completion)
            elif method == b"POST" and (path == b"/tokenize" or path.endswith(b"/render")):
                self.transport.write(self.upstream.tokenize(path, body))
            else:
                self.transport.write(_GET_ROUTES.get(path, _NOT_FOUND))
            if not keep_alive:
                self.transport.close()

    def _stream(self, sent: int, keep_alive: bool) -> None:
        loop = asyncio.get_running_loop()
        self.streaming = loop.call_later(self.replies.token_s, self._event, sent, keep_alive)

    def _event(self, index: int, keep_alive: bool) -> None:
        self.streaming = None
        if self.transport is None:
            return
        self.transport.write(self.replies.events[index])
        if index + 1 < len(self.replies.events):
            self._stream(index + 1, keep_alive)
        elif not keep_alive:
            self.transport.close()
        else:
            self._answer_next()


async def run_upstream(args: argparse.Namespace) -> None:
    """Serve ``args.replicas`` ports until SIGTERM; announce them as ``PORTS p1,p2,...``."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    upstream = Upstream(args.render == "tokens")
    servers = []
    for i in range(args.replicas):
        replies = Replies.build(i, args.chunks, args.token_ms)
        protocol = functools.partial(UpstreamProtocol, replies, upstream)
        servers.append(await loop.create_server(protocol, HOST, 0, backlog=1024))
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    print("PORTS " + ",".join(map(str, ports)), flush=True)
    await stop.wait()
    for s in servers:
        s.close()
    served = ", ".join(f"{k.decode()} {n}" for k, n in upstream.seen.most_common())
    print(f"upstream served: {served}", file=sys.stderr, flush=True)
