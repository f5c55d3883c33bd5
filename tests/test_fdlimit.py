"""llmgw.fdlimit: the open files limit raised at start, accept errors logged sparingly."""

from __future__ import annotations

import asyncio
import errno
import logging
from typing import Any

import pytest

from llmgw.fdlimit import AcceptErrorThrottle, throttled_accept_errors

ACCEPT = "socket.accept() out of system resource"  # asyncio's own message


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _emfile() -> dict[str, Any]:
    return {"message": ACCEPT, "exception": OSError(errno.EMFILE, "Too many open files")}


def test_accept_errors_are_logged_once_per_interval_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, passed = _Clock(), []
    throttle = AcceptErrorThrottle(lambda _loop, ctx: passed.append(ctx), 10.0, clock)
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.ERROR, "llmgw.fdlimit"):
            for _ in range(1000):
                throttle(loop, _emfile())
                clock.now += 0.005  # 1000 errors in 5 s: one line
            clock.now += 6
            throttle(loop, _emfile())  # 11 s after the first: the second line, with the count
    finally:
        loop.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and passed == []
    assert "Too many open files" in lines[0] and "at most every 10 s" in lines[0]
    assert "999 more times since 11 s ago" in lines[1]


def test_other_errors_go_to_the_handler_before() -> None:
    passed: list[dict[str, Any]] = []
    throttle = AcceptErrorThrottle(lambda _loop, ctx: passed.append(ctx), 10.0, _Clock())
    loop = asyncio.new_event_loop()
    try:
        other = {"message": "Task exception was never retrieved", "exception": ValueError()}
        refused = {"message": ACCEPT, "exception": OSError(errno.ECONNABORTED, "aborted")}
        throttle(loop, other)
        throttle(loop, refused)
    finally:
        loop.close()
    assert passed == [other, refused]


async def test_the_handler_is_installed_for_the_block_and_put_back() -> None:
    loop = asyncio.get_running_loop()
    before = loop.get_exception_handler()
    with throttled_accept_errors() as throttle:
        assert loop.get_exception_handler() is throttle
    assert loop.get_exception_handler() is before
