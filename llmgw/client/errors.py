"""What operator clients (CLI, console) raise.

::

    ClientError               anything the client raises on purpose; also refusals made
    │                         locally without sending anything (a read-only client)
    ├── ServerUnreachable     no connection to the server (refused, DNS, connect timeout),
    │                         or the connection was lost mid-call; ``.url`` says where
    ├── RpcError              the server answered with a gRPC status other than OK;
    │                         ``.status`` (``grpclib.const.Status``) and ``.message``.
    │                         A call that outlives its timeout is DEADLINE_EXCEEDED.
    └── ProtocolViolation     the server's reply is not well-formed gRPC-web (bad frames,
                              missing trailers, a message that does not decode)

httpx's exceptions are mapped to these in one place, ``llmgw.client.channel``
(``_translate_transport_errors``), always ``raise … from exc``. Anything else escaping
the client is a bug.
"""

from __future__ import annotations

from grpclib.const import Status

__all__ = ["ClientError", "ProtocolViolation", "RpcError", "ServerUnreachable"]


class ClientError(Exception):
    """Base of the operator client's exceptions."""


class ServerUnreachable(ClientError):
    """The server could not be reached, or the connection broke during a call."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason


class RpcError(ClientError):
    """The server answered with a non-OK gRPC status."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(f"{status.name}: {message}" if message else status.name)
        self.status = status
        self.message = message


class ProtocolViolation(ClientError):
    """The server's reply is not well-formed gRPC-web."""
