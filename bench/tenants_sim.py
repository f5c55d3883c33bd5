"""The tenants benchmark's simulation (bench/tenants.py runs and reports it).

A saturated fleet in simulated time: ``engines`` simulated engines (the routing
benchmark's ``SimEngine``: the simulated engine's block pool, scheduler and timing model),
each running at most ``max_num_seqs`` requests, behind one gateway's flow control, the
gateway's own pure scheduler (``llmgw.gateway.flow.FlowScheduler``): a request goes to the
least loaded replica with a free slot (the gateway's in-flight count below the replica's
``max_in_flight``, here its ``max_num_seqs``), else it waits in the scheduler, which hands
the next request (interactive band first; between tenants of a band the least virtual
token counter) to the first slot that frees. Service is charged at dispatch with the
request's estimate and corrected to its real tokens when it ends, as the gateway does.

Tenants: one interactive tenant sending at a steady Poisson rate, and two batch tenants
flooding: each keeps ``backlog`` requests outstanding (closed loop: a new one as soon as one
ends), with different prompt and answer lengths so that fairness by tokens is tested, not
by requests. Prompts are random tokens (no prefix sharing: the cache is not what is
measured here); answers ignore EOS so their lengths are exact.

Scenarios, each from the same seed: the interactive tenant alone (its unloaded TTFT), the
batch tenants alone (what the fleet serves), both with the flow control, and both without
it (every request straight to the least loaded engine, which queues it: what the queue
buys). Figures are taken over ``[warmup_s, duration_s)``.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.routing_fleet import BenchConfig, SimEngine
from llmgw.gateway.flow import FlowItem, FlowScheduler
from llmgw.gateway.routing.load import LoadTracker
from llmgw.sim.engine.generation import OutputPlan, SamplingSpec, word_token_ids
from llmgw.sim.engine.scheduler import SimRequest, TokenOutput
from llmgw.sim.engine.tokenizer import SimTokenizer

INTERACTIVE, BATCH = 0, 1


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """One tenant's traffic: a Poisson rate (interactive) or a backlog kept full (batch)."""

    name: str
    band: int
    prompt_tokens: int
    max_tokens: int
    rate: float = 0.0  # requests per second; 0: closed loop of ``backlog``
    backlog: int = 0


@dataclass(frozen=True, slots=True)
class SimConfig:
    engines: int = 4
    max_num_seqs: int = 16
    duration_s: float = 240.0
    warmup_s: float = 30.0
    seed: int = 1
    interactive: TenantLoad = TenantLoad("interactive", INTERACTIVE, 800, 64, rate=2.0)
    batch: tuple[TenantLoad, ...] = (
        TenantLoad("batch-a", BATCH, 300, 192, backlog=96),
        TenantLoad("batch-b", BATCH, 1200, 48, backlog=96),
    )
    max_queued: int = 4096


@dataclass(slots=True)
class Outcome:
    """One scenario's figures over the measured window."""

    ttfts: list[float] = field(default_factory=list)  # interactive, seconds
    tokens: dict[str, int] = field(default_factory=dict)  # tenant → prompt + completion
    completion: dict[str, int] = field(default_factory=dict)  # tenant → completion tokens
    slot_s: dict[str, float] = field(default_factory=dict)  # tenant → slot-seconds held
    window_s: float = 0.0
    max_queued: int = 0


@dataclass(order=True)
class _Event:
    at_s: float
    seq: int
    engine: SimEngine | None = field(compare=False, default=None)
    tenant: TenantLoad | None = field(compare=False, default=None)


class Fleet:
    """One scenario: the tenants in ``loads`` against a fresh fleet, with or without flow."""

    def __init__(self, config: SimConfig, loads: tuple[TenantLoad, ...], flow: bool) -> None:
        self.config = config
        self.loads = loads
        self.flow = flow
        longest = max(t.prompt_tokens + t.max_tokens for t in loads)
        bench = BenchConfig(
            engines=config.engines, max_num_seqs=config.max_num_seqs, block_size=16,
            system_tokens=longest, question_tokens=0, max_tokens=0, turns=1,
            kv_blocks=config.max_num_seqs * (longest // 16 + 2) * 2,
        )  # fmt: skip
        self.engines = {
            f"engine-{i:02d}": SimEngine(f"engine-{i:02d}", bench) for i in range(config.engines)
        }
        self.load = LoadTracker()
        self.scheduler = FlowScheduler(max_queued=config.max_queued)
        self.rng = random.Random(config.seed)
        self.words = word_token_ids(SimTokenizer())
        self.out = Outcome()
        self._heap: list[_Event] = []
        self._seq = 0
        self._now = 0.0
        self._ids = 0

    # -- the event loop -------------------------------------------------------------------

    def run(self) -> Outcome:
        for tenant in self.loads:
            if tenant.rate:
                self._push(self.rng.expovariate(tenant.rate), tenant=tenant)
            for _ in range(tenant.backlog):
                self._arrive(tenant)
        end = self.config.duration_s
        while self._heap and self._heap[0].at_s < end:
            event = heapq.heappop(self._heap)
            self._now = event.at_s
            if event.engine is not None:
                event.engine.finish_step(self._now)
                self._start(event.engine)
            else:
                assert event.tenant is not None
                self._arrive(event.tenant)
                self._push(self._now + self.rng.expovariate(event.tenant.rate), tenant=event.tenant)
        self.out.window_s = end - self.config.warmup_s
        return self.out

    def _push(
        self, at_s: float, *, engine: SimEngine | None = None, tenant: TenantLoad | None = None
    ) -> None:
        self._seq += 1
        heapq.heappush(self._heap, _Event(at_s, self._seq, engine, tenant))

    def _start(self, engine: SimEngine) -> None:
        if engine.step is None:
            end = engine.start_step(self._now)
            if end is not None:
                self._push(end, engine=engine)

    # -- the gateway ----------------------------------------------------------------------

    def _arrive(self, tenant: TenantLoad) -> None:
        item = FlowItem(
            tenant=tenant.name, band=tenant.band, cost=tenant.prompt_tokens + tenant.max_tokens,
            enqueued_at=self._now, payload=tenant,
        )  # fmt: skip
        if not self.flow:
            self._dispatch(item, min(self.engines, key=self.load.in_flight))
            return
        # Through the queue even when a slot is free: requests already waiting go first.
        if not self.scheduler.push(item):
            raise RuntimeError("the flow queue is full: raise max_queued")
        self.out.max_queued = max(self.out.max_queued, len(self.scheduler))
        self._next()

    def _free_replica(self) -> str | None:
        """The least loaded replica with a free slot, or None."""
        rid = min(self.engines, key=self.load.in_flight)
        return None if self.load.in_flight(rid) >= self.config.max_num_seqs else rid

    def _dispatch(self, item: FlowItem, rid: str) -> None:
        tenant = item.payload
        assert isinstance(tenant, TenantLoad)
        if self.flow:
            self.scheduler.charge(item.tenant, item.band, item.cost)  # the estimate
        self.load.acquire(rid)
        self._ids += 1
        prompt = [self.rng.randrange(1000, 30000) for _ in range(tenant.prompt_tokens)]
        spec = SamplingSpec(max_tokens=tenant.max_tokens, ignore_eos=True)
        request = SimRequest(
            request_id=f"{tenant.name}/{self._ids}", prompt_token_ids=prompt,
            plan=OutputPlan(prompt, spec, self.words, 0), sink=_ignore, arrival_s=item.enqueued_at,
        )  # fmt: skip
        request.sink = self._sink(request, item, rid, self._now)
        engine = self.engines[rid]
        engine.submit(request)
        self._start(engine)

    def _sink(
        self, request: SimRequest, item: FlowItem, rid: str, dispatched_s: float
    ) -> Callable[[TokenOutput], None]:
        def done(output: TokenOutput) -> None:
            if output.finish_reason is not None:
                self._finished(request, item, rid, dispatched_s)

        return done

    def _finished(self, request: SimRequest, item: FlowItem, rid: str, dispatched_s: float) -> None:
        tenant = item.payload
        assert isinstance(tenant, TenantLoad) and request.first_token_s is not None
        spent = len(request.prompt_token_ids) + len(request.output_token_ids)
        if self.flow:
            self.scheduler.charge(item.tenant, item.band, spent - item.cost)  # corrected
        self.load.release(rid)
        if self._now >= self.config.warmup_s:
            out = self.out
            if tenant.band == INTERACTIVE:
                out.ttfts.append(request.first_token_s - request.arrival_s)
            out.tokens[tenant.name] = out.tokens.get(tenant.name, 0) + spent
            done = len(request.output_token_ids)
            out.completion[tenant.name] = out.completion.get(tenant.name, 0) + done
            held = self._now - max(dispatched_s, self.config.warmup_s)
            out.slot_s[tenant.name] = out.slot_s.get(tenant.name, 0.0) + held
        if tenant.backlog:
            self._arrive(tenant)  # the closed loop: the next one at once
        if self.flow:
            self._next()

    def _next(self) -> None:
        """Slots freed: the scheduler's next requests go to them."""
        while len(self.scheduler):
            replica = self._free_replica()
            if replica is None:
                return
            item = self.scheduler.pop()
            if item is None:
                return
            self._dispatch(item, replica)


def _ignore(output: TokenOutput) -> None:
    del output


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when every value is equal, 1/n when one has everything."""
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 1.0


__all__ = ["BATCH", "INTERACTIVE", "Fleet", "Outcome", "SimConfig", "TenantLoad", "jain"]
