"""``serving.feature_stage: ingress``: the same decisions with one Serve hop fewer, still shared memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from riskserve.demo.dataset import generate_transactions
from riskserve.pipelines.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.pipelines.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc

from .conftest import ServeCluster, deploy, pipeline_on

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stub(serve_cluster: ServeCluster, demo_models: Path) -> pb_grpc.RiskPipelineStub:
    deploy(pipeline_on("tabular_only.yaml", demo_models))
    inline = pipeline_on(
        "tabular_only.yaml",
        demo_models,
        name="tabular_inline",
        serving={"feature_stage": "ingress", "decision_timeout_ms": 20_000},
    )
    deploy(inline)
    return pb_grpc.RiskPipelineStub(serve_cluster.channel())  # type: ignore[no-untyped-call]


def _md(app: str) -> tuple[tuple[str, str], ...]:
    return (("application", app),)


def _handle(deployment: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name="tabular_inline")


def test_no_feature_deployment_and_the_same_decisions(stub: pb_grpc.RiskPipelineStub) -> None:
    from ray import serve

    deployments = set(serve.status().applications["tabular_inline"].deployments)
    assert deployments == {"ingress", "model-credit", "model-fraud"}
    tx = generate_transactions(20, seed=31)
    for i in range(len(tx)):
        row = tx.row(i)
        request = pb.DecideRequest(
            request_id=f"tx-{i}",
            numeric={k: float(v) for k, v in row.items() if isinstance(v, float)},
            categorical={k: str(row[k]) for k in ("merchant_category", "channel")},
        )
        inline = stub.Decide(request, metadata=_md("tabular_inline"), timeout=30)
        staged = stub.Decide(request, metadata=_md("tabular_only"), timeout=30)
        assert (inline.decision, inline.risk_score, list(inline.reasons)) == (
            staged.decision,
            staged.risk_score,
            list(staged.reasons),
        )


def test_encoded_once_per_call_and_read_from_one_shared_buffer(stub: pb_grpc.RiskPipelineStub) -> None:
    ingress = _handle("ingress")
    before = ingress.feature_stats.remote().result()["calls"]
    request = pb.DecideRequest(
        numeric={"amount": 30.0, "account_age_days": 800.0, "txn_velocity_1h": 1.0, "hour": 12.0},
        categorical={"merchant_category": "grocery", "channel": "pos"},
    )
    for _ in range(3):
        stub.Decide(request, metadata=_md("tabular_inline"), timeout=30)
    stub.DecideBatch(
        pb.DecideBatchRequest(requests=[request] * 5), metadata=_md("tabular_inline"), timeout=30
    )
    stats = ingress.feature_stats.remote().result()
    assert stats["calls"] - before == 4
    infos = [
        _handle(f"model-{n}").input_info.remote(stats["last_batch_id"]).result() for n in ("credit", "fraud")
    ]
    assert all(info is not None and "plasma" in info.mapping and info.read_only for info in infos)
    credit, fraud = infos
    assert (credit.inode, credit.file_offset) == (fraud.inode, fraud.file_offset)


def test_bad_input_is_refused_in_the_ingress_naming_the_field(stub: pb_grpc.RiskPipelineStub) -> None:
    request = pb.DecideRequest(
        numeric={"amount": -5.0, "account_age_days": 800.0, "txn_velocity_1h": 1.0, "hour": 12.0},
        categorical={"merchant_category": "grocery", "channel": "pos"},
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.Decide(request, metadata=_md("tabular_inline"), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (info.value.details() or "").startswith("amount:")
