"""The native gRPC port's connection limits: a grpclib ``Server`` that closes what idles.

grpclib keeps every accepted connection until its peer closes it: a socket that never sends
the HTTP/2 preface, or one that opened no stream, holds a descriptor for good, and a few
hundred of them exhaust the process. :class:`LimitedServer` gives each connection:

- a **handshake** deadline (``ConnectionLimits.handshake_timeout_s``): the TLS handshake,
  if any, and the 24-byte HTTP/2 client preface must be done by then, else the socket is
  dropped;
- an **idle** deadline (``idle_timeout_s``): a connection with no open stream for that long
  is sent GOAWAY and closed (a stream that stays open, an agent's Connect or a gateway's
  Feed, keeps its connection however quiet it is; clients reconnect on their next call);
- **caps**: at most ``max_connections`` in all and ``max_per_peer`` from one IP address; one
  over a cap is closed at once. Refusals are logged at most once per
  ``REFUSED_LOG_EVERY_S`` with their count.

It reaches into two grpclib 0.4.9 internals (pinned): ``Server._protocol_factory`` (one
protocol per accepted connection, wrapped here) and ``Server.start``'s ``_server`` and
``_server_closed_fut`` (to pass ``ssl_handshake_timeout``, which grpclib does not).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import ssl
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, cast

import grpclib.server
from grpclib.protocol import H2Protocol

log = logging.getLogger(__name__)

PREFACE_BYTES = 24  # b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
REFUSED_LOG_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The native port's limits (``llmgw server --grpc-*`` flags)."""

    handshake_timeout_s: float = 10.0  # TLS handshake and HTTP/2 preface, from accept
    idle_timeout_s: float = 300.0  # no open stream this long: GOAWAY and close
    max_connections: int = 16384  # in all
    max_per_peer: int = 1024  # from one IP address (agents behind one NAT address count)


class LimitedServer(grpclib.server.Server):
    """A grpclib ``Server`` whose connections obey :class:`ConnectionLimits`."""

    def __init__(self, handlers: Collection[Any], *, limits: ConnectionLimits, **kwargs: Any):
        super().__init__(handlers, **kwargs)
        self.limits = limits
        self.total = 0
        self.by_peer: Counter[str] = Counter()
        self._refused = 0  # refusals not logged yet
        self._refused_logged_at: float | None = None

    def _protocol_factory(self) -> _GuardedProtocol:  # type: ignore[override]
        return _GuardedProtocol(super()._protocol_factory(), self)

    async def start(  # type: ignore[override]
        self, host: str, port: int, *, ssl: ssl.SSLContext | None = None, backlog: int = 100
    ) -> None:
        """Listen on ``host:port`` (TLS with ``ssl``), with the TLS handshake bounded too."""
        if self._server is not None:
            raise RuntimeError("Server is already started")
        self._server = await self._loop.create_server(
            self._protocol_factory,
            host,
            port,
            family=socket.AF_UNSPEC,
            flags=socket.AI_PASSIVE,
            backlog=backlog,
            ssl=ssl,
            ssl_handshake_timeout=self.limits.handshake_timeout_s if ssl is not None else None,
        )
        self._server_closed_fut = self._loop.create_future()
        _warn_if_above_open_files(self.limits.max_connections)

    def admit(self, peer: str) -> bool:
        """Count a new connection from ``peer`` in, or refuse it (False) over a cap."""
        if self.total >= self.limits.max_connections:
            self._refuse(peer, f"{self.total} connections open (--grpc-max-connections)")
            return False
        if self.by_peer[peer] >= self.limits.max_per_peer:
            self._refuse(
                peer, f"{self.by_peer[peer]} open from it (--grpc-max-connections-per-peer)"
            )
            return False
        self.total += 1
        self.by_peer[peer] += 1
        return True

    def release(self, peer: str) -> None:
        """Count a connection that ended out."""
        self.total -= 1
        self.by_peer[peer] -= 1
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]

    def _refuse(self, peer: str, why: str) -> None:
        self._refused += 1
        now = time.monotonic()
        last = self._refused_logged_at
        if last is not None and now - last < REFUSED_LOG_EVERY_S:
            return
        log.warning(
            "native gRPC port: refused %d connection(s)%s, the last from %s: %s",
            self._refused,
            "" if last is None else f" in {now - last:.0f} s",
            peer,
            why,
        )
        self._refused, self._refused_logged_at = 0, now


def _warn_if_above_open_files(cap: int) -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and cap > soft // 2:
        log.warning(
            "--grpc-max-connections %d is more than half the open files limit (%d): "
            "descriptors may run out before the cap is reached",
            cap,
            soft,
        )


class _GuardedProtocol(asyncio.Protocol):
    """One connection: grpclib's protocol inside, admitted, timed and counted out."""

    def __init__(self, inner: H2Protocol, server: LimitedServer) -> None:
        self._inner = inner
        self._server = server
        self._peer = ""
        self._admitted = False
        self._received = 0
        self._last_busy = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = self._transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass
        peer = transport.get_extra_info("peername")
        self._peer = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self._server.admit(self._peer):
            self._inner.handler.close()  # never served: let grpclib forget it
            transport.abort()
            return
        self._admitted = True
        self._inner.connection_made(transport)
        limits = self._server.limits
        self._arm(limits.handshake_timeout_s, self._handshake_due)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        self._received += len(data)
        self._inner.data_received(data)
        if self._streams():
            self._last_busy = time.monotonic()

    def pause_writing(self) -> None:
        if self._admitted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        if self._timer is not None:
            self._timer.cancel()
        self._server.release(self._peer)
        self._inner.connection_lost(exc)

    # --- deadlines -------------------------------------------------------------------------

    def _arm(self, delay_s: float, then: Any) -> None:
        self._timer = asyncio.get_running_loop().call_later(delay_s, then)

    def _streams(self) -> int:
        return len(self._inner.processor.streams)

    def _handshake_due(self) -> None:
        if self._received < PREFACE_BYTES:
            log.debug("native gRPC port: %s sent no HTTP/2 preface in time; dropped", self._peer)
            if self._transport is not None:
                self._transport.abort()
            return
        self._idle_due()

    def _idle_due(self) -> None:
        now = time.monotonic()
        if self._streams():
            self._last_busy = now
        idle_for = now - self._last_busy
        limit = self._server.limits.idle_timeout_s
        if idle_for < limit:
            self._arm(limit - idle_for, self._idle_due)
            return
        log.debug("native gRPC port: %s idle for %.0f s; closed", self._peer, idle_for)
        self._goaway()
        self._close()

    def _goaway(self) -> None:
        """Tell the peer no new stream will be served (HTTP/2 GOAWAY, NO_ERROR)."""
        h2 = getattr(self._inner.connection, "_connection", None)  # grpclib's H2Connection
        if h2 is not None and self._transport is not None and not self._transport.is_closing():
            h2.close_connection()
            self._inner.connection.flush()

    def _close(self) -> None:
        """Close after what is written is sent; drop it if that takes longer than a
        handshake (a peer that reads nothing keeps its socket no longer)."""
        if self._transport is not None:
            self._transport.close()
            loop = asyncio.get_running_loop()
            loop.call_later(self._server.limits.handshake_timeout_s, self._transport.abort)
