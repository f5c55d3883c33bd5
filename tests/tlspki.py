"""A test PKI made on the spot: a CA, a server certificate it signed for loopback, and the
wrong things a user may hand over (another CA, a certificate for another name, a key that
belongs to nothing, a file that is not PEM). Elliptic-curve keys: made in milliseconds."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_NAMES = ("localhost", "127.0.0.1")


@dataclass(frozen=True, slots=True)
class Pki:
    """Paths of PEM files; ``cert``/``key`` are the server's, valid for 127.0.0.1 and
    localhost, signed by ``ca``."""

    ca: Path
    cert: Path
    key: Path
    other_ca: Path  # a CA that signed nothing here
    wrong_name_cert: Path  # signed by ``ca``, for elsewhere.test only (key: ``key``)
    stray_key: Path  # a key that belongs to no certificate here
    not_pem: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _builder(
    subject: str, issuer: str, public: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
    )


def _ca(common: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _key()
    cert = (
        _builder(common, common, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    key: ec.EllipticCurvePrivateKey,
    names: tuple[str, ...],
) -> x509.Certificate:
    alt: list[x509.GeneralName] = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    issuer = ca_cert.subject.rfc4514_string().removeprefix("CN=")
    return (
        _builder(names[0], issuer, key.public_key())
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
    return path


def make_pki(root: Path) -> Pki:
    """Write a fresh test PKI under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("llmgw test CA")
    _, other_cert = _ca("llmgw other CA")
    server_key = _key()
    not_pem = root / "not.pem"
    not_pem.write_text("this is not a certificate\n")
    return Pki(
        ca=_write_cert(root / "ca.pem", ca_cert),
        cert=_write_cert(root / "server.pem", _leaf(ca_key, ca_cert, server_key, LOOPBACK_NAMES)),
        key=_write_key(root / "server.key", server_key),
        other_ca=_write_cert(root / "other-ca.pem", other_cert),
        wrong_name_cert=_write_cert(
            root / "elsewhere.pem", _leaf(ca_key, ca_cert, server_key, ("elsewhere.test",))
        ),
        stray_key=_write_key(root / "stray.key", _key()),
        not_pem=not_pem,
    )
