"""Operator clients' access to the control server over gRPC-web (CLI and console).

Imports only ``llmgw.api`` and ``llmgw.tls`` of llmgw: the client talks to the server over the
wire.
"""

from llmgw.client.channel import GrpcWebChannel, Timeouts
from llmgw.client.control import ControlClient
from llmgw.client.errors import ClientError, ProtocolViolation, RpcError, ServerUnreachable

__all__ = [
    "ClientError",
    "ControlClient",
    "GrpcWebChannel",
    "ProtocolViolation",
    "RpcError",
    "ServerUnreachable",
    "Timeouts",
]
