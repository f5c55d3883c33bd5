"""Scheduler steps: prefix hits, simulated time, eviction, preemption, LoRA budget, aborts."""

from __future__ import annotations

import pytest

from llmgw.kvcache import BlockRemoved, BlockStored, RequestExtraKeys, none_hash
from llmgw.sim.engine.blocks import BlockPool
from llmgw.sim.engine.generation import OutputPlan, SamplingSpec, word_token_ids
from llmgw.sim.engine.metrics import EngineStats
from llmgw.sim.engine.scheduler import (
    HashingConfig,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SimRequest,
    TokenOutput,
)
from llmgw.sim.engine.tokenizer import SimTokenizer

WORDS = word_token_ids(SimTokenizer())
PREFILL_S, DECODE_S = 0.001, 0.01


def make(
    num_blocks: int = 64,
    *,
    block_size: int = 16,
    caching: bool = True,
    max_loras: int = 1,
    max_model_len: int = 512,
) -> Scheduler:
    hashing = None
    if caching:
        root = none_hash("sha256_cbor", "0", "0.32.0")
        hashing = HashingConfig("sha256_cbor", root, "0.32.0")
    config = SchedulerConfig(
        block_size=block_size,
        max_model_len=max_model_len,
        max_loras=max_loras,
        prefill_s_per_token=PREFILL_S,
        decode_s_per_token=DECODE_S,
        hashing=hashing,
    )
    pool = BlockPool(num_blocks, block_size, record_events=caching)
    return Scheduler(config, pool, EngineStats(max_model_len))


class Recorder:
    def __init__(self) -> None:
        self.outputs: list[TokenOutput] = []

    def __call__(self, output: TokenOutput) -> None:
        self.outputs.append(output)


def request(
    prompt: list[int], max_tokens: int = 4, rid: str = "r", lora: str | None = None
) -> tuple[SimRequest, Recorder]:
    sink = Recorder()
    spec = SamplingSpec(max_tokens=max_tokens, ignore_eos=True)
    keys = None
    if lora is not None:
        keys = RequestExtraKeys(lora_name=lora, lora_path=f"/{lora}", vllm_version="0.32.0")
    req = SimRequest(
        rid, prompt, OutputPlan(prompt, spec, WORDS), sink, 0.0, lora_name=lora, extra_keys=keys
    )
    return req, sink


def drain(scheduler: Scheduler, now: float = 0.0, limit: int = 1000) -> float:
    """Run steps until idle; the simulated time spent."""
    for _ in range(limit):
        if not scheduler.has_work():
            return now
        plan = scheduler.schedule(now)
        now += plan.duration_s
        scheduler.complete(plan, now)
    raise AssertionError("the scheduler did not go idle")


PROMPT = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16 and 8 more


def test_a_first_prompt_pays_prefill_for_every_token() -> None:
    scheduler = make()
    req, sink = request(PROMPT)
    scheduler.add(req)
    plan = scheduler.schedule(0.0)
    assert plan.prefills == ((req, 40),)
    assert plan.duration_s == pytest.approx(40 * PREFILL_S + DECODE_S)


def test_a_repeated_prompt_reuses_its_full_blocks_and_prefills_only_the_rest() -> None:
    scheduler = make()
    first, _ = request(PROMPT, rid="a")
    scheduler.add(first)
    drain(scheduler)
    again, sink = request(PROMPT, rid="b")
    scheduler.add(again)
    plan = scheduler.schedule(1.0)
    assert plan.prefills == ((again, 8),)
    assert plan.duration_s == pytest.approx(8 * PREFILL_S + DECODE_S)
    drain(scheduler, 1.0)
    stats = scheduler.stats
    assert (stats.prefix_queries, stats.prefix_hits) == (80, 32)
    assert (stats.prompt_tokens, stats.cached_prompt_tokens) == (80, 32)
    assert sink.outputs[-1].cached_tokens == 32


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    scheduler = make()
    prompt = list(range(32))  # exactly two blocks
    for rid in ("a", "b"):
        scheduler.add(request(prompt, rid=rid)[0])
        drain(scheduler)
    assert scheduler.stats.prefix_hits == 16  # vLLM caps a hit at num_tokens - 1


def test_without_prefix_caching_nothing_is_hashed_counted_or_reused() -> None:
    scheduler = make(caching=False)
    for rid in ("a", "b"):
        scheduler.add(request(PROMPT, rid=rid)[0])
        drain(scheduler)
    assert (scheduler.stats.prefix_queries, scheduler.stats.prefix_hits) == (0, 0)
    assert scheduler.pool.take_events() == []


def test_tokens_arrive_one_per_step_and_the_request_ends_with_its_reason() -> None:
    scheduler = make()
    req, sink = request(PROMPT, max_tokens=3)
    scheduler.add(req)
    drain(scheduler)
    assert [o.output_tokens for o in sink.outputs] == [1, 2, 3]
    assert [o.finish_reason for o in sink.outputs] == [None, None, "length"]
    assert req.status is RequestStatus.FINISHED and scheduler.pool.usage == 0.0
    assert scheduler.stats.success["length"] == 1 and scheduler.stats.generation_tokens == 3


def test_decode_fills_blocks_and_stores_them_as_they_fill() -> None:
    scheduler = make()
    req, _ = request(PROMPT, max_tokens=12)  # 40 + 12 = 52 tokens: a third full block
    scheduler.add(req)
    drain(scheduler)
    stored = [e for e in scheduler.pool.take_events() if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [2, 1]
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
    assert stored[1].token_ids[:8] == tuple(PROMPT[32:])


def test_a_full_cache_evicts_the_least_recently_freed_prefix() -> None:
    scheduler = make(num_blocks=6)
    first, _ = request(PROMPT, rid="a")
    scheduler.add(first)
    drain(scheduler)
    other, _ = request(list(range(2000, 2081)), max_tokens=1, rid="b")  # 81 tokens: 6 blocks
    scheduler.add(other)
    drain(scheduler)
    removed = [e for e in scheduler.pool.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 2  # both of the first prompt's cached blocks
    again, _ = request(PROMPT, rid="c")
    scheduler.add(again)
    assert scheduler.schedule(9.0).prefills == ((again, 40),)


def test_when_blocks_run_out_the_newest_running_request_is_preempted_and_resumes() -> None:
    scheduler = make(num_blocks=3, block_size=4, max_model_len=12)
    older, older_sink = request(list(range(8)), max_tokens=4, rid="old")
    newer, newer_sink = request(list(range(100, 104)), max_tokens=4, rid="new")
    scheduler.add(older)
    scheduler.add(newer)
    drain(scheduler)
    assert scheduler.stats.preemptions >= 1 and newer.preemptions >= 1
    assert older_sink.outputs[-1].finish_reason == "length"
    assert newer_sink.outputs[-1].output_tokens == 4
    assert scheduler.pool.num_free == 3


def test_requests_for_a_second_lora_wait_while_the_budget_is_used() -> None:
    scheduler = make(max_loras=1)
    a, _ = request(PROMPT, rid="a", lora="sql")
    b, _ = request(PROMPT, rid="b", lora="chat")
    c, _ = request(PROMPT, rid="c")
    for req in (a, b, c):
        scheduler.add(req)
    plan = scheduler.schedule(0.0)
    assert [r.request_id for r, _ in plan.prefills] == ["a", "c"]
    assert scheduler.num_deferred == 1 and list(scheduler.waiting) == [b]
    drain(scheduler)
    assert b.status is RequestStatus.FINISHED


def test_lora_requests_hash_differently_from_the_base_model() -> None:
    scheduler = make()
    scheduler.add(request(PROMPT, rid="a")[0])
    drain(scheduler)
    lora, _ = request(PROMPT, rid="b", lora="sql")
    scheduler.add(lora)
    assert scheduler.schedule(1.0).prefills == ((lora, 40),)


def test_an_aborted_request_frees_its_blocks_and_says_abort() -> None:
    scheduler = make()
    req, sink = request(PROMPT, max_tokens=50)
    scheduler.add(req)
    plan = scheduler.schedule(0.0)
    assert scheduler.pool.usage > 0
    assert scheduler.abort("r", 0.5)
    scheduler.complete(plan, 0.5)  # the step in flight skips it
    assert scheduler.pool.usage == 0.0 and not scheduler.has_work()
    assert sink.outputs[-1] == TokenOutput(None, "abort", 40, 0, 0)
    assert scheduler.stats.success["abort"] == 1
    assert not scheduler.abort("r", 0.6)


def test_a_waiting_request_can_be_aborted_too() -> None:
    scheduler = make()
    req, sink = request(PROMPT)
    scheduler.add(req)
    assert scheduler.abort("r", 0.0)
    assert not scheduler.has_work() and sink.outputs[-1].finish_reason == "abort"


def test_the_model_length_ends_a_request() -> None:
    scheduler = make(max_model_len=42)
    req, sink = request(PROMPT, max_tokens=100)
    scheduler.add(req)
    drain(scheduler)
    assert sink.outputs[-1].output_tokens == 2 and sink.outputs[-1].finish_reason == "length"


def test_waiting_requests_queue_behind_the_seat_limit() -> None:
    scheduler = make()
    scheduler.config = SchedulerConfig(block_size=16, max_model_len=512, max_num_seqs=1)
    scheduler.add(request(PROMPT, rid="a")[0])
    scheduler.add(request(PROMPT, rid="b")[0])
    scheduler.schedule(0.0)
    assert (len(scheduler.running), len(scheduler.waiting)) == (1, 1)
