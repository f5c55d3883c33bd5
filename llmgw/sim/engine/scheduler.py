"""One simulated scheduler step at a time: admission, prefix hits, preemption, tokens.

Pure logic over `SimRequest` objects and a `BlockPool`: no clock of its own (times are
passed in), no asyncio. A step is planned by `Scheduler.schedule` (decode slots for the
running requests, preempting the newest when blocks run out; then waiting requests in
arrival order while blocks and seats last, each reusing its cached prefix) and completed by
`Scheduler.complete` (every scheduled request gains one token; finished ones free their
blocks). The step's simulated duration is ``prefill_s × uncached tokens + decode_s``.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw.kvcache import ExtraKeysFn, event_extra_keys, hash_block
from llmgw.sim.engine.blocks import BlockPool, StoredBlocks
from llmgw.sim.engine.generation import OutputPlan
from llmgw.sim.engine.metrics import EngineStats, FinishedRequest


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # queued (new or preempted); holds no blocks
    RUNNING = "running"  # holds blocks; computes one token per step
    FINISHED = "finished"  # done (stop, length or abort); blocks freed


@dataclass(frozen=True, slots=True)
class HashingConfig:
    """How block hashes are computed, as the engine's vLLM version does."""

    algo: str
    root: bytes
    vllm_version: str


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The knobs of the step loop."""

    block_size: int
    max_model_len: int
    max_num_seqs: int = 256
    max_loras: int = 1
    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.0
    hashing: HashingConfig | None = None  # None: prefix caching off


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """What one step produced for one request (crosses to the HTTP task)."""

    token_id: int | None  # None when the request ended without a new token (abort)
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


Sink = Callable[[TokenOutput], None]


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request inside the engine (owned by the engine task; never shared)."""

    request_id: str
    prompt_token_ids: list[int]
    plan: OutputPlan
    sink: Sink
    arrival_s: float
    lora_name: str | None = None
    lora_int_id: int | None = None
    extra_keys: ExtraKeysFn | None = None
    session_id: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks registered in the pool's cache
    num_computed_tokens: int = 0
    cached_tokens: int = -1  # prefix hit at first admission; -1 until admitted
    preemptions: int = 0
    scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        return (prompt + self.output_token_ids)[start:end]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The requests one step computes and how long the step takes."""

    prefills: tuple[tuple[SimRequest, int], ...]  # (request, tokens computed, not cached)
    decodes: tuple[SimRequest, ...]
    duration_s: float

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """vLLM's v1 scheduler, reduced to what timing, caching and events need."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, stats: EngineStats) -> None:
        self.config = config
        self.pool = pool
        self.stats = stats
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._by_id: dict[str, SimRequest] = {}
        self._deferred = 0

    @property
    def num_deferred(self) -> int:
        """Waiting requests held back by the LoRA budget at the last schedule."""
        return self._deferred

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: SimRequest) -> None:
        self._by_id[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str, now_s: float) -> bool:
        """End a request now (client gone); False if it already finished."""
        request = self._by_id.get(request_id)
        if request is None:
            return False
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._finish(request, "abort", now_s)
        request.sink(self._output(request, None, "abort"))
        return True

    def schedule(self, now_s: float) -> StepPlan:
        """Plan the next step: decode slots first, then admissions."""
        decodes = self._schedule_running()
        prefills = self._admit_waiting(now_s)
        uncached = sum(tokens for _, tokens in prefills)
        busy = bool(prefills or decodes)
        duration = uncached * self.config.prefill_s_per_token
        duration += self.config.decode_s_per_token if busy else 0.0
        if busy:
            self.stats.iteration_tokens.observe(uncached + len(decodes))
        return StepPlan(tuple(prefills), tuple(decodes), duration)

    def complete(self, plan: StepPlan, now_s: float) -> None:
        """The step's model run is over: each request still running gains a token."""
        for request, _ in plan.prefills:
            if request.status is RequestStatus.RUNNING:
                request.num_computed_tokens = request.num_tokens
                self._sample(request, now_s)
        for request in plan.decodes:
            if request.status is RequestStatus.RUNNING:
                request.num_computed_tokens += 1
                self._sample(request, now_s)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset()

    # -- running requests -------------------------------------------------------------------

    def _schedule_running(self) -> list[SimRequest]:
        decodes: list[SimRequest] = []
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._make_room(request, request.num_computed_tokens + 1):
                self._cache_blocks(request, request.num_computed_tokens + 1)
                decodes.append(request)
        return decodes

    def _make_room(self, request: SimRequest, num_tokens: int) -> bool:
        """Give ``request`` blocks for ``num_tokens``, preempting the newest; False if it was."""
        size = self.config.block_size
        need = -(-num_tokens // size) - len(request.block_ids)
        while need > self.pool.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        if need > 0:
            request.block_ids += self.pool.allocate(need)
        return True

    def _preempt(self, request: SimRequest) -> None:
        self.running.remove(request)
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.num_cached_blocks = 0
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(request)

    # -- admission --------------------------------------------------------------------------

    def _admit_waiting(self, now_s: float) -> list[tuple[SimRequest, int]]:
        admitted: list[tuple[SimRequest, int]] = []
        skipped: list[SimRequest] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self._lora_fits(request):
                skipped.append(self.waiting.popleft())
                continue
            computed = self._try_admit(request)
            if computed is None:
                break
            self.waiting.popleft()
            admitted.append((request, request.num_tokens - computed))
            if request.scheduled_s is None:
                request.scheduled_s = now_s
        self.waiting.extendleft(reversed(skipped))
        self._deferred = len(skipped)
        return admitted

    def _lora_fits(self, request: SimRequest) -> bool:
        if request.lora_name is None:
            return True
        active = {r.lora_name for r in self.running if r.lora_name is not None}
        return request.lora_name in active or len(active) < self.config.max_loras

    def _try_admit(self, request: SimRequest) -> int | None:
        """Allocate blocks for the whole request; the tokens found cached, or None."""
        size, num_tokens = self.config.block_size, request.num_tokens
        hits: list[int] = []
        if self.config.hashing is not None:
            self._ensure_hashes(request, num_tokens)
            hits = self.pool.longest_hit(request.block_hashes, (num_tokens - 1) // size)
        need = -(-num_tokens // size) - len(hits)
        if need > self.pool.num_free - self.pool.num_free_among(hits):
            return None
        self.pool.touch(hits)
        request.block_ids = hits + self.pool.allocate(need)
        request.num_cached_blocks = len(hits)
        request.num_computed_tokens = len(hits) * size
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._record_admission(request, len(hits) * size)
        self._cache_blocks(request, num_tokens)
        return len(hits) * size

    def _record_admission(self, request: SimRequest, hit_tokens: int) -> None:
        if self.config.hashing is not None:
            self.stats.record_prefix_lookup(request.num_tokens, hit_tokens)
        if request.cached_tokens < 0:
            request.cached_tokens = hit_tokens
            self.stats.record_new_prompt(len(request.prompt_token_ids), hit_tokens)

    # -- hashing and caching ----------------------------------------------------------------

    def _ensure_hashes(self, request: SimRequest, num_tokens: int) -> None:
        hashing = self.config.hashing
        assert hashing is not None  # callers check
        size = self.config.block_size
        hashes = request.block_hashes
        for index in range(len(hashes), num_tokens // size):
            start = index * size
            parent = hashes[-1] if hashes else hashing.root
            keys = request.extra_keys(start, start + size) if request.extra_keys else None
            hashes.append(
                hash_block(parent, request.token_slice(start, start + size), keys, hashing.algo)
            )

    def _cache_blocks(self, request: SimRequest, num_tokens: int) -> None:
        """Register the request's blocks that ``num_tokens`` tokens fill."""
        if self.config.hashing is None:
            return
        size = self.config.block_size
        num_full = num_tokens // size
        first = request.num_cached_blocks
        if num_full <= first:
            return
        self._ensure_hashes(request, num_full * size)
        stored = StoredBlocks(
            token_ids=tuple(request.token_slice(first * size, num_full * size)),
            extra_keys=self._event_keys(request, first, num_full),
            lora_id=request.lora_int_id,
            lora_name=request.lora_name,
            session_id=request.session_id,
        )
        self.pool.cache_full_blocks(
            request.block_ids, request.block_hashes, first, num_full, stored
        )
        request.num_cached_blocks = num_full

    def _event_keys(
        self, request: SimRequest, first: int, last: int
    ) -> tuple[tuple[object, ...] | None, ...]:
        hashing = self.config.hashing
        assert hashing is not None
        if request.extra_keys is None:
            return (None,) * (last - first)
        size = self.config.block_size
        return tuple(
            event_extra_keys(request.extra_keys(i * size, (i + 1) * size), hashing.vllm_version)
            for i in range(first, last)
        )

    # -- tokens and endings -----------------------------------------------------------------

    def _sample(self, request: SimRequest, now_s: float) -> None:
        token = request.plan.token(len(request.output_token_ids))
        request.output_token_ids.append(token)
        self.stats.generation_tokens += 1
        if request.first_token_s is None:
            request.first_token_s = now_s
            self.stats.ttft.observe(now_s - request.arrival_s)
        elif request.last_token_s is not None:
            self.stats.itl.observe(now_s - request.last_token_s)
        request.last_token_s = now_s
        reason = request.plan.finish_reason(
            len(request.output_token_ids), request.num_tokens, self.config.max_model_len
        )
        if reason is not None:
            self._finish(request, reason, now_s)
        request.sink(self._output(request, token, reason))

    def _finish(self, request: SimRequest, reason: str, now_s: float) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.pool.free(request.block_ids)
            request.block_ids = []
        request.status = RequestStatus.FINISHED
        del self._by_id[request.request_id]
        self.stats.record_finished(_finished_record(request, reason, now_s))

    @staticmethod
    def _output(request: SimRequest, token: int | None, reason: str | None) -> TokenOutput:
        return TokenOutput(
            token_id=token,
            finish_reason=reason,
            prompt_tokens=len(request.prompt_token_ids),
            cached_tokens=max(request.cached_tokens, 0),
            output_tokens=len(request.output_token_ids),
        )


def _finished_record(request: SimRequest, reason: str, now_s: float) -> FinishedRequest:
    scheduled = request.scheduled_s if request.scheduled_s is not None else now_s
    first = request.first_token_s if request.first_token_s is not None else now_s
    last = request.last_token_s if request.last_token_s is not None else first
    return FinishedRequest(
        reason=reason,
        prompt_tokens=len(request.prompt_token_ids),
        cached_tokens=max(request.cached_tokens, 0),
        generation_tokens=len(request.output_token_ids),
        max_tokens=request.plan.spec.max_tokens,
        preemptions=request.preemptions,
        queue_s=scheduled - request.arrival_s,
        prefill_s=first - scheduled,
        decode_s=last - first,
        e2e_s=now_s - request.arrival_s,
    )
