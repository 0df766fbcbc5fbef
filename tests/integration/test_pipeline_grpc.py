"""End to end over real gRPC on loopback: Ray Serve's proxy, the feature stage, the real models.

Two pipelines run side by side (card_fraud with the vLLM intent model, tabular_only) and are chosen by the
``application`` metadata, exactly as a client would use them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from riskserve.demo.dataset import generate_transactions
from riskserve.features.encoder import FeatureEncoder, RawRequest
from riskserve.pipelines.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.pipelines.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc
from riskserve.pipelines.spec import PipelineSpec
from riskserve.platform.artifacts import open_artifact
from riskserve.wrappers.sklearn_model import SklearnModel, SklearnSettings

from .conftest import ServeCluster, deploy, pipeline_on

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

LEGIT = {
    "numeric": {"amount": 23.5, "account_age_days": 2400.0, "txn_velocity_1h": 0.0, "hour": 12.0},
    "categorical": {"merchant_category": "grocery", "channel": "pos"},
    "text": "weekly groceries from the supermarket",
}
RISKY = {
    "numeric": {"amount": 2500.0, "account_age_days": 3.0, "txn_velocity_1h": 9.0, "hour": 3.0,
                "country_mismatch": 1.0, "device_change": 1.0},
    "categorical": {"merchant_category": "crypto", "channel": "online"},
    "text": "urgent, send it now before the deadline",
}  # fmt: skip


def _request(body: dict[str, Any], request_id: str = "") -> pb.DecideRequest:
    return pb.DecideRequest(request_id=request_id, **body)


@pytest.fixture(scope="module")
def pipelines(serve_cluster: ServeCluster, demo_models: Path) -> dict[str, PipelineSpec]:
    specs = {
        "card_fraud": pipeline_on("card_fraud.yaml", demo_models),
        "tabular_only": pipeline_on("tabular_only.yaml", demo_models),
    }
    for spec in specs.values():
        deploy(spec)
    return specs


@pytest.fixture(scope="module")
def stub(
    serve_cluster: ServeCluster, pipelines: dict[str, PipelineSpec]
) -> Iterator[pb_grpc.RiskPipelineStub]:
    channel = serve_cluster.channel()
    yield pb_grpc.RiskPipelineStub(channel)
    channel.close()


def _md(app: str) -> list[tuple[str, str]]:
    return [("application", app)]


def _ingress(app: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle("ingress", app_name=app)


def _model(app: str, name: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle(f"model-{name}", app_name=app)


def test_a_decision_carries_every_model_with_its_artifact_version(
    stub: pb_grpc.RiskPipelineStub, demo_models: Path
) -> None:
    response = stub.Decide(_request(LEGIT, "legit-1"), metadata=_md("card_fraud"), timeout=30)
    assert response.request_id == "legit-1"
    assert response.pipeline == "card_fraud"
    assert response.pipeline_version == "2026.12.0"
    assert len(response.trace_id) == 32
    by_name = {m.model: m for m in response.models}
    assert list(by_name) == ["intent", "credit", "fraud"]
    for name, kind in (("intent", "vllm"), ("credit", "treelite"), ("fraud", "sklearn")):
        assert by_name[name].version == open_artifact(demo_models / name, kind=kind).version
        assert not by_name[name].fallback
        assert by_name[name].latency_ms > 0
    assert by_name["intent"].label == "purchase"
    assert response.decision == pb.APPROVE
    assert response.reasons == ["low risk"]


def test_scores_equal_the_models_run_locally_and_the_rules_are_applied(
    stub: pb_grpc.RiskPipelineStub, pipelines: dict[str, PipelineSpec], demo_models: Path
) -> None:
    spec = pipelines["card_fraud"]
    response = stub.Decide(_request(RISKY), metadata=_md("card_fraud"), timeout=30)
    scores = {m.model: m for m in response.models}
    encoder = FeatureEncoder(spec.features)
    row = encoder.validate(RawRequest(**RISKY))
    local = SklearnModel(SklearnSettings(name="fraud", artifact=demo_models / "fraud"))
    asyncio.run(local.load())
    expected_fraud = float(local.score_sync(encoder.encode([row]).matrix)[0])
    assert scores["fraud"].score == pytest.approx(expected_fraud, abs=1e-12)
    assert scores["intent"].label == "urgent"
    expected_risk = (
        0.45 * scores["fraud"].score + 0.35 * scores["credit"].score + 0.2 * scores["intent"].score
    )
    assert response.risk_score == pytest.approx(min(1.0, expected_risk), abs=1e-9)
    assert response.decision == pb.DECLINE
    assert any(r.startswith("high_risk:") for r in response.reasons)
    assert any(r.startswith("pressure_language:") for r in response.reasons)
    assert any(r.startswith("new_device_abroad:") for r in response.reasons)


BAD = [
    ({"numeric": {k: v for k, v in LEGIT["numeric"].items() if k != "amount"}}, "amount", "required"),
    ({"numeric": {**LEGIT["numeric"], "amount": float("nan")}}, "amount", "finite"),
    ({"numeric": {**LEGIT["numeric"], "hour": float("inf")}}, "hour", "finite"),
    ({"numeric": {**LEGIT["numeric"], "hour": 25.0}}, "hour", "above the maximum"),
    ({"categorical": {"merchant_category": "grocery", "channel": "fax"}}, "channel", "not one of"),
    ({"numeric": {**LEGIT["numeric"], "amout": 3.0}}, "amout", "unknown numeric field"),
    ({"text": "x" * 501}, "text", "at most 500"),
]


@pytest.mark.parametrize(("change", "field", "message"), BAD, ids=[b[1] + "-" + b[2] for b in BAD])
def test_bad_input_is_invalid_argument_naming_the_field_and_reaches_no_model(
    stub: pb_grpc.RiskPipelineStub, change: dict[str, Any], field: str, message: str
) -> None:
    before = {
        n: _model("card_fraud", n).metadata.remote().result()["calls"] for n in ("intent", "credit", "fraud")
    }
    with pytest.raises(grpc.RpcError) as info:
        stub.Decide(_request({**LEGIT, **change}), metadata=_md("card_fraud"), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}: ")
    assert message in info.value.details()
    after = {
        n: _model("card_fraud", n).metadata.remote().result()["calls"] for n in ("intent", "credit", "fraud")
    }
    assert after == before


def test_the_feature_stage_runs_once_per_decision_and_models_read_its_shared_buffer(
    stub: pb_grpc.RiskPipelineStub,
) -> None:
    ingress = _ingress("tabular_only")
    before = ingress.feature_stats.remote().result()["calls"]
    for i in range(5):
        stub.Decide(_request(LEGIT | {"text": ""}, f"once-{i}"), metadata=_md("tabular_only"), timeout=30)
    batch = pb.DecideBatchRequest(requests=[_request(LEGIT | {"text": ""}, f"b{i}") for i in range(7)])
    stub.DecideBatch(batch, metadata=_md("tabular_only"), timeout=30)
    stats = ingress.feature_stats.remote().result()
    assert stats["calls"] - before == 6  # five decisions and one batch of seven: six matrices

    infos = [
        _model("tabular_only", n).input_info.remote(stats["last_batch_id"]).result()
        for n in ("credit", "fraud")
    ]
    assert all(info is not None for info in infos)
    for info in infos:
        assert info.read_only
        assert not info.owns_data
        assert not info.copied_for_columns
        assert "plasma" in info.mapping
        assert info.inode > 0
    credit, fraud = infos
    assert (credit.mapping, credit.inode, credit.file_offset) == (
        fraud.mapping,
        fraud.inode,
        fraud.file_offset,
    )
    pids = {_model("tabular_only", n).metadata.remote().result()["pid"] for n in ("credit", "fraud")}
    assert len(pids) == 2, "the two models are separate processes sharing one buffer"


def test_decide_batch_keeps_order_and_equals_single_decisions(stub: pb_grpc.RiskPipelineStub) -> None:
    tx = generate_transactions(12, seed=77)
    requests = []
    for i in range(len(tx)):
        row = tx.row(i)
        requests.append(
            pb.DecideRequest(
                request_id=f"tx-{i}",
                numeric={k: v for k, v in row.items() if isinstance(v, float)},
                categorical={
                    "merchant_category": str(row["merchant_category"]),
                    "channel": str(row["channel"]),
                },
                text=str(row["text"]),
            )
        )
    batch = stub.DecideBatch(pb.DecideBatchRequest(requests=requests), metadata=_md("card_fraud"), timeout=60)
    assert [r.request_id for r in batch.responses] == [f"tx-{i}" for i in range(len(tx))]
    for request, in_batch in zip(requests, batch.responses, strict=True):
        alone = stub.Decide(request, metadata=_md("card_fraud"), timeout=30)
        assert alone.decision == in_batch.decision
        np.testing.assert_allclose(
            [m.score for m in alone.models], [m.score for m in in_batch.models], rtol=0, atol=1e-6
        )
        assert [m.label for m in alone.models] == [m.label for m in in_batch.models]


def test_two_pipelines_side_by_side_are_routed_by_application(stub: pb_grpc.RiskPipelineStub) -> None:
    card = stub.Decide(_request(LEGIT), metadata=_md("card_fraud"), timeout=30)
    tabular = stub.Decide(_request(LEGIT | {"text": ""}), metadata=_md("tabular_only"), timeout=30)
    assert (card.pipeline, tabular.pipeline) == ("card_fraud", "tabular_only")
    assert [m.model for m in card.models] == ["intent", "credit", "fraud"]
    assert [m.model for m in tabular.models] == ["credit", "fraud"]
    assert card.models[1].score == pytest.approx(tabular.models[0].score, abs=1e-9)
    with pytest.raises(grpc.RpcError) as info:
        stub.Decide(_request(LEGIT), metadata=_md("no_such_pipeline"), timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        stub.Decide(_request(LEGIT | {"text": "hello"}), metadata=_md("tabular_only"), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "text: this pipeline reads no text"


def test_describe_lists_features_and_serving_versions(
    stub: pb_grpc.RiskPipelineStub, demo_models: Path, pipelines: dict[str, PipelineSpec]
) -> None:
    described = stub.Describe(pb.DescribeRequest(), metadata=_md("card_fraud"), timeout=30)
    assert (described.pipeline, described.version) == ("card_fraud", "2026.12.0")
    features = {f.name: f for f in described.features}
    assert set(features) == set(pipelines["card_fraud"].features.fields)
    assert features["amount"].kind == "numeric"
    assert features["amount"].required
    assert features["amount"].min == pytest.approx(0.01)
    assert features["channel"].categories == ["pos", "online", "atm", "phone"]
    assert features["text"].kind == "text"
    assert not features["country_mismatch"].required
    models = {m.name: m for m in described.models}
    assert models["credit"].version == open_artifact(demo_models / "credit", kind="treelite").version
    assert (models["intent"].kind, models["intent"].pool, models["intent"].replicas) == ("vllm", "llm", 1)


def test_feedback_needs_a_feedback_section_and_a_recorded_decision(stub: pb_grpc.RiskPipelineStub) -> None:
    request = pb.FeedbackRequest(request_id="never-decided", label=1, feedback_id="f")
    with pytest.raises(grpc.RpcError) as info:
        stub.Feedback(request, metadata=_md("tabular_only"))  # its YAML keeps no feedback
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "no 'feedback' section" in (info.value.details() or "")
    with pytest.raises(grpc.RpcError) as info:
        stub.Feedback(request, metadata=_md("card_fraud"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "never-decided" in (info.value.details() or "")


def test_reflection_lists_the_service_for_generic_clients(serve_cluster: ServeCluster) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with serve_cluster.channel() as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = list(stub.ServerReflectionInfo(iter([request]), timeout=30))
    names = {s.name for s in answer.list_services_response.service}
    assert "riskserve.v1.RiskPipeline" in names
