"""The HTTP ports' limit flags, shared by ``llmgw server`` (its gRPC-web and gateway ports)
and ``llmgw gateway``: the ones operators tune, the rest of ``ServerLimits`` fixed.

It imports only the standard library and ``CliError`` at import time; the gateway's
``ServerLimits`` is imported when a function runs.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from llmgw.cli.errors import CliError

if TYPE_CHECKING:
    from llmgw.gateway.httplimits import ServerLimits

__all__ = ["add_http_limit_flags", "http_limits"]


def add_http_limit_flags(p: argparse.ArgumentParser, ports: str) -> None:
    """``--idle-timeout``, ``--header-timeout``, ``--max-connections``,
    ``--max-connections-per-peer`` and ``--max-body-buffer``, for ``ports``."""
    from llmgw.gateway.httplimits import ServerLimits

    default = ServerLimits()
    g = p.add_argument_group(f"limits of {ports}")
    g.add_argument(
        "--idle-timeout",
        type=float,
        default=default.idle_timeout_s,
        metavar="SECONDS",
        help="close a client connection that sends no request for this long, after it "
        f"connects or after a response (default: {default.idle_timeout_s:g})",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=default.head_timeout_s,
        metavar="SECONDS",
        help="a request's headers must arrive whole within this of its first byte, else "
        f"408 and the connection closed (default: {default.head_timeout_s:g})",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=default.max_connections,
        metavar="N",
        help="client connections open at once, per port; one more is answered 503 and "
        f"closed (default: {default.max_connections})",
    )
    g.add_argument(
        "--max-connections-per-peer",
        type=int,
        default=default.max_connections_per_peer,
        metavar="N",
        help=f"of those, from one IP address (default: {default.max_connections_per_peer})",
    )
    g.add_argument(
        "--max-body-buffer",
        type=int,
        default=default.max_body_buffer_bytes,
        metavar="BYTES",
        help="request body bytes held in memory at once across a port's connections; a "
        "request beyond it is answered 503 unread (default: "
        f"{default.max_body_buffer_bytes})",
    )


def http_limits(args: argparse.Namespace) -> ServerLimits:
    """The flags' values, checked."""
    from llmgw.gateway.httplimits import ServerLimits

    for flag, value in (
        ("--idle-timeout", args.idle_timeout),
        ("--header-timeout", args.header_timeout),
    ):
        if not 0 < value < math.inf:
            raise CliError(f"{flag} must be a positive number of seconds, not {value}")
    counts = (
        ("--max-connections", args.max_connections),
        ("--max-connections-per-peer", args.max_connections_per_peer),
        ("--max-body-buffer", args.max_body_buffer),
    )
    for flag, count in counts:
        if count < 1:
            raise CliError(f"{flag} must be at least 1, not {count}")
    return ServerLimits(
        idle_timeout_s=args.idle_timeout,
        head_timeout_s=args.header_timeout,
        max_connections=args.max_connections,
        max_connections_per_peer=args.max_connections_per_peer,
        max_body_buffer_bytes=args.max_body_buffer,
    )
