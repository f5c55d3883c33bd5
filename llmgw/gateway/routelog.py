"""The gateway's last routing decisions, for ``GetRouterStats`` and the console.

A bounded ring (`RECENT_DECISIONS`) of `RouteRecord`: when, which model, the `Decision`
(with its `Basis`, kept by reference: nothing is copied or formatted on the request path),
why the precise tier did not decide, and, once the answer has ended, the cached tokens the
engine reported. A record is explained (``llmgw.gateway.routing.explain``) only when it is
read. Every attempt is a decision: a retried request leaves one record per replica tried.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from llmgw.gateway.routing.policy import Decision

RECENT_DECISIONS = 200
"""Decisions a gateway keeps (and the server answers, merged over every gateway)."""

__all__ = ["RECENT_DECISIONS", "RouteLog", "RouteRecord"]


class RouteRecord:
    """One decision as the ring keeps it."""

    __slots__ = ("at_ms", "cached_tokens", "decision", "fallback", "model")

    def __init__(self, at_ms: int, model: str, decision: Decision, fallback: str) -> None:
        self.at_ms = at_ms
        self.model = model
        self.decision = decision
        self.fallback = fallback  # why the precise tier did not decide ("" it did or is off)
        self.cached_tokens: int | None = None  # what the engine reported, once answered


class RouteLog:
    """The last ``size`` decisions, oldest first."""

    def __init__(
        self, size: int = RECENT_DECISIONS, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._records: deque[RouteRecord] = deque(maxlen=size)
        self._clock = clock

    def add(self, model: str, decision: Decision, fallback: str = "") -> RouteRecord:
        record = RouteRecord(int(self._clock() * 1000), model, decision, fallback)
        self._records.append(record)
        return record

    def records(self) -> list[RouteRecord]:
        return list(self._records)

    def __len__(self) -> int:
        return len(self._records)
