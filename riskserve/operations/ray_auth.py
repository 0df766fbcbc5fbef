"""Ray's token authentication for the Ray that riskserve starts or joins (``RAY_AUTH_MODE=token``).

Ray 2.60 checks a shared token on its control-plane gRPC servers (GCS, raylet, core workers, each Serve
replica's inter-deployment server) and its HTTP endpoints when ``RAY_AUTH_MODE=token``; the token is read
from ``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``. A local
``riskserve up`` uses a token of its own install, generated once into riskserve's state directory (mode
0600 in a 0700 directory), never the world-readable default Ray writes. ``up --address`` joins a cluster
only in token mode and first checks that the cluster refuses a call without a token.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
from pathlib import Path

import grpc

from riskserve.platform.errors import ConfigError

__all__ = [
    "RAY_TOKEN_FILE",
    "install_token",
    "refuses_without_token",
    "token_available",
    "token_mode_env",
    "use_token_mode",
]

RAY_TOKEN_FILE = "ray_auth_token"
"""Name of the per-install Ray token in riskserve's state directory."""
_GCS_PROBE = "/ray.rpc.NodeInfoGcsService/GetClusterId"
"""A GCS method every Ray serves; its request may be empty."""


def install_token(directory: Path) -> Path:
    """The per-install Ray token file in ``directory``, made on first use (0600; the directory 0700).

    Raises:
        ConfigError: the file exists but other users may read or write it.
    """
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    path = directory / RAY_TOKEN_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise ConfigError(
                f"{path}: mode {mode:04o} lets other users read the Ray token; chmod 600 it"
            ) from None
        return path
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32))  # 256 bits, as Ray's own generator
    return path


def token_mode_env(token_path: Path) -> dict[str, str]:
    """Environment under which Ray runs, and joins, in token mode with the token in ``token_path``."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}


def token_available() -> bool:
    """Whether Ray would find a token here (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray``)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    named = os.environ.get("RAY_AUTH_TOKEN_PATH")
    path = Path(named) if named else Path.home() / ".ray" / "auth_token"
    try:
        return bool(path.read_text().strip())
    except OSError:
        return False


def use_token_mode(token_path: Path | None = None) -> None:
    """Put this process (and the Ray processes it starts) in token mode, before it starts or joins Ray.

    ``token_path``: the token file (``RAY_AUTH_TOKEN_PATH``; it then wins over ``RAY_AUTH_TOKEN``);
    ``None`` keeps what the environment names.

    Raises:
        ConfigError: no token can be found.
    """
    os.environ["RAY_AUTH_MODE"] = "token"
    if token_path is not None:
        os.environ.pop("RAY_AUTH_TOKEN", None)
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(token_path)
    if not token_available():
        raise ConfigError(
            "Ray token authentication needs the cluster's token: pass --ray-token-file, or set "
            "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN (`ray get-auth-token` on the head node prints it)"
        )
    if "ray" in sys.modules:  # Ray caches its config when imported: re-read the environment (as Ray does)
        from ray._raylet import Config  # type: ignore[attr-defined]

        Config.initialize("")


def refuses_without_token(gcs_address: str, timeout_s: float = 5.0) -> bool:
    """Whether the Ray GCS at ``HOST:PORT`` refuses a call that carries no token (UNAUTHENTICATED).

    Raises:
        ConfigError: the address does not answer gRPC within ``timeout_s``.
    """
    with grpc.insecure_channel(gcs_address) as channel:
        call = channel.unary_unary(_GCS_PROBE, request_serializer=None, response_deserializer=None)
        try:
            call(b"", timeout=timeout_s)
        except grpc.RpcError as error:
            code = error.code()
            if code == grpc.StatusCode.UNAUTHENTICATED:
                return True
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise ConfigError(f"no Ray GCS answers at {gcs_address}: {error.details()}") from error
            return False
    return False
