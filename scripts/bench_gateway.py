#!/usr/bin/env python3
"""Benchmark: what the gateway costs per proxied request, against vllm-router and sglang-router.

One fast upstream process (``_upstream`` mode: an asyncio protocol over httptools on uvloop,
``--replicas`` listening ports that stand for that many replicas) answers
``/v1/chat/completions`` and ``/v1/completions`` with a small fixed JSON body naming the
replica, or with ``"stream": true`` an SSE stream of ``--chunks`` events ``--token-ms`` apart,
then ``data: [DONE]``; keep-alive, TCP_NODELAY. In front of it, in the same run:

* ``direct``: no proxy, the baseline;
* ``llmgw``: our ``Gateway`` (``_gateway`` mode: a RoutingTable with one Target per upstream
  port, no control server), with ``round_robin`` and with ``prefix`` (the default policy);
* ``vllm-router`` 0.1.17 and ``sglang-router`` 0.3.2 (PyPI; ``scripts/setup-bench-routers``
  installs them) with ``round_robin`` and with ``cache_aware``, their approximate prefix tree.
  vllm-router's cache_aware tokenizes every request through vLLM's render endpoint on every
  worker before routing it; the upstream answers those with stand-in token ids, as
  ``vllm serve --enable-scale-out`` does, or with ``--render forbidden`` refuses them as plain
  ``vllm serve`` does (vllm-router then routes by load alone).

Every proxy runs in its own process pinned to ``--proxy-cpu``; this process (the load
generator: a raw asyncio HTTP/1.1 keep-alive client on uvloop) and the upstream run on
``--client-cpu``. The requests are chat completions with realistic text: ``--groups`` long
system prompts shared by ``--users`` users each, every user with a question of their own, sent
in a shuffled order. Cells, each ``--reps`` times, the proxies in a rotating order:

* ``rps``: ``--conns`` connections (32), one request in flight on each: requests/s, and the
  proxy's CPU time per request (``utime + stime`` of its process tree from ``/proc``);
* ``lat``: one connection: latency p50/p99 and what the proxy adds to direct's;
* ``stream``: one connection, ``stream: true``: first streamed byte (request written → first
  ``data:`` byte read) p50/p99 and what the proxy adds, and the proxy's CPU per stream.

The proxy's CPU is its own (user + system); the softirq time on its core, where much of
loopback TCP's receive path runs, is shown apart, per request.

Every reply is checked (status, framing, the replica's name, ``[DONE]`` at a stream's end),
and where each group's requests landed is counted: the busiest replica's share shows whether
round-robin spreads, the group stickiness how well a prefix policy keeps a group together.
Other processes' use of the proxy's CPU (of the client's, for direct) is measured from
``/proc/stat``; a cell where they took more than ``--max-others`` percent of it is run again
(the quietest run is kept). With
``--profile DIR``, py-spy then samples each of our gateways under the 32-connection load and
the report says which files and functions the time went to. Everything listens on 127.0.0.1;
every child dies with this process.

    scripts/setup-bench-routers                            # once: the peer routers' venv
    .venv/bin/python scripts/bench_gateway.py              # 3 reps, 5-12 min (re-runs)
    .venv/bin/python scripts/bench_gateway.py --quick      # 1 rep of short cells, ~2 min
    .venv/bin/python scripts/bench_gateway.py --only llmgw # without the peers
    .venv/bin/python scripts/bench_gateway.py --markdown --profile /tmp/prof
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import itertools
import json
import math
import os
import random
import re
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TextIO, cast

import httptools
import uvloop
from benchkit import CLK_TCK, base_machine, command_line, proc_cpu_seconds

HOST: Final = "127.0.0.1"
MODEL: Final = "bench-model"
ROUTERS_DIR: Final = Path(
    os.environ.get("LLMGW_BENCH_ROUTERS_DIR", Path.home() / ".cache/llmgw/bench-routers")
)
ROUTERS_PYTHON: Final = ROUTERS_DIR / "venv/bin/python"
PEER_MODULES: Final = {
    "vllm-router": ("vllm_router.launch_router", "warning"),
    "sglang-router": ("sglang_router.launch_router", "warn"),
}
PEERS: Final = ", ".join(PEER_MODULES)
RENDER: Final = ("tokens", "forbidden")
START_TIMEOUT_S: Final = 60.0
CELL_GRACE_S: Final = 30.0
PR_SET_PDEATHSIG: Final = 1

# ======================================================================================
# The workload: chat requests with realistic text, groups sharing a long system prompt
# ======================================================================================

_WORDS: Final = (
    "the of and to in is that for it as with was on be by this are from at or an have not "
    "which but all they one can were their there been has when if more will would who so no "
    "what about out up into do than some could them time only other new these two may first "
    "then any like now my such make over our even most after also did many before must "
    "through back years where much your way well down should because each just those people "
    "how too little state good very world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off "
    "come since against go came right used take three himself few house use during without "
    "again place around however home small found thought went say part once general high "
    "upon school every does group number customer account order invoice shipment refund "
    "policy request support answer question please thanks document contract clause section "
    "service model replica latency throughput memory cache prompt token server cluster"
).split()


@dataclass(frozen=True, slots=True)
class Prompt:
    group: int
    system: str
    user: str


def prose(rng: random.Random, chars: int) -> str:
    """Sentences of common English words, about ``chars`` long."""
    sentences: list[str] = []
    size = 0
    while size < chars:
        words = rng.choices(_WORDS, k=rng.randint(6, 18))
        sentence = " ".join(words).capitalize() + rng.choice((".", ".", ".", "?", "!"))
        sentences.append(sentence)
        size += len(sentence) + 1
    return " ".join(sentences)


def make_prompts(groups: int, users: int, prefix_chars: int, question_chars: int) -> list[Prompt]:
    """``groups`` x ``users`` prompts, shuffled; the same arguments give the same prompts."""
    rng = random.Random(20_250_601)
    systems = [
        f"You are the assistant of team {g}. " + prose(rng, prefix_chars) for g in range(groups)
    ]
    prompts = [
        Prompt(g, systems[g], f"User {u}: " + prose(rng, question_chars))
        for g in range(groups)
        for u in range(users)
    ]
    rng.shuffle(prompts)
    return prompts


def chat_request(port: int, prompt: Prompt, stream: bool) -> bytes:
    """A ``/v1/chat/completions`` POST as an OpenAI client sends it, pre-encoded."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": prompt.system},
                {"role": "user", "content": prompt.user},
            ],
            "max_tokens": 16,
            "stream": stream,
        },
        separators=(",", ":"),
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        "Content-Type: application/json\r\nAccept: */*\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("ascii") + body


# ======================================================================================
# Mode `_upstream`: the fast upstream, several ports (replicas) in one process
# ======================================================================================


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
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    upstream = Upstream(args.render == "tokens")
    servers = []
    for i in range(args.replicas):
        replies = Replies.build(i, args.chunks, args.token_ms)
        servers.append(
            await loop.create_server(
                lambda r=replies: UpstreamProtocol(r, upstream), HOST, 0, backlog=1024
            )
        )
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    print("PORTS " + ",".join(map(str, ports)), flush=True)
    await stop.wait()
    for s in servers:
        s.close()
    served = ", ".join(f"{k.decode()} {n}" for k, n in upstream.seen.most_common())
    print(f"upstream served: {served}", file=sys.stderr, flush=True)


# ======================================================================================
# Mode `_gateway`: our Gateway in front of the upstream ports, without a control server
# ======================================================================================


async def run_gateway(args: argparse.Namespace) -> None:
    from llmgw.server.router.gateway import Gateway, GatewayConfig
    from llmgw.server.router.table import RoutingTable, Target

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    table = RoutingTable()
    table.replace_all(
        Target(replica_id=f"r{i}", model=MODEL, url=f"http://{HOST}:{port}")
        for i, port in enumerate(args.upstreams)
    )
    gateway = Gateway(table, GatewayConfig(host=HOST, port=0, policy=args.policy))
    _, port = await gateway.start()
    try:
        print(f"PORT {port}", flush=True)
        await stop.wait()
    finally:
        await gateway.stop()


# ======================================================================================
# The client: keep-alive HTTP/1.1 over asyncio protocols, with first-byte times
# ======================================================================================

_CONTENT_LENGTH: Final = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_CHUNKED: Final = re.compile(rb"\r\ntransfer-encoding:[^\r]*chunked", re.IGNORECASE)
_CLOSE: Final = re.compile(rb"\r\nconnection:[ \t]*close", re.IGNORECASE)
_REPLICA: Final = re.compile(rb'"system_fingerprint":\s*"r(\d+)"')


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    close: bool
    first_data: float  # perf_counter() when the first SSE ``data:`` arrived; NaN if none


def _parse_chunked(buf: bytearray, start: int) -> tuple[bytes, int] | None:
    """A chunked body starting at ``buf[start:]``: (body, end offset), or None if partial."""
    body = bytearray()
    at = start
    while True:
        eol = buf.find(b"\r\n", at)
        if eol < 0:
            return None
        size = int(bytes(buf[at:eol]).split(b";", 1)[0], 16)
        at = eol + 2
        if size == 0:  # trailer section: header lines up to an empty line
            while True:
                eol = buf.find(b"\r\n", at)
                if eol < 0:
                    return None
                if eol == at:
                    return bytes(body), eol + 2
                at = eol + 2
        if len(buf) < at + size + 2:
            return None
        body += buf[at : at + size]
        at += size + 2


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request in flight at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[Reply] | None = None
        self.first_data = math.nan
        self.lost = False

    @classmethod
    async def open(cls, port: int) -> Connection:
        _, conn = await asyncio.get_running_loop().create_connection(cls, HOST, port)
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"the peer closed the connection ({exc})"))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if math.isnan(self.first_data) and b"data:" in self.buf:
            self.first_data = time.perf_counter()
        if self.waiter is None or self.waiter.done():
            return
        try:
            reply = self._parse()
        except ValueError as exc:  # unframed or malformed: this connection is done
            self.waiter.set_exception(exc)
            self.close()
            return
        if reply is not None:
            self.waiter.set_result(reply)

    def _parse(self) -> Reply | None:
        buf = self.buf
        head_end = buf.find(b"\r\n\r\n")
        if head_end < 0:
            return None
        head = bytes(buf[: head_end + 2])
        length = _CONTENT_LENGTH.search(head)
        if length is not None:
            end = head_end + 4 + int(length.group(1))
            if len(buf) < end:
                return None
            body = bytes(buf[head_end + 4 : end])
        elif _CHUNKED.search(head):
            parsed = _parse_chunked(buf, head_end + 4)
            if parsed is None:
                return None
            body, end = parsed
        else:
            raise ValueError(f"a response without framing: {head!r}")
        del buf[:end]
        first, self.first_data = self.first_data, math.nan
        return Reply(int(head[9:12]), body, _CLOSE.search(head) is not None, first)

    async def request(self, raw: bytes) -> Reply:
        if self.lost or self.transport is None:
            raise ConnectionError("connection lost")
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def replica_of(reply: Reply, stream: bool, chunks: int) -> int:
    """The replica that answered ``reply``; ValueError when the reply is not the upstream's."""
    found = _REPLICA.search(reply.body)
    if reply.status != 200 or found is None:
        raise ValueError(f"bad reply: {reply.status} {reply.body[:300]!r}")
    if stream:
        events = reply.body.count(b"data: ")
        if not reply.body.endswith(b"data: [DONE]\n\n") or events != chunks + 1:
            raise ValueError(f"bad stream ({events} events): {reply.body[-300:]!r}")
    return int(found.group(1))


# ======================================================================================
# One cell: a workload through one proxy (or direct), measured over a window
# ======================================================================================

KINDS: Final = ("rps", "lat", "stream")


@dataclass(frozen=True, slots=True)
class Work:
    """What one cell sends: pre-encoded requests per target port, and how many at once."""

    kind: str
    conns: int
    stream: bool
    chunks: int
    requests: Mapping[int, Sequence[bytes]]  # port → one request per prompt
    groups: Sequence[int]  # the prompts' groups, by index


@dataclass(slots=True)
class Cell:
    proxy: str
    kind: str
    rep: int
    window_s: float
    requests: int
    latencies_s: list[float]  # sorted
    first_data_s: list[float]  # sorted; streams only
    proxy_cpu_s: float  # NaN for direct
    client_cpu_s: float
    upstream_cpu_s: float
    others_cpu_s: float  # what other processes used of the proxy's CPU meanwhile
    irq_cpu_s: float  # interrupt time on the proxy's CPU (mostly its sockets' softirq)
    client_others_cpu_s: float  # what other processes used of the client's CPU meanwhile
    routes: Counter[tuple[int, int]]  # (group, replica) → requests
    attempts: int = 1

    @property
    def rps(self) -> float:
        return self.requests / self.window_s if self.window_s > 0 else math.nan

    @property
    def others_share(self) -> float:
        """Other processes' share of the CPU that matters here: the proxy's, or for direct
        (the scheduler moves them to the proxy's idle core then) the client's."""
        others = self.client_others_cpu_s if self.proxy == "direct" else self.others_cpu_s
        return others / self.window_s if self.window_s > 0 else math.nan

    @property
    def cpu_us_per_request(self) -> float:
        return 1e6 * self.proxy_cpu_s / self.requests if self.requests else math.nan

    def latency_us(self, q: float) -> float:
        return 1e6 * percentile(self.latencies_s, q)

    def first_data_us(self, q: float) -> float:
        return 1e6 * percentile(self.first_data_s, q)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of sorted ``values``; NaN when empty."""
    if not values:
        return math.nan
    return values[max(1, math.ceil(q * len(values))) - 1]


def stickiness(routes: Mapping[tuple[int, int], int]) -> float:
    """The share of requests that went to their group's most used replica (1.0: all did)."""
    by_group: dict[int, Counter[int]] = {}
    for (group, replica), n in routes.items():
        by_group.setdefault(group, Counter())[replica] += n
    total = sum(sum(c.values()) for c in by_group.values())
    top = sum(max(c.values()) for c in by_group.values())
    return top / total if total else math.nan


def busiest_share(routes: Mapping[tuple[int, int], int]) -> float:
    """The busiest replica's share of all requests."""
    per: Counter[int] = Counter()
    for (_, replica), n in routes.items():
        per[replica] += n
    total = sum(per.values())
    return max(per.values()) / total if total else math.nan


def cpu_seconds(cpu: int) -> tuple[float, float]:
    """Seconds one CPU spent in tasks (user, nice, system, steal) and in interrupts (irq,
    softirq: on loopback, much of TCP's receive path) since boot, from ``/proc/stat``."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{cpu} "):
            user, nice, system, _, _, irq, softirq, steal = map(int, line.split()[1:9])
            return (user + nice + system + steal) / CLK_TCK, (irq + softirq) / CLK_TCK
    return math.nan, math.nan


def tree_cpu_seconds(pid: int | None) -> float:
    """CPU seconds of a process and its descendants (NaN for no process)."""
    if pid is None:
        return math.nan
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        with contextlib.suppress(OSError):
            total += proc_cpu_seconds(p)
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
    return total


@dataclass(slots=True)
class _Window:
    start: float = math.inf
    end: float = math.inf
    done: int = 0
    latencies: list[float] = field(default_factory=list)
    first_data: list[float] = field(default_factory=list)
    routes: Counter[tuple[int, int]] = field(default_factory=Counter)


async def _drive(port: int, offset: int, work: Work, window: _Window, until: float) -> None:
    """One connection's closed loop over the prompts from ``offset``, until ``until``."""
    conn = await Connection.open(port)
    requests, clock, n = work.requests[port], time.perf_counter, len(work.groups)
    i = offset
    try:
        while (t0 := clock()) < until:
            reply = await conn.request(requests[i % n])
            t1 = clock()
            replica = replica_of(reply, work.stream, work.chunks)
            if window.start <= t1 < window.end:
                window.latencies.append(t1 - t0)
                if work.stream:
                    window.first_data.append(reply.first_data - t0)
                window.routes[work.groups[i % n], replica] += 1
                window.done += 1
            i += 1
            if reply.close or conn.lost:
                conn.close()
                conn = await Connection.open(port)
    finally:
        conn.close()


@dataclass(frozen=True, slots=True)
class Meter:
    """Where a cell reads CPU: the proxy's process, the upstream's, both cores."""

    proxy_pid: int | None
    upstream_pid: int | None
    proxy_cpu: int
    client_cpu: int

    def read(self) -> tuple[float, ...]:
        return (
            tree_cpu_seconds(self.proxy_pid),
            tree_cpu_seconds(self.upstream_pid),
            *cpu_seconds(self.proxy_cpu),
            cpu_seconds(self.client_cpu)[0],
            time.process_time(),
        )


async def run_cell(
    proxy: str, ports: Sequence[int], work: Work, meter: Meter, rep: int, timing: Timing
) -> Cell:
    """``work.conns`` connections spread over ``ports``, measured for ``timing.seconds``."""
    window, clock = _Window(), time.perf_counter
    until = clock() + timing.warmup_s + timing.seconds + 0.5
    n = len(work.groups)
    async with asyncio.timeout(timing.warmup_s + timing.seconds + CELL_GRACE_S):
        drivers = [
            asyncio.create_task(_drive(port, c * n // work.conns, work, window, until))
            for c, port in zip(range(work.conns), itertools.cycle(ports), strict=False)
        ]
        try:
            await asyncio.sleep(timing.warmup_s)
            before, window.start = meter.read(), clock()
            window.end = window.start + timing.seconds
            # the window ends early if a connection fails: its error is raised below
            await asyncio.wait(drivers, timeout=timing.seconds, return_when="FIRST_COMPLETED")
            after, window.end = meter.read(), min(clock(), window.end)
        finally:
            for d in drivers:
                d.cancel()
            results = await asyncio.gather(*drivers, return_exceptions=True)
    errors = [r for r in results if isinstance(r, Exception)]
    if errors:
        raise RuntimeError(f"{proxy} {work.kind}: {errors[0]!r}") from errors[0]
    deltas = (a - b for a, b in zip(after, before, strict=True))
    proxy_cpu, upstream_cpu, tasks, irq, client_tasks, own = deltas
    return Cell(
        proxy=proxy,
        kind=work.kind,
        rep=rep,
        window_s=window.end - window.start,
        requests=window.done,
        latencies_s=sorted(window.latencies),
        first_data_s=sorted(window.first_data),
        proxy_cpu_s=proxy_cpu,
        client_cpu_s=own,
        upstream_cpu_s=upstream_cpu,
        others_cpu_s=max(0.0, tasks - (0.0 if math.isnan(proxy_cpu) else proxy_cpu)),
        irq_cpu_s=irq,
        client_others_cpu_s=max(0.0, client_tasks - own - upstream_cpu),
        routes=window.routes,
    )


# ======================================================================================
# Orchestration: the child processes and the order of the cells
# ======================================================================================


@dataclass(frozen=True, slots=True)
class Proxy:
    name: str  # "llmgw round_robin"
    kind: str  # "direct" | "llmgw" | "vllm-router" | "sglang-router"
    policy: str  # as that proxy names it; "" for direct
    family: str  # "round_robin" | "prefix": the policies compared with each other


PROXIES: Final = (
    Proxy("direct", "direct", "", ""),
    Proxy("llmgw round_robin", "llmgw", "round_robin", "round_robin"),
    Proxy("vllm-router round_robin", "vllm-router", "round_robin", "round_robin"),
    Proxy("sglang-router round_robin", "sglang-router", "round_robin", "round_robin"),
    Proxy("llmgw prefix", "llmgw", "prefix", "prefix"),
    Proxy("vllm-router cache_aware", "vllm-router", "cache_aware", "prefix"),
    Proxy("sglang-router cache_aware", "sglang-router", "cache_aware", "prefix"),
)


@dataclass(frozen=True, slots=True)
class Timing:
    seconds: float
    warmup_s: float


@dataclass(frozen=True, slots=True)
class Settings:
    timing: Timing
    reps: int
    conns: int
    replicas: int
    chunks: int
    token_ms: float
    render: str  # one of RENDER
    groups: int
    users: int
    prefix_chars: int
    question_chars: int
    proxy_cpu: int
    client_cpu: int
    max_others: float  # a cell where other processes used more of the proxy's CPU is re-run
    attempts: int
    kinds: tuple[str, ...]  # the proxy kinds measured besides direct
    profile: Path | None = None  # where py-spy's output goes; None: no profile


@dataclass(slots=True)
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    ports: tuple[int, ...] = ()

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _child_setup(cpu: int) -> Callable[[], None]:
    """A ``preexec_fn``: pin to ``cpu`` (its threads too); die with this process."""

    def setup() -> None:
        os.sched_setaffinity(0, {cpu})
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return setup


def spawn(name: str, argv: Sequence[str], cpu: int, workdir: Path, announces: bool) -> Child:
    """Start a child pinned to ``cpu``, its output in a log file; stdout stays a pipe when the
    child ``announces`` its ports there (and writes nothing else to it)."""
    log = workdir / (name.replace(" ", "-") + ".log")
    with log.open("wb") as err:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if announces else err,
            stderr=err,
            preexec_fn=_child_setup(cpu),
        )
    return Child(name, proc, log)


def announced_ports(child: Child, prefix: str) -> tuple[int, ...]:
    """Wait for the child's ``PREFIX p1,p2`` line on stdout; its ports."""
    assert child.proc.stdout is not None
    line = b""
    with selectors.DefaultSelector() as sel:
        sel.register(child.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            if sel.select(max(0.0, deadline - time.monotonic())):
                chunk = os.read(child.proc.stdout.fileno(), 1)
                if not chunk:
                    break
                line += chunk
    if not line.startswith(prefix.encode() + b" "):
        child.stop()
        raise RuntimeError(f"{child.name} did not start:\n{child.log_tail()}")
    return tuple(int(p) for p in line.split()[1].split(b","))


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def peer_argv(proxy: Proxy, port: int, metrics_port: int, upstreams: Sequence[int]) -> list[str]:
    module, log_level = PEER_MODULES[proxy.kind]
    urls = [f"http://{HOST}:{p}" for p in upstreams]
    return [
        str(ROUTERS_PYTHON), "-m", module, "--host", HOST, "--port", str(port),
        "--worker-urls", *urls, "--policy", proxy.policy, "--prometheus-host", HOST,
        "--prometheus-port", str(metrics_port), "--log-level", log_level,
    ]  # fmt: skip


def start_proxy(proxy: Proxy, upstreams: Sequence[int], s: Settings, workdir: Path) -> Child:
    if proxy.kind == "llmgw":
        argv = [sys.executable, os.path.abspath(__file__), "_gateway", "--policy", proxy.policy,
                "--upstreams", ",".join(map(str, upstreams))]  # fmt: skip
        child = spawn(proxy.name, argv, s.proxy_cpu, workdir, announces=True)
        child.ports = announced_ports(child, "PORT")
        return child
    port = free_port()
    argv = peer_argv(proxy, port, free_port(), upstreams)
    child = spawn(proxy.name, argv, s.proxy_cpu, workdir, announces=False)
    child.ports = (port,)
    return child


async def wait_ready(child: Child, probe: bytes) -> None:
    """Until a chat request through ``child`` answers 200 (a router checks its workers first)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    last: object = None
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            break
        try:
            conn = await Connection.open(child.ports[0])
            try:
                async with asyncio.timeout(5):
                    reply = await conn.request(probe)
                if reply.status == 200:
                    return
                last = f"{reply.status} {reply.body[:200]!r}"
            finally:
                conn.close()
        except (OSError, TimeoutError) as exc:
            last = exc
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{child.name} never answered 200 (last: {last}):\n{child.log_tail()}")


def make_work(kind: str, s: Settings, ports: Iterable[int], prompts: Sequence[Prompt]) -> Work:
    stream = kind == "stream"
    requests = {p: [chat_request(p, x, stream) for x in prompts] for p in ports}
    conns = s.conns if kind == "rps" else 1
    return Work(kind, conns, stream, s.chunks, requests, [x.group for x in prompts])


Progress = Callable[[Cell], None]


async def quietest_cell(
    proxy: str, ports: Sequence[int], work: Work, meter: Meter, rep: int, s: Settings,
    progress: Progress,
) -> Cell:  # fmt: skip
    """Run a cell, again (at most ``s.attempts`` runs) while others used more than
    ``s.max_others`` of the CPU that matters to it (``Cell.others_share``); the quietest run
    is kept."""
    best: Cell | None = None
    for attempt in range(1, s.attempts + 1):
        cell = await run_cell(proxy, ports, work, meter, rep, s.timing)
        cell.attempts = attempt
        progress(cell)
        if best is None or cell.others_share < best.others_share:
            best = cell
        if cell.others_share <= s.max_others:
            break
        if attempt < s.attempts:
            await asyncio.sleep(2.0)
    assert best is not None
    return best


async def run_bench(
    children: Mapping[str, Child], upstream: Child, s: Settings, progress: Progress
) -> tuple[list[Cell], list[Profile]]:
    """Every (rep, kind, proxy) cell, the proxies' order rotating with the rep; then, with
    ``s.profile``, a profile of each of our gateways under the throughput cell's load."""
    prompts = make_prompts(s.groups, s.users, s.prefix_chars, s.question_chars)
    names = ["direct", *children]
    for name, child in children.items():
        await wait_ready(child, chat_request(child.ports[0], prompts[0], stream=False))
        progress_line(f"{name} ready on port {child.ports[0]}")
    cells = []
    for rep in range(s.reps):
        for kind in KINDS:
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                child = children.get(name)
                ports = child.ports if child is not None else upstream.ports
                work = make_work(kind, s, ports, prompts)
                pid = child.proc.pid if child is not None else None
                meter = Meter(pid, upstream.proc.pid, s.proxy_cpu, s.client_cpu)
                cells.append(await quietest_cell(name, ports, work, meter, rep, s, progress))
                for c in (upstream, *children.values()):
                    if c.proc.poll() is not None:
                        raise RuntimeError(f"{c.name} exited:\n{c.log_tail()}")
    return cells, await profile_gateways(children, s, prompts)


def progress_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def progress(cell: Cell) -> None:
    extra = f", first data p50 {cell.first_data_us(0.5):7,.0f} µs" if cell.first_data_s else ""
    progress_line(
        f"  rep {cell.rep + 1} {cell.kind:6} {cell.proxy:26}: {cell.rps:7,.0f} req/s, "
        f"p50 {cell.latency_us(0.5):7,.0f} µs, p99 {cell.latency_us(0.99):7,.0f} µs{extra}, "
        f"proxy {cell.cpu_us_per_request:5,.0f} µs/req, sticky {stickiness(cell.routes):.2f}, "
        f"others {100 * cell.others_share:3.0f}%"
        + (f" (attempt {cell.attempts})" if cell.attempts > 1 else "")
    )


# ======================================================================================
# Optional: where our gateway's time goes (py-spy, after the measured cells)
# ======================================================================================


@dataclass(frozen=True, slots=True)
class Profile:
    proxy: str
    samples: int  # non-idle samples
    self_by_file: Mapping[str, int]  # the file of the innermost frame → samples
    self_by_function: Mapping[str, int]  # "function (file)" of the innermost frame → samples


def parse_raw_profile(proxy: str, text: str) -> Profile:
    """py-spy's ``--format raw --function`` output (``name (file:line);... count`` per line) by
    innermost frame."""
    by_file: Counter[str] = Counter()
    by_function: Counter[str] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        inner = stack.rsplit(";", 1)[-1]
        by_function[inner] += int(count)
        where = inner.rpartition(" (")[2].rstrip(")")  # "file:first line of the function"
        by_file[where.rpartition(":")[0] or where] += int(count)
    return Profile(proxy, sum(by_function.values()), by_file, by_function)


async def profile_gateway(name: str, child: Child, work: Work, s: Settings, out: Path) -> Profile:
    """Sample ``child`` with py-spy (not pausing it) under ``work`` for ``s.timing.seconds``."""
    raw = out / (name.replace(" ", "-") + ".raw.txt")
    seconds = max(1, round(s.timing.seconds))
    spy = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(child.proc.pid),
        "--duration", str(seconds), "--rate", "250", "--format", "raw", "--nonblocking",
        "--function", "--output", str(raw),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    meter = Meter(None, None, s.proxy_cpu, s.client_cpu)
    load = asyncio.create_task(
        run_cell(name, child.ports, work, meter, 0, Timing(seconds + 1.0, 0.0))
    )
    try:
        if await spy.wait() != 0 or not raw.exists():
            raise RuntimeError(f"py-spy failed on {name} (pid {child.proc.pid})")
    finally:
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
    return parse_raw_profile(name, raw.read_text())


async def profile_gateways(
    children: Mapping[str, Child], s: Settings, prompts: Sequence[Prompt]
) -> list[Profile]:
    """With ``s.profile``, each of our gateways profiled under the throughput cell's load."""
    if s.profile is None:
        return []
    return [
        await profile_gateway(name, child, make_work("rps", s, child.ports, prompts), s, s.profile)
        for name, child in children.items()
        if name.startswith("llmgw")
    ]


def profile_lines(profile: Profile, top: int = 12) -> list[str]:
    def share(n: int) -> str:
        return f"{100 * n / profile.samples:4.1f}%"

    lines = [f"{profile.proxy}: {profile.samples:,} samples, innermost frame by file:"]
    lines += [f"  {share(n)}  {f}" for f, n in Counter(profile.self_by_file).most_common(top)]
    lines += ["  by function:"]
    lines += [f"  {share(n)}  {f}" for f, n in Counter(profile.self_by_function).most_common(top)]
    return lines


# ======================================================================================
# The report
# ======================================================================================

Value = Callable[[Cell, "Cell | None"], float]  # (cell, direct's cell of the same rep and kind)


@dataclass(frozen=True, slots=True)
class Metric:
    kind: str
    label: str
    value: Value
    fmt: str


def _added(of: Callable[[Cell], float]) -> Value:
    return lambda c, d: of(c) - of(d) if d is not None else math.nan


def _p(q: float) -> Callable[[Cell], float]:
    return lambda c: c.latency_us(q)


def _first(q: float) -> Callable[[Cell], float]:
    return lambda c: c.first_data_us(q)


def metrics(s: Settings) -> list[Metric]:
    n = s.conns
    return [
        Metric("rps", f"{n} conns: requests/s", lambda c, d: c.rps, ",.0f"),
        Metric("rps", f"{n} conns: proxy CPU µs/request",
               lambda c, d: c.cpu_us_per_request, ",.0f"),
        Metric("rps", f"{n} conns: softirq µs/request on the proxy's core",
               lambda c, d: 1e6 * c.irq_cpu_s / c.requests if c.requests else math.nan, ",.0f"),
        Metric("rps", f"{n} conns: proxy CPU % of its core",
               lambda c, d: 100 * c.proxy_cpu_s / c.window_s, ".0f"),
        Metric("rps", f"{n} conns: client + upstream CPU % of their core",
               lambda c, d: 100 * (c.client_cpu_s + c.upstream_cpu_s) / c.window_s, ".0f"),
        Metric("rps", f"{n} conns: busiest replica's share",
               lambda c, d: busiest_share(c.routes), ".2f"),
        Metric("rps", f"{n} conns: group stickiness", lambda c, d: stickiness(c.routes), ".2f"),
        Metric("lat", "1 conn: latency p50 µs", lambda c, d: c.latency_us(0.5), ",.0f"),
        Metric("lat", "1 conn: latency p99 µs", lambda c, d: c.latency_us(0.99), ",.0f"),
        Metric("lat", "1 conn: added latency p50 µs", _added(_p(0.5)), ",.0f"),
        Metric("lat", "1 conn: added latency p99 µs", _added(_p(0.99)), ",.0f"),
        Metric("lat", "1 conn: proxy CPU µs/request", lambda c, d: c.cpu_us_per_request, ",.0f"),
        Metric("stream", "stream: first data p50 µs", lambda c, d: c.first_data_us(0.5), ",.0f"),
        Metric("stream", "stream: first data p99 µs", lambda c, d: c.first_data_us(0.99), ",.0f"),
        Metric("stream", "stream: added first data p50 µs", _added(_first(0.5)), ",.0f"),
        Metric("stream", "stream: added first data p99 µs", _added(_first(0.99)), ",.0f"),
        Metric("stream", "stream: whole stream p50 µs", lambda c, d: c.latency_us(0.5), ",.0f"),
        Metric("stream", "stream: proxy CPU µs/request", lambda c, d: c.cpu_us_per_request, ",.0f"),
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Summary:
    metric: Metric
    values: Mapping[str, list[float]]  # proxy name → one value per rep

    def median(self, proxy: str) -> float:
        values = [v for v in self.values.get(proxy, []) if not math.isnan(v)]
        return statistics.median(values) if values else math.nan

    def cell(self, proxy: str) -> str:
        values = [v for v in self.values.get(proxy, []) if not math.isnan(v)]
        if not values:
            return "–"
        spec = self.metric.fmt
        text = format(self.median(proxy), spec)
        low, high = format(min(values), spec), format(max(values), spec)
        return text + (f" ({low}–{high})" if low != high else "")

    def ratio(self, a: str, b: str) -> float:
        return self.median(a) / self.median(b) if self.median(b) else math.nan


def summarize(cells: Sequence[Cell], s: Settings) -> dict[str, Summary]:
    direct = {(c.kind, c.rep): c for c in cells if c.proxy == "direct"}
    out = {}
    for m in metrics(s):
        values: dict[str, list[float]] = {}
        for c in cells:
            if c.kind == m.kind:
                values.setdefault(c.proxy, []).append(m.value(c, direct.get((c.kind, c.rep))))
        out[m.label] = Summary(m, values)
    return out


def family_names(family: str) -> tuple[str, str, str]:
    """The (llmgw, vllm-router, sglang-router) proxies of one family of policies."""
    by_kind = {p.kind: p.name for p in PROXIES if p.family == family}
    return by_kind["llmgw"], by_kind["vllm-router"], by_kind["sglang-router"]


def _ratio_text(r: float) -> str:
    return "–" if math.isnan(r) else f"{r:.2f}×"


def table(summaries: Mapping[str, Summary], family: str, markdown: bool) -> str:
    ours, vllm, sglang = family_names(family)
    columns = ["metric", "direct", ours, vllm, sglang, "llmgw ÷ vllm", "llmgw ÷ sglang"]
    rows = [
        [label, s.cell("direct"), s.cell(ours), s.cell(vllm), s.cell(sglang),
         _ratio_text(s.ratio(ours, vllm)), _ratio_text(s.ratio(ours, sglang))]
        for label, s in summaries.items()
    ]  # fmt: skip
    if markdown:
        lines = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
        return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    lines = []
    for row in [columns, *rows]:
        figures = [v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join([row[0].ljust(widths[0]), *figures]))
    return "\n".join(lines)


TARGET_RR: Final = 1.5  # our CPU per request at most this × vllm-router's, round-robin
TARGET_FIRST_DATA_US: Final = 1000.0  # first streamed byte at most this much after direct's


def verdicts(summaries: Mapping[str, Summary], s: Settings) -> list[str]:
    cpu = summaries[f"{s.conns} conns: proxy CPU µs/request"]
    added = summaries["stream: added first data p50 µs"]
    rr, vr, sr = family_names("round_robin")
    px, vc, sc = family_names("prefix")
    out = []

    def mark(value: float, ok: bool) -> str:
        return "NOT MEASURED" if math.isnan(value) else "MET" if ok else "MISSED"

    r = cpu.ratio(rr, vr)
    out.append(
        f"{mark(r, r <= TARGET_RR)}: CPU per request, round-robin: llmgw "
        f"{cpu.median(rr):,.0f} µs vs vllm-router {cpu.median(vr):,.0f} µs = {r:.2f}× "
        f"(target ≤ {TARGET_RR}×; sglang-router {cpu.median(sr):,.0f} µs)."
    )
    r = cpu.ratio(px, vc)
    out.append(
        f"{mark(r, r < 1.0)}: CPU per request, prefix tree on: llmgw prefix "
        f"{cpu.median(px):,.0f} µs vs vllm-router cache_aware {cpu.median(vc):,.0f} µs = "
        f"{r:.2f}× (target < 1×; sglang-router cache_aware {cpu.median(sc):,.0f} µs)."
    )
    for name in (rr, px):
        a = added.median(name)
        out.append(
            f"{mark(a, a <= TARGET_FIRST_DATA_US)}: first streamed byte, {name}: {a:,.0f} µs after "
            f"direct's (target ≤ {TARGET_FIRST_DATA_US:,.0f} µs; vllm-router "
            f"{added.median(vr):,.0f} µs, sglang-router {added.median(sr):,.0f} µs)."
        )
    return out


def routing_line(summaries: Mapping[str, Summary], s: Settings) -> str:
    busiest = summaries[f"{s.conns} conns: busiest replica's share"]
    sticky = summaries[f"{s.conns} conns: group stickiness"]
    rr = [p.name for p in PROXIES if p.family == "round_robin"]
    px = [p.name for p in PROXIES if p.family == "prefix"]
    return (
        f"Routing check ({s.replicas} replicas, {s.groups} groups; an even spread puts "
        f"{1 / s.replicas:.2f} of the requests on the busiest replica): round-robin busiest "
        "share " + ", ".join(f"{n} {busiest.median(n):.2f}" for n in rr) + "; prefix policies' "
        "group stickiness (1.00: every group's requests on one replica) "
        + ", ".join(f"{n} {sticky.median(n):.2f}" for n in px)
        + "."
    )


def _others_line(cells: Sequence[Cell], s: Settings) -> str:
    def span(cells: Sequence[Cell]) -> str:
        shares = sorted(100 * c.others_share for c in cells)
        return f"median {statistics.median(shares):.0f}%, at most {shares[-1]:.0f}%"

    rerun = sum(c.attempts > 1 for c in cells)
    return (
        f"Other processes during the kept windows: on CPU {s.proxy_cpu} in the proxies' cells "
        f"{span([c for c in cells if c.proxy != 'direct'])}, on CPU {s.client_cpu} in direct's "
        f"{span([c for c in cells if c.proxy == 'direct'])}; {rerun} of {len(cells)} cells "
        f"were re-run because others used more than {100 * s.max_others:g}% of that CPU."
    )


def settings_line(s: Settings) -> str:
    return (
        f"upstream: {s.replicas} ports in one process (replicas), {s.chunks} SSE events "
        f"{s.token_ms:g} ms apart when streaming, render endpoints answering {s.render}; "
        f"requests: chat completions, {s.groups} groups × {s.users} users, system prompt "
        f"~{s.prefix_chars:,} chars shared per group, question ~{s.question_chars:,} chars; "
        f"proxies pinned to CPU {s.proxy_cpu}, client and upstream to CPU {s.client_cpu}; "
        f"{s.timing.warmup_s:g} s warmup + {s.timing.seconds:g} s per cell, {s.reps} rep(s), "
        "proxies in rotating order; figures are medians (min–max)"
    )


def machine() -> dict[str, str]:
    return {
        **base_machine(),
        "versions": _versions(),
        "llmgw": _llmgw_revision(),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for name in ("uvloop", "httptools", "aiohttp", "uvicorn"):
        with contextlib.suppress(PackageNotFoundError):
            parts.append(f"{name} {version(name)}")
    if ROUTERS_PYTHON.exists():
        probe = (
            "import importlib.metadata as m; print(m.version('vllm-router'), "
            "m.version('sglang-router'))"
        )
        done = subprocess.run(
            [str(ROUTERS_PYTHON), "-c", probe], capture_output=True, text=True, check=False
        )
        vr, _, sr = done.stdout.strip().partition(" ")
        parts += [f"vllm-router {vr}", f"sglang-router {sr}"]
    return ", ".join(parts)


def _llmgw_revision() -> str:
    """The commit measured (read-only git queries), and whether llmgw/ differs from it."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=False
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown (not a git checkout)"
    dirty = git("status", "--porcelain", "--", "llmgw")
    return f"git {head}" + (" + uncommitted changes in llmgw/" if dirty else "")


def render(
    s: Settings,
    facts: Mapping[str, str],
    cells: Sequence[Cell],
    markdown: bool,
    profiles: Sequence[Profile] = (),
) -> str:
    summaries = summarize(cells, s)
    out = []
    if markdown:
        out += ["## Gateway overhead: llmgw vs vllm-router and sglang-router "
                "(scripts/bench_gateway.py)", "", "```", command_line(), "```", ""]  # fmt: skip
        out += [f"- {k}: {v}" for k, v in facts.items()] + [f"- settings: {settings_line(s)}"]
    else:
        out += [f"command: {command_line()}"] + [f"{k}: {v}" for k, v in facts.items()]
        out += [f"settings: {settings_line(s)}"]
    for family in ("round_robin", "prefix"):
        out += ["", f"Policy family: {family}", "", table(summaries, family, markdown)]
    out += ["", _others_line(cells, s), "", routing_line(summaries, s), ""]
    out += [("- " if markdown else "") + v for v in verdicts(summaries, s)]
    if profiles:
        out += [
            "",
            "Where our gateway's time goes (py-spy, not pausing it, under the "
            f"{s.conns}-connection load; the innermost Python frame of each sample):",
        ]
        out += ["", "```"] if markdown else [""]
        out += [line for p in profiles for line in profile_lines(p)]
        out += ["```"] if markdown else []
    return "\n".join(out)


# ======================================================================================
# Command line
# ======================================================================================


def parse_main(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add = p.add_argument
    add("--reps", type=int, default=3, help="repetitions of every cell (3)")
    add("--seconds", type=float, default=3.0, help="measured seconds per cell (3)")
    add("--warmup", type=float, default=1.0, help="seconds before measuring (1)")
    add("--conns", type=int, default=32, help="connections of the throughput cell (32)")
    add("--replicas", type=int, default=4, help="upstream ports, i.e. replicas (4)")
    add("--chunks", type=int, default=8, help="SSE events per streamed reply (8)")
    add("--token-ms", type=float, default=2.0, help="ms between SSE events (2)")
    add(
        "--render",
        choices=RENDER,
        default="tokens",
        help="how the upstream answers vLLM's render endpoints, which vllm-router's cache_aware "
        "calls for every request: tokens (as `vllm serve --enable-scale-out`), or forbidden "
        "(403, as plain `vllm serve`)",
    )
    add("--groups", type=int, default=8, help="shared system prompts (8)")
    add("--users", type=int, default=32, help="users (questions) per system prompt (32)")
    add("--prefix-chars", type=int, default=6000, help="system prompt length (6000)")
    add("--question-chars", type=int, default=600, help="question length (600)")
    add("--proxy-cpu", type=int, default=1)
    add("--client-cpu", type=int, default=0)
    add(
        "--max-others",
        type=float,
        default=10.0,
        help="re-run a cell where other processes used more than this %% of the proxy's CPU",
    )
    add("--attempts", type=int, default=3, help="most runs of one cell (3)")
    add(
        "--only",
        default="llmgw,vllm-router,sglang-router",
        help="proxy kinds to measure besides direct (comma-separated)",
    )
    add(
        "--profile",
        type=Path,
        metavar="DIR",
        help="after the cells, profile our gateway under load with py-spy; raw output in DIR",
    )
    add("--quick", action="store_true", help="1 rep of 1.5 s cells, 0.5 s warmup")
    add("--markdown", action="store_true", help="also print a BENCHMARKS.md section")
    return p.parse_args(argv)  # fmt: skip


def settings_from(args: argparse.Namespace) -> Settings:
    reps, seconds, warmup = (1, 1.5, 0.5) if args.quick else (args.reps, args.seconds, args.warmup)
    kinds = tuple(k for k in args.only.split(",") if k)
    if unknown := set(kinds) - {"llmgw", *PEER_MODULES}:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; choose from llmgw, {PEERS}")
    if set(kinds) & set(PEER_MODULES) and not ROUTERS_PYTHON.exists():
        raise SystemExit(
            f"vllm-router and sglang-router are not installed ({ROUTERS_PYTHON} is missing): "
            "run scripts/setup-bench-routers first, or pass --only llmgw"
        )
    checks = (0 < seconds <= 600, 0 <= warmup <= 60, 1 <= reps <= 50, 1 <= args.conns <= 1024,
              1 <= args.replicas <= 64, 1 <= args.chunks <= 1000, 0 <= args.token_ms <= 1000,
              args.groups >= 1, args.users >= 1, 1 <= args.attempts <= 20)  # fmt: skip
    if not all(checks):
        raise SystemExit("an argument is out of range (see --help)")
    if args.profile is not None:
        if not Path(sys.executable).with_name("py-spy").exists():
            raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy==0.4.3")
        args.profile.mkdir(parents=True, exist_ok=True)
    cpus = os.sched_getaffinity(0)
    if {args.proxy_cpu, args.client_cpu} - cpus or args.proxy_cpu == args.client_cpu:
        raise SystemExit(f"--proxy-cpu/--client-cpu: two different CPUs among {sorted(cpus)}")
    return Settings(
        Timing(seconds, warmup), reps, args.conns, args.replicas, args.chunks, args.token_ms,
        args.render, args.groups, args.users, args.prefix_chars, args.question_chars,
        args.proxy_cpu, args.client_cpu, args.max_others / 100, args.attempts, kinds,
        args.profile,
    )  # fmt: skip


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def start_children(s: Settings, workdir: Path) -> tuple[Child, dict[str, Child]]:
    argv = [sys.executable, os.path.abspath(__file__), "_upstream", "--replicas", str(s.replicas),
            "--chunks", str(s.chunks), "--token-ms", str(s.token_ms),
            "--render", s.render]  # fmt: skip
    upstream = spawn("upstream", argv, s.client_cpu, workdir, announces=True)
    upstream.ports = announced_ports(upstream, "PORTS")
    children: dict[str, Child] = {}
    try:
        for proxy in PROXIES:
            if proxy.kind in s.kinds:
                children[proxy.name] = start_proxy(proxy, upstream.ports, s, workdir)
    except BaseException:
        for child in (upstream, *children.values()):
            child.stop()
        raise
    return upstream, children


def main_orchestrator(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    args = parse_main(argv)
    s = settings_from(args)
    facts = machine()  # before pinning: nproc counts the CPUs this process may use
    os.sched_setaffinity(0, {s.client_cpu})
    signal.signal(signal.SIGTERM, _terminate)
    cells_per_rep = len(KINDS) * (1 + sum(p.kind in s.kinds for p in PROXIES))
    progress_line(f"bench_gateway: {s.reps} rep(s) x {cells_per_rep} cells")
    with tempfile.TemporaryDirectory(prefix="bench_gateway.") as tmp:
        upstream, children = start_children(s, Path(tmp))
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                cells, profiles = runner.run(run_bench(children, upstream, s, progress))
        except KeyboardInterrupt:
            progress_line("interrupted; every child process was stopped")
            return 130
        finally:
            for child in (*children.values(), upstream):
                child.stop()
            progress_line(upstream.log_tail(1))
    print(render(s, facts, cells, False, profiles), file=out)
    if args.markdown:
        print("\n" + render(s, facts, cells, True, profiles), file=out)
    return 0


def main(argv: Sequence[str]) -> int:
    if argv[:1] in (["_upstream"], ["_gateway"]):
        p = argparse.ArgumentParser(prog=f"bench_gateway.py {argv[0]}")
        p.add_argument("--replicas", type=int, default=1)
        p.add_argument("--chunks", type=int, default=8)
        p.add_argument("--token-ms", type=float, default=2.0)
        p.add_argument("--render", choices=RENDER, default="tokens")
        p.add_argument("--policy", default="prefix")
        p.add_argument("--upstreams", type=lambda v: [int(x) for x in v.split(",")], default=[])
        args = p.parse_args(argv[1:])
        serve = run_upstream if argv[0] == "_upstream" else run_gateway
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(args))
        return 0
    return main_orchestrator(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
