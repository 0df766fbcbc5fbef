"""kill -9 of the ingress replica under steady load: every decision a client got an answer for is in the
audit trail after the restart (write-ahead: on the journal before the answer left), none counted lost.

The writer is made to ship rarely (``flush_ms: 10000``), so at the kill the dead replica still holds
answered decisions only in memory and on its journal: the hard case, not the lucky one. Real Ray Serve,
real gRPC clients, a real SIGKILL (the fault injected), the replica restarted by Serve.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from riskserve.audit import AuditTrail
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc
from riskserve.state.db import open_database

from .conftest import ServeCluster, channel, deploy, pipeline_on, serving_pid

pytestmark = [pytest.mark.slow, pytest.mark.long]

APP = "audit_kill"
SAFE = {
    "numeric": {"amount": 42.5, "account_age_days": 900.0, "txn_velocity_1h": 0.0, "hour": 14.0},
    "categorical": {"merchant_category": "grocery", "channel": "pos"},
}  # fmt: skip


class Load:
    """Client threads deciding one request after another; keeps the ids of the answered decisions."""

    def __init__(self, spec: object, threads: int = 2) -> None:
        self.acknowledged: set[str] = set()
        self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(spec, n)) for n in range(threads)]

    def _run(self, spec: object, n: int) -> None:
        with channel(spec) as chan:  # type: ignore[arg-type]
            stub = pb_grpc.RiskPipelineStub(chan)
            i = 0
            while not self._stop.is_set():
                i += 1
                request = pb.DecideRequest(request_id=f"load-{n}-{i}", **SAFE)  # type: ignore[arg-type]
                try:
                    answer = stub.Decide(request, metadata=[("application", APP)], timeout=5)
                except grpc.RpcError:
                    with self._lock:
                        self.failed += 1
                    time.sleep(0.05)
                    continue
                with self._lock:  # answered: the client holds its decision_id
                    self.acknowledged.add(answer.decision_id)

    def count(self) -> int:
        with self._lock:
            return len(self.acknowledged)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


def _ingress() -> object:
    from ray import serve

    return serve.get_deployment_handle("ingress", app_name=APP)


def _restarted(spec: object, pid: int) -> bool:
    try:
        return serving_pid(spec) != pid  # type: ignore[arg-type]
    except AssertionError:  # no process listens yet (or two, for a moment)
        return False


def _wait(condition: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_kill_9_of_the_ingress_under_load_loses_no_answered_decision(
    serve_cluster: ServeCluster, demo_models: Path
) -> None:
    directory = Path(tempfile.mkdtemp(prefix="audit-kill-"))
    spec = pipeline_on(
        "tabular_only.yaml", demo_models, name=APP,
        audit={"path": str(directory), "flush_ms": 10_000, "batch_rows": 100_000},
    )  # fmt: skip
    deploy(spec)
    pid = serving_pid(spec)
    with Load(spec) as load:
        _wait(lambda: load.count() >= 300, 60, "300 answered decisions")
        before_kill = load.count()
        os.kill(pid, signal.SIGKILL)  # fault injected: the replica dies with answered decisions in memory
        _wait(lambda: _restarted(spec, pid), 120, "Serve to restart the ingress replica")
        after_restart = load.count()
        _wait(lambda: load.count() >= after_restart + 100, 60, "decisions answered by the new replica")
    handle = _ingress()
    assert handle.audit_flush.remote(30.0).result(timeout_s=60)  # type: ignore[attr-defined]
    counts = handle.audit_status.remote().result(timeout_s=60)  # type: ignore[attr-defined]
    trail = AuditTrail(open_database(spec.state_dsn()), directory)  # the database and this node's journals
    kept = {r["decision_id"] for r in trail.records(0, 1e12)}
    trail.db.close()
    missing = load.acknowledged - kept
    print(
        f"answered {len(load.acknowledged)} ({before_kill} before the kill), failed calls {load.failed}, "
        f"in the trail {len(kept)}, replayed from the dead replica's journal {counts.replayed}, "
        f"dropped {counts.dropped}"
    )
    assert not missing, f"{len(missing)} of {len(load.acknowledged)} answered decisions are not in the trail"
    assert counts.dropped == 0
    # The new replica took the dead one's slot and replayed its journal: the records the dead replica had
    # answered but not committed (it committed at most once, 10 s in) came back from disk.
    assert counts.slot == "slot-0"
    assert counts.replayed > 0
    assert before_kill >= 300
