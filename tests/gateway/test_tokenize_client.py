"""The tokenize client: the simulated engine's real /tokenize, and replicas that fail it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from simserve import sim_engine

from llmgw.addresses import free_port
from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.precise import Fallback, PreciseRequest, PreciseTier
from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.gateway.routing.load import LoadTracker
from llmgw.gateway.routing.policy import PrefixPolicy
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.gateway.tokenize import (
    TokenizeClient,
    TokenizeConfig,
    parse_tokens,
    tokenize_input,
)
from llmgw.gateway.upstream import UpstreamPool
from llmgw.sim.engine import SimTokenizer, render_chat

KEY = "sk-tok"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def key_engine(*flags: str) -> contextlib.AbstractAsyncContextManager[str]:
    """``llmgw sim-engine serve sim-model`` with this file's API key; its URL."""
    return sim_engine("sim-model", "--api-key", KEY, *flags)


Answer = Callable[[bytes], Awaitable[bytes | None]]  # request head+body → bytes to send


@contextlib.asynccontextmanager
async def fake_replica(answer: Answer) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A replica that answers each request as ``answer`` says (None: nothing, the
    connection stays open until the client leaves; b"": the connection is closed)."""
    seen: list[bytes] = []
    handlers: set[asyncio.Task[Any]] = set()
    writers: set[asyncio.StreamWriter] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                request = head + await reader.readexactly(length)
                seen.append(request)
                out = await answer(request)
                if out is None:
                    await reader.read()  # until the client closes
                if not out:
                    return
                writer.write(out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


def http_json(document: Any, status: int = 200) -> bytes:
    data = json.dumps(document).encode()
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        len(data),
        data,
    )


@contextlib.asynccontextmanager
async def client(config: TokenizeConfig | None = None) -> AsyncIterator[TokenizeClient]:
    pool = UpstreamPool()
    try:
        yield TokenizeClient(pool, config or TokenizeConfig())
    finally:
        await pool.close()


def body_of(path: str, document: dict[str, Any]) -> bytes:
    wanted = tokenize_input(path, json.dumps(document).encode(), document["model"])
    assert not wanted.unsupported
    return wanted.body


# -- against the simulated engine's own /tokenize ---------------------------------------------


async def test_tokens_from_the_simulated_engine_are_those_it_prefills() -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    async with key_engine() as url, client(TokenizeConfig(timeout_s=2.0)) as tokenizer:
        prompt = "The capital of France is Paris, 42 times."
        completion = body_of(COMPLETIONS, {"model": "sim-model", "prompt": prompt})
        done = await tokenizer.tokenize(url, KEY, completion)
        assert done.failure == "" and done.tokens is not None
        assert list(done.tokens) == SimTokenizer().encode(prompt)
        chat = body_of(CHAT, {"model": "sim-model", "messages": messages, "max_tokens": 3})
        done = await tokenizer.tokenize(url, KEY, chat)
        assert done.tokens is not None and done.seconds > 0 and not done.cached
        rendered = render_chat(messages, add_generation_prompt=True)
        assert list(done.tokens) == SimTokenizer().encode(rendered)
        async with httpx.AsyncClient(base_url=url) as direct:  # what the engine itself says
            reply = await direct.post("/tokenize", content=chat)
            assert reply.json()["tokens"] == list(done.tokens)
        again = await tokenizer.tokenize(url, KEY, chat)
        assert again.cached and again.tokens == done.tokens


async def test_the_generation_prompt_and_template_fields_follow_the_request() -> None:
    messages = [
        {"role": "user", "content": "Continue this"},
        {"role": "assistant", "content": "Ok"},
    ]
    document = {
        "model": "sim-model",
        "messages": messages,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "temperature": 0.3,
    }
    sent = json.loads(body_of(CHAT, document))
    assert sent == {
        "model": "sim-model",
        "messages": messages,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    async with key_engine() as url, client(TokenizeConfig(timeout_s=2.0)) as tokenizer:
        done = await tokenizer.tokenize(url, KEY, body_of(CHAT, document))
        rendered = render_chat(messages, add_generation_prompt=False, continue_final_message=True)
        assert done.tokens is not None and list(done.tokens) == SimTokenizer().encode(rendered)


def test_what_is_tokenized_for_each_kind_of_request() -> None:
    def of(path: str, document: dict[str, Any]) -> Any:
        return tokenize_input(path, json.dumps(document).encode(), "m")

    batch = of(COMPLETIONS, {"model": "m", "prompt": ["first", "second"], "cache_salt": "s"})
    assert json.loads(batch.body) == {"model": "m", "prompt": "first"} and batch.cache_salt == "s"
    ids = of(COMPLETIONS, {"model": "m", "prompt": [5, 6, 7]})
    assert ids.body == b"" and ids.tokens is not None and list(ids.tokens) == [5, 6, 7]
    nested = of(COMPLETIONS, {"model": "m", "prompt": [[8, 9]]})
    assert nested.tokens is not None and list(nested.tokens) == [8, 9]
    assert of(COMPLETIONS, {"model": "m", "prompt": [True, 2]}).unsupported == "malformed_request"
    assert of(COMPLETIONS, {"model": "m", "prompt": [-1]}).unsupported == "malformed_request"
    assert of(COMPLETIONS, {"model": "m", "prompt_embeds": "x"}).unsupported == "prompt_embeds"
    special = of(COMPLETIONS, {"model": "m", "prompt": "p", "add_special_tokens": False})
    assert json.loads(special.body)["add_special_tokens"] is False
    text_parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    chat = of(CHAT, {"model": "m", "messages": [{"role": "user", "content": text_parts}]})
    assert chat.unsupported == "" and json.loads(chat.body)["add_generation_prompt"] is True
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    media = of(CHAT, {"model": "m", "messages": [{"role": "user", "content": image}]})
    assert media.unsupported == "multimodal"
    assert tokenize_input(CHAT, b"\xff", "m").unsupported == "malformed_request"


def test_answers_are_validated() -> None:
    assert parse_tokens(b'{"count":2,"tokens":[1,2],"token_strs":null}', 10) is not None
    for bad in (
        b"not json",
        b"[1,2]",
        b'{"count":3,"tokens":[1,2]}',  # count disagrees
        b'{"tokens":"12"}',
        b'{"tokens":[1,"2"]}',
        b'{"tokens":[1,-2]}',
        b'{"tokens":[1,18446744073709551616]}',  # beyond 64 bits
        b'{"tokens":[1,2.5]}',
        b'{"tokens":[true]}',
        b'{"tokens":[1,2,3]}',  # longer than the bound below
    ):
        assert parse_tokens(bad, 2) is None, bad


# -- replicas that are slow or broken -----------------------------------------------------------


def answering(out: bytes | None, delay: float = 0.0) -> Answer:
    async def answer(request: bytes) -> bytes | None:
        if delay:
            await asyncio.sleep(delay)
        return out

    return answer


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (answering(None), "timeout"),  # never answers
        (answering(http_json({"tokens": [1, 2]}), delay=2.0), "timeout"),  # too late
        (answering(http_json({"error": "boom"}, status=500)), "status"),
        (answering(http_json({"tokens": ["a"]})), "malformed"),
        (answering(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n{nope"), "malformed"),
        (answering(b"SPDY/9 what\r\n\r\n"), "protocol"),
        (answering(b"HTTP/1.1 200 OK\r\ncontent-length: 99999999\r\n\r\n"), "protocol"),
        (answering(b""), "closed"),  # closes without answering
    ],
)
async def test_a_failed_call_says_why_within_its_bound(answer: Answer, reason: str) -> None:
    # 0.4 s rather than the gateway's 50 ms: a starved CI machine must not turn a fast
    # failure into a timeout
    bound = TokenizeConfig(timeout_s=0.4)
    async with fake_replica(answer) as (url, seen), client(bound) as tokenizer:
        started = time.monotonic()
        done = await tokenizer.tokenize(url, "sk-x", b'{"model":"m","prompt":"p"}')
        took = time.monotonic() - started
    assert (done.tokens, done.failure) == (None, reason)
    assert took < bound.timeout_s + 0.5  # this shared machine's slack
    assert seen and b"authorization: Bearer sk-x" in seen[0]
    assert seen[0].startswith(b"POST /tokenize HTTP/1.1\r\n")


async def test_no_replica_listening_is_a_connect_failure() -> None:
    async with client(TokenizeConfig(timeout_s=1.0)) as tokenizer:
        done = await tokenizer.tokenize(f"http://127.0.0.1:{free_port()}", "", b"{}")
    assert done.failure == "connect"


async def test_a_slow_tokenizer_sends_the_request_to_the_approximate_tier() -> None:
    index = KvIndex()
    index.apply("r1", False, [11, 12], block_size=16)
    metrics = GatewayMetrics()
    async with fake_replica(answering(None)) as (url, _), client() as tokenizer:
        precise = PreciseTier(index, PrefixPolicy(), tokenizer, metrics=metrics)
        prepared = await precise.prepare(
            COMPLETIONS,
            b'{"model":"m","prompt":"hello there"}',
            "m",
            11,
            (Target("r1", "m", url, kv_events=True),),
            LoadTracker(),
        )
    assert prepared == Fallback("timeout")
    assert metrics.precise_fallbacks == {"timeout": 1}
    assert metrics.tokenize_failures == {"timeout": 1}
    assert metrics.tokenize_seconds.count == 1


async def test_the_least_loaded_candidate_tokenizes() -> None:
    index = KvIndex()
    index.apply("a", False, [1], block_size=4)
    answer = answering(http_json({"count": 3, "tokens": [1, 2, 3]}))
    async with fake_replica(answer) as (busy, busy_seen), fake_replica(answer) as (idle, idle_seen):
        async with client() as tokenizer:
            precise = PreciseTier(index, PrefixPolicy(), tokenizer)
            load = LoadTracker()
            load.acquire("a")
            candidates = (
                Target("a", "m", busy, kv_events=True),
                Target("b", "m", idle, kv_events=True),
            )
            for prompt in ("one", "two", "three"):
                data = json.dumps({"model": "m", "prompt": prompt}).encode()
                prepared = await precise.prepare(COMPLETIONS, data, "m", 3, candidates, load)
                assert isinstance(prepared, PreciseRequest)
                assert list(prepared.tokens) == [1, 2, 3]
    assert (len(busy_seen), len(idle_seen)) == (0, 3)


async def test_the_gateway_routes_by_the_approximate_tier_when_tokenize_hangs() -> None:
    async def replica(request: bytes) -> bytes | None:
        if request.startswith(b"POST /tokenize"):
            return None  # hangs
        return http_json({"id": "cmpl-1", "choices": []})

    async with fake_replica(replica) as (url, seen):
        table = RoutingTable([Target("r1", "m", url, kv_events=True)])
        gateway = Gateway(table, GatewayConfig(port=0, tokenize_timeout_s=0.05))
        gateway.kv_index.apply("r1", False, [21, 22], block_size=16)
        host, port = await gateway.start()
        try:
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as http:
                reply = await http.post(COMPLETIONS, json={"model": "m", "prompt": "hi there"})
        finally:
            await gateway.stop()
        assert reply.status_code == 200
        assert gateway.metrics.precise_fallbacks == {"timeout": 1}
        assert gateway.metrics.decisions == {("load", "miss"): 1}  # the tree was cold
        text = gateway.metrics.render({}).decode()
        assert 'llmgw_precise_fallbacks_total{reason="timeout"} 1' in text
        assert 'llmgw_tokenize_failures_total{reason="timeout"} 1' in text
    assert [r.split(b" ")[1] for r in seen] == [b"/tokenize", b"/v1/completions"]
