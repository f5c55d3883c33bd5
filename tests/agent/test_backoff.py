"""The reconnect backoff follows a server's retry hint and keeps long streaks visible."""

from __future__ import annotations

import logging

import pytest

from llmgw.agent.backoff import Backoff, BackoffPolicy


def test_a_retry_hint_replaces_the_exponential_delay_once() -> None:
    backoff = Backoff(BackoffPolicy(base_s=0.5, cap_s=15.0), seed=1)
    for _ in range(8):
        backoff.failed("down")
    assert 7.5 <= backoff.next_delay() <= 15.0  # capped exponential
    backoff.failed("refused", retry_after_s=2.5)
    assert 2.5 <= backoff.next_delay() <= 2.5 * 1.25  # the hint, with jitter
    assert backoff.next_delay() >= 7.5  # a hint counts for the next attempt only


def test_a_streak_warns_first_then_at_most_once_a_minute(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr("llmgw.agent.backoff.time.monotonic", lambda: now[0])
    backoff = Backoff(BackoffPolicy())
    with caplog.at_level(logging.DEBUG, logger="llmgw.agent.backoff"):
        for _ in range(30):  # 30 failures, 5 s apart: 150 s
            backoff.failed("refused: ALREADY_EXISTS")
            now[0] += 5.0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [int(r.args[2]) for r in warnings] == [1, 13, 25]  # type: ignore[index, arg-type]
