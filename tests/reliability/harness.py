"""A real ``riskserve up`` for the fault drills, and the faults themselves (named as such).

The pipeline is ``tabular_only`` with the fraud model in a Serve deployment of its own (``placement:
deployment``) and a feedback log, so one pipeline has every kind of replica a fault can hit: ingress,
model and feedback. Replicas are found by the kernel, not by asking riskserve: Ray titles each replica's
process ``ray::ServeReplica:<app>:<deployment>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..conftest import PIPELINES

__all__ = [
    "Running",
    "TreeUse",
    "fault_hang",
    "fault_kill",
    "fault_resume",
    "pipeline_data",
    "pipeline_file",
    "replaced",
    "replica_pids",
    "riskserve_up",
    "tree_use",
    "wait_for",
]

PIPELINE = "tabular_only"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pipeline_data(
    models: Path,
    root: Path,
    *,
    fraud_replicas: int = 1,
    ingress_replicas: int = 2,
    ingress: dict[str, Any] | None = None,
    fraud: dict[str, Any] | None = None,
    grpc: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``tabular_only`` with the fraud model in its own deployment and a feedback log under ``root``."""
    data: dict[str, Any] = yaml.safe_load((PIPELINES / "tabular_only.yaml").read_text())
    for name, model in data["models"].items():
        model["artifact"] = str(models / name)
        model["timeout_ms"] = 2000  # a loaded 2-core machine must not turn healthy calls into fallbacks
    data["models"]["fraud"] |= {"placement": "deployment", "replicas": fraud_replicas, **(fraud or {})}
    data["pools"] = {"cpu": {"cpus": 2}}
    data["serving"] = {
        "ingress": {"replicas": ingress_replicas, "num_cpus": 0.25, **(ingress or {})},
        "decision_timeout_ms": 5000,
        **({"grpc": grpc} if grpc else {}),
    }
    data["feedback"] = {"pool": "cpu", "num_cpus": 0, "source_rate_per_s": 1000, "source_burst": 1000}
    data["state"] = {"dsn": f"sqlite:///{root / 'state.sqlite'}"}  # labels, cursors, checkpoints
    data["audit"] = {"path": str(root / "audit")}  # a pipeline with feedback joins labels to its audit trail
    return data


def pipeline_file(models: Path, root: Path, **options: Any) -> Path:
    """:func:`pipeline_data` written as a YAML file under ``root``."""
    path = root / "tabular_only.yaml"
    path.write_text(yaml.safe_dump(pipeline_data(models, root, **options), sort_keys=False))
    return path


@dataclass(frozen=True)
class Running:
    """A ``riskserve up`` in the background: its process, gRPC target and environment."""

    pid: int
    target: str
    env: dict[str, str]
    log: Path
    audit: Path
    """The pipeline's audit trail, which labels are joined to (the drills read it to check no decision was
    lost)."""


def _riskserve(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "riskserve.cli", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def riskserve_up(pipeline: Path, root: Path) -> Iterator[Running]:
    """``riskserve up PIPELINE`` with a state directory of its own; ``riskserve down`` afterwards."""
    env = {**os.environ, "RISKSERVE_STATE_DIR": str(root / "state")}
    up = _riskserve("up", str(pipeline), "--grpc-port", str(_free_port()), env=env)
    assert up.returncode == 0, up.stderr + up.stdout
    state = json.loads((root / "state" / "state.json").read_text())
    audit = Path(yaml.safe_load(pipeline.read_text())["audit"]["path"])
    running = Running(int(state["pid"]), state["endpoints"][PIPELINE], env, Path(state["log"]), audit)
    try:
        yield running
    finally:
        down = _riskserve("down", env=env)
        assert down.returncode == 0, down.stderr


def _session(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])


def _processes(running: Running) -> dict[int, str]:
    """Every process of the deployment (``up``'s session: Ray's GCS, raylet, workers, replicas)."""
    found: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if _session(int(proc.name)) != running.pid:
                continue
            found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, IndexError):
            continue
    return found


def replica_pids(deployment: str, app: str = PIPELINE) -> list[int]:
    """Pids of the live (not stopped) replicas of one deployment of ``app``, by their process title."""
    title = f"ray::ServeReplica:{app}:{deployment}"
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        first = cmdline.split()[0] if cmdline.split() else ""
        if (first == title or first.startswith(f"{title}.")) and state not in ("T", "Z"):
            pids.append(int(proc.name))
    return sorted(pids)


def replaced(deployment: str, victim: int, count: int, app: str = PIPELINE) -> Callable[[], bool]:
    """A predicate: ``victim`` is gone and ``count`` replicas of the deployment run again."""

    def check() -> bool:
        pids = replica_pids(deployment, app)
        return victim not in pids and len(pids) == count

    return check


def fault_kill(pid: int) -> None:
    """Fault: ``kill -9`` (the process gets no chance to drain or flush)."""
    os.kill(pid, signal.SIGKILL)


def fault_hang(pid: int) -> None:
    """Fault: the process stops answering anything (SIGSTOP), its sockets stay open."""
    os.kill(pid, signal.SIGSTOP)


def fault_resume(pid: int) -> None:
    """Undo :func:`fault_hang` if the process still exists (Serve normally killed it already)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``predicate`` until true; returns the seconds it took. Fails naming ``what`` after the timeout."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"no {what} after {timeout_s:.0f} s"
        time.sleep(0.2)
    return time.monotonic() - started


@dataclass(frozen=True)
class TreeUse:
    """Resident memory and open file descriptors of every process of the deployment, at one time."""

    rss: dict[str, int]
    """Process title (its first word, with the pid for the non-replicas) -> resident bytes."""
    fds: dict[str, int]

    @property
    def total_rss(self) -> int:
        return sum(self.rss.values())

    @property
    def total_fds(self) -> int:
        return sum(self.fds.values())


_PAGE = os.sysconf("SC_PAGE_SIZE")


def tree_use(running: Running) -> TreeUse:
    """RSS and fd counts of every riskserve/Ray process of ``running`` (read from /proc)."""
    rss: dict[str, int] = {}
    fds: dict[str, int] = {}
    for pid, cmdline in _processes(running).items():
        name = cmdline.split(" ", 1)[0][:60] or str(pid)
        key = f"{name}#{pid}"
        try:
            rss[key] = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
            fds[key] = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
    return TreeUse(rss, fds)
