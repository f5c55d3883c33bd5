"""The usage ledger turns cumulative reports into per-hour deltas: restarts, resets, hours."""

from __future__ import annotations

from llmgw.server.state.usage import HOUR_MS, UsageCounts, UsageLedger

L = ("t", "k_1", "m")


def test_deltas_restart_and_reset() -> None:
    ledger = UsageLedger()
    ledger.report("g", 1, {L: UsageCounts(requests=2, prompt_tokens=10)}, 5)
    ledger.report("g", 1, {L: UsageCounts(requests=3, prompt_tokens=15)}, 6)
    assert ledger.pending[(0, *L)] == UsageCounts(requests=3, prompt_tokens=15)
    ledger.report("g", 2, {L: UsageCounts(requests=1, prompt_tokens=4)}, 7)  # restart: whole
    ledger.report("g", 2, {L: UsageCounts(requests=0, prompt_tokens=3)}, 8)  # went down: whole
    assert ledger.pending[(0, *L)] == UsageCounts(requests=4, prompt_tokens=22)


def test_hour_boundary_and_give_back() -> None:
    ledger = UsageLedger()
    ledger.report("g", 1, {L: UsageCounts(requests=1)}, HOUR_MS - 1)
    ledger.report("g", 1, {L: UsageCounts(requests=3)}, HOUR_MS)
    batch = ledger.take()
    assert batch == {(0, *L): UsageCounts(requests=1), (HOUR_MS, *L): UsageCounts(requests=2)}
    assert ledger.pending == {}
    ledger.give_back(batch)
    assert ledger.pending == batch
