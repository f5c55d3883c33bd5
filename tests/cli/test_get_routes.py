"""``llmgw get routes``'s table (llmgw.cli.routes): one row per decision, the reason last."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from llmgw.api.llmgw.v1 import RouteCandidate, RouteDecision
from llmgw.cli.routes import decision_rows
from llmgw.cli.tables import render_table


@pytest.fixture(autouse=True)
def _utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        yield
    finally:
        monkeypatch.undo()
        time.tzset()


def test_each_decision_is_a_row_with_its_match_candidates_and_reason() -> None:
    precise = RouteDecision(
        at_unix_ms=1_700_000_000_000,
        model="chat",
        tier="precise",
        replica_id="chat-2",
        reason="precise-hit",
        matched=58,
        total=62,
        unit="blocks",
        candidates=[
            RouteCandidate(replica_id="chat-1", matched=3, in_flight=1),
            RouteCandidate(replica_id="chat-2", matched=58),
        ],
        cached_tokens=928,
        gateway_id="gw-east",
    )
    plain = RouteDecision(tier="round_robin", replica_id="chat-1", reason="round-robin")
    rows = decision_rows([precise, plain])
    assert rows[0] == [
        "TIME", "GATEWAY", "MODEL", "TIER", "REPLICA", "MATCHED", "CACHED", "CANDIDATES", "REASON"
    ]  # fmt: skip
    assert rows[1] == [
        "22:13:20", "gw-east", "chat", "precise", "chat-2", "58/62b", "928",
        "chat-1:3/1 chat-2:58/0", "precise-hit",
    ]  # fmt: skip
    assert rows[2] == ["-", "-", "", "round_robin", "chat-1", "-", "-", "-", "round-robin"]
    assert render_table(rows).splitlines()[1].endswith("precise-hit")
