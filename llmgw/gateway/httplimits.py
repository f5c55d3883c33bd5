"""What an HTTP/1.1 port lets its clients take: ``ServerLimits`` and the two shared counters
it bounds, connections per peer (``PeerCount``) and request bytes buffered (``BodyBudget``).

Both HTTP ports (the gateway's and the gRPC-web one) are served by ``httpserver.HttpServer``
under these limits. Each bound answers as operators of nginx or Envoy expect:

- the request head (request line and headers) at most ``max_head_bytes`` bytes and
  ``max_headers`` headers, else 431 and close;
- the head complete within ``head_timeout_s`` of its first byte, else 408 and close (a
  slowloris client that sends a header byte a second); a connection that sends nothing, or
  nothing more after a response, is closed after ``idle_timeout_s``;
- a body whose first bytes come within ``body_timeout_s`` of the head and that keeps up
  ``min_body_rate`` bytes/s after that grace, else 408 and close;
- at most ``max_connections`` open connections, ``max_connections_per_peer`` of them from
  one IP address: one more is answered 503 and closed at once, nothing of it read;
- at most ``max_body_buffer_bytes`` of request bodies held in memory across all connections
  of the port: a request whose body would go beyond it is answered 503 and closed, its body
  not read (its ``content-length`` is taken up front; a chunked body as it arrives);
- a body at most ``max_body_bytes`` (413).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

__all__ = ["BodyBudget", "PeerCount", "ServerLimits"]


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Bounds on what clients of one port may send, how long they may take and how many may
    be connected (see the module docstring for how each is answered)."""

    max_body_bytes: int = 32 * 1024 * 1024
    max_head_bytes: int = 64 * 1024  # request line + headers
    max_headers: int = 100
    head_timeout_s: float = 10.0  # first byte of a request → the end of its head
    body_timeout_s: float = 10.0  # grace from the end of the head, before min_body_rate holds
    min_body_rate: int = 32 * 1024  # bytes/s a body must average beyond the grace
    idle_timeout_s: float = 75.0  # accept or end of a response → the next request's first byte
    max_connections: int = 1024
    max_connections_per_peer: int = 128
    max_body_buffer_bytes: int = 256 * 1024 * 1024  # request bodies held, all connections

    def body_deadline(self, head_done: float, received: int) -> float:
        """When a body that began after a head ending at ``head_done`` is too slow, having
        delivered ``received`` bytes so far."""
        return head_done + self.body_timeout_s + received / self.min_body_rate


class PeerCount:
    """Open connections, in all and per peer address, against the two caps."""

    def __init__(self, limits: ServerLimits) -> None:
        self._limits = limits
        self._by_peer: Counter[str] = Counter()
        self.total = 0

    def refusal(self, peer: str) -> str | None:
        """Why one more connection from ``peer`` is refused; None: it may be taken."""
        if self.total >= self._limits.max_connections:
            return f"the server has {self.total} connections, its limit"
        if self._by_peer[peer] >= self._limits.max_connections_per_peer:
            return f"{peer} has {self._by_peer[peer]} connections open, the limit per client"
        return None

    def add(self, peer: str) -> None:
        self._by_peer[peer] += 1
        self.total += 1

    def remove(self, peer: str) -> None:
        self.total -= 1
        self._by_peer[peer] -= 1
        if self._by_peer[peer] <= 0:
            del self._by_peer[peer]


class BodyBudget:
    """Bytes of request bodies held in memory, across the connections of one port."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        """Hold ``size`` more bytes if the budget has room; False (nothing taken) if not."""
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size
