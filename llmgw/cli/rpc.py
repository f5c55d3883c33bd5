"""How a command calls the control server over gRPC-web: its flags and its one call helper.

``add_client_flags`` gives a command ``--server URL``, ``--token``, ``--token-file`` and
``--ca-file``; ``use_client_flags`` (called by ``llmgw.cli.main`` before the command runs)
hands the token (``--token``, else ``--token-file``, else ``$LLMGW_TOKEN``) and the CA
(``--ca-file``, else ``$LLMGW_CA_FILE``) to every gRPC-web channel the command opens; ``call``
opens one channel, runs one function of a ``ControlClient`` and maps the client's errors to
one ``CliError`` line.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmgw.cli.errors import CliError
from llmgw.cli.flags import read_token_file
from llmgw.cli.tls import add_client_ca_flag, client_ca
from llmgw.client import (
    ClientError,
    ControlClient,
    GrpcWebChannel,
    RpcError,
    ServerUnreachable,
    Timeouts,
)

__all__ = [
    "DEFAULT_WEB_URL",
    "TOKEN_ENV",
    "add_client_flags",
    "call",
    "client_token",
    "use_client_flags",
]

DEFAULT_WEB_URL = "http://127.0.0.1:8080"
TOKEN_ENV = "LLMGW_TOKEN"


def add_client_flags(p: argparse.ArgumentParser) -> None:
    """``--server URL``, ``--token``, ``--token-file`` and ``--ca-file`` for a command that
    calls the control server's gRPC-web port."""
    p.add_argument(
        "--server",
        default=DEFAULT_WEB_URL,
        metavar="URL",
        help=f"the control server's gRPC-web URL (default: {DEFAULT_WEB_URL})",
    )
    p.add_argument(
        "--token",
        default=None,
        metavar="TOKEN",
        help=f"a bearer token (visible to other users in ps: prefer --token-file or ${TOKEN_ENV})",
    )
    p.add_argument(
        "--token-file", type=Path, default=None, metavar="FILE", help="read the token from FILE"
    )
    add_client_ca_flag(p)


def client_token(args: argparse.Namespace) -> str | None:
    """The token ``args`` ask for: ``--token``, else ``--token-file``, else ``$LLMGW_TOKEN``."""
    token: str | None = getattr(args, "token", None)
    if token:
        return token
    path: Path | None = getattr(args, "token_file", None)
    if path is not None:
        return read_token_file(path, "--token-file")
    return os.environ.get(TOKEN_ENV) or None


def use_client_flags(args: argparse.Namespace) -> None:
    """Give every gRPC-web channel this command opens the token and the CA it was told (if
    any); a command without those flags does not call over gRPC-web and is left alone."""
    from llmgw.client.channel import bearer_token, trusted_ca

    if hasattr(args, "token"):
        bearer_token.set(client_token(args))
    if hasattr(args, "client_ca_file"):  # only gRPC-web clients have it
        trusted_ca.set(client_ca(args))


async def call(
    server: str, fn: Callable[[ControlClient], Any], timeouts: Timeouts | None = None
) -> Any:
    """``fn`` on a client of ``server``'s gRPC-web port; CliError for any client error."""
    try:
        async with GrpcWebChannel(server, timeouts=timeouts or Timeouts()) as channel:
            return await fn(ControlClient(channel))
    except ServerUnreachable as exc:
        raise CliError(f"cannot reach the control server at {server}: {exc}") from exc
    except RpcError as exc:
        raise CliError(f"{exc.status.name}: {exc.message}") from exc
    except ClientError as exc:
        raise CliError(str(exc)) from exc
