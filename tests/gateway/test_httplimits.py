"""The pure parts of the HTTP ports' limits: the connection caps, the body budget, the body
deadline."""

from __future__ import annotations

from llmgw.gateway.httplimits import BodyBudget, PeerCount, ServerLimits


def test_the_per_peer_cap_counts_each_address_apart() -> None:
    peers = PeerCount(ServerLimits(max_connections=10, max_connections_per_peer=2))
    for _ in range(2):
        assert peers.refusal("10.0.0.1") is None
        peers.add("10.0.0.1")
    assert "10.0.0.1 has 2 connections open" in (peers.refusal("10.0.0.1") or "")
    assert peers.refusal("10.0.0.2") is None  # another peer is still taken in
    peers.remove("10.0.0.1")
    assert peers.refusal("10.0.0.1") is None


def test_the_total_cap_holds_whoever_connects() -> None:
    peers = PeerCount(ServerLimits(max_connections=3, max_connections_per_peer=3))
    for host in ("a", "b", "c"):
        peers.add(host)
    assert "3 connections, its limit" in (peers.refusal("d") or "")
    peers.remove("b")
    assert peers.refusal("d") is None
    assert peers.total == 2


def test_the_budget_takes_nothing_it_cannot_hold_whole() -> None:
    budget = BodyBudget(100)
    assert budget.take(60)
    assert not budget.take(41)
    assert budget.held == 60
    assert budget.take(40)
    budget.give(100)
    assert budget.held == 0


def test_a_body_has_its_grace_then_must_keep_the_minimum_rate() -> None:
    limits = ServerLimits(body_timeout_s=10.0, min_body_rate=1000)
    assert limits.body_deadline(5.0, 0) == 15.0
    assert limits.body_deadline(5.0, 20_000) == 35.0  # 20 s more for 20,000 bytes
