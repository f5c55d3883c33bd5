"""llmgw.tls: contexts from files, and errors that name the file at fault."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from tlspki import Pki

from llmgw.tls import (
    ALPN_GRPC,
    ALPN_HTTP1,
    TlsFileError,
    TlsFiles,
    client_context,
    describe_tls_error,
    find_tls_error,
    server_context,
)


def test_certificate_and_key_go_together(pki: Pki) -> None:
    assert TlsFiles.from_flags(None, None) is None
    assert TlsFiles.from_flags(pki.cert, pki.key) == TlsFiles(pki.cert, pki.key)
    with pytest.raises(TlsFileError, match="^--tls-cert needs --tls-key too"):
        TlsFiles.from_flags(pki.cert, None)
    with pytest.raises(TlsFileError, match="^--tls-key needs --tls-cert too"):
        TlsFiles.from_flags(None, pki.key)


def test_server_context_is_tls12_plus_with_the_given_alpn(pki: Pki) -> None:
    context = server_context(TlsFiles(pki.cert, pki.key), ALPN_GRPC)
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert context.verify_mode is ssl.CERT_NONE  # clients are not asked for certificates
    client = client_context(pki.ca, ALPN_GRPC)
    assert client.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert client.check_hostname and client.verify_mode is ssl.CERT_REQUIRED


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_each_bad_file_is_named_with_what_is_wrong(pki: Pki, tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    cases = {
        (missing, pki.key): f"--tls-cert {missing}: cannot read it (No such file or directory)",
        (pki.cert, missing): f"--tls-key {missing}: cannot read it (No such file or directory)",
        (pki.not_pem, pki.key): f"--tls-cert {pki.not_pem}: holds no PEM certificate",
        (pki.key, pki.key): f"--tls-cert {pki.key}: holds no PEM certificate",
        (pki.cert, pki.not_pem): f"--tls-key {pki.not_pem}: holds no usable PEM private key",
        (pki.cert, pki.stray_key): (
            f"--tls-key {pki.stray_key}: this key does not belong to the certificate in "
            f"--tls-cert {pki.cert}"
        ),
    }
    for (cert, key), expected in cases.items():
        with pytest.raises(TlsFileError) as caught:
            server_context(TlsFiles(cert, key), ALPN_HTTP1)
        assert str(caught.value).startswith(expected), (cert, key, str(caught.value))


def test_an_unreadable_key_is_named(pki: Pki, tmp_path: Path) -> None:
    # a directory: unreadable even for root, who reads a mode-0 file
    with pytest.raises(TlsFileError, match=f"^--tls-key {tmp_path}: cannot read it"):
        server_context(TlsFiles(pki.cert, tmp_path), ALPN_HTTP1)


def test_an_encrypted_key_is_refused_without_a_prompt(pki: Pki, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(TlsFileError, match="the key is encrypted"):
        server_context(TlsFiles(pki.cert, encrypted), ALPN_HTTP1)


def test_a_bad_ca_file_is_named(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(TlsFileError, match=f"^--ca-file {pki.not_pem}: holds no PEM certificate"):
        client_context(pki.not_pem)
    missing = tmp_path / "nope.pem"
    with pytest.raises(TlsFileError, match=f"^--ca-file {missing}: cannot read it"):
        client_context(missing)
    client_context(None)  # the system's trust store


async def _handshake(
    server: ssl.SSLContext, client: ssl.SSLContext, host: str
) -> tuple[str | None, str | None]:
    """Connect ``client`` to a loopback TLS server as ``host``: the ALPN and TLS version."""

    async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    listener = await asyncio.start_server(_serve, "127.0.0.1", 0, ssl=server)
    port = listener.sockets[0].getsockname()[1]
    try:
        _, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client, server_hostname=host
        )
        ssl_object = writer.get_extra_info("ssl_object")
        found = ssl_object.selected_alpn_protocol(), ssl_object.version()
        writer.close()
        await writer.wait_closed()
        return found
    finally:
        listener.close()
        await listener.wait_closed()


async def test_a_handshake_verifies_the_ca_and_the_host_name(pki: Pki) -> None:
    server = server_context(TlsFiles(pki.cert, pki.key), ALPN_GRPC)
    alpn, version = await _handshake(server, client_context(pki.ca, ALPN_GRPC), "127.0.0.1")
    assert alpn == "h2" and version in ("TLSv1.2", "TLSv1.3")
    assert (await _handshake(server, client_context(pki.ca), "localhost"))[1] is not None

    with pytest.raises(ssl.SSLCertVerificationError) as wrong_ca:
        await _handshake(server, client_context(pki.other_ca), "127.0.0.1")
    assert describe_tls_error(wrong_ca.value) == (
        "the server's TLS certificate was not accepted (unable to get local issuer certificate)"
    )
    elsewhere = server_context(TlsFiles(pki.wrong_name_cert, pki.key), ALPN_GRPC)
    with pytest.raises(ssl.SSLCertVerificationError) as wrong_name:
        await _handshake(elsewhere, client_context(pki.ca), "127.0.0.1")
    assert "IP address mismatch" in (describe_tls_error(wrong_name.value) or "")


def test_tls_errors_are_found_behind_the_libraries_that_wrap_them() -> None:
    inner = ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number")
    try:
        try:
            raise inner
        except ssl.SSLError as exc:
            raise ConnectionError("connect failed") from exc
    except ConnectionError as outer:
        assert find_tls_error(outer) is inner
        assert (describe_tls_error(outer) or "").startswith("the TLS handshake failed")
    assert describe_tls_error(ConnectionRefusedError(111, "refused")) is None
