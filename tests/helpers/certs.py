"""A throwaway PKI for TLS tests (tests/service/test_tls.py): a CA, and certificates it
signs for localhost / 127.0.0.1, written as PEM files (`cryptography`, a dev dependency)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

SANS = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as objects and as PEM files."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    cert_path: Path
    key_path: Path


def _certificate(
    name: str, key: ec.EllipticCurvePrivateKey, issuer: Issued | None, ca: bool
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.cert.subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(SANS), critical=False)
    return builder.sign(issuer.key if issuer else key, hashes.SHA256())


def issue(directory: Path, name: str, issuer: Issued | None = None) -> Issued:
    """`name`.crt and `name`.key in `directory`: a CA when `issuer` is None, else a leaf
    for localhost and 127.0.0.1 (server or client) signed by `issuer`."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(name, key, issuer, ca=issuer is None)
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return Issued(cert, key, cert_path, key_path)
