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
"""

from __future__ import annotations

import heapq
import random
import string
from array import array
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.precise import TIER_PRECISE, PreciseConfig, PreciseRequest, PreciseTier
from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.gateway.routing.load import LoadTracker
from llmgw.gateway.routing.policy import (
    Decision,
    Policy,
    PrefixConfig,
    PrefixPolicy,
    RouteRequest,
    make_policy,
    prefix_decision,
)
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.kvcache import EventBatch, hash_block, none_hash
from llmgw.kvcache.mirror import BlockMirror, MirrorDelta, block_keys
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
PRECISE = TIER_PRECISE
DEFAULT_POLICY = "prefix"
POLICY_ORDER = (DEFAULT_POLICY, "round_robin", "least_load", "session")
HASH_ALGO, HASH_SEED, VLLM_VERSION = "sha256", "0", "0.32.0"
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
    # The prefix policy is told each engine's KV capacity × kv_hint in characters (its KV
    # tokens × the workload's characters per prompt token); 0: told nothing, its tree
    # then holds up to PrefixConfig.max_chars_per_replica per engine.
    kv_hint: float = 1.0
    # The precise tier's index lags the engines by this much (agent flush + feed).
    precise_lag_s: float = 0.05
    precise_claim_ttl_s: float = PreciseConfig().claim_ttl_s  # 0: decisions claim nothing

    @property
    def blocks_per_engine(self) -> int:
        if self.kv_blocks:
            return self.kv_blocks
        return max(self.groups * self.system_tokens // (3 * self.block_size), 1)

    @property
    def max_model_len(self) -> int:
        per_turn = self.question_tokens + self.max_tokens + 16
        return self.system_tokens + self.turns * per_turn + 64


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


# -- the engines ---------------------------------------------------------------------------


class SimEngine:
    """One simulated engine: the sim's block pool, scheduler and counters, driven by events."""

    def __init__(self, replica_id: str, config: BenchConfig, *, events: bool = False) -> None:
        self.replica_id = replica_id
        self.block_size = config.block_size
        self.pool = BlockPool(config.blocks_per_engine, config.block_size, record_events=events)
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
    tokens: Sequence[int] = ()  # the prompt's tokens, as /tokenize gives them (precise)


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


class OracleChooser:
    """The prefix policy's decision (``prefix_decision``) over the engines' exact caches.

    A candidate's share is the request's longest cached prefix on that engine (whole
    blocks of its block hashes, as the engine's admission finds them) over the prompt's
    tokens; the miss tie-break reads the engine's cached tokens. Nothing is recorded: the
    engines' caches are the truth.
    """

    name = ORACLE

    def __init__(
        self, engines: dict[str, SimEngine], candidates: tuple[Target, ...], config: PrefixConfig
    ) -> None:
        self._engines = engines
        self._candidates = candidates
        self._config = config

    def choose(self, ask: Ask, load: LoadTracker) -> Decision:
        held = {
            rid: engine.cached_tokens(ask.hashes, ask.num_tokens)
            for rid, engine in self._engines.items()
        }
        loads = {t.replica_id: load.in_flight(t.replica_id) for t in self._candidates}
        return prefix_decision(
            self._candidates, held, loads, self._config, total=ask.num_tokens, cached=self._cached
        )

    def _cached(self, replica_id: str) -> int:
        engine = self._engines[replica_id]
        return engine.pool.num_cached_blocks * engine.block_size


class _Costs(GatewayMetrics):
    """Gateway metrics that also keep each precise decision's own cost (seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.costs: list[float] = []

    def precise_decided(
        self, prompt_tokens: int, available: int, captured: int, seconds: float
    ) -> None:
        super().precise_decided(prompt_tokens, available, captured, seconds)
        self.costs.append(seconds)


class PreciseChooser:
    """The gateway's precise tier over an index fed by the engines' KV events, late.

    ``events`` is called with each engine's events at the end of its steps; the deltas of
    its mirror reach the index ``lag_s`` later. With no blocks indexed for any candidate
    the prefix policy decides (and its tree is fed by every precise decision too), as in
    the gateway.
    """

    name = PRECISE

    def __init__(
        self,
        candidates: tuple[Target, ...],
        policy: PrefixPolicy,
        clock: Callable[[], float],
        *,
        block_size: int,
        lag_s: float,
        config: PreciseConfig | None = None,
    ) -> None:
        self._candidates = candidates
        self._policy = policy
        self._clock = clock
        self._block_size = block_size
        self._lag_s = lag_s
        self.index = KvIndex()
        self.metrics = _Costs()
        self.tier = PreciseTier(
            self.index, policy, None, config or PreciseConfig(), metrics=self.metrics, clock=clock
        )
        self._mirrors = {t.replica_id: BlockMirror() for t in candidates}
        self._due: deque[tuple[float, str, MirrorDelta]] = deque()

    def events(self, replica_id: str, events: list[Any], now_s: float) -> None:
        mirror = self._mirrors[replica_id]
        if events:
            mirror.apply(EventBatch(ts=now_s, events=tuple(events)))
        if mirror.pending:
            self._due.append((now_s + self._lag_s, replica_id, mirror.take_delta()))

    def choose(self, ask: Ask, load: LoadTracker) -> Decision:
        now = self._clock()
        while self._due and self._due[0][0] <= now:
            _, replica_id, delta = self._due.popleft()
            self.index.apply(
                replica_id, delta.reset, delta.stored_keys, delta.removed_keys,
                block_size=self._block_size,
            )  # fmt: skip
        decision: Decision | None
        if self.tier.applicable(self._candidates):
            decision = self._policy.choose(ask.request, self._candidates, load)
        else:
            request = PreciseRequest(array("Q", ask.tokens))
            decision = self.tier.choose(request, ask.request, self._candidates, load)
        if decision is None:
            raise RuntimeError("the precise tier chose nothing among the candidates")
        return decision


def precise_micro(
    block_size: int,
    *,
    replicas: int = 8,
    conversations: int = 200,
    system_tokens: int = 4000,
    first_turn: int = 5000,
    second_turn: int = 6000,
    seed: int = 1,
) -> list[float]:
    """The precise tier's own cost (seconds) for chats that continue an earlier turn.

    Every replica holds a shared system prompt; each conversation's first turn is decided
    (which warms the key memo, as the gateway's previous request did) and then held by the
    replica chosen; its second turn, ``second_turn - first_turn`` tokens longer, is the
    decision timed: block keys (only the new blocks are hashed), index match and scoring.
    """
    rng = random.Random(seed)
    index, metrics = KvIndex(), _Costs()
    tier = PreciseTier(index, PrefixPolicy(), None, metrics=metrics)
    candidates = tuple(
        Target(f"r{i:02d}", MODEL, f"http://127.0.0.1:{9000 + i}", kv_events=True)
        for i in range(replicas)
    )
    system = [rng.randrange(49_152) for _ in range(system_tokens)]
    for target in candidates:
        index.apply(target.replica_id, False, block_keys(system, block_size), block_size=block_size)
    load, route = LoadTracker(), RouteRequest(MODEL)
    timed: list[float] = []
    for _ in range(conversations):
        first = system + [rng.randrange(49_152) for _ in range(first_turn - system_tokens)]
        second = first + [rng.randrange(49_152) for _ in range(second_turn - first_turn)]
        earlier = tier.choose(PreciseRequest(array("Q", first)), route, candidates, load)
        assert earlier is not None
        holder = earlier.target.replica_id  # it computed the first turn: now it holds it
        index.apply(holder, False, block_keys(first, block_size), block_size=block_size)
        decision = tier.choose(PreciseRequest(array("Q", second)), route, candidates, load)
        if decision is None or decision.target.replica_id != holder:
            raise RuntimeError(f"the precise tier missed the replica holding {holder}'s turn")
        timed.append(metrics.costs[-1])
    return timed


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
