"""The leader lease on both backends (``llmgw.server.state.lease``): one holder at a time,
an epoch that only grows, expiry by the database's clock, release, and writes fenced by it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from llmgw.api.llmgw.v1 import EngineProfile
from llmgw.server.core.plan import ReplicaPlan, ShardPlan
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord
from llmgw.server.errors import Deposed
from llmgw.server.state.lease import claim_lease, read_lease, release_lease
from llmgw.server.state.store import Store


async def test_one_holder_at_a_time_and_the_epoch_only_grows(db: Path | str) -> None:
    async with Store(db) as store:
        back = store.backend
        assert (await read_lease(back)).epoch == 0
        first = await claim_lease(back, "a/1", "a", "h:1", 400)
        assert first.held_by("a/1") and first.epoch == 1
        other = await claim_lease(back, "b/1", "b", "h:2", 400)
        assert other.held_by("a/1") and not other.held_by("b/1")  # a's, unexpired
        again = await claim_lease(back, "a/1", "a", "h:1", 400)
        assert again.epoch == 1  # a renewal keeps the epoch
        await asyncio.sleep(0.5)  # a stops renewing: its lease expires by the db's clock
        taken = await claim_lease(back, "b/1", "b", "h:2", 400)
        assert taken.held_by("b/1") and taken.epoch == 2 and taken.address == "h:2"
        back_to_a = await claim_lease(back, "a/1", "a", "h:1", 400)
        assert back_to_a.held_by("b/1")  # a does not take back what b holds


async def test_a_release_hands_over_without_waiting(db: Path | str) -> None:
    async with Store(db) as store:
        back = store.backend
        await claim_lease(back, "a/1", "a", "h:1", 60_000)
        assert not await release_lease(back, "b/1")  # not b's to release
        assert await release_lease(back, "a/1")
        taken = await claim_lease(back, "b/1", "b", "h:2", 60_000)
        assert taken.held_by("b/1") and taken.epoch == 2


async def test_a_deposed_servers_writes_are_refused_and_change_nothing(db: Path | str) -> None:
    async with Store(db) as store:
        back = store.backend
        view = await claim_lease(back, "a/1", "a", "h:1", 300)
        store.fence = ("a/1", view.epoch)
        await store.save_requests([("r1", "retire")])  # a leads: written
        await asyncio.sleep(0.4)
        await claim_lease(back, "b/1", "b", "h:2", 60_000)  # b took over
        with pytest.raises(Deposed, match="no longer holds the leader lease at epoch 1"):
            await store.save_requests([("r2", "retire")])
        with pytest.raises(Deposed):
            await store.save_replicas([_record("r3")])
        assert await store.load_requests() == [("r1", "retire")]
        assert await store.load_replicas() == []
        assert store.health.problem is None  # not a disk problem: nothing to recover from


async def test_the_sole_server_of_a_file_moves_the_epoch_on_at_each_start(tmp_path: Path) -> None:
    path = tmp_path / "server.db"
    epochs = []
    for _ in range(3):
        async with Store(path) as store:
            epochs.append((await store.take_lease("s/x", "s", "h:1")).epoch)
            await store.save_requests([("r", "retire")])  # fenced on its own lease: written
    assert epochs == [1, 2, 3]


def _record(replica_id: str) -> ReplicaRecord:
    shard = ShardPlan(f"{replica_id}.0", "n1", 0, (), 20000)
    plan = ReplicaPlan(replica_id, "chat", "p", "fp", (shard,))
    return ReplicaRecord(plan, EngineProfile(), Lifecycle.ACTIVE, 1)
