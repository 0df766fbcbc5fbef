"""A pipeline on two real Ray nodes of one machine, each with its own state, cache and temporary
directories and its own loopback address, PostgreSQL as the state store and a shared artifact directory:
a decision answered through one node's front door is labelled through the other's, learned by the
feedback service on the second node, and the new version serves on both; an ingress replica killed on the
first node comes back serving the learned version, which its own disk never held; then the first node is
lost whole under load, and the audit trail misses only decisions it answered in its last second (the bound
is its unshipped records: about one shipping interval)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from riskserve.audit.store import AuditStore
from riskserve.client import RiskClient
from riskserve.learning.learner import load_version
from riskserve.platform.errors import RiskServeError
from riskserve.schema.pipeline import parse_pipeline
from riskserve.state.db import open_database

from ..conftest import PIPELINES, REPO
from ..learning_helpers import BATCH, ONLINE, Labels
from ..pg_server import PostgresServer
from ..ray_nodes import RayNode, ray_cluster
from ..sockets import listening_sockets

pytestmark = pytest.mark.slow

DEPLOY = """
import sys, yaml
from ray import serve
import ray
from riskserve.operations.app import build_application
from riskserve.schema.pipeline import parse_pipeline
ray.init(address=sys.argv[1], log_to_driver=False)
serve.start(proxy_location="Disabled", http_options={"host": "127.0.0.1"})
spec = parse_pipeline(yaml.safe_load(open(sys.argv[2])), base_dir=sys.argv[3])
serve.run(build_application(spec), name=spec.name, route_prefix=None)
"""


def _pipeline(tmp_path: Path, models: Path, dsn: str, port: int) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((PIPELINES / "tabular_only.yaml").read_text())
    data["name"] = "twonodes"
    data["pools"] = {"cpu": {"cpus": 8}, "learn": {"cpus": 1}}
    data["serving"] = {
        "grpc": {"port": port},
        "ingress": {"replicas": 2, "max_replicas_per_node": 1, "pool": "cpu"},
    }
    for name, model in data["models"].items():
        model["artifact"] = str(models / name)  # the YAML's artifacts: on a volume every node mounts
        model["timeout_ms"] = 20_000
        model["pool"] = "cpu"
    data["models"]["fraud"]["online"] = {**ONLINE, "artifact_dir": str(tmp_path / "learner-disk")}
    data["feedback"] = {"pool": "learn"}
    data["audit"] = {}  # each node journals on its own disk and ships to PostgreSQL
    data["state"] = {"dsn": dsn, "artifacts": str(tmp_path / "shared-artifacts")}
    return data


def _fraud_version(client: RiskClient, labels: Labels) -> str:
    answer = client.decide_request(labels.requests["req-0"])
    return next(m.version for m in answer.models if m.model == "fraud")


def _listener(host: str, port: int) -> int:
    """The pid of the process listening on ``host:port`` (the kernel's socket table)."""
    sockets = {f"socket:[{inode}]" for inode, (address, bound) in listening_sockets().items()
               if bound == port and address.removeprefix("::ffff:") == host}  # fmt: skip
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if any(os.readlink(fd) in sockets for fd in (proc / "fd").iterdir()):
                    return int(proc.name)
            except OSError:
                continue
    raise AssertionError(f"nothing listens on {host}:{port}")


def _wait(what: str, condition: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = condition()
            if value:
                return value
        except Exception:  # the replica is coming back
            value = None
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _answered_until_the_node_dies(target: str, labels: Labels, node: RayNode, run_s: float) -> dict[str, Any]:
    """Decide through ``target`` from a thread until ``node`` is killed whole (every process, as a lost
    machine) after ``run_s``; returns when each decision was answered, and when the node died."""
    answered: list[tuple[float, str]] = []
    stop = threading.Event()

    def load() -> None:
        with RiskClient(target, pipeline="twonodes", timeout_s=2) as client:
            i = 0
            while not stop.is_set():
                try:
                    answer = client.decide_request(labels.requests[f"req-{i % BATCH}"])
                except RiskServeError:
                    return  # the node is gone: its front door answers no more
                answered.append((time.monotonic(), answer.decision_id))
                i += 1

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(run_s)
    killed_at = time.monotonic()
    assert node.kill() > 0
    stop.set()
    thread.join(30)
    return {"answered": answered, "killed_at": killed_at}


def test_a_decision_on_one_node_is_learned_through_the_other_and_serves_on_both(
    tmp_path: Path, demo_models: Path, postgres: PostgresServer
) -> None:
    from ..integration.conftest import free_port

    port = free_port()
    dsn = postgres.new_database("twonodes")
    data = _pipeline(tmp_path, demo_models, dsn, port)
    path = tmp_path / "twonodes.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    spec = parse_pipeline(data, base_dir=PIPELINES)
    head = RayNode("head", "127.0.0.1", tmp_path / "node-head", {}, num_cpus=1)  # Serve's controller only
    a = RayNode("a", "127.0.0.2", tmp_path / "node-a", {"riskserve_pool_cpu": 4000}, num_cpus=4)
    b = RayNode("b", "127.0.0.3", tmp_path / "node-b",
                {"riskserve_pool_cpu": 4000, "riskserve_pool_learn": 1000}, num_cpus=4)  # fmt: skip
    ray_temp = Path(tempfile.mkdtemp(prefix="rs-ray-"))  # short: Ray's socket paths must fit 107 bytes
    with ray_cluster(head, [a, b], ray_temp) as cluster:
        deploy = subprocess.run(
            [sys.executable, "-c", DEPLOY, cluster.address, str(path), str(PIPELINES)],
            env={**cluster.env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert deploy.returncode == 0, deploy.stderr[-4000:]
        yaml_version = load_version(demo_models / "fraud").version
        with (
            RiskClient(f"{a.host}:{port}", pipeline="twonodes", timeout_s=30) as on_a,
            RiskClient(f"{b.host}:{port}", pipeline="twonodes", timeout_s=30) as on_b,
        ):
            labels = Labels(spec, on_a)
            labels.decide(0, BATCH)  # answered by node a's front door
            labels.client = on_b
            labels.send(0, BATCH, retry_s=30)  # labelled through node b's: one mini-batch, one version
            learned = _wait(
                "the learned version on both nodes",
                lambda: {_fraud_version(on_a, labels), _fraud_version(on_b, labels)} - {yaml_version},
                120,
            )
            assert len(learned) == 1, learned  # one version, the same on both nodes
            (version,) = learned
            assert {_fraud_version(on_a, labels), _fraud_version(on_b, labels)} == {version}
            # The learner's own disk loses the version: what serves must come from the shared store.
            shutil.rmtree(tmp_path / "learner-disk", ignore_errors=True)
            os.kill(_listener(a.host, port), signal.SIGKILL)  # fault injected: node a's ingress replica dies
            restarted = _wait("node a's ingress back", lambda: _fraud_version(on_a, labels), 180)
            assert restarted == version != yaml_version
            # Node a lost whole under load: what it answered and had not shipped is all the trail misses.
            run = _answered_until_the_node_dies(f"{a.host}:{port}", labels, a, run_s=2.0)
            assert _fraud_version(on_b, labels) == version  # node b decides on
        flush_s = spec.audit.flush_ms / 1e3 if spec.audit else 0.0
        db = open_database(dsn)
        try:
            kept = AuditStore(db).many([d for _, d in run["answered"]])
        finally:
            db.close()
        lost = [(at, d) for at, d in run["answered"] if d not in kept]
        last_interval = [d for at, d in run["answered"] if at > run["killed_at"] - 1.0]
        print(  # the drill's figures (RELIABILITY.md)
            f"node lost: {len(run['answered'])} answered, {len(lost)} not in the trail "
            f"(shipping interval {flush_s * 1e3:.0f} ms; {len(last_interval)} answered in its last second)"
        )
        assert len(run["answered"]) > 0
        assert {d for _, d in lost} <= set(last_interval)  # only what it answered in its last second
