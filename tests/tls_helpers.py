"""Real X.509 certificates made at test time (``cryptography``): a CA, a server and clients, as PEM files.

Nothing is checked in: each test session signs its own, so no key ever sits in the repository.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    """PEM files of one test PKI: ``ca`` signs ``server`` and ``client``; ``rogue`` is a client of another
    CA (a certificate the server must refuse)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    rogue_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _sign(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer if issuer is not None else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
    elif not ca:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(
    directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


def make_pki(directory: Path) -> Pki:
    """A fresh CA, a server certificate for ``localhost``/``127.0.0.1``, a client and a rogue client."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _sign("riskserve test CA", ca_key, None, ca=True)
    ca_path, _ = _write(directory, "ca", ca_cert, ca_key)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _write(
        directory,
        "server",
        _sign("localhost", server_key, ("riskserve test CA", ca_key), server=True),
        server_key,
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _write(
        directory, "client", _sign("checkout", client_key, ("riskserve test CA", ca_key)), client_key
    )
    rogue_ca_key = ec.generate_private_key(ec.SECP256R1())
    rogue_key = ec.generate_private_key(ec.SECP256R1())
    rogue = _write(directory, "rogue", _sign("rogue", rogue_key, ("another CA", rogue_ca_key)), rogue_key)
    return Pki(ca_path, *server, *client, *rogue)


def write_tokens(path: Path, entries: dict[str, tuple[str, list[str]]]) -> None:
    """Write a tokens file (mode 0600) atomically: ``{identity: (token, roles)}``."""
    table = {"tokens": [{"identity": i, "roles": roles, "token": t} for i, (t, roles) in entries.items()]}
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(yaml.safe_dump(table))
    tmp.replace(path)


def new_token() -> str:
    """A random bearer token."""
    return secrets.token_hex(32)
