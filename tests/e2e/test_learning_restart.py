"""Exactly-once online learning across ``kill -9`` of the learner and a restart of Ray (``down`` + ``up``).

Everything runs as a user runs it: ``riskserve up`` starts its own local Ray in the background, labels
arrive over real gRPC, ``riskserve learning`` reports the learner's cursor. After the learner's process is
killed and, later, the whole Ray is stopped and started again, every acknowledged label is in the log
once and in the served model once: its version equals a reference trained here on the same labels. The
fraud model runs where it runs by default, inside the ingress: the learner publishes to the ingress.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from riskserve.client import RiskClient
from riskserve.learning.learner import load_version
from riskserve.schema.pipeline import load_pipeline
from riskserve.state.db import open_database
from riskserve.state.versions import VersionsStore

from ..conftest import PIPELINES
from ..learning_helpers import BATCH, ONLINE, Labels
from .test_cli import _free_port, _riskserve

pytestmark = pytest.mark.slow


def _pipeline(tmp_path: Path, models: Path) -> Path:
    data: dict[str, Any] = yaml.safe_load((PIPELINES / "tabular_only.yaml").read_text())
    data["name"] = "restarts"
    data["pools"] = {"cpu": {"cpus": 1.25}}
    data["serving"] = {"ingress": {"replicas": 1}}  # a small Ray; two: test_online_learning
    for name, model in data["models"].items():
        model["artifact"] = str(models / name)
        model["timeout_ms"] = 20_000
    data["models"]["fraud"]["online"] = ONLINE
    data["feedback"] = {}
    data["state"] = {"dsn": f"sqlite:///{tmp_path / 'state' / 'state.sqlite'}"}  # labels, cursor, checkpoints
    data["audit"] = {"path": str(tmp_path / "audit")}  # the decisions labels are joined to
    data["state"] = {"dsn": f"sqlite:///{tmp_path / 'state.sqlite'}"}  # the versions record, read here too
    path = tmp_path / "restarts.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _status(env: dict[str, str]) -> dict[str, Any]:
    done = _riskserve("learning", "restarts", env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    status: dict[str, Any] = json.loads(done.stdout)
    return status


def _wait(
    env: dict[str, str], condition: Callable[[dict[str, Any]], bool], timeout_s: float
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        status = _status(env)
        if condition(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; learner status {status}")
        time.sleep(0.1)  # each status is a CLI process joining Ray: that is the poll's pace


def _up(path: Path, port: int, env: dict[str, str]) -> None:
    up = _riskserve("up", str(path), "--grpc-port", str(port), env=env)
    assert up.returncode == 0, up.stderr + up.stdout


def test_labels_survive_kill_9_and_a_ray_restart_exactly_once(tmp_path: Path, demo_models: Path) -> None:
    env = {**os.environ, "RISKSERVE_STATE_DIR": str(tmp_path / "state")}
    path = _pipeline(tmp_path, demo_models)
    spec = load_pipeline(path)
    port = _free_port()
    target = f"127.0.0.1:{port}"
    _up(path, port, env)
    try:
        with RiskClient(target, pipeline="restarts", timeout_s=30) as client:
            labels = Labels(spec, client)
            labels.decide(0, 4 * BATCH)
            labels.send(0, 2 * BATCH)
            pid = _wait(env, lambda s: s["models"]["fraud"]["last_seq"] == 2 * BATCH, 90)["pid"]
            labels.send(2 * BATCH, 3)
            os.kill(pid, signal.SIGKILL)  # fault injected: the learner and log writer dies mid-stream
            labels.send(2 * BATCH + 3, BATCH - 3, retry_s=120)
            learned = _wait(env, lambda s: s["models"]["fraud"]["last_seq"] == 3 * BATCH, 120)
            learned_version = learned["models"]["fraud"]["version"]
            assert learned_version != load_version(demo_models / "fraud").version
        down = _riskserve("down", env=env)
        assert down.returncode == 0, down.stderr  # Ray stops: every process, the object store, Serve
        store = VersionsStore(open_database(spec.state_dsn()))  # the versions record survives Ray
        entry = store.read("restarts").models["fraud"].entries[-1]
        store.db.close()
        assert (entry.version, entry.source) == (learned_version, "learned")
        _up(path, port, env)  # a new Ray serves the learned version from its first decision, not the YAML's
        with RiskClient(target, pipeline="restarts", timeout_s=30) as client:
            first = client.decide_request(labels.requests["req-0"]).models
            assert {m.version for m in first if m.model == "fraud"} == {learned_version}
            labels.client = client
            labels.send(3 * BATCH, BATCH, retry_s=60)  # decisions made before the restart are in the log
            status = _wait(env, lambda s: s["models"]["fraud"]["last_seq"] == 4 * BATCH, 120)
            expected = labels.reference(load_version(demo_models / "fraud").snapshot)
            assert len(labels.acked) == 4 * BATCH
            assert status["models"]["fraud"]["version"] == expected
            assert status["models"]["fraud"]["batches"] == {
                "applied": 1
            }  # this process applied only the last
            deadline = time.monotonic() + 60
            while True:  # the restarted learner republished the learned lineage over the YAML's artifact
                served = {
                    m.version
                    for m in client.decide_request(labels.requests["req-0"]).models
                    if m.model == "fraud"
                }
                if served == {expected} or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert served == {expected}
            shown = _riskserve("status", env=env)
            assert shown.returncode == 0, shown.stdout + shown.stderr
            line = rf"^  model fraud\s+sklearn\s+in ingress\s+{re.escape(expected)}$"
            assert re.search(line, shown.stdout, re.MULTILINE), shown.stdout
            assert f"serves its learned version {expected} (since " in shown.stdout  # and why it serves
            for i in range(0, 4 * BATCH, 7):  # replays after all of it: duplicates, nothing moves
                ack = client.feedback(
                    request_id=f"req-{i}", label=int(labels.tx.is_fraud[i]), feedback_id=f"fb-{i}"
                )
                assert ack.duplicate
                assert ack.seq == labels.seqs[f"fb-{i}"]
            again = _status(env)["models"]["fraud"]
            assert (again["last_seq"], again["version"], again["pending"]) == (4 * BATCH, expected, 0)
    finally:
        _riskserve("down", env=env)
