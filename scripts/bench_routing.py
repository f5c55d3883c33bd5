#!/usr/bin/env python3
"""Benchmark: the gateway's routing policies on a shared-prefix, multi-turn chat workload.

The workload is shaped like llm-d's prefix-cache benchmark: ``--groups`` groups, each with a
long shared system prompt (``--system-tokens``, 6,000 by default), ``--users`` users per
group, each in a ``--turns``-turn conversation: every turn appends a fresh question
(``--question-tokens``, 1,000) to the conversation so far, the model's earlier answers
included, rendered as ChatML. Conversations start as a seeded Poisson process
(``--rate`` requests per second offered: conversations start at ``rate / turns`` per
second) and a user sends the next turn an exponential think time (``--think`` seconds,
mean) after the previous answer ends. Everything is generated from ``--seed``, and the
model's answers are a function of the prompt, so every policy replays the same workload.

It is replayed in simulated time, in-process, against ``--engines`` simulated engines
built from the simulated engine's own parts (llmgw/sim/engine): its vLLM v1 block pool
(prefix hashes, LRU eviction of free cached blocks), its scheduler (admission with prefix
reuse, preemption) and its timing model (a step costs ``prefill_s × uncached tokens +
decode_s``, the simulated engine's defaults), with ``--kv-blocks`` blocks per engine: by
default a third of the groups' system prompts fit in one engine, so no engine holds the
working set. A discrete-event loop (step completions and arrivals on one heap) drives them;
wall time does not enter, so figures depend on the seed only.

Per policy (the gateway's own ``make_policy`` for prefix, round_robin, least_load and
session, and an ORACLE that reads every engine's exact cache at decision time: the longest
cached prefix of the request's block hashes, turned into a decision by the same scoring,
guard and tie-break as the prefix policy), with in-flight load counted at decision time by
the gateway's `LoadTracker`:

* delivered prefix-hit rate: prefix_cache_hits / prefix_cache_queries summed over the
  engines' own counters (as vLLM counts them, re-admissions after preemption included);
* simulated TTFT p50/p90/p99: arrival to the first token (queueing, prefill of the uncached
  tokens, steps shared with other requests);
* load imbalance: max / mean requests per engine, and their coefficient of variation;
* ratios: default hit rate / oracle hit rate (target >= 0.8) and round-robin TTFT p90 /
  default TTFT p90 (target >= 2); the exit status is 1 when a measured ratio misses.

Besides, the reuse ceiling: the share of prompt tokens one unbounded cache could serve in
any arrival order, a bound on every policy's cached share. The oracle is the issue's upper
bound but no strict one: it trades cache for load like the prefix policy, and sees only
what engines hold, not requests still queued for them, where the tree records a choice at
once. The JSON also says, per policy, the share the decisions claimed
(``predicted_share``), what the chosen engine really held when it was chosen
(``exact_chosen_share``) and what the best engine held (``exact_best_share``): the gap
between the first two is the approximate tree's staleness, between the last two the cost
of the choice.

The default rate, 12 requests/s, keeps the oracle's engines about half busy (52 %, TTFT
p90 0.5 s) while round-robin, least-load and session are past saturation (their engines
~90 % busy over the whole run and their last answers 40 s later than the oracle's). At
8 requests/s round-robin still keeps up; from 10 it falls behind.

    .venv/bin/python scripts/bench_routing.py             # 8 engines, 16 × 32 users, 4 turns
    .venv/bin/python scripts/bench_routing.py --quick     # a small workload, seconds
    .venv/bin/python scripts/bench_routing.py --json      # figures as JSON on stdout
    .venv/bin/python scripts/bench_routing.py --markdown  # also a BENCHMARKS.md section
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import string
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from benchkit import base_machine, command_line

from llmgw.kvcache import hash_block, none_hash
from llmgw.server.router.load import LoadTracker
from llmgw.server.router.policy import (
    Decision,
    Policy,
    PrefixConfig,
    PrefixPolicy,
    RouteRequest,
    make_policy,
)
from llmgw.server.router.prefix_tree import PrefixTree
from llmgw.server.router.table import RoutingTable, Target
from llmgw.sim.engine.blocks import BlockPool
from llmgw.sim.engine.config import SimBehaviour
from llmgw.sim.engine.generation import OutputPlan, SamplingSpec, word_token_ids
from llmgw.sim.engine.metrics import EngineStats
from llmgw.sim.engine.scheduler import (
    HashingConfig,
    Scheduler,
    SchedulerConfig,
    SimRequest,
    StepPlan,
    TokenOutput,
)
from llmgw.sim.engine.tokenizer import IM_END, SimTokenizer

MODEL = "bench-model"
ORACLE = "oracle"
DEFAULT_POLICY = "prefix"
POLICY_ORDER = (DEFAULT_POLICY, "round_robin", "least_load", "session")
HASH_ALGO, HASH_SEED, VLLM_VERSION = "sha256", "0", "0.32.0"
HIT_RATIO, TTFT_RATIO = "default_hit_rate_over_oracle", "rr_ttft_p90_over_default"
TARGETS = {HIT_RATIO: 0.8, TTFT_RATIO: 2.0}  # issue #5
TARGET_LABELS = {
    HIT_RATIO: "default hit rate / oracle hit rate",
    TTFT_RATIO: "round-robin TTFT p90 / default TTFT p90",
}
_SHARED = SimBehaviour()  # the simulated engine's default timing


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """The workload, the fleet and the timing model of one run."""

    engines: int = 8
    groups: int = 16
    users: int = 32  # per group
    turns: int = 4
    seed: int = 1
    system_tokens: int = 6000
    question_tokens: int = 1000
    rate: float = 12.0  # requests per second offered (conversations start at rate / turns)
    think_s: float = 5.0  # mean pause between an answer and the next question
    block_size: int = 16
    kv_blocks: int = 0  # per engine; 0 → a third of the groups' system prompts
    max_tokens: int = 256
    max_num_seqs: int = 256
    prefill_s_per_token: float = _SHARED.prefill_s_per_token
    decode_s_per_token: float = _SHARED.decode_s_per_token
    prefix: PrefixConfig = PrefixConfig()  # the prefix policy's knobs (and the oracle's)

    @property
    def blocks_per_engine(self) -> int:
        if self.kv_blocks:
            return self.kv_blocks
        return max(self.groups * self.system_tokens // (3 * self.block_size), 1)

    @property
    def max_model_len(self) -> int:
        per_turn = self.question_tokens + self.max_tokens + 16
        return self.system_tokens + self.turns * per_turn + 64


QUICK: dict[str, Any] = {
    "engines": 4, "groups": 6, "users": 6, "turns": 3, "system_tokens": 1500,
    "question_tokens": 250, "rate": 6.0, "think_s": 2.0,
}  # fmt: skip


# -- the workload --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a conversation: its prompt is a prefix of the conversation's tokens."""

    prompt_len: int  # tokens
    text_len: int  # characters of the rendered prompt
    answer: tuple[int, ...]  # the tokens the model answers (a function of the prompt)
    think_s: float  # pause after the previous answer (0 for the first turn)


@dataclass(frozen=True, slots=True)
class Conversation:
    """One user's turns; tokens, hashes and text beyond the group's shared prefix."""

    user: str
    group: int
    start_s: float
    tail_tokens: tuple[int, ...]
    tail_text: str
    hashes: tuple[bytes, ...]  # block hashes of the whole conversation, group prefix included
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class Group:
    """A group's shared system prompt, rendered and tokenized."""

    tokens: tuple[int, ...]
    text: str
    hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    groups: tuple[Group, ...]
    conversations: tuple[Conversation, ...]

    @property
    def requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def prompt(self, conv: Conversation, turn: Turn) -> list[int]:
        group = self.groups[conv.group]
        return [*group.tokens, *conv.tail_tokens[: turn.prompt_len - len(group.tokens)]]

    def text(self, conv: Conversation, turn: Turn) -> str:
        group = self.groups[conv.group]
        return group.text + conv.tail_text[: turn.text_len - len(group.text)]


class _Words:
    """Seeded random lowercase words, each one token of the simulated tokenizer."""

    def __init__(self, rng: random.Random, size: int = 20_000) -> None:
        letters = string.ascii_lowercase
        self._rng = rng
        self._vocab = [
            " " + "".join(rng.choices(letters, k=rng.randint(3, 9))) for _ in range(size)
        ]

    def text(self, count: int) -> str:
        return "".join(self._rng.choices(self._vocab, k=count))


class _Builder:
    """Builds conversations turn by turn: tokens, text and block hashes in lockstep."""

    def __init__(self, config: BenchConfig, tokenizer: SimTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.words = word_token_ids(tokenizer)
        self.root = none_hash(HASH_ALGO, HASH_SEED, VLLM_VERSION)

    def extend_hashes(self, hashes: list[bytes], tokens: Sequence[int]) -> None:
        size = self.config.block_size
        for index in range(len(hashes), len(tokens) // size):
            parent = hashes[-1] if hashes else self.root
            block = tokens[index * size : (index + 1) * size]
            hashes.append(hash_block(parent, block, None, HASH_ALGO))

    def group(self, system: str) -> Group:
        text = f"<|im_start|>system\n{system}<|im_end|>\n"
        tokens = self.tokenizer.encode(text)
        hashes: list[bytes] = []
        self.extend_hashes(hashes, tokens)
        return Group(tuple(tokens), text, tuple(hashes))

    def answer(self, prompt: Sequence[int]) -> tuple[int, ...]:
        """What the simulated engine answers, exactly as its scheduler samples it."""
        spec = SamplingSpec(max_tokens=self.config.max_tokens)
        plan = OutputPlan(prompt, spec, self.words, 0)
        out: list[int] = []
        while True:
            out.append(plan.token(len(out)))
            if plan.finish_reason(len(out), len(prompt) + len(out), self.config.max_model_len):
                return tuple(out)

    def conversation(
        self, user: str, group_index: int, group: Group, start_s: float, draw: _Draw
    ) -> Conversation:
        tokens, text, hashes = list(group.tokens), group.text, list(group.hashes)
        turns: list[Turn] = []
        for _ in range(self.config.turns):
            closing = "" if not turns or turns[-1].answer[-1] == IM_END else "<|im_end|>"
            opening = "" if not turns else "\n"
            piece = f"{closing}{opening}<|im_start|>user\n{draw.question()}<|im_end|>\n"
            piece += "<|im_start|>assistant\n"
            tokens += self.tokenizer.encode(piece)
            text += piece
            answer = self.answer(tokens)
            think = draw.think() if turns else 0.0
            turns.append(Turn(len(tokens), len(text), answer, think))
            tokens += answer
            text += self.tokenizer.decode(answer)
        self.extend_hashes(hashes, tokens)
        tail = len(group.tokens)
        return Conversation(
            user, group_index, start_s, tuple(tokens[tail:]), text[len(group.text) :],
            tuple(hashes), tuple(turns),
        )  # fmt: skip


@dataclass(slots=True)
class _Draw:
    """The seeded random draws of a workload, in a fixed order."""

    rng: random.Random
    words: _Words
    config: BenchConfig

    def question(self) -> str:
        return self.words.text(self.config.question_tokens)

    def think(self) -> float:
        return self.rng.expovariate(1.0 / self.config.think_s) if self.config.think_s else 0.0


def build_workload(config: BenchConfig) -> Workload:
    """The whole workload, deterministic in ``config.seed``."""
    rng = random.Random(config.seed)
    draw = _Draw(rng, _Words(rng), config)
    builder = _Builder(config, SimTokenizer())
    groups = tuple(
        builder.group(f"You are assistant {g}." + draw.words.text(config.system_tokens))
        for g in range(config.groups)
    )
    members = [(g, u) for g in range(config.groups) for u in range(config.users)]
    rng.shuffle(members)
    starts_per_s = config.rate / config.turns
    clock, conversations = 0.0, []
    for g, u in members:
        clock += rng.expovariate(starts_per_s)
        user = f"user-{g:03d}-{u:03d}"
        conversations.append(builder.conversation(user, g, groups[g], clock, draw))
    return Workload(groups, tuple(conversations))


# -- the engines ---------------------------------------------------------------------------


class SimEngine:
    """One simulated engine: the sim's block pool, scheduler and counters, driven by events."""

    def __init__(self, replica_id: str, config: BenchConfig) -> None:
        self.replica_id = replica_id
        self.block_size = config.block_size
        self.pool = BlockPool(config.blocks_per_engine, config.block_size)
        self.stats = EngineStats(config.max_model_len)
        root = none_hash(HASH_ALGO, HASH_SEED, VLLM_VERSION)
        scheduler_config = SchedulerConfig(
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            prefill_s_per_token=config.prefill_s_per_token,
            decode_s_per_token=config.decode_s_per_token,
            hashing=HashingConfig(HASH_ALGO, root, VLLM_VERSION),
        )
        self.scheduler = Scheduler(scheduler_config, self.pool, self.stats)
        self.step: StepPlan | None = None  # the step in progress; None when idle
        self.busy_s = 0.0
        self.routed = 0

    def cached_tokens(self, hashes: Sequence[bytes], num_tokens: int) -> int:
        """The prompt tokens this engine would find cached right now (its exact cache)."""
        usable = (num_tokens - 1) // self.block_size
        return len(self.pool.longest_hit(hashes, usable)) * self.block_size

    def submit(self, request: SimRequest) -> None:
        self.routed += 1
        self.scheduler.add(request)

    def start_step(self, now_s: float) -> float | None:
        """Plan the next step; its end time, or None when nothing can run."""
        plan = self.scheduler.schedule(now_s)
        if plan.empty:
            self.step = None
            return None
        self.step = plan
        self.busy_s += plan.duration_s
        return now_s + plan.duration_s

    def finish_step(self, now_s: float) -> None:
        plan, self.step = self.step, None
        assert plan is not None, "a step ended on an idle engine"
        self.scheduler.complete(plan, now_s)


# -- choosers: the gateway's policies and the oracle ----------------------------------------


@dataclass(frozen=True, slots=True)
class Ask:
    """What a chooser may look at for one request."""

    request: RouteRequest
    hashes: Sequence[bytes]  # the prompt's full-block hashes (only the oracle reads them)
    num_tokens: int


class Chooser(Protocol):
    name: str

    def choose(self, ask: Ask, load: LoadTracker) -> Decision: ...


class PolicyChooser:
    """A gateway policy, asked exactly as the gateway asks it."""

    def __init__(self, policy: Policy, candidates: tuple[Target, ...]) -> None:
        self.name = policy.name
        self._policy = policy
        self._candidates = candidates

    def choose(self, ask: Ask, load: LoadTracker) -> Decision:
        decision = self._policy.choose(ask.request, self._candidates, load)
        if decision is None:
            raise RuntimeError(f"policy {self.name} chose nothing among the candidates")
        return decision


class ExactCacheView(PrefixTree):
    """The prefix tree's questions answered from the engines' exact caches.

    ``match`` reports, per engine, the request's longest cached prefix (whole blocks of its
    block hashes, as the engine's admission finds them) converted to characters of the
    text at the same share; ``replica_chars`` (the prefix policy's spread tie-break) is the
    engine's cached tokens; ``insert`` records nothing: the engines' caches are the truth.
    """

    def __init__(self, engines: dict[str, SimEngine]) -> None:
        super().__init__()
        self._engines = engines
        self.ask: Ask | None = None  # the request being decided

    def match(self, text: str) -> dict[str, int]:
        ask = self.ask
        if ask is None or ask.request.text != text:
            raise RuntimeError("the oracle was asked about a request it was not given")
        matched = {}
        for rid, engine in self._engines.items():
            cached = engine.cached_tokens(ask.hashes, ask.num_tokens)
            if cached:
                matched[rid] = round(len(text) * cached / ask.num_tokens)
        return matched

    def insert(self, text: str, replica_id: str, now: float) -> None:
        del text, replica_id, now

    def replica_chars(self, replica_id: str) -> int:
        engine = self._engines[replica_id]
        return engine.pool.num_cached_blocks * engine.block_size


class OraclePolicy(PrefixPolicy):
    """The prefix policy's scoring, guard and tie-breaks over the exact caches."""

    name = ORACLE

    def __init__(self, engines: dict[str, SimEngine], config: PrefixConfig) -> None:
        super().__init__(config)
        self.view = ExactCacheView(engines)

    def tree(self, model: str) -> PrefixTree:
        del model
        return self.view


class OracleChooser(PolicyChooser):
    """Hands the oracle the request's block hashes before it decides."""

    def __init__(self, policy: OraclePolicy, candidates: tuple[Target, ...]) -> None:
        super().__init__(policy, candidates)
        self._view = policy.view

    def choose(self, ask: Ask, load: LoadTracker) -> Decision:
        self._view.ask = ask
        try:
            return super().choose(ask, load)
        finally:
            self._view.ask = None


# -- the replay ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """The figures of one policy's replay."""

    policy: str
    requests: int
    hit_rate: float  # Σ prefix_cache_hits / Σ prefix_cache_queries over the engines
    prompt_cached_share: float  # Σ cached prompt tokens / Σ prompt tokens (first admission)
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    imbalance_max_mean: float  # most requests on one engine / mean per engine
    imbalance_cv: float  # coefficient of variation of requests per engine
    utilization_max: float  # busiest engine's busy time / makespan
    utilization_mean: float
    preemptions: int
    makespan_s: float
    per_engine: tuple[int, ...]
    predicted_share: float  # Σ Decision.matched × prompt tokens / Σ prompt tokens
    exact_chosen_share: float  # … the chosen engine's exact cached share at decision time
    exact_best_share: float  # … the best engine's exact cached share at decision time
    decisions: dict[str, int] = field(default_factory=dict)  # "tier/outcome" → count


@dataclass(slots=True)
class DecisionTally:
    """What the decisions claimed against what the engines held when they were taken."""

    decisions: Counter[str] = field(default_factory=Counter)  # "tier/outcome" → count
    prompt: int = 0
    predicted: float = 0.0  # tokens the policy believed cached at its choice
    exact_chosen: int = 0  # tokens the chosen engine held at decision time
    exact_best: int = 0  # tokens the best-holding engine held at decision time

    def record(self, decision: Decision, ask: Ask, engines: dict[str, SimEngine]) -> None:
        self.decisions[f"{decision.tier}/{decision.outcome}"] += 1
        held = {rid: e.cached_tokens(ask.hashes, ask.num_tokens) for rid, e in engines.items()}
        self.prompt += ask.num_tokens
        self.predicted += decision.matched * ask.num_tokens
        self.exact_chosen += held[decision.target.replica_id]
        self.exact_best += max(held.values())


@dataclass(order=True, slots=True)
class _Event:
    at_s: float
    seq: int
    engine: SimEngine | None = field(compare=False)  # a step ends on this engine …
    conv: Conversation | None = field(compare=False, default=None)  # … or a turn arrives
    turn: int = field(compare=False, default=0)


class Replay:
    """One policy against a fresh fleet: arrivals and engine steps on one event heap."""

    def __init__(self, config: BenchConfig, workload: Workload, policy: str) -> None:
        self.config = config
        self.workload = workload
        self.engines = {
            f"engine-{i:02d}": SimEngine(f"engine-{i:02d}", config) for i in range(config.engines)
        }
        table = RoutingTable(
            Target(rid, MODEL, f"http://127.0.0.1:{9000 + i}") for i, rid in enumerate(self.engines)
        )
        candidates = table.candidates(MODEL)
        self.chooser = self._chooser(policy, candidates)
        self.load = LoadTracker()
        self._words = word_token_ids(SimTokenizer())
        self.ttfts: list[float] = []
        self.tally = DecisionTally()
        self._heap: list[_Event] = []
        self._seq = 0
        self._now = 0.0

    def _chooser(self, name: str, candidates: tuple[Target, ...]) -> Chooser:
        prefix = self.config.prefix
        if name == ORACLE:
            return OracleChooser(OraclePolicy(self.engines, prefix), candidates)
        if name == DEFAULT_POLICY:  # the gateway's prefix policy, on the simulated clock
            return PolicyChooser(PrefixPolicy(prefix, clock=self._clock), candidates)
        return PolicyChooser(make_policy(name), candidates)

    def _clock(self) -> float:
        return self._now

    def run(self) -> PolicyResult:
        for conv in self.workload.conversations:
            self._push(conv.start_s, conv=conv, turn=0)
        while self._heap:
            event = heapq.heappop(self._heap)
            self._now = event.at_s
            if event.engine is not None:
                event.engine.finish_step(self._now)
                self._start(event.engine)
            else:
                assert event.conv is not None
                self._arrive(event.conv, event.turn)
        return self._result()

    def _push(self, at_s: float, engine: SimEngine | None = None, **kw: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, _Event(at_s, self._seq, engine, **kw))

    def _start(self, engine: SimEngine) -> None:
        end = engine.start_step(self._now)
        if end is not None:
            self._push(end, engine)

    def _arrive(self, conv: Conversation, index: int) -> None:
        turn = conv.turns[index]
        ask = Ask(
            RouteRequest(MODEL, self.workload.text(conv, turn), conv.user),
            conv.hashes[: turn.prompt_len // self.config.block_size],
            turn.prompt_len,
        )
        decision = self.chooser.choose(ask, self.load)
        rid = decision.target.replica_id
        self.tally.record(decision, ask, self.engines)
        self.load.acquire(rid)
        engine = self.engines[rid]
        engine.submit(self._request(conv, index, rid, list(ask.hashes)))
        if engine.step is None:
            self._start(engine)

    def _request(self, conv: Conversation, index: int, rid: str, hashes: list[bytes]) -> SimRequest:
        turn = conv.turns[index]
        prompt = self.workload.prompt(conv, turn)
        spec = SamplingSpec(max_tokens=self.config.max_tokens)
        request = SimRequest(
            request_id=f"{conv.user}/{index}",
            prompt_token_ids=prompt,
            plan=OutputPlan(prompt, spec, self._words, 0),  # as the engine plans it
            sink=_ignore,
            arrival_s=self._now,
            block_hashes=hashes,
        )
        request.sink = self._sink(request, conv, index, rid)
        return request

    def _sink(
        self, request: SimRequest, conv: Conversation, index: int, rid: str
    ) -> Callable[[TokenOutput], None]:
        def done(output: TokenOutput) -> None:
            if output.finish_reason is None:
                return
            self._finished(request, conv, index, rid)

        return done

    def _finished(self, request: SimRequest, conv: Conversation, index: int, rid: str) -> None:
        turn = conv.turns[index]
        if tuple(request.output_token_ids) != turn.answer or request.first_token_s is None:
            raise RuntimeError(f"{request.request_id}: the engine answered other tokens")
        self.ttfts.append(request.first_token_s - request.arrival_s)
        self.load.release(rid)
        if index + 1 < len(conv.turns):
            self._push(self._now + conv.turns[index + 1].think_s, conv=conv, turn=index + 1)

    def _result(self) -> PolicyResult:
        engines = list(self.engines.values())
        stuck = [e.replica_id for e in engines if e.scheduler.has_work()]
        if stuck or len(self.ttfts) != self.workload.requests:
            raise RuntimeError(f"replay ended with work left on {stuck or 'the heap'}")
        return summarize(self.chooser.name, engines, self.ttfts, self.tally, self._now)


def _ignore(output: TokenOutput) -> None:
    del output


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0..1) of ``values``."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered) - 1e-9))
    return ordered[min(rank, len(ordered)) - 1]


def summarize(
    name: str,
    engines: Sequence[SimEngine],
    ttfts: Sequence[float],
    tally: DecisionTally,
    makespan_s: float,
) -> PolicyResult:
    """The figures of a finished replay, from the engines' own counters."""
    queries = sum(e.stats.prefix_queries for e in engines)
    prompt = sum(e.stats.prompt_tokens for e in engines)
    per_engine = tuple(e.routed for e in engines)
    mean = statistics.fmean(per_engine)
    busy = [e.busy_s / makespan_s for e in engines]
    return PolicyResult(
        policy=name,
        requests=len(ttfts),
        hit_rate=sum(e.stats.prefix_hits for e in engines) / queries,
        prompt_cached_share=sum(e.stats.cached_prompt_tokens for e in engines) / prompt,
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p90_s=percentile(ttfts, 0.9),
        ttft_p99_s=percentile(ttfts, 0.99),
        ttft_mean_s=statistics.fmean(ttfts),
        imbalance_max_mean=max(per_engine) / mean,
        imbalance_cv=statistics.pstdev(per_engine) / mean,
        utilization_max=max(busy),
        utilization_mean=statistics.fmean(busy),
        preemptions=sum(e.stats.preemptions for e in engines),
        makespan_s=makespan_s,
        per_engine=per_engine,
        predicted_share=tally.predicted / tally.prompt,
        exact_chosen_share=tally.exact_chosen / tally.prompt,
        exact_best_share=tally.exact_best / tally.prompt,
        decisions=dict(sorted(tally.decisions.items())),
    )


# -- the report ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkloadFacts:
    requests: int
    prompt_tokens_mean: float
    shared_prefix_tokens: int  # every group's system prompt
    distinct_tokens: int  # every system prompt and every conversation, answers included
    engine_kv_tokens: int
    reuse_ceiling: float  # cached share of prompt tokens with one unbounded cache (bound)

    @staticmethod
    def of(config: BenchConfig, workload: Workload) -> WorkloadFacts:
        prompts = [t.prompt_len for c in workload.conversations for t in c.turns]
        shared = sum(len(g.tokens) for g in workload.groups)
        return WorkloadFacts(
            requests=len(prompts),
            prompt_tokens_mean=statistics.fmean(prompts),
            shared_prefix_tokens=shared,
            distinct_tokens=shared + sum(len(c.tail_tokens) for c in workload.conversations),
            engine_kv_tokens=config.blocks_per_engine * config.block_size,
            reuse_ceiling=sum(reusable_tokens(workload, config.block_size)) / sum(prompts),
        )


def reusable_tokens(workload: Workload, block_size: int) -> list[int]:
    """Per request, the most prompt tokens any cache could hold for it, in any order.

    A prompt block can only be found cached if another conversation contains it (then it
    may have run first) or an earlier turn of the same conversation computed it (its
    prompt or answer); whole blocks, at most all but the prompt's last token, as the
    engine's admission looks them up. Any policy's first-admission cached share is at most
    this total over the prompt tokens: a bound that does not depend on the replay.
    """
    holders: Counter[bytes] = Counter()
    for conv in workload.conversations:
        holders.update(set(conv.hashes))
    out: list[int] = []
    for conv in workload.conversations:
        own = 0  # full blocks computed by this conversation's earlier turns
        for turn in conv.turns:
            usable = (turn.prompt_len - 1) // block_size
            shared = 0
            while shared < usable and holders[conv.hashes[shared]] > 1:
                shared += 1
            out.append(max(shared, min(own, usable)) * block_size)
            own = (turn.prompt_len + len(turn.answer)) // block_size
    return out


@dataclass(frozen=True, slots=True)
class Report:
    config: BenchConfig
    facts: WorkloadFacts
    results: tuple[PolicyResult, ...]
    wall_s: float

    def by_name(self, name: str) -> PolicyResult | None:
        return next((r for r in self.results if r.policy == name), None)

    def ratios(self) -> dict[str, float]:
        """The target ratios whose two policies ran."""
        default, oracle = self.by_name(DEFAULT_POLICY), self.by_name(ORACLE)
        rr = self.by_name("round_robin")
        ratios = {}
        if default and oracle:
            ratios[HIT_RATIO] = default.hit_rate / oracle.hit_rate
        if default and rr:
            ratios[TTFT_RATIO] = rr.ttft_p90_s / default.ttft_p90_s
        return ratios

    def targets_met(self) -> bool | None:
        """Both targets met; None when a ratio was not measured."""
        ratios = self.ratios()
        if len(ratios) < len(TARGETS):
            return None
        return all(ratios[key] >= bound for key, bound in TARGETS.items())

    def missed(self) -> list[str]:
        """The measured ratios below their targets."""
        return [key for key, value in self.ratios().items() if value < TARGETS[key]]

    def as_json(self) -> dict[str, Any]:
        return {
            "command": command_line(),
            "machine": base_machine(),
            "config": asdict(self.config) | {"kv_blocks": self.config.blocks_per_engine},
            "workload": asdict(self.facts),
            "results": [asdict(r) for r in self.results],
            "ratios": self.ratios(),
            "targets_met": self.targets_met(),
            "wall_s": self.wall_s,
        }

    def head(self) -> list[str]:
        c, f = self.config, self.facts
        kv, fleet = f.engine_kv_tokens, f.engine_kv_tokens * c.engines
        return [
            f"workload: {c.groups} groups × {c.users} users × {c.turns} turns = {f.requests:,} "
            f"requests; system prompt {c.system_tokens:,} tokens, question "
            f"{c.question_tokens:,}; mean prompt {f.prompt_tokens_mean:,.0f} tokens; "
            f"{c.rate:g} requests/s offered, think time {c.think_s:g} s (mean), seed {c.seed}",
            f"fleet: {c.engines} engines × {f.engine_kv_tokens:,} KV tokens "
            f"({c.blocks_per_engine:,} blocks of {c.block_size}); the system prompts alone are "
            f"{f.shared_prefix_tokens:,} tokens = {f.shared_prefix_tokens / kv:.1f}× one engine; "
            f"all distinct tokens {f.distinct_tokens:,} = {f.distinct_tokens / fleet:.1f}× "
            f"the fleet; prefill {c.prefill_s_per_token * 1e6:g} µs/token, decode step "
            f"{c.decode_s_per_token * 1e3:g} ms",
            f"reuse ceiling (one unbounded cache, any order): {_pct(f.reuse_ceiling)} of "
            "prompt tokens",
        ]

    def rows(self) -> list[tuple[str, ...]]:
        return [
            (
                r.policy + (" (default)" if r.policy == DEFAULT_POLICY else ""),
                _pct(r.hit_rate),
                _pct(r.prompt_cached_share),
                _s(r.ttft_p50_s),
                _s(r.ttft_p90_s),
                _s(r.ttft_p99_s),
                f"{r.imbalance_max_mean:.2f}",
                f"{r.imbalance_cv:.2f}",
                f"{_pct(r.utilization_mean)} / {_pct(r.utilization_max)}",
                str(r.preemptions),
            )
            for r in self.results
        ]

    def verdict(self) -> list[str]:
        ratios = self.ratios()
        lines = []
        for key, bound in TARGETS.items():
            label = TARGET_LABELS[key]
            value = ratios.get(key)
            if value is None:
                lines.append(f"{label}: not measured (run the policies it compares)")
                continue
            met = "met" if value >= bound else "MISSED"
            lines.append(f"{label}: {value:.2f} (target >= {bound:g}: {met})")
        return [*lines, f"replayed in {self.wall_s:.1f} s of wall time (simulated time)"]

    def render(self, markdown: bool) -> str:
        head = ("policy", "hit rate", "prompt cached", "TTFT p50", "TTFT p90", "TTFT p99",
                "max/mean req", "CV req", "busy mean/max", "preempt")  # fmt: skip
        rows = self.rows()
        facts = [f"{k}: {v}" for k, v in base_machine().items()]
        if markdown:
            out = ["## Routing policies: shared prefixes, multi-turn (scripts/bench_routing.py)"]
            out += ["", "```", command_line(), "```", ""]
            out += [f"- {line}" for line in [*facts, *self.head()]]
            out += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            out += ["| " + " | ".join(r) + " |" for r in rows]
            return "\n".join([*out, "", *(f"- {line}" for line in self.verdict())])
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        lines = [f"command: {command_line()}", "; ".join(facts), *self.head(), ""]
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
        return "\n".join([*lines, "", *self.verdict()])


def _pct(share: float) -> str:
    return f"{100 * share:.1f}%"


def _s(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds < 10 else f"{seconds:,.1f} s"


# -- the command -----------------------------------------------------------------------------


def run_bench(config: BenchConfig, policies: Sequence[str] = (*POLICY_ORDER, ORACLE)) -> Report:
    """Build the workload once and replay it under every policy."""
    start = time.perf_counter()
    workload = build_workload(config)
    longest = max(t.prompt_len + len(t.answer) for c in workload.conversations for t in c.turns)
    if -(-longest // config.block_size) > config.blocks_per_engine:
        raise ValueError(
            f"a conversation reaches {longest:,} tokens, more than one engine's KV cache "
            f"({config.blocks_per_engine:,} blocks of {config.block_size}): raise --kv-blocks"
        )
    results = tuple(Replay(config, workload, name).run() for name in policies)
    facts = WorkloadFacts.of(config, workload)
    return Report(config, facts, results, time.perf_counter() - start)


_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("engines", int, "simulated engines (replicas of one model)"),
    ("groups", int, "groups, each with its own shared system prompt"),
    ("users", int, "users per group, one conversation each"),
    ("turns", int, "turns per conversation"),
    ("seed", int, "seed of every random draw"),
    ("system_tokens", int, "tokens of each group's system prompt"),
    ("question_tokens", int, "tokens of each question"),
    ("rate", float, "requests per second offered (conversations start at rate / turns)"),
    ("think_s", float, "mean seconds between an answer and the next question"),
    ("kv_blocks", int, "KV blocks per engine (0: a third of the groups' system prompts)"),
    ("block_size", int, "tokens per KV block"),
)
_PREFIX_FLAGS: tuple[tuple[str, type], ...] = (
    ("min_share", float),
    ("load_weight", float),
    ("guard_abs", int),
    ("guard_rel", float),
    ("max_chars", int),
)


def parse_config(argv: Sequence[str] | None) -> tuple[BenchConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="a small workload (seconds)")
    for name, kind, text in _FLAGS:
        p.add_argument(
            "--" + name.removesuffix("_s").replace("_", "-"),
            dest=name,
            type=kind,
            help=text,
            metavar=name.removesuffix("_s").upper(),
        )
    for name, kind in _PREFIX_FLAGS:
        flag = "--prefix-" + name.replace("_", "-")
        p.add_argument(
            flag, dest=name, type=kind, help="PrefixConfig." + name + " (prefix and oracle)"
        )
    p.add_argument("--policies", default=",".join((*POLICY_ORDER, ORACLE)), help="comma-separated")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--markdown", action="store_true", help="also print a BENCHMARKS.md section")
    args = p.parse_args(argv)
    config = replace(BenchConfig(), **QUICK) if args.quick else BenchConfig()
    given = {name: getattr(args, name) for name, _, _ in _FLAGS if getattr(args, name) is not None}
    tuned = {
        name: getattr(args, name) for name, _ in _PREFIX_FLAGS if getattr(args, name) is not None
    }
    return replace(config, prefix=replace(config.prefix, **tuned), **given), args


def main(argv: Sequence[str] | None = None) -> int:
    config, args = parse_config(argv)
    policies = [name for name in args.policies.split(",") if name]
    unknown = set(policies) - {*POLICY_ORDER, ORACLE}
    if unknown:
        raise SystemExit(
            f"unknown policies {sorted(unknown)}; choose from {(*POLICY_ORDER, ORACLE)}"
        )
    report = run_bench(config, policies)
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        print(report.render(markdown=False))
    if args.markdown:
        print("\n" + report.render(markdown=True))
    return 1 if report.missed() else 0


if __name__ == "__main__":
    sys.exit(main())
