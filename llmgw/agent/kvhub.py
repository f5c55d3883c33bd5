"""The agent's KV event hub: one subscriber per followed engine, and what goes up the stream.

`KvEventHub` owns the subscribers (``follow``/``forget``, driven by shard states) and is
what the stream reads: `KvEventHub.full_copy` (every engine's blocks, for a new stream) and
`KvEventHub.next_deltas` (net changes, batched every ``flush_interval_s``, packed). Nothing is
queued while the stream is down: the mirrors are the state and the next stream gets a full
copy, so memory stays bounded by the blocks the engines hold.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import zmq
import zmq.asyncio

from llmgw.agent.engines.base import KvEventEndpoints
from llmgw.agent.kvevents import EngineSubscriber, KvEventCounters, KvFollowConfig
from llmgw.api.llmgw.v1 import KvDelta
from llmgw.kvcache.keys import pack_keys
from llmgw.kvcache.mirror import BlockMirror, MirrorDelta

__all__ = ["KvEventHub"]

log = logging.getLogger(__name__)


class KvEventHub:
    """Every engine this agent follows, and what goes up the stream about their blocks."""

    def __init__(self, config: KvFollowConfig | None = None) -> None:
        self.config = config or KvFollowConfig()
        self._ctx: zmq.asyncio.Context | None = None
        self._engines: dict[str, tuple[EngineSubscriber, asyncio.Task[None]]] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._gone: dict[tuple[str, int], None] = {}  # engines whose blocks upstream must drop
        self._dirty = asyncio.Event()

    def follow(self, shard_id: str, endpoints: KvEventEndpoints) -> None:
        """Subscribe to a shard's engine (nothing changes if it already is, same endpoints)."""
        current = self._engines.get(shard_id)
        if current is not None and current[0].endpoints == endpoints:
            return
        self.forget(shard_id)
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sub = EngineSubscriber(
            shard_id, endpoints, ctx=self._ctx, config=self.config, on_change=self._dirty.set
        )
        task = asyncio.create_task(sub.run(), name=f"kv-events {shard_id}")
        self._engines[shard_id] = (sub, task)
        log.info("shard %s: following KV events on %s", shard_id, endpoints.endpoint)

    def cap(self, shard_id: str, blocks: int) -> None:
        """Bound the shard's mirrors at its engine's block count (`EngineSubscriber.cap`);
        nothing happens for a shard not followed. A new subscriber (another engine process)
        starts from ``config.max_blocks`` again, until it is capped in turn."""
        entry = self._engines.get(shard_id)
        if entry is None:
            return
        entry[0].cap(blocks)
        log.info("shard %s: KV mirrors hold at most %d blocks", shard_id, entry[0].max_blocks)

    def forget(self, shard_id: str) -> None:
        """Stop following a shard's engine; upstream drops its blocks with the next deltas."""
        entry = self._engines.pop(shard_id, None)
        if entry is None:
            return
        sub, task = entry
        task.cancel()
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)
        for rank in sub.mirrors:
            self._gone[(shard_id, rank)] = None
        self._dirty.set()

    def following(self) -> list[str]:
        return sorted(self._engines)

    def counters(self) -> dict[str, KvEventCounters]:
        """Each followed engine's counters, by shard id."""
        return {shard: sub.counters() for shard, (sub, _) in sorted(self._engines.items())}

    def max_blocks(self, shard_id: str) -> int | None:
        """The bound on each of the shard's mirrors now (its engine's count once capped, else
        ``config.max_blocks``); None for a shard not followed."""
        entry = self._engines.get(shard_id)
        return entry[0].max_blocks if entry is not None else None

    def full_copy(self) -> list[KvDelta]:
        """Every followed engine's blocks (reset first): what a new stream starts with."""
        out = self._take_gone()
        for sub, rank, mirror in self._mirrors():
            out += self._wire(sub, rank, mirror, mirror.take_snapshot())
        self._dirty.clear()
        return out

    def take_deltas(self) -> list[KvDelta]:
        """The net changes of every engine since the last call (or full copy)."""
        out = self._take_gone()
        for sub, rank, mirror in self._mirrors():
            if mirror.pending:
                delta = mirror.take_delta()
                if not delta.empty:
                    out += self._wire(sub, rank, mirror, delta)
        return out

    async def next_deltas(self) -> list[KvDelta]:
        """Wait for changes, let them gather for ``flush_interval_s``, then take them."""
        while True:
            await self._dirty.wait()
            await asyncio.sleep(self.config.flush_interval_s)
            self._dirty.clear()
            deltas = self.take_deltas()
            if deltas:
                return deltas

    async def aclose(self) -> None:
        """Stop every subscriber and close the ZMQ context."""
        tasks = [task for _, task in self._engines.values()] + list(self._stopping)
        self._engines.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _mirrors(self) -> Iterator[tuple[EngineSubscriber, int, BlockMirror]]:
        """Every mirror with its subscriber and rank, in shard and rank order."""
        for shard_id in sorted(self._engines):
            sub = self._engines[shard_id][0]
            for rank in sorted(sub.mirrors):
                yield sub, rank, sub.mirrors[rank]

    def _take_gone(self) -> list[KvDelta]:
        gone = [KvDelta(shard_id=s, data_parallel_rank=r, reset=True) for s, r in self._gone]
        self._gone.clear()
        return gone

    def _wire(
        self, sub: EngineSubscriber, rank: int, mirror: BlockMirror, delta: MirrorDelta
    ) -> list[KvDelta]:
        """``delta`` as KvDelta messages: removals before stores, reset on the first."""
        chunk = max(1, self.config.full_copy_chunk)
        parts = [(delta.removed[i : i + chunk], delta.removed_keys[i : i + chunk], False)
                 for i in range(0, len(delta.removed), chunk)]  # fmt: skip
        parts += [(delta.stored[i : i + chunk], delta.stored_keys[i : i + chunk], True)
                  for i in range(0, len(delta.stored), chunk)]  # fmt: skip
        out: list[KvDelta] = []
        for hashes, keys, stored in parts or [((), (), True)]:
            message = KvDelta(
                shard_id=sub.shard_id,
                data_parallel_rank=rank,
                reset=delta.reset and not out,
                seq=sub.last_seq or 0,
                block_size=mirror.block_size,
                oldest_event_ts=delta.oldest_event_ts,
            )
            if stored:
                message.stored, message.stored_keys = pack_keys(hashes), pack_keys(keys)
            else:
                message.removed, message.removed_keys = pack_keys(hashes), pack_keys(keys)
            out.append(message)
        return out
