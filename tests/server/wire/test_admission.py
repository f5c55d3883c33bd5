"""Registration rate limits, with explicit clocks."""

from __future__ import annotations

from llmgw.server.wire.admission import RegisterLimiter, RegisterLimits, TokenBucket


def test_a_bucket_gives_its_burst_then_one_token_per_interval() -> None:
    bucket = TokenBucket(rate=2.0, burst=3)
    assert [bucket.take(10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(10.0) == 0.5  # one token is 0.5 s away at 2 a second
    assert bucket.take(10.5) == 0.0
    assert bucket.take(100.0) == 0.0 and bucket.tokens == 2.0  # refilled to the burst only


def test_one_peer_is_limited_without_limiting_another() -> None:
    limiter = RegisterLimiter(RegisterLimits(per_peer_per_s=1, per_peer_burst=2, total_burst=100))
    assert limiter.admit("10.0.0.1", 0.0) == ("", 0.0)
    assert limiter.admit("10.0.0.1", 0.0) == ("", 0.0)
    why, wait = limiter.admit("10.0.0.1", 0.0)
    assert why == "too many registrations from 10.0.0.1" and wait == 1.0
    assert limiter.admit("10.0.0.2", 0.0) == ("", 0.0)
    assert limiter.refused == 1


def test_the_overall_limit_holds_across_peers_and_returns_the_peer_token() -> None:
    limits = RegisterLimits(per_peer_burst=5, total_per_s=1, total_burst=2)
    limiter = RegisterLimiter(limits)
    assert limiter.admit("a", 0.0)[0] == limiter.admit("b", 0.0)[0] == ""
    why, wait = limiter.admit("c", 0.0)
    assert why == "too many registrations from all agents together" and wait == 1.0
    for _ in range(5):  # "c" lost no token of its own to the overall refusal
        assert limiter.admit("c", 10.0 + _)[0] == ""


def test_idle_peers_are_forgotten_when_the_table_is_full() -> None:
    limiter = RegisterLimiter(RegisterLimits(max_peers=2, per_peer_per_s=1, per_peer_burst=1))
    limiter.admit("a", 0.0)
    limiter.admit("b", 0.0)
    limiter.admit("c", 5.0)  # a and b are full again: forgotten
    assert set(limiter._peers) == {"c"}
