"""Online learning on real Ray Serve over real gRPC: Feedback -> durable log -> partial_fit -> every replica.

The reference model is computed here, without the service: the same requests encoded by the pipeline's
own feature encoder, cut into the same mini-batches in the order the labels were acknowledged. The fraud
model runs where it runs by default, inside every ingress replica (two here): a learned version is
published by reconfiguring the ingress replicas in place, never by restarting one.
"""

from __future__ import annotations

import copy
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from riskserve.client import RiskClient
from riskserve.learning.learner import load_version
from riskserve.platform.errors import (
    AlreadyExists,
    Conflict,
    InvalidInput,
    ModelLoadError,
    ModelUnavailable,
    NotFound,
    Overloaded,
)
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline

from ..learning_helpers import BATCH, ONLINE, Labels, own_connection, replica_statuses
from ..pg_server import PostgresServer
from .conftest import GENEROUS_TIMEOUT_MS, PIPELINES, ServeCluster, deploy, endpoint, free_port

pytestmark = pytest.mark.slow

APP = "learning"
INGRESS_REPLICAS = 2


def _spec(models: Path, dsn: str) -> PipelineSpec:
    data: dict[str, Any] = copy.deepcopy(yaml.safe_load((PIPELINES / "tabular_only.yaml").read_text()))
    data["name"] = APP
    data["pools"] = {"cpu": {"cpus": 2}}
    for name, model in data["models"].items():
        model["artifact"] = str(models / name)
        model["timeout_ms"] = GENEROUS_TIMEOUT_MS
    data["models"]["fraud"]["online"] = ONLINE
    data["feedback"] = {"source_rate_per_s": 0.5, "source_burst": 100}
    data["state"] = {"dsn": dsn}  # PostgreSQL: labels, the learner and its publishes (SQLite: tests/e2e)
    data["audit"] = {"path": tempfile.mkdtemp(prefix="audit-")}  # the decisions labels are joined to
    data["serving"] = {
        "decision_timeout_ms": GENEROUS_TIMEOUT_MS,
        "ingress": {"replicas": INGRESS_REPLICAS},
        "grpc": {"port": free_port()},
    }
    spec = parse_pipeline(data, base_dir=PIPELINES, source="learning")
    assert spec.models["fraud"].in_ingress, "the default placement of a scikit-learn model"
    return spec


def _feedback_status() -> dict[str, Any]:
    from ray import serve

    status: dict[str, Any] = (
        serve.get_deployment_handle("feedback", app_name=APP).status.remote().result(timeout_s=60)
    )
    return status


def _wait(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {_feedback_status()}")
        time.sleep(0.25)


def _fraud_versions() -> set[str]:
    """The fraud versions the ingress replicas serve (every replica asked)."""
    statuses = replica_statuses(APP, "fraud", INGRESS_REPLICAS)
    assert {s.placement for s in statuses.values()} == {"ingress"}
    return {str(s.version) for s in statuses.values()}


def _ingress_processes() -> dict[str, tuple[int, float]]:
    """Each ingress replica's process (actor id -> pid, when its fraud runner started)."""
    return {a: (s.pid, s.started_at) for a, s in replica_statuses(APP, "fraud", INGRESS_REPLICAS).items()}


def _answered_versions(spec: PipelineSpec, request: pb.DecideRequest, connections: int = 8) -> set[str]:
    """The fraud versions named in answers to ``request`` (as a new decision: no request id), over
    connections of their own (the kernel spreads them over the ingress replicas)."""
    request = pb.DecideRequest(numeric=request.numeric, categorical=request.categorical)
    versions = set()
    for _ in range(connections):
        with own_connection(endpoint(spec)) as channel:
            stub = pb_grpc.RiskPipelineStub(channel)  # type: ignore[no-untyped-call]
            response = stub.Decide(request, metadata=(("application", APP),), timeout=30)
        versions |= {m.version for m in response.models if m.model == "fraud"}
    return versions


@pytest.fixture(scope="module")
def learning(
    serve_cluster: ServeCluster, demo_models: Path, postgres: PostgresServer
) -> Iterator[tuple[PipelineSpec, Labels]]:
    spec = _spec(demo_models, postgres.new_database())
    deploy(spec)
    with RiskClient(endpoint(spec), pipeline=APP, timeout_s=30) as client:
        yield spec, Labels(spec, client)


@pytest.fixture(scope="module")
def ingress_processes(learning: tuple[PipelineSpec, Labels]) -> dict[str, tuple[int, float]]:
    """The ingress replicas as first deployed: learning must never restart one."""
    return _ingress_processes()


def test_labels_are_learned_once_and_published_to_every_replica(
    learning: tuple[PipelineSpec, Labels], demo_models: Path, ingress_processes: dict[str, tuple[int, float]]
) -> None:
    spec, labels = learning
    base = load_version(demo_models / "fraud").snapshot
    responses = labels.decide(0, 3 * BATCH)
    assert {m.version for r in responses for m in r.models if m.model == "fraud"} == {base.version}
    labels.send(0, 3 * BATCH)
    assert [labels.seqs[f"fb-{i}"] for i in range(3 * BATCH)] == list(range(1, 3 * BATCH + 1))

    _wait(lambda: _feedback_status()["models"]["fraud"]["last_seq"] == 3 * BATCH, 60, "three mini-batches")
    expected = labels.reference(base)
    status = _feedback_status()["models"]["fraud"]
    assert status["version"] == expected
    assert status["batches"] == {"applied": 3}
    assert status["pending"] == 0
    _wait(lambda: _fraud_versions() == {expected}, 30, "both ingress replicas on the learned version")
    assert _ingress_processes() == ingress_processes, "published in place: no ingress replica restarted"
    after = labels.decide(3 * BATCH, 4)
    assert {m.version for r in after for m in r.models if m.model == "fraud"} == {expected}
    assert _answered_versions(spec, labels.requests["req-0"]) == {expected}
    credit = {m.version for r in after for m in r.models if m.model == "credit"}
    assert credit == {m.version for m in responses[0].models if m.model == "credit"}  # untouched

    # A replayed batch of feedback ids changes nothing: duplicates with their first seq, same version.
    for i in range(3 * BATCH):
        ack = labels.client.feedback(
            request_id=f"req-{i}", label=int(labels.tx.is_fraud[i]), feedback_id=f"fb-{i}", source="bank"
        )
        assert ack.duplicate
        assert ack.seq == labels.seqs[f"fb-{i}"]
    time.sleep(1.0)
    replayed = _feedback_status()["models"]["fraud"]
    assert (replayed["last_seq"], replayed["version"], replayed["pending"]) == (3 * BATCH, expected, 0)
    assert _fraud_versions() == {expected}
    assert _ingress_processes() == ingress_processes


def test_bad_feedback_gets_a_clear_status_and_records_nothing(learning: tuple[PipelineSpec, Labels]) -> None:
    _, labels = learning
    before = _feedback_status()["models"]["fraud"]
    client = labels.client
    with pytest.raises(InvalidInput, match="label"):
        client.feedback(request_id="req-0", label=2, feedback_id="bad-1")
    with pytest.raises(InvalidInput, match="feedback_id"):
        client.feedback(request_id="req-0", label=1, feedback_id="")
    with pytest.raises(NotFound, match="never-decided"):
        client.feedback(request_id="never-decided", label=1, feedback_id="bad-2")
    with pytest.raises(Conflict, match="fb-0"):  # the id was used for another label
        client.feedback(request_id="req-0", label=1 - int(labels.tx.is_fraud[0]), feedback_id="fb-0")
    after = _feedback_status()["models"]["fraud"]
    assert (after["last_seq"], after["pending"]) == (before["last_seq"], before["pending"])


def test_kill_9_of_the_feedback_service_loses_no_label(
    learning: tuple[PipelineSpec, Labels], demo_models: Path, ingress_processes: dict[str, tuple[int, float]]
) -> None:
    spec, labels = learning
    start = 3 * BATCH
    labels.decide(start + 4, 2 * BATCH)  # decisions 48..51 were made by the first test
    pid = _feedback_status()["pid"]
    labels.send(start, 5)
    os.kill(pid, signal.SIGKILL)  # fault injected: the log's only writer dies mid-stream
    labels.send(start + 5, 2 * BATCH - 5, retry_s=90)  # the client retries with the same ids until acked
    _wait(lambda: _feedback_status()["pid"] != pid, 60, "the restarted feedback replica")
    _wait(lambda: _feedback_status()["models"]["fraud"]["last_seq"] == 5 * BATCH, 90, "every label applied")
    expected = labels.reference(load_version(demo_models / "fraud").snapshot)
    assert len(labels.acked) == 5 * BATCH
    assert _feedback_status()["models"]["fraud"]["version"] == expected
    _wait(lambda: _fraud_versions() == {expected}, 30, "both replicas on the version after the restart")
    assert _answered_versions(spec, labels.requests[f"req-{start}"]) == {expected}
    assert _ingress_processes() == ingress_processes, "only the feedback service restarted"


def test_a_source_over_its_rate_is_refused_by_name(learning: tuple[PipelineSpec, Labels]) -> None:
    _, labels = learning
    labels.decide(200, 2)
    client = labels.client
    refused: list[str] = []
    started = time.monotonic()
    for i in range(120):  # the burst is 100 labels per source, refilled at 0.5 per second (a repeat of
        # the same verdict for one decision is a duplicate, but it spends the source's rate all the same)
        try:
            client.feedback(request_id="req-200", label=0, feedback_id=f"spam-{i}", source="analyst:eve")
        except Overloaded as error:
            refused.append(str(error))
    refilled = 0.5 * (time.monotonic() - started)
    assert 20 - refilled - 1 <= len(refused) <= 20  # 120 sent: 100 of burst plus what the refill allowed
    assert all("source 'analyst:eve' is over its label rate" in message for message in refused)
    ack = client.feedback(request_id="req-201", label=0, feedback_id="other-source", source="chargebacks")
    assert ack.accepted
    assert not ack.duplicate
    # Every admitted label is learned (the last partial batch stays pending: its interval is 10 minutes).
    last = ack.seq - ack.seq % BATCH
    _wait(lambda: _feedback_status()["models"]["fraud"]["last_seq"] == last, 90, "the admitted labels")


def test_a_second_label_of_another_value_is_already_exists(learning: tuple[PipelineSpec, Labels]) -> None:
    _, labels = learning
    truth = int(labels.tx.is_fraud[0])
    with pytest.raises(AlreadyExists, match="req-0"):
        labels.client.feedback(request_id="req-0", label=1 - truth, feedback_id="flip-0", source="eve")
    again = labels.client.feedback(request_id="req-0", label=truth, feedback_id="again-0", source="eve")
    assert (again.duplicate, again.seq) == (True, labels.seqs["fb-0"])


def test_the_server_issues_decision_ids_and_a_shared_request_id_is_not_enough_to_label(
    learning: tuple[PipelineSpec, Labels],
) -> None:
    _, labels = learning
    request = labels.decide(300, 1)[0]
    again = labels.client.decide_request(labels.requests["req-300"])  # a second caller squats the same id
    assert (request.request_id, again.request_id) == ("req-300", "req-300")  # echoed
    assert len({request.decision_id, again.decision_id}) == 2
    assert all(len(r.decision_id) == 32 for r in (request, again))
    with pytest.raises(InvalidInput, match="several decisions"):
        labels.client.feedback(request_id="req-300", label=1, feedback_id="squat-1", source="bank")
    ack = labels.client.feedback(
        decision_id=request.decision_id, label=1, feedback_id="squat-1", source="bank"
    )
    assert ack.accepted
    assert not ack.duplicate


def _feedback() -> Any:
    from ray import serve

    return serve.get_deployment_handle("feedback", app_name=APP)


def test_swaps_publish_under_the_learners_lock_and_a_refused_one_is_never_adopted(
    learning: tuple[PipelineSpec, Labels], demo_models: Path
) -> None:
    base = load_version(demo_models / "fraud")
    before = _feedback_status()["models"]["fraud"]
    serving = before["version"]
    assert serving != base.version  # the earlier tests made the learner publish
    with pytest.raises(Conflict, match="another publish came first"):  # verified against a stale version
        _feedback().swap.remote("fraud", str(base.artifact), base.version, "stale").result()
    # Fault injected: a candidate that claims another version than the replicas will report serving.
    with pytest.raises(ModelLoadError, match="rolled back"):
        _feedback().swap.remote("fraud", str(base.artifact), "not-what-it-holds", serving).result()
    after = _feedback_status()["models"]["fraud"]
    assert (after["version"], after["baseline"]) == (serving, before["baseline"])  # never adopted
    assert _fraud_versions() == {serving}  # every replica serves the old version again
    _feedback().swap.remote("fraud", str(base.artifact), base.version, serving).result()
    assert _fraud_versions() == {base.version}
    adopted = _feedback_status()["models"]["fraud"]
    assert (adopted["version"], adopted["baseline"]) == (base.version, str(base.artifact))


def test_after_the_fence_nothing_is_published(
    learning: tuple[PipelineSpec, Labels], demo_models: Path
) -> None:
    """What a shutdown does before it drains: a later publish would redeploy a pipeline being deleted."""
    _feedback().fence.remote().result()
    serving = _feedback_status()["models"]["fraud"]["version"]
    with pytest.raises(ModelUnavailable, match="shutting down"):
        _feedback().swap.remote("fraud", str(demo_models / "fraud"), serving, serving).result()
