"""The routing simulation's fleet (bench/routing_sim.py replays it): the run's constants and
``BenchConfig``, the engines, and the choosers (the gateway's policies, its precise tier and the
oracle) with ``precise_micro``, the precise tier's own cost."""

from __future__ import annotations

import random
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    prefix_decision,
)
from llmgw.gateway.routing.table import Target
from llmgw.kvcache import EventBatch, none_hash
from llmgw.kvcache.mirror import BlockMirror, MirrorDelta, block_keys
from llmgw.sim.engine.blocks import BlockPool
from llmgw.sim.engine.config import SimBehaviour
from llmgw.sim.engine.metrics import EngineStats
from llmgw.sim.engine.scheduler import (
    HashingConfig,
    Scheduler,
    SchedulerConfig,
    SimRequest,
    StepPlan,
)

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
