"""riskserve's own gRPC front door in the ingress replicas: where it listens, how calls are routed and
bounded, what it offers besides decisions, and that the tabular models really run in the ingress."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from riskserve.demo.dataset import generate_transactions
from riskserve.features.encoder import FeatureEncoder, RawRequest
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc
from riskserve.schema.pipeline import PipelineSpec
from riskserve.wrappers.sklearn_model import load_sklearn_artifact

from .conftest import ServeCluster, channel, deploy, pipeline_on

pytestmark = pytest.mark.slow

APP = "front_door"


@pytest.fixture(scope="module")
def spec(serve_cluster: ServeCluster, demo_models: Path) -> PipelineSpec:
    """tabular_only with two ingress replicas (sharing one port) and a small message cap."""
    spec = pipeline_on(
        "tabular_only.yaml",
        demo_models,
        name=APP,
        pools={"cpu": {"cpus": 2}},
        serving={"ingress": {"replicas": 2, "num_cpus": 0.25}, "grpc": {"max_receive_message_bytes": 64_000}},
    )
    deploy(spec)
    return spec


@pytest.fixture(scope="module")
def stub(spec: PipelineSpec) -> Iterator[pb_grpc.RiskPipelineStub]:
    with channel(spec) as chan:
        yield pb_grpc.RiskPipelineStub(chan)  # type: ignore[no-untyped-call]


def _requests(count: int, seed: int = 3) -> list[pb.DecideRequest]:
    transactions = generate_transactions(count, seed=seed)
    out = []
    for i in range(count):
        out.append(pb.DecideRequest(request_id=f"r{i}", **transactions.request_fields(i, text=False)))
    return out


def _md(name: str = APP) -> tuple[tuple[str, str], ...]:
    return (("application", name),)


def _ingress() -> Any:
    from ray import serve

    return serve.get_deployment_handle("ingress", app_name=APP)


def _listeners(port: int) -> list[tuple[str, int]]:
    """(local address, pid) of every socket listening on ``port`` (``ss -ltnp``)."""
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, check=True)
    found = []
    for line in out.stdout.splitlines():
        address = line.split()[3].rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")  # v4-mapped v6
        found += [(address, int(pid)) for pid in re.findall(r"pid=(\d+)", line)]
    return found


def test_every_ingress_replica_listens_on_the_one_loopback_port(spec: PipelineSpec) -> None:
    listeners = _listeners(spec.serving.grpc.port)
    assert {address for address, _ in listeners} == {"127.0.0.1"}, listeners
    assert len({pid for _, pid in listeners}) == 2, "two ingress replicas share the port (SO_REUSEPORT)"
    assert _ingress().endpoint.remote().result() == f"127.0.0.1:{spec.serving.grpc.port}"


def test_the_tabular_models_run_inside_the_ingress_process(spec: PipelineSpec) -> None:
    from ray import serve

    deployments = set(serve.status().applications[APP].deployments)
    assert deployments == {"ingress"}, "no model or feature-stage deployment: one process decides"
    listening = {pid for _, pid in _listeners(spec.serving.grpc.port)}
    for name in ("credit", "fraud"):
        status = _ingress().model_status.remote(name).result()
        assert status.placement == "ingress"
        assert status.ready
        assert status.pid in listening  # the process that answers gRPC is the one that scores


def test_a_call_for_another_pipeline_or_none_is_not_found(stub: pb_grpc.RiskPipelineStub) -> None:
    request = _requests(1)[0]
    for metadata, needle in ((_md("no_such_pipeline"), "no_such_pipeline"), ((), "application")):
        with pytest.raises(grpc.RpcError) as caught:
            stub.Decide(request, metadata=metadata, timeout=10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert needle in (caught.value.details() or "")


def test_reflection_lists_the_services(spec: PipelineSpec) -> None:
    with channel(spec) as chan:
        reflection = reflection_pb2_grpc.ServerReflectionStub(chan)  # type: ignore[no-untyped-call]
        answers = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for answer in answers for s in answer.list_services_response.service}
    assert {"riskserve.v1.RiskPipeline", "grpc.health.v1.Health"} <= names


def test_a_message_over_the_cap_is_refused_before_it_is_parsed(stub: pb_grpc.RiskPipelineStub) -> None:
    big = pb.DecideRequest(text="x" * 100_000, numeric={"amount": 1.0})
    with pytest.raises(grpc.RpcError) as caught:
        stub.Decide(big, metadata=_md(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_bad_input_names_the_field_before_any_model_runs(stub: pb_grpc.RiskPipelineStub) -> None:
    calls_before = _ingress().model_status.remote("fraud").result().calls
    request = _requests(1)[0]
    request.numeric["amount"] = float("nan")
    with pytest.raises(grpc.RpcError) as caught:
        stub.Decide(request, metadata=_md(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("amount")
    assert _ingress().model_status.remote("fraud").result().calls == calls_before  # one replica's count


def test_a_large_batch_scores_like_single_decisions(
    stub: pb_grpc.RiskPipelineStub, spec: PipelineSpec, demo_models: Path
) -> None:
    """300 rows go to a worker thread (past serving.inline_rows); one row runs on the event loop."""
    requests = _requests(300)
    batch = stub.DecideBatch(pb.DecideBatchRequest(requests=requests), metadata=_md(), timeout=60).responses
    assert [r.request_id for r in batch] == [r.request_id for r in requests]
    singles = [stub.Decide(r, metadata=_md(), timeout=10) for r in requests[:20]]
    for one, many in zip(singles, batch[:20], strict=True):
        # Equal up to BLAS summation order (a batch's matmul vs one row's): 1 ulp at most.
        assert [m.score for m in one.models] == pytest.approx([m.score for m in many.models], abs=1e-12)
        assert one.decision == many.decision
    # The fraud scores are scikit-learn's on the same encoded rows (an independent reference).
    encoder = FeatureEncoder(spec.features)
    matrix = encoder.encode(
        [encoder.validate(RawRequest(dict(r.numeric), dict(r.categorical), r.text)) for r in requests]
    ).matrix
    _, snapshot = load_sklearn_artifact(demo_models / "fraud")
    reference = snapshot.make_classifier().predict_proba(snapshot.make_scaler().transform(matrix))[:, 1]
    served = np.array([next(m.score for m in r.models if m.model == "fraud") for r in batch])
    np.testing.assert_allclose(served, reference, rtol=0, atol=1e-12)
    assert not any(m.fallback for r in batch for m in r.models)
