"""A follower's operator API: every ``ControlService`` call relayed to the leader (#17).

Only the leader holds the plane (the agents' live state, the reconciler), so a follower
answers an operator's call by making the same call on the leader's native gRPC port (the
address in the lease, ``Leadership.not_leader``) and passing back what the leader answers:
its messages, its status and message. Writes so land where they act at once, and reads say
what the leader knows, never a follower's stale copy. The caller's own ``authorization`` goes
with the call, so the leader checks its token and records its actor in the audit log as if it
had been asked directly (the follower has checked it too: ``llmgw.server.wire.auth`` runs
before this handler, on both the native and the gRPC-web port).

A relayed call is marked ``llmgw-relayed-by: SERVER_ID``; a follower refuses to relay a
marked call again (two servers that each think the other leads, for a moment, do not pass
a call round). A ``Cluster`` passed back (``GetCluster``, ``Watch``'s snapshots) says which
server answered: its ``leadership`` names this follower, not leading. With no leader, or a
leader that cannot be reached, the call ends UNAVAILABLE naming the leader and why.

The channel to the leader is one per leader address, opened at the first call and replaced
when the lease names another; over TLS with ``ssl`` (``--ca-file``, else the server's own
certificate: servers that share one certificate, or a chain, trust each other).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping
from typing import Any, Final

import grpclib.client
import grpclib.const
import grpclib.server
from grpclib.const import Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from llmgw.addresses import AddressError, parse_host_port
from llmgw.api.llmgw.v1 import Cluster, ControlServiceBase, WatchEvent
from llmgw.server.state.leadership import Leadership
from llmgw.server.wire.follower import HandlerFunc, handlers_of

__all__ = ["RELAYED_BY", "LeaderRelay"]

log = logging.getLogger(__name__)

RELAYED_BY: Final = "llmgw-relayed-by"
"""The metadata key a relayed call carries: the relaying server's id."""

_FORWARDED: Final = ("authorization",)
"""The caller's metadata that goes with a relayed call (its credential)."""

_AWAY: Final = (
    OSError,
    StreamTerminatedError,
    ProtocolError,
)  # ConnectionError, ssl's errors: OSError


class LeaderRelay:
    """``ControlService`` on a follower: each method relayed to the leader."""

    def __init__(self, leadership: Leadership, *, ssl: ssl.SSLContext | None = None) -> None:
        self._leadership = leadership
        self._ssl = ssl
        self._address = ""
        self._channel: grpclib.client.Channel | None = None
        self.relayed = 0  # calls passed to the leader (whatever it answered)

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return handlers_of(ControlServiceBase, self._relayer)

    def close(self) -> None:
        """Close the channel to the leader (the follower's turn ended)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self._address = ""

    def _relayer(self, path: str, handler: grpclib.const.Handler) -> HandlerFunc:
        async def relay(stream: grpclib.server.Stream[Any, Any]) -> None:
            given: Mapping[str, str | bytes] = stream.metadata or {}
            if relayed_by := given.get(RELAYED_BY):
                raise GRPCError(
                    Status.UNAVAILABLE,
                    f"{self._leadership.refusal()}; this call was relayed here by server "
                    f"{_text(relayed_by)} and is not relayed twice",
                )
            request = await stream.recv_message()
            channel = self._leader_channel()
            metadata = {key: _text(given[key]) for key in _FORWARDED if key in given}
            metadata[RELAYED_BY] = self._leadership.server_id
            timeout = stream.deadline.time_remaining() if stream.deadline is not None else None
            self.relayed += 1
            try:
                async with channel.request(
                    path, handler.cardinality, handler.request_type, handler.reply_type,
                    timeout=timeout, metadata=metadata,
                ) as upstream:  # fmt: skip
                    await upstream.send_message(request, end=True)
                    async for reply in upstream:
                        await stream.send_message(self._as_answered_here(reply))
            except GRPCError:
                raise  # the leader's own answer (a refusal, NOT_FOUND …), passed back as it is
            except _AWAY as exc:
                self.close()  # a new connection for the next call
                raise GRPCError(
                    Status.UNAVAILABLE, f"{self._leadership.refusal()}, and it cannot be "
                    f"reached from here: {exc or type(exc).__name__}",
                ) from None  # fmt: skip

        return relay

    def _leader_channel(self) -> grpclib.client.Channel:
        view = self._leadership.not_leader()
        address = view.leader_address
        if not address or view.leader_id == self._leadership.server_id:
            raise GRPCError(Status.UNAVAILABLE, self._leadership.refusal())
        if self._channel is None or address != self._address:
            try:
                host, port = parse_host_port(address, port_zero=False)
            except AddressError as exc:
                raise GRPCError(
                    Status.UNAVAILABLE,
                    f"{self._leadership.refusal()}, an address that cannot be dialled: {exc}",
                ) from None
            self.close()
            self._channel = grpclib.client.Channel(host, port, ssl=self._ssl)
            self._address = address
        return self._channel

    def _as_answered_here(self, reply: Any) -> Any:
        """``reply``, any ``Cluster`` in it saying this follower answered (relaying)."""
        cluster = reply if isinstance(reply, Cluster) else None
        if isinstance(reply, WatchEvent) and reply.snapshot is not None:
            cluster = reply.snapshot
        if cluster is not None and cluster.leadership is not None:
            cluster.leadership.server_id = self._leadership.server_id
            cluster.leadership.leading = False
        return reply


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
