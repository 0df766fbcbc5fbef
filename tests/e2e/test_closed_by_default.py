"""A newcomer's ``riskserve up`` is closed: every listening socket of its whole process tree is on loopback
or refuses a call without Ray's token, Ray runs in token mode with a token only its owner can read, and a
pipeline with TLS and tokens in its YAML refuses a client without them and decides for one with them.

One real ``riskserve up`` (a background local Ray with Serve), sockets read from the kernel
(``/proc/<pid>/fd`` and ``/proc/net/tcp{,6}``), never from riskserve's own account.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from riskserve.operations.ray_auth import refuses_without_token

from ..conftest import PIPELINES
from ..sockets import is_loopback, listening_sockets
from ..tls_helpers import Pki, make_pki, new_token, write_tokens

pytestmark = pytest.mark.slow

RAY_PROBES = ("/ray.rpc.NodeInfoGcsService/GetClusterId", "/ray.serve.ASGIService/HandleRequest")
"""Methods of Ray's gRPC servers (the GCS; a Serve replica's inter-deployment server) a probe calls."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _riskserve(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "riskserve.cli", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


@dataclass(frozen=True)
class Running:
    pid: int
    port: int
    env: dict[str, str]
    state: dict[str, object]
    pki: Pki
    decide_token: Path


@pytest.fixture(scope="module")
def running(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    root = tmp_path_factory.mktemp("closed")
    pki = make_pki(root / "pki")
    token = new_token()
    write_tokens(root / "tokens.yaml", {"checkout": (token, ["decide"])})
    (root / "checkout.token").write_text(token)
    (root / "checkout.token").chmod(0o600)
    data = yaml.safe_load((PIPELINES / "tabular_only.yaml").read_text())
    for name, model in data["models"].items():
        model["artifact"] = str(demo_models / name)
        model["timeout_ms"] = 20_000
    data.setdefault("serving", {})["grpc"] = {
        "tls": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)},
        "auth": {"tokens_file": str(root / "tokens.yaml")},
    }  # the host stays the default
    pipeline = root / "tabular_only.yaml"
    pipeline.write_text(yaml.safe_dump(data, sort_keys=False))
    # The environment a newcomer may have: RAY_AUTH_MODE as the test session left it (riskserve forces token).
    env = {**os.environ, "RISKSERVE_STATE_DIR": str(root / "state")}
    port = _free_port()
    up = _riskserve("up", str(pipeline), "--grpc-port", str(port), env=env)
    assert up.returncode == 0, up.stderr + up.stdout
    state = json.loads((root / "state" / "state.json").read_text())
    try:
        yield Running(int(state["pid"]), port, env, state, pki, root / "checkout.token")
    finally:
        down = _riskserve("down", env=env)
        assert down.returncode == 0, down.stderr


def _process_tree(root: int) -> set[int]:
    """``root``, its descendants, and every process of its session (Ray's workers are the raylet's)."""
    parents: dict[int, int] = {}
    sessions: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(proc.name)] = int(fields[1])
        sessions[int(proc.name)] = int(fields[3])
    tree = {root} | {pid for pid, sid in sessions.items() if sid == root}
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return tree


def _refuses_without_token(port: int) -> bool:
    """Whether the server on ``port`` answers one of Ray's methods with UNAUTHENTICATED when sent no token."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for method in RAY_PROBES:
            call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            try:
                call(b"", timeout=5)
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                    return True
    return False


def test_every_listening_socket_is_loopback_or_needs_rays_token(running: Running) -> None:
    tree = _process_tree(running.pid)
    listening = listening_sockets()
    sockets: list[tuple[int, str, int]] = []
    for pid in tree:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue  # gone
        for link in links:
            inode = link.removeprefix("socket:[").removesuffix("]")
            if link.startswith("socket:[") and inode in listening:
                sockets.append((pid, *listening[inode]))
    assert len(tree) >= 5, tree  # the background process, GCS, raylet, Serve's controller, the ingress
    ports = {port for _, _, port in sockets}
    assert running.port in ports, "the pipeline's front door is one of them"
    open_sockets = [(pid, address, port) for pid, address, port in sockets if not is_loopback(address)]
    unprotected = [s for s in open_sockets if not _refuses_without_token(s[2])]
    assert not unprotected, f"listening beyond loopback without Ray's token: {unprotected} (all: {sockets})"
    front_door = {address for _, address, port in sockets if port == running.port}
    assert front_door <= {"127.0.0.1", "::ffff:127.0.0.1"}, front_door


def test_ray_runs_in_token_mode_with_a_token_only_its_owner_reads(running: Running) -> None:
    assert running.state["ray_auth_mode"] == "token"
    token_path = Path(str(running.state["ray_auth_token_path"]))
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_path.parent.stat().st_mode) == 0o700
    assert refuses_without_token(str(running.state["gcs_address"]))  # the GCS checks it
    status = _riskserve("status", env=running.env, timeout=120)  # a CLI driver joins with the token
    assert status.returncode == 0, status.stderr
    assert "tabular_only" in status.stdout


def test_the_front_door_refuses_clients_without_tls_or_token_and_decides_for_one_with_them(
    running: Running,
) -> None:
    fields = {"amount": 42.0, "account_age_days": 900, "txn_velocity_1h": 0, "hour": 14,
              "merchant_category": "grocery", "channel": "pos", "request_id": "closed-1"}  # fmt: skip
    base = ["decide", "--pipeline", "tabular_only", "--json", json.dumps(fields)]
    tls = ["--ca-file", str(running.pki.ca)]
    plain = _riskserve(*base, env=running.env)
    assert plain.returncode == 2, plain.stdout  # plain text: no handshake (UNAVAILABLE)
    no_token = _riskserve(*base, *tls, env=running.env)
    assert no_token.returncode == 2
    assert "missing credentials" in no_token.stderr
    decided = _riskserve(*base, *tls, "--token-file", str(running.decide_token), env=running.env)
    assert decided.returncode == 0, decided.stderr
    assert json.loads(decided.stdout)["request_id"] == "closed-1"
