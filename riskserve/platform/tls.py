"""TLS credentials of the gRPC front door (server side) and of its clients, from PEM files.

Server: a certificate chain and its key; with a client CA, mutual TLS (a client without a certificate
signed by that CA never completes the handshake). Clients: the CA that signed the server's certificate,
and for mutual TLS their own certificate and key.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from riskserve.platform.errors import ConfigError

__all__ = ["channel_credentials", "read_pem", "server_credentials"]


def read_pem(path: Path, what: str) -> bytes:
    """The PEM file at ``path``.

    Raises:
        ConfigError: it cannot be read or holds no PEM block (naming ``what`` and the path).
    """
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{what}: cannot read {path}: {error.strerror}") from error
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{what}: {path} is not a PEM file")
    return data


def server_credentials(
    cert_file: Path, key_file: Path, client_ca_file: Path | None
) -> grpc.ServerCredentials:
    """Server TLS from PEM files; mutual TLS (client certificates required) when ``client_ca_file`` is set.

    Raises:
        ConfigError: a file is missing or not PEM.
    """
    chain = read_pem(cert_file, "serving.grpc.tls.cert_file")
    key = read_pem(key_file, "serving.grpc.tls.key_file")
    client_ca = read_pem(client_ca_file, "serving.grpc.tls.client_ca_file") if client_ca_file else None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def channel_credentials(
    ca_file: Path | None, cert_file: Path | None = None, key_file: Path | None = None
) -> grpc.ChannelCredentials:
    """Client TLS: trust ``ca_file`` (the system's roots when ``None``), present a certificate if given.

    Raises:
        ConfigError: only one of ``cert_file`` and ``key_file``, or a file is missing or not PEM.
    """
    if (cert_file is None) != (key_file is None):
        raise ConfigError("client TLS: give both a certificate and its key, or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca_file, "CA file") if ca_file else None,
        private_key=read_pem(key_file, "client key file") if key_file else None,
        certificate_chain=read_pem(cert_file, "client certificate file") if cert_file else None,
    )
