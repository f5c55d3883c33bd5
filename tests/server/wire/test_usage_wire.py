"""llmgw.server.wire.usage: reported rows into the ledger, bounded and clamped."""

from __future__ import annotations

import math

from llmgw.api.llmgw.v1 import TenantUsage
from llmgw.server.state.usage import UsageLedger
from llmgw.server.wire.usage import MAX_COUNT, MAX_USAGE_ROWS, counts_of, take_usage


def test_a_lying_gateways_figures_are_clamped() -> None:
    lie = TenantUsage(
        tenant="t", key_id="k", model="m", requests=2**64 - 1, prompt_tokens=5,
        cached_prompt_tokens=9, gpu_seconds=math.inf,
    )  # fmt: skip
    counts = counts_of(lie)
    assert counts.requests == MAX_COUNT
    assert counts.cached_tokens == 5  # never more cached than prompt
    assert counts.gpu_ms == 0
    assert counts_of(TenantUsage(gpu_seconds=-3.0)).gpu_ms == 0


def test_a_report_with_too_many_rows_is_not_counted() -> None:
    ledger = UsageLedger(since_ms=0)
    rows = [
        TenantUsage(tenant="t", key_id=f"k{i}", model="m", requests=1)
        for i in range(MAX_USAGE_ROWS + 1)
    ]
    take_usage(ledger, "g", 1, rows)
    assert ledger.pending == {}
    take_usage(ledger, "g", 1, rows[:3])
    assert len(ledger.pending) == 3
