"""The engine task: runs scheduler steps in simulated time and hands tokens to requests.

`EngineCore` owns the tokenizer, the block pool, the scheduler and the stats; one asyncio
task (`EngineCore.run`) plans a step, sleeps for the step's simulated duration, completes
it, publishes the step's KV events as one batch, and wakes the requests that gained a
token. HTTP handlers talk to it through `submit` (an async iterator of `TokenOutput`),
`abort` and the read-only views; everything runs on the one event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from llmgw.kvcache import Event, RequestExtraKeys, none_hash
from llmgw.sim.engine.blocks import BlockPool
from llmgw.sim.engine.config import LoraModule, SimEngineConfig
from llmgw.sim.engine.generation import OutputPlan, SamplingSpec, word_token_ids
from llmgw.sim.engine.metrics import EngineGauges, EngineStats
from llmgw.sim.engine.scheduler import (
    HashingConfig,
    Scheduler,
    SchedulerConfig,
    SimRequest,
    TokenOutput,
)
from llmgw.sim.engine.tokenizer import SimTokenizer

log = logging.getLogger(__name__)

EventPublisher = Callable[[Sequence[Event]], None]


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """Per-request inputs besides the prompt that change hashing or events."""

    lora: LoraModule | None = None
    cache_salt: str | None = None
    session_id: str | None = None


class RequestStream:
    """The outputs of one request, oldest first; ends after the one with a finish reason."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self.finished = False

    def put(self, output: TokenOutput) -> None:
        self._queue.put_nowait(output)

    def __aiter__(self) -> AsyncIterator[TokenOutput]:
        return self

    async def __anext__(self) -> TokenOutput:
        if self.finished:
            raise StopAsyncIteration
        output = await self._queue.get()
        if output.finish_reason is not None:
            self.finished = True
        return output


class EngineCore:
    """The simulated engine core: one scheduler, one block pool, one step loop."""

    def __init__(
        self,
        config: SimEngineConfig,
        *,
        publish: EventPublisher | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.tokenizer = SimTokenizer()
        self.stats = EngineStats(config.max_model_len)
        self._word_ids = word_token_ids(self.tokenizer)
        self._publish = publish
        self._clock = clock
        records = config.enable_prefix_caching and config.kv_events.publishes
        self.pool = BlockPool(
            config.sim.num_kv_blocks,
            config.block_size,
            record_events=records,
            int_hashes=config.int_block_hashes,
        )
        self.scheduler = Scheduler(_scheduler_config(config), self.pool, self.stats)
        self._work = asyncio.Event()
        self._ids = itertools.count()
        self._id_prefix = os.urandom(4).hex()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def gauges(self) -> EngineGauges:
        return EngineGauges(
            running=self.num_running,
            waiting=self.num_waiting,
            waiting_deferred=self.scheduler.num_deferred,
            kv_usage=self.pool.usage,
        )

    def submit(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        options: RequestOptions = RequestOptions(),
    ) -> RequestStream:
        """Queue a request; its tokens arrive on the returned stream."""
        request_id = f"{self._id_prefix}-{next(self._ids)}"
        stream = RequestStream(request_id)
        lora = options.lora
        request = SimRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            plan=OutputPlan(prompt_token_ids, sampling, self._word_ids, self.config.seed),
            sink=stream.put,
            arrival_s=self._clock(),
            lora_name=lora.name if lora else None,
            lora_int_id=self._lora_event_id(lora),
            extra_keys=self._extra_keys(options),
            session_id=options.session_id,
        )
        self.scheduler.add(request)
        self._work.set()
        return stream

    def abort(self, request_id: str) -> None:
        """End a request whose client went away; a finished one is left alone."""
        if self.scheduler.abort(request_id, self._clock()):
            log.debug("aborted request %s", request_id)
            self._flush_events()
            self._work.set()

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``; False (and a warning) while blocks are in use."""
        if not self.scheduler.reset_prefix_cache():
            used = self.pool.num_blocks - self.pool.num_free
            log.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet", used
            )
            return False
        log.info("Resetting prefix cache")
        self._flush_events()
        return True

    async def run(self) -> None:
        """The step loop; runs until cancelled."""
        while True:
            await self._work.wait()
            self._work.clear()
            while self.scheduler.has_work():
                if not await self._step():
                    break  # nothing schedulable until a request arrives or leaves

    async def _step(self) -> bool:
        started = self._clock()
        plan = self.scheduler.schedule(started)
        if plan.empty:
            self._flush_events()
            return False
        remaining = started + plan.duration_s - self._clock()
        await asyncio.sleep(max(remaining, 0.0))
        self.scheduler.complete(plan, self._clock())
        self._flush_events()
        return True

    def _flush_events(self) -> None:
        events = self.pool.take_events()
        if events and self._publish is not None:
            self._publish(events)

    def _extra_keys(self, options: RequestOptions) -> RequestExtraKeys | None:
        if options.lora is None and not options.cache_salt:
            return None
        lora = options.lora
        return RequestExtraKeys(
            lora_name=lora.name if lora else None,
            lora_path=lora.path if lora else None,
            lora_int_id=lora.lora_int_id if lora else None,
            cache_salt=options.cache_salt or None,
            vllm_version=self.config.vllm_version,
        )

    def _lora_event_id(self, lora: LoraModule | None) -> int | None:
        # vLLM before 0.11.1 read a field LoRARequest does not have; from 0.11.1 events
        # carry adapter_id, which for a static module is its lora_int_id.
        if lora is None or self.config.version < (0, 11, 1):
            return None
        return lora.lora_int_id


def _scheduler_config(config: SimEngineConfig) -> SchedulerConfig:
    hashing = None
    if config.enable_prefix_caching:
        algo = config.prefix_caching_hash_algo
        root = none_hash(algo, config.hash_seed, config.vllm_version)
        hashing = HashingConfig(algo=algo, root=root, vllm_version=config.vllm_version)
    return SchedulerConfig(
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_loras=config.max_loras,
        prefill_s_per_token=config.sim.prefill_s_per_token,
        decode_s_per_token=config.sim.decode_s_per_token,
        hashing=hashing,
    )
