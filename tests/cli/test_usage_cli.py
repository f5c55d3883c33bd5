"""``llmgw usage``: its time flags, its sums by period, its refusals."""

from __future__ import annotations

import argparse

import pytest

from llmgw.api.llmgw.v1 import UsageRow
from llmgw.cli.usage import summarize, when_ms

HOUR = 3_600_000


def row(hour: int, **counts: int) -> UsageRow:
    return UsageRow(hour_unix_ms=hour * HOUR, tenant="t", key_id="k", model="m", **counts)


def test_when_takes_a_duration_back_from_now_or_an_iso_time() -> None:
    assert when_ms("24h", now_s=100_000.0) == (100_000 - 86_400) * 1000
    assert when_ms("1d12h30m", now_s=200_000.0) == (200_000 - 131_400) * 1000
    assert when_ms("2026-12-01T00:00:00Z") == when_ms("2026-12-01T00:00:00")  # UTC
    for bad in ("", "yesterday", "12x"):
        with pytest.raises(argparse.ArgumentTypeError, match="neither a duration"):
            when_ms(bad)


def test_summarize_sums_per_key_and_model_or_per_period() -> None:
    rows = [
        row(0, requests=1, prompt_tokens=10, cached_prompt_tokens=4),
        row(1, requests=2, prompt_tokens=20, cached_prompt_tokens=6, completion_tokens=5),
    ]
    [total] = summarize(rows, "total")
    assert total == {
        "tenant": "t", "key": "k", "model": "m", "requests": 3, "refused": 0, "prompt": 30,
        "cached": 10, "uncached": 20, "completion": 5, "gpu_seconds": 0.0,
    }  # fmt: skip
    hours = summarize(rows, "hour")
    assert [h["period"] for h in hours] == ["1970-01-01T00:00Z", "1970-01-01T01:00Z"]
    [day] = summarize(rows, "day")
    assert day["period"] == "1970-01-01T00:00Z" and day["requests"] == 3
