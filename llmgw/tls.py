"""TLS for llmgw's listening ports and for the clients of them; imports nothing else of llmgw.

The control server's native gRPC port, its gRPC-web port, and the OpenAI gateway (in the
server or ``llmgw gateway``) serve TLS when given a certificate and its key
(``--tls-cert``/``--tls-key``, :class:`TlsFiles`). Agents, gateways' router feeds and
operator clients verify the server's certificate against a CA file (``--ca-file``), or
the system's trust store when none is given; the host name checked is the address they
were given. Every context comes from ``ssl.create_default_context`` with TLS 1.2 at least.
ALPN says ``h2`` on the native gRPC port (grpclib and grpcio need it) and ``http/1.1`` on
the HTTP/1.1 ports.

Exceptions: one, :class:`TlsFileError`, for a certificate, key or CA file that cannot be
read or used; its message names the flag and the file, and says what is wrong with it.
``ssl``'s and the file system's exceptions are mapped to it here, ``raise … from exc``;
each caller maps it to its own tree at one place (the server's ``ConfigError``, the
agent's ``AgentConfigError``, the client's ``ClientError``, the CLI's ``CliError``).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "ALPN_GRPC",
    "ALPN_HTTP1",
    "MIN_VERSION",
    "TlsFileError",
    "TlsFiles",
    "client_context",
    "describe_tls_error",
    "find_tls_error",
    "server_context",
]

MIN_VERSION: Final = ssl.TLSVersion.TLSv1_2
ALPN_GRPC: Final = ("h2",)
ALPN_HTTP1: Final = ("http/1.1",)

CERT_FLAG: Final = "--tls-cert"
KEY_FLAG: Final = "--tls-key"
CA_FLAG: Final = "--ca-file"


class TlsFileError(ValueError):
    """A certificate, key or CA file cannot be read or used; the message names it."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A server's certificate (PEM, the chain after it) and its private key (PEM)."""

    cert: Path
    key: Path

    @classmethod
    def from_flags(cls, cert: Path | None, key: Path | None) -> TlsFiles | None:
        """Both or neither: ``None`` for neither, a TlsFileError for one alone."""
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            given, missing = (KEY_FLAG, CERT_FLAG) if cert is None else (CERT_FLAG, KEY_FLAG)
            raise TlsFileError(f"{given} needs {missing} too (a certificate and its key)")
        return cls(cert, key)


def server_context(files: TlsFiles, alpn: Sequence[str]) -> ssl.SSLContext:
    """A server context holding ``files``; a TlsFileError naming the file at fault."""
    _readable(files.cert, CERT_FLAG)
    _readable(files.key, KEY_FLAG)
    _check_certificate(files.cert)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = MIN_VERSION
    try:
        context.load_cert_chain(files.cert, files.key, password=_no_password(files.key))
    except ssl.SSLError as exc:
        raise _key_error(files, exc) from exc
    context.set_alpn_protocols(list(alpn))
    return context


def client_context(ca_file: Path | None, alpn: Sequence[str] = ()) -> ssl.SSLContext:
    """A client context verifying the server against ``ca_file`` (the system's trust store
    when ``None``), host name checked; a TlsFileError naming an unusable CA file."""
    if ca_file is not None:
        _readable(ca_file, CA_FLAG)
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except ssl.SSLError as exc:
        raise TlsFileError(
            f"{CA_FLAG} {ca_file}: holds no PEM certificate ({_reason(exc)})"
        ) from exc
    context.minimum_version = MIN_VERSION
    if alpn:
        context.set_alpn_protocols(list(alpn))
    return context


def find_tls_error(exc: BaseException) -> ssl.SSLError | None:
    """The ``ssl.SSLError`` that is ``exc`` or caused it (libraries wrap it), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLError):
            return current
        current = current.__cause__ or current.__context__
    return None


def describe_tls_error(exc: BaseException) -> str | None:
    """Words for a failed TLS handshake found in ``exc`` or what caused it; ``None`` when
    it is not one."""
    found = find_tls_error(exc)
    if isinstance(found, ssl.SSLCertVerificationError):
        why = found.verify_message or _reason(found)
        return f"the server's TLS certificate was not accepted ({why})"
    return None if found is None else f"the TLS handshake failed ({_reason(found)})"


def _readable(path: Path, flag: str) -> None:
    try:
        with path.open("rb") as handle:
            handle.read(1)
    except OSError as exc:
        raise TlsFileError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from exc


def _check_certificate(cert: Path) -> None:
    """Parse the certificate file alone, so that a bad one is not blamed on the key."""
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        probe.load_verify_locations(cafile=cert)
    except ssl.SSLError as exc:
        raise TlsFileError(
            f"{CERT_FLAG} {cert}: holds no PEM certificate ({_reason(exc)})"
        ) from exc


def _key_error(files: TlsFiles, exc: ssl.SSLError) -> TlsFileError:
    if exc.reason == "KEY_VALUES_MISMATCH":
        return TlsFileError(
            f"{KEY_FLAG} {files.key}: this key does not belong to the certificate in "
            f"{CERT_FLAG} {files.cert}"
        )
    return TlsFileError(f"{KEY_FLAG} {files.key}: holds no usable PEM private key")


def _no_password(key: Path) -> Callable[[], bytes]:
    """OpenSSL asks for a password only for an encrypted key: refuse, never prompt."""

    def refuse() -> bytes:
        raise TlsFileError(
            f"{KEY_FLAG} {key}: the key is encrypted; give an unencrypted key "
            "(readable by this user only)"
        )

    return refuse


def _reason(exc: ssl.SSLError) -> str:
    reason = getattr(exc, "reason", None)  # set by the ssl module, absent on a bare SSLError
    return str(reason or exc.strerror or exc).replace("_", " ").lower()
