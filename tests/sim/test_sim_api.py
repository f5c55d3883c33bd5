"""The simulated OpenAI server through httpx's ASGI transport: shapes, errors, keys, metrics."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from simhelpers import metric, parse_metrics, sim_client, sim_config

from llmgw.sim.engine import EngineCore

PROMPT = ("The quick brown fox jumps over the lazy dog. " * 8).strip()  # 80 tokens
KEY = {"Authorization": "Bearer sk-sim"}
REAL_METRICS = Path(__file__).parent / "vllm-0.32-metrics-sample.txt"  # spec/, from vLLM 0.32


def sse_events(text: str) -> list[str]:
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e.removeprefix("data: ") for e in events]


async def test_health_is_200_with_an_empty_body() -> None:
    async with sim_client(sim_config()) as (_, client):
        response = await client.get("/health")
    assert (response.status_code, response.content) == (200, b"")


async def test_models_lists_served_names_and_lora_adapters_as_vllm_does() -> None:
    config = sim_config(
        "--served-model-name", "smol", "smol-alias", "--max-model-len", "2048",
        "--enable-lora", "--lora-modules", "sql=/adapters/sql",
        '{"name":"chat","path":"/adapters/chat","base_model_name":"smol-alias"}',
        "--max-loras", "2",
    )  # fmt: skip
    async with sim_client(config) as (_, client):
        body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    cards = {c["id"]: c for c in body["data"]}
    assert list(cards) == ["smol", "smol-alias", "sql", "chat"]
    smol = cards["smol"]
    assert (smol["object"], smol["owned_by"], smol["root"], smol["parent"]) == (
        "model",
        "vllm",
        "m",
        None,
    )
    assert smol["max_model_len"] == 2048 and smol["permission"][0]["object"] == "model_permission"
    assert (cards["sql"]["root"], cards["sql"]["parent"]) == ("/adapters/sql", "smol")
    assert (cards["sql"]["max_model_len"], cards["chat"]["parent"]) == (None, "smol-alias")


async def test_a_completion_has_vllms_fields_and_usage() -> None:
    async with sim_client(sim_config()) as (_, client):
        response = await client.post("/v1/completions", json={"model": "m", "prompt": PROMPT})
    body = response.json()
    assert response.status_code == 200
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "m" and body["system_fingerprint"].startswith("vllm-0.32.0")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert choice["text"] and choice["logprobs"] is None
    assert body["usage"] == {
        "prompt_tokens": 80,
        "total_tokens": 96,
        "completion_tokens": 16,  # vLLM's completions default for max_tokens
        "prompt_tokens_details": None,
    }


async def test_the_same_prompt_gets_the_same_answer() -> None:
    body = {"prompt": PROMPT, "max_tokens": 8}
    async with sim_client(sim_config()) as (_, client):
        first = (await client.post("/v1/completions", json=body)).json()
        second = (await client.post("/v1/completions", json=body)).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


async def test_prompt_token_ids_are_accepted_as_a_prompt() -> None:
    async with sim_client(sim_config()) as (_, client):
        body = (await client.post("/v1/completions", json={"prompt": [5, 6, 7]})).json()
    assert body["usage"]["prompt_tokens"] == 3


async def test_a_streamed_completion_ends_with_usage_and_done() -> None:
    request = {
        "prompt": PROMPT,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with sim_client(sim_config()) as (_, client):
        response = await client.post("/v1/completions", json=request)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = chunks[:-1]
    assert len(texts) == 5 and all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in texts] == [None] * 4 + ["length"]
    assert set(texts[0]["choices"][0]) == {
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
    }
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 80, "total_tokens": 85, "completion_tokens": 5}


async def test_a_streamed_chat_starts_with_the_role_and_ends_with_done() -> None:
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    async with sim_client(sim_config()) as (_, client):
        events = sse_events((await client.post("/v1/chat/completions", json=request)).text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["id"].startswith("chatcmpl-") for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [set(c["choices"][0]["delta"]) for c in chunks[1:]] == [{"content"}] * 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[-1]  # no include_usage, no usage chunk


async def test_a_chat_answer_has_a_message_and_stops_by_itself() -> None:
    async with sim_client(sim_config()) as (_, client):
        request = {"messages": [{"role": "user", "content": "hi"}]}
        body = (await client.post("/v1/chat/completions", json=request)).json()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "stop" and choice["message"]["content"]
    assert 8 <= body["usage"]["completion_tokens"] <= 64


async def test_tokenize_answers_in_vllms_shape_for_prompts_and_messages() -> None:
    messages = [{"role": "user", "content": "hi"}]
    async with sim_client(sim_config("--max-model-len", "2048")) as (_, client):
        prompt = (await client.post("/tokenize", json={"prompt": "Hello world"})).json()
        chat = (await client.post("/tokenize", json={"messages": messages})).json()
        strs = await client.post("/tokenize", json={"prompt": "a b", "return_token_strs": True})
        detok = await client.post("/detokenize", json={"tokens": prompt["tokens"]})
        usage = (
            await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        ).json()["usage"]
    assert list(prompt) == ["count", "max_model_len", "tokens", "token_strs"]
    assert (prompt["count"], prompt["max_model_len"], prompt["token_strs"]) == (2, 2048, None)
    assert strs.json()["token_strs"] == ["a", " b"]
    assert detok.json() == {"prompt": "Hello world"}
    assert chat["count"] == usage["prompt_tokens"] == len(chat["tokens"])


async def test_an_unknown_model_is_a_404_in_vllms_words() -> None:
    async with sim_client(sim_config()) as (_, client):
        response = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        tokenize = await client.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert response.status_code == 404 and tokenize.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ],
)
async def test_bad_requests_are_400_bad_request_errors(body: dict[str, Any], param: str) -> None:
    async with sim_client(sim_config("--max-model-len", "1024")) as (_, client):
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)


async def test_a_prompt_longer_than_the_model_is_refused() -> None:
    async with sim_client(sim_config("--max-model-len", "16")) as (_, client):
        response = await client.post("/v1/completions", json={"prompt": PROMPT})
    assert response.status_code == 400
    assert "maximum context length is 16 tokens" in response.json()["error"]["message"]


async def test_malformed_json_and_wrong_methods_and_paths_are_refused() -> None:
    async with sim_client(sim_config()) as (_, client):
        bad = await client.post("/v1/completions", content=b"{not json")
        method = await client.get("/v1/completions")
        path = await client.get("/nowhere")
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    assert (method.status_code, path.status_code) == (405, 404)


async def test_the_api_key_guards_v1_only_as_in_vllm() -> None:
    async with sim_client(sim_config("--api-key", "sk-sim")) as (_, client):
        missing = await client.get("/v1/models")
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        scheme = await client.get("/v1/models", headers={"Authorization": "Basic sk-sim"})
        good = await client.get("/v1/models", headers=KEY)
        completion = await client.post("/v1/completions", json={"prompt": "x"}, headers=KEY)
        open_paths = [await client.get(p) for p in ("/health", "/metrics", "/version")]
        tokenize = await client.post("/tokenize", json={"prompt": "x"})
    for refused in (missing, wrong, scheme):
        assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
    assert good.status_code == completion.status_code == tokenize.status_code == 200
    assert [r.status_code for r in open_paths] == [200, 200, 200]


async def test_the_api_key_can_come_from_vllm_api_key() -> None:
    config = sim_config(env={"VLLM_API_KEY": "sk-sim"})
    async with sim_client(config) as (_, client):
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/v1/models", headers=KEY)).status_code == 200


async def test_version_and_load() -> None:
    config = sim_config("--sim-vllm-version", "0.30.1", "--enable-server-load-tracking")
    async with sim_client(config) as (_, client):
        version = (await client.get("/version")).json()
        load = (await client.get("/load")).json()
    assert (version, load) == ({"version": "0.30.1"}, {"server_load": 0})


async def test_metrics_parse_and_move_with_requests() -> None:
    async with sim_client(sim_config("--served-model-name", "smol")) as (_, client):
        before = parse_metrics((await client.get("/metrics")).text)
        for _ in range(2):
            await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        response = await client.get("/metrics")
    after = parse_metrics(response.text)
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert all(
        dict(labels)["model_name"] == "smol"
        for name, labels in after
        if name != "vllm:cache_config_info"  # as in vLLM: engine only
    )
    assert all(dict(labels)["engine"] == "0" for _, labels in after)
    assert metric(before, "vllm:prefix_cache_queries_total") == 0
    assert metric(after, "vllm:prefix_cache_queries_total") == 160
    assert metric(after, "vllm:prefix_cache_hits_total") == 64  # 4 full blocks of 16
    assert metric(after, "vllm:prompt_tokens_total") == 160
    assert metric(after, "vllm:generation_tokens_total") == 8
    assert metric(after, "vllm:request_success_total", finished_reason="length") == 2
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
    assert metric(after, "vllm:time_to_first_token_seconds_count") == 2
    assert metric(after, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == 2
    info = dict(next(ls for n, ls in after if n == "vllm:cache_config_info"))
    assert (info["block_size"], info["enable_prefix_caching"], info["engine"]) == (
        "16",
        "True",
        "0",
    )
    assert "model_name" not in info


async def test_prompt_tokens_details_report_cached_tokens_when_enabled() -> None:
    async with sim_client(sim_config("--enable-prompt-tokens-details")) as (_, client):
        usages = [
            (await client.post("/v1/completions", json={"prompt": PROMPT})).json()["usage"]
            for _ in range(2)
        ]
    assert [u["prompt_tokens_details"] for u in usages] == [
        {"cached_tokens": 0},
        {"cached_tokens": 64},
    ]


async def test_reset_prefix_cache_forgets_cached_prompts() -> None:
    async with sim_client(sim_config()) as (_, client):
        await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert (await client.post("/reset_prefix_cache")).status_code == 200
        await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        samples = parse_metrics((await client.get("/metrics")).text)
    assert metric(samples, "vllm:prefix_cache_hits_total") == 0


async def test_a_lora_request_echoes_the_adapter_name() -> None:
    config = sim_config("--enable-lora", "--lora-modules", "sql=/a/sql")
    async with sim_client(config) as (_, client):
        body = (await client.post("/v1/completions", json={"model": "sql", "prompt": "x"})).json()
    assert body["model"] == "sql"


async def test_many_concurrent_requests_all_complete() -> None:
    async with sim_client(sim_config("--sim-kv-blocks", "64", "--max-model-len", "256")) as (
        server,
        client,
    ):
        bodies = [
            {"prompt": f"{i} {PROMPT}", "max_tokens": 20, "ignore_eos": True} for i in range(24)
        ]
        responses = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
        assert all(r.status_code == 200 for r in responses)
        assert {r.json()["usage"]["completion_tokens"] for r in responses} == {20}
        assert server.engine.pool.usage == 0.0 and server.engine.stats.preemptions > 0


async def test_a_cached_prefix_shortens_the_simulated_prefill_in_real_time() -> None:
    config = sim_config(
        "--sim-prefill-ms-per-token", "5", "--sim-decode-ms-per-token", "1", fast=False
    )
    body = {"prompt": PROMPT, "max_tokens": 1}
    async with sim_client(config) as (_, client):
        elapsed = []
        for _ in range(2):
            started = time.monotonic()
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            elapsed.append(time.monotonic() - started)
    assert elapsed[0] >= 80 * 0.005  # every prompt token prefilled
    assert elapsed[1] < 0.3  # 16 uncached tokens: about 80 ms


async def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    async with sim_client(sim_config()) as (_, client):
        response = await client.post("/v1/completions", json={"prompt": [1, 2**70]})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"Token id {2**70} is out of vocabulary"


async def test_a_dead_engine_makes_health_answer_503(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken_step(self: EngineCore) -> bool:
        raise RuntimeError("simulated bug in the step loop")

    monkeypatch.setattr(EngineCore, "_step", broken_step)
    async with sim_client(sim_config()) as (server, client):
        crashed = asyncio.Event()
        server.set_on_crash(crashed.set)
        pending = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"}))
        await asyncio.wait_for(crashed.wait(), 5)
        assert (await client.get("/health")).status_code == 503
        pending.cancel()
        await asyncio.wait([pending])


def _families(text: str) -> dict[str, tuple[str, str]]:
    """{name: (type, help)} of the vllm: families in an exposition text."""
    helps = dict(re.findall(r"^# HELP (vllm:\S+) (.*)$", text, re.M))
    types = dict(re.findall(r"^# TYPE (vllm:\S+) (\S+)$", text, re.M))
    return {name: (kind, helps[name]) for name, kind in types.items()}


def _label_names(text: str) -> dict[str, set[frozenset[str]]]:
    """{sample name: the label-name sets it appears with}, ``le`` left out."""
    out: dict[str, set[frozenset[str]]] = {}
    for name, labels in parse_metrics(text):
        if name.startswith("vllm:") and not name.endswith("_created"):
            out.setdefault(name, set()).add(frozenset(k for k, _ in labels if k != "le"))
    return out


async def test_every_metric_family_is_one_vllm_0_32_exposes_with_its_type_and_help() -> None:
    real_text = REAL_METRICS.read_text()
    async with sim_client(sim_config()) as (_, client):
        text = (await client.get("/metrics")).text
    real, ours = _families(real_text), _families(text)
    assert {name: real.get(name) for name in ours} == ours
    real_labels, our_labels = _label_names(real_text), _label_names(text)
    del our_labels["vllm:cache_config_info"]  # a subset of vLLM's many config labels
    assert {name: real_labels.get(name) for name in our_labels} == our_labels


async def test_tokenize_skew_shifts_what_tokenize_answers_but_not_what_is_generated() -> None:
    async with sim_client(sim_config()) as (_, plain):
        honest = (await plain.post("/tokenize", json={"model": "m", "prompt": PROMPT})).json()
    async with sim_client(sim_config("--sim-tokenize-skew", "7")) as (_, client):
        skewed = (await client.post("/tokenize", json={"model": "m", "prompt": PROMPT})).json()
        answer = await client.post("/v1/completions", json={"model": "m", "prompt": PROMPT})
    assert skewed["tokens"] == [t + 7 for t in honest["tokens"]]
    assert answer.json()["usage"]["prompt_tokens"] == honest["count"]
