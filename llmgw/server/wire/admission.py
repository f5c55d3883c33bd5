"""Who may open an agent stream now: registration rate limits, pure and clocked by the caller.

Every ``AgentService.Connect`` takes one token from the bucket of its peer's host and one
from the bucket shared by all peers (:class:`RegisterLimiter`); a call that finds either
empty is refused with RESOURCE_EXHAUSTED and the seconds until a token is back, so a flood
of registrations (fake node ids, a reconnect loop) costs the server a refusal each and
cannot fill the inventory faster than the overall rate. The defaults leave room for a fleet
that reconnects at once after a server restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RegisterLimits", "RegisterLimiter", "TokenBucket"]


@dataclass(frozen=True, slots=True)
class RegisterLimits:
    """Registrations allowed: per peer host and overall, as a rate and a burst."""

    per_peer_per_s: float = 5.0
    per_peer_burst: int = 30
    total_per_s: float = 50.0
    total_burst: int = 300
    max_peers: int = 10_000  # buckets kept; the fullest (idle) ones are forgotten first


@dataclass(slots=True)
class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second."""

    rate: float
    burst: int
    tokens: float = field(default=-1.0)
    at: float = 0.0

    def take(self, now: float) -> float:
        """Take one token: 0.0 when there was one, else the seconds until there is."""
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def give_back(self) -> None:
        """Return a token taken by a call another bucket refused."""
        self.tokens = min(float(self.burst), self.tokens + 1.0)

    def full(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= self.burst

    def _refill(self, now: float) -> None:
        if self.tokens < 0:
            self.tokens, self.at = float(self.burst), now
            return
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.rate)
        self.at = now


class RegisterLimiter:
    """The buckets of :class:`RegisterLimits`: one per peer host, one for everyone."""

    def __init__(self, limits: RegisterLimits | None = None) -> None:
        self.limits = limits or RegisterLimits()
        self._total = TokenBucket(self.limits.total_per_s, self.limits.total_burst)
        self._peers: dict[str, TokenBucket] = {}
        self.refused = 0

    def admit(self, peer_host: str, now: float) -> tuple[str, float]:
        """('', 0) when a registration from ``peer_host`` may go on, else why not and the
        seconds until it would be admitted."""
        bucket = self._peer(peer_host, now)
        wait = bucket.take(now)
        if wait:
            self.refused += 1
            return f"too many registrations from {peer_host or 'this peer'}", wait
        wait = self._total.take(now)
        if wait:
            bucket.give_back()
            self.refused += 1
            return "too many registrations from all agents together", wait
        return "", 0.0

    def _peer(self, peer_host: str, now: float) -> TokenBucket:
        bucket = self._peers.get(peer_host)
        if bucket is None:
            if len(self._peers) >= self.limits.max_peers:
                self._forget_idle(now)
            bucket = TokenBucket(self.limits.per_peer_per_s, self.limits.per_peer_burst)
            self._peers[peer_host] = bucket
        return bucket

    def _forget_idle(self, now: float) -> None:
        """Drop the buckets that are full again (their peers have been quiet)."""
        for host in [h for h, b in self._peers.items() if b.full(now)]:
            del self._peers[host]
        if len(self._peers) >= self.limits.max_peers:  # all busy: forget the oldest
            del self._peers[next(iter(self._peers))]
