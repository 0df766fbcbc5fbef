"""A real multi-node Ray cluster on one machine, for the drills that need one: ``ray start --head`` and
``ray start --address`` raylets, each with its own resources and its own environment (state, cache and
temporary directories, the loopback address its front doors bind), so anything that leans on one node's
disk fails. Every process of a node carries the node's name in its environment (``RISKSERVE_TEST_NODE``):
that is how a node is killed whole (every process of it, as a lost machine) without touching any other
Ray on the machine."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.sockets import free_port

__all__ = ["RayCluster", "RayNode", "ray_cluster"]

MARK = "RISKSERVE_TEST_NODE"
RAY = str(Path(sys.executable).with_name("ray"))


@dataclass
class RayNode:
    """One raylet: its name, loopback address, resources and environment."""

    name: str
    host: str
    root: Path
    resources: dict[str, float] = field(default_factory=dict)
    num_cpus: int = 1

    @property
    def env(self) -> dict[str, str]:
        """What every process of this node inherits: its own disk, and the address its front doors bind."""
        return {
            MARK: self.name,
            "RISKSERVE_NODE_HOST": self.host,
            "RISKSERVE_STATE_DIR": str(self.root / "state"),
            "RISKSERVE_CACHE_DIR": str(self.root / "cache"),
            "TMPDIR": str(self.root / "tmp"),
        }

    def pids(self) -> list[int]:
        """Every live process of this node."""
        needle = f"{MARK}={self.name}".encode()
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if needle in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
        return found

    def kill(self) -> int:
        """SIGKILL every process of the node at once (a machine lost); returns how many there were."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)


@dataclass
class RayCluster:
    """A head and its workers; ``address`` is the GCS's."""

    address: str
    nodes: list[RayNode]
    env: dict[str, str]

    def start_node(self, node: RayNode) -> None:
        """Start ``node`` as a worker of this cluster (again, after a kill, too)."""
        for sub in ("state", "cache", "tmp"):
            (node.root / sub).mkdir(parents=True, exist_ok=True)
        command = [RAY, "start", f"--address={self.address}", f"--num-cpus={node.num_cpus}",
                   f"--resources={json.dumps(node.resources)}", "--node-ip-address=127.0.0.1",
                   "--disable-usage-stats"]  # fmt: skip
        _run(command, {**self.env, **node.env})
        if node not in self.nodes:
            self.nodes.append(node)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.kill()


def _run(command: list[str], env: dict[str, str]) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-3000:]}")


@contextlib.contextmanager
def ray_cluster(head: RayNode, workers: list[RayNode], temp_dir: Path) -> Iterator[RayCluster]:
    """Start ``head`` and ``workers`` with Ray's token authentication on; kill every process of each after.
    ``RayCluster.env`` is what a driver joining it needs (the token's file included)."""
    port = free_port()
    temp_dir.mkdir(parents=True, exist_ok=True)
    token = temp_dir / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # "0" (single-machine Ray) refuses a second raylet
    }
    cluster = RayCluster(address=f"127.0.0.1:{port}", nodes=[], env=env)
    for sub in ("state", "cache", "tmp"):
        (head.root / sub).mkdir(parents=True, exist_ok=True)
    command = [RAY, "start", "--head", f"--port={port}", f"--num-cpus={head.num_cpus}",
               f"--resources={json.dumps(head.resources)}", "--node-ip-address=127.0.0.1",
               "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"]  # fmt: skip
    try:
        _run(command, {**env, **head.env})
        cluster.nodes.append(head)
        for worker in workers:
            cluster.start_node(worker)
        yield cluster
    finally:
        cluster.stop()
        time.sleep(0.5)
