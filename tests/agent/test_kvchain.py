"""The whole KV chain as a property: engine → agent → server → router feed → gateway index.

`test_kvevents.py` proves the agent's subscriber against a stand-in receiver. Here the
agent's deltas go through the real pieces behind it, as the server and a gateway run them:
``decode_kv_delta`` and the server's `KvBlocks` store, a `KvWatcher` (the router feed's
per-gateway debt: net changes coalesced, full copies after resets, chunked), and
``apply_kv_blocks`` into the gateway's `KvIndex`. Random stores, evictions and clears, with
lost batches (healed by replay), engine restarts, feeds drained at random moments with
small budgets and gateways that reconnect (a fresh index fed a full copy): once the engine
is quiet, the gateway's index holds exactly the keys of the engine's cache.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kvevents import Engine, _restart, endpoints_in, joined, synced

from llmgw.agent.kvevents import KvFollowConfig
from llmgw.agent.kvhub import KvEventHub
from llmgw.api.llmgw.v1 import KvDelta
from llmgw.gateway.feed import apply_kv_blocks
from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.server.state.kvblocks import KvBlocks, KvWatcher, decode_kv_delta

NODE, REPLICA, SHARD = "n1", "r1", "s1"


class Chain:
    """The server's store and one gateway's index behind it, fed the agent's deltas."""

    def __init__(self, rng: random.Random, reconnects: bool) -> None:
        self.rng = rng
        self.reconnects_at_random = reconnects
        # Small limits, so that chunked copies and the switch to a full copy happen here.
        self.store = KvBlocks(touched_limit=6, chunk=4)
        self.watcher: KvWatcher = self.store.watch()
        self.index = KvIndex()
        self.reconnects = 0

    def apply(self, deltas: Sequence[KvDelta]) -> None:
        """Take the agent's deltas, then maybe drain some of the feed or reconnect."""
        for delta in deltas:
            self.store.apply(NODE, REPLICA, decode_kv_delta(delta))
            if self.rng.random() < 0.3:
                self.drain(self.rng.choice([1, 3, 50]))
        if self.reconnects_at_random and self.rng.random() < 0.1:
            self.reconnect()

    def drain(self, budget: int = 1 << 30) -> None:
        for event in self.watcher.take(budget):
            apply_kv_blocks(self.index, event)

    def reconnect(self) -> None:
        """A gateway that lost its feed: a new index, owed a full copy of every replica."""
        self.watcher.close()
        self.watcher = self.store.watch()
        self.watcher.mark_full(self.store.replica_ids())
        self.index = KvIndex()
        self.reconnects += 1

    def of(self, shard: str) -> dict[int, int]:
        """What `synced` compares, read from the gateway's end: key → key."""
        return {key: key for key in self.index.keys_of(REPLICA)}

    def close(self) -> None:
        self.watcher.close()


_STEPS = st.lists(
    st.sampled_from(["store", "store", "evict", "clear", "lose", "restart", "reconnect"]),
    min_size=1,
    max_size=25,
)


async def _scenario(folder: Path, steps: list[str], seed: int, each: bool) -> Chain:
    """Run ``steps``; with ``each``, every step's batch passes the chain before the next
    (else the agent may coalesce several steps into one net delta)."""
    engine = Engine(endpoints_in(folder), seed=seed)
    await engine.start()
    hub = KvEventHub(KvFollowConfig(flush_interval_s=0.005, replay_timeout_s=1.0))
    chain = Chain(random.Random(seed), reconnects=not each)
    try:
        await joined(hub, chain, engine)
        for step in steps:
            await _step(step, hub, chain, engine)
            if each and step != "lose":  # a lost batch shows only when the next arrives
                await synced(hub, chain, SHARD, engine)
        engine.pub.publish([engine.store(1)])  # a delivered batch reveals any trailing gap
        await synced(hub, chain, SHARD, engine)
        chain.drain()
        assert sorted(chain.store.keys(REPLICA)) == sorted(set(engine.blocks.values()))
        assert sorted(chain.index.keys_of(REPLICA)) == sorted(set(engine.blocks.values()))
        assert hub.counters()[SHARD].replay_failures == 0
        return chain
    finally:
        chain.close()
        await hub.aclose()
        await engine.stop()


async def _step(step: str, hub: KvEventHub, chain: Chain, engine: Engine) -> None:
    if step == "restart":
        await _restart(hub, chain, engine)
    elif step == "reconnect":
        chain.reconnect()
    elif step == "lose" and engine.blocks:
        engine.pub.publish_lost([engine.store(1), engine.evict()])
    elif step == "evict" and engine.blocks:
        engine.pub.publish([engine.evict()])
    elif step == "clear":
        engine.pub.publish([engine.clear()])
    else:
        engine.pub.publish([engine.store(engine.rng.randint(1, 3))])
    if engine.rng.random() < 0.3:
        chain.apply(hub.take_deltas())
    await asyncio.sleep(0)


def _run(steps: list[str], seed: int, each: bool = False) -> Chain:
    folder = Path(tempfile.mkdtemp(prefix="llmgw-kvc-", dir="/tmp"))
    try:
        return asyncio.run(_scenario(folder, steps, seed, each))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_STEPS, st.integers(0, 2**32))
def test_after_losses_restarts_and_reconnects_the_gateway_index_equals_the_engines_cache(
    steps: list[str], seed: int
) -> None:
    _run(steps, seed)


def test_the_chain_sees_every_fault_in_one_run() -> None:
    """One fixed run with each fault, so the property's claim never rests on luck alone."""
    steps = ["store", "lose", "store", "evict", "reconnect", "store", "restart", "store",
             "clear", "store", "lose", "store", "reconnect", "store", "evict", "store", "clear",
             "store", "evict"]  # fmt: skip
    chain = _run(steps, seed=7, each=True)
    stats = chain.store.stats()
    assert chain.reconnects == 2
    assert stats.resets >= 3  # the join's full copy, the restart, the clear
    assert stats.removed >= 2  # the eviction and the lost one, healed by replay
