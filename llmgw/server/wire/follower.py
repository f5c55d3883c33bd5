"""What a follower serves (issue #17) of the agents' and the gateways' services: where the
leader is.

A server that does not hold the leader lease (``llmgw.server.state.leadership``) runs no
reconciler and knows no agent's live state, so an agent's ``Connect`` and a gateway's
``Feed`` get one ``not_leader`` message (the leader's address and epoch), so that they follow
it at once (the stream then ends: the message is the answer, and a client drops one that
comes before an error status); a gateway's ``Report`` gets UNAVAILABLE naming the leader (a
gateway reports to the server its feed follows). A follower never answers with state it
does not have. The operators' ``ControlService`` is relayed to the leader instead
(``llmgw.server.wire.relay``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpclib.const
import grpclib.server
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from llmgw.api.llmgw.v1 import (
    AgentServiceBase,
    ControlMessage,
    RouterFeedEvent,
    RouterServiceBase,
)
from llmgw.server.state.leadership import Leadership

log = logging.getLogger(__name__)

_REDIRECTED = {
    "/llmgw.v1.AgentService/Connect": lambda lead: ControlMessage(not_leader=lead.not_leader()),
    "/llmgw.v1.RouterService/Feed": lambda lead: RouterFeedEvent(not_leader=lead.not_leader()),
}


HandlerFunc = Callable[[grpclib.server.Stream[Any, Any]], Any]


def handlers_of(
    base: type[Any], serve: Callable[[str, grpclib.const.Handler], HandlerFunc]
) -> dict[str, grpclib.const.Handler]:
    """Every method of ``base`` (a generated service class: its paths, cardinalities and
    message types), each served by ``serve(path, handler)`` instead of ``base``'s own."""
    real = base.__mapping__(base())
    return {
        path: grpclib.const.Handler(
            serve(path, handler), handler.cardinality, handler.request_type, handler.reply_type
        )
        for path, handler in real.items()
    }


class FollowerService:
    """One service's every method refused while this server follows; ``base`` is its
    generated class (for its method paths and message types)."""

    def __init__(self, base: type[Any], leadership: Leadership) -> None:
        self._base = base
        self._leadership = leadership

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return handlers_of(self._base, lambda path, _: self._refuser(path))

    def _refuser(self, path: str) -> HandlerFunc:
        first = _REDIRECTED.get(path)

        async def refuse(stream: grpclib.server.Stream[Any, Any]) -> None:
            lead = self._leadership
            if first is None:
                raise GRPCError(Status.UNAVAILABLE, lead.refusal())
            # the stream then ends with OK: a client drops a message that arrived before
            # an error status (grpclib does), and this one is the answer
            await stream.send_message(first(lead))  # type: ignore[no-untyped-call]

        return refuse


def follower_services(leadership: Leadership) -> list[FollowerService]:
    """The agents' and the gateways' services as a follower serves them."""
    return [FollowerService(base, leadership) for base in (AgentServiceBase, RouterServiceBase)]
