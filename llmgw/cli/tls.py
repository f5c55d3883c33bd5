"""TLS flags: ``--tls-cert``/``--tls-key`` for what listens (``llmgw server``, ``llmgw
gateway``), ``--ca-file`` for what connects (``llmgw agent``, the gateway's router feed, and
every gRPC-web client: ``get``, ``apply``, ``drain``, ``console`` …, which also read
``$LLMGW_CA_FILE``). The files are read by ``llmgw.tls``; its errors become one line here.
"""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Sequence
from pathlib import Path

from llmgw.cli.errors import CliError
from llmgw.tls import TlsFileError, TlsFiles, client_context

CA_ENV = "LLMGW_CA_FILE"


def add_listen_flags(p: argparse.ArgumentParser, ports: str) -> None:
    """``--tls-cert`` and ``--tls-key``: TLS on ``ports`` (words for --help)."""
    p.add_argument(
        "--tls-cert",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"serve TLS on {ports} with this PEM certificate (chain after it); needs --tls-key",
    )
    p.add_argument(
        "--tls-key",
        type=Path,
        default=None,
        metavar="FILE",
        help="the PEM private key of --tls-cert (unencrypted; keep it readable by you only)",
    )


def add_ca_flag(p: argparse.ArgumentParser, what: str) -> None:
    """``--ca-file`` for a command that connects to the native gRPC port: TLS when given."""
    p.add_argument(
        "--ca-file",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"connect to {what} over TLS, trusting the CA certificates (PEM) in FILE; "
        "the server's certificate must name the host given to --server (default: plaintext)",
    )


def add_client_ca_flag(p: argparse.ArgumentParser) -> None:
    """``--ca-file`` for a gRPC-web client (an https:// --server URL means TLS)."""
    p.add_argument(
        "--ca-file",
        dest="client_ca_file",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"with an https:// --server: trust the CA certificates (PEM) in FILE (default: "
        f"${CA_ENV}, else the system's trust store)",
    )


def listen_files(args: argparse.Namespace) -> TlsFiles | None:
    """The certificate and key to serve TLS with, or ``None``; both or neither."""
    try:
        return TlsFiles.from_flags(args.tls_cert, args.tls_key)
    except TlsFileError as exc:
        raise CliError(str(exc)) from exc


def connect_context(ca_file: Path | None, alpn: Sequence[str]) -> ssl.SSLContext | None:
    """The client context for ``--ca-file`` (``None`` without one: plaintext)."""
    if ca_file is None:
        return None
    try:
        return client_context(ca_file, alpn)
    except TlsFileError as exc:
        raise CliError(str(exc)) from exc


def client_ca(args: argparse.Namespace) -> Path | None:
    """The CA file a gRPC-web client trusts: ``--ca-file``, else ``$LLMGW_CA_FILE``. The
    flag with a plaintext URL is refused (the user believes TLS is on); the variable is
    simply unused then."""
    flag: Path | None = getattr(args, "client_ca_file", None)
    server = str(getattr(args, "server", ""))
    if flag is not None and not server.lower().startswith("https://"):
        raise CliError(f"--ca-file is for an https:// server; {server} is plaintext")
    env = os.environ.get(CA_ENV)
    return flag or (Path(env) if env else None)
