"""The routing benchmark's simulation (bench/routing.py runs and reports it).

The workload, after llm-d's prefix-cache benchmark: groups with a long shared system
prompt, users per group in multi-turn ChatML conversations whose every turn appends a
fresh question to the conversation so far, the model's earlier answers included; starts
are a seeded Poisson process (``rate / turns`` conversations per second) and a user sends
the next turn an exponential think time after the previous answer. Everything comes from
the seed and the answers are a function of the prompt, so every policy replays the same
requests.

The engines are the simulated engine's own parts (llmgw/sim/engine): its vLLM v1 block
pool (prefix hashes, LRU eviction of free cached blocks), its scheduler (admission with
prefix reuse, preemption) and its timing model (a step costs ``prefill_s × uncached
tokens + decode_s``), driven by a discrete-event loop (step ends and arrivals on one
heap) in simulated time: figures depend on the seed only.

The choosers: the gateway's own policies (``make_policy``; the prefix policy on the
simulated clock, told each engine's KV capacity as a gateway that knows it would tell
it), the gateway's PRECISE tier (precise.py) and an ORACLE reading every engine's exact
cache at decision time, deciding with the prefix policy's own ``prefix_decision``. Load
is the gateway's ``LoadTracker``, acquired at decision and released at the last token.

The precise tier sees what a gateway would: each engine's pool records vLLM's KV events,
which are taken at the end of every step (as the simulated engine publishes them),
mirrored as an agent mirrors them (``BlockMirror``: our block keys from the events'
tokens) and reach the gateway's ``KvIndex`` ``precise_lag_s`` later (the agent's flush
interval and the feed). It decides with the gateway's own ``PreciseTier`` on the
request's tokens (what ``/tokenize`` returns; the call's latency is not simulated), and
falls back to its own approximate tree exactly when the gateway would (no blocks yet).
Its cost per decision (block keys, index match, scoring; ``llmgw_precise_seconds``) is
measured in wall time.

This module holds the workload and the replay; the run's constants and ``BenchConfig``, the
engines, the choosers and ``precise_micro`` are in ``bench.routing_fleet``.
"""

from __future__ import annotations

import heapq
import random
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.routing_fleet import (
    DEFAULT_POLICY,
    HASH_ALGO,
    HASH_SEED,
    MODEL,
    ORACLE,
    PRECISE,
    VLLM_VERSION,
    Ask,
    BenchConfig,
    Chooser,
    OracleChooser,
    PolicyChooser,
    PreciseChooser,
    SimEngine,
)
from llmgw.gateway.precise import PreciseConfig
from llmgw.gateway.routing.load import LoadTracker
from llmgw.gateway.routing.policy import Decision, PrefixPolicy, RouteRequest, make_policy
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.kvcache import hash_block, none_hash
from llmgw.sim.engine.generation import OutputPlan, SamplingSpec, word_token_ids
from llmgw.sim.engine.scheduler import SimRequest, TokenOutput
from llmgw.sim.engine.tokenizer import IM_END, SimTokenizer

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

    @property
    def chars_per_token(self) -> float:
        """Characters of rendered prompt per prompt token, over all requests."""
        turns = [t for c in self.conversations for t in c.turns]
        return sum(t.text_len for t in turns) / sum(t.prompt_len for t in turns)


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


def kv_chars_told(config: BenchConfig, workload: Workload) -> int | None:
    """The KV capacity the prefix policy is told per engine, in characters (None: nothing)."""
    if config.kv_hint <= 0:
        return None
    kv_tokens = config.blocks_per_engine * config.block_size
    return max(1, round(config.kv_hint * kv_tokens * workload.chars_per_token))


# -- the replay ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Replayed:
    """A finished replay: the engines with their counters, the TTFTs, the decisions."""

    policy: str
    engines: tuple[SimEngine, ...]
    ttfts: tuple[float, ...]
    tally: DecisionTally
    makespan_s: float
    precise_costs: tuple[float, ...] = ()  # seconds per precise decision (wall time)


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
        events = policy == PRECISE
        self.engines = {
            f"engine-{i:02d}": SimEngine(f"engine-{i:02d}", config, events=events)
            for i in range(config.engines)
        }
        table = RoutingTable(
            Target(rid, MODEL, f"http://127.0.0.1:{9000 + i}", kv_events=events)
            for i, rid in enumerate(self.engines)
        )
        candidates = table.candidates(MODEL)
        self.precise: PreciseChooser | None = None  # set by _chooser for the precise tier
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
            return OracleChooser(self.engines, candidates, prefix)
        if name not in (DEFAULT_POLICY, PRECISE):
            return PolicyChooser(make_policy(name), candidates)
        policy = PrefixPolicy(prefix, clock=self._clock)  # on the simulated clock
        told = kv_chars_told(self.config, self.workload)
        if told is not None:
            for rid in self.engines:
                policy.set_replica_capacity(rid, told)
        if name == PRECISE:
            self.precise = PreciseChooser(
                candidates, policy, self._clock,
                block_size=self.config.block_size, lag_s=self.config.precise_lag_s,
                config=PreciseConfig(claim_ttl_s=self.config.precise_claim_ttl_s),
            )  # fmt: skip
            return self.precise
        return PolicyChooser(policy, candidates)

    def _clock(self) -> float:
        return self._now

    def run(self) -> Replayed:
        for conv in self.workload.conversations:
            self._push(conv.start_s, conv=conv, turn=0)
        while self._heap:
            event = heapq.heappop(self._heap)
            self._now = event.at_s
            if event.engine is not None:
                event.engine.finish_step(self._now)
                if self.precise is not None:  # the step's KV events, as the engine publishes
                    events = event.engine.pool.take_events()
                    self.precise.events(event.engine.replica_id, events, self._now)
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
            self.workload.prompt(conv, turn) if self.precise is not None else (),
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

    def _result(self) -> Replayed:
        engines = tuple(self.engines.values())
        stuck = [e.replica_id for e in engines if e.scheduler.has_work()]
        if stuck or len(self.ttfts) != self.workload.requests:
            raise RuntimeError(f"replay ended with work left on {stuck or 'the heap'}")
        costs = tuple(self.precise.metrics.costs) if self.precise is not None else ()
        return Replayed(self.chooser.name, engines, tuple(self.ttfts), self.tally, self._now, costs)


def _ignore(output: TokenOutput) -> None:
    del output
