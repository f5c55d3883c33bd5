"""The usage ledger turns cumulative reports into per-hour deltas: restarts, resets, hours."""

from __future__ import annotations

from pathlib import Path

from llmgw.server.state.store import Store
from llmgw.server.state.usage import HOUR_MS, UsageCounts, UsageLedger

L = ("t", "k_1", "m")


def test_deltas_restart_and_reset() -> None:
    ledger = UsageLedger(since_ms=0)
    ledger.report("g", 1, {L: UsageCounts(requests=2, prompt_tokens=10)}, 5)
    ledger.report("g", 1, {L: UsageCounts(requests=3, prompt_tokens=15)}, 6)
    assert ledger.pending[(0, *L)] == UsageCounts(requests=3, prompt_tokens=15)
    ledger.report("g", 2, {L: UsageCounts(requests=1, prompt_tokens=4)}, 7)  # restart: whole
    ledger.report("g", 2, {L: UsageCounts(requests=0, prompt_tokens=3)}, 8)  # went down: whole
    assert ledger.pending[(0, *L)] == UsageCounts(requests=4, prompt_tokens=22)


def test_a_gateway_older_than_the_ledger_gives_a_baseline_not_a_count() -> None:
    # a new leader: what the gateway counted before may be stored already
    ledger = UsageLedger(since_ms=1000)
    ledger.report("old", 500, {L: UsageCounts(requests=50)}, 2000)
    assert ledger.pending == {}
    ledger.report("old", 500, {L: UsageCounts(requests=52)}, 3000)
    ledger.report("new", 1500, {L: UsageCounts(requests=1)}, 3000)  # started after: whole
    assert ledger.pending[(0, *L)] == UsageCounts(requests=3)


def test_hour_boundary_and_give_back() -> None:
    ledger = UsageLedger(since_ms=0)
    ledger.report("g", 1, {L: UsageCounts(requests=1)}, HOUR_MS - 1)
    ledger.report("g", 1, {L: UsageCounts(requests=3)}, HOUR_MS)
    batch = ledger.take()
    assert batch == {(0, *L): UsageCounts(requests=1), (HOUR_MS, *L): UsageCounts(requests=2)}
    assert ledger.pending == {}
    ledger.give_back(batch)
    assert ledger.pending == batch


async def test_usage_batches_add_up_in_the_store_across_reopens(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    async with Store(db) as store:
        await store.add_usage({(0, *L): UsageCounts(requests=1, cached_tokens=3)})
        await store.add_usage({(0, *L): UsageCounts(requests=2, gpu_ms=7)})
    async with Store(db) as store:
        assert await store.load_usage() == {
            (0, *L): UsageCounts(requests=3, cached_tokens=3, gpu_ms=7)
        }
        assert await store.load_usage(since_ms=HOUR_MS) == {}
