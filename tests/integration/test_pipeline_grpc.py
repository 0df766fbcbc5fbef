"""End to end over real gRPC on loopback: each pipeline's own front door, the feature stage, the real models.

Two pipelines run side by side (card_fraud with the vLLM intent model, tabular_only), each on a port of its
own and named by the ``application`` metadata, exactly as a client would use them. With the defaults the
feature stage and the tabular models run inside the ingress and the LLM in a deployment of its own; a third
pipeline places every stage in a deployment to show the models reading one shared buffer.
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
from riskserve.platform.artifacts import open_artifact
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline
from riskserve.wrappers.sklearn_model import SklearnModel, SklearnSettings

from .conftest import ServeCluster, channel, deploy, endpoint, pipeline_on, serving_pid

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
def pipelines(
    serve_cluster: ServeCluster, demo_models: Path, tabular_only: PipelineSpec
) -> dict[str, PipelineSpec]:
    card_fraud = pipeline_on("card_fraud.yaml", demo_models)
    deploy(card_fraud)
    return {"card_fraud": card_fraud, "tabular_only": tabular_only}  # tabular_only: the session's


@pytest.fixture(scope="module")
def stubs(pipelines: dict[str, PipelineSpec]) -> Iterator[dict[str, pb_grpc.RiskPipelineStub]]:
    """A stub per pipeline, each on the pipeline's own port."""
    channels = {name: channel(spec) for name, spec in pipelines.items()}
    yield {name: _stub(chan) for name, chan in channels.items()}
    for chan in channels.values():
        chan.close()


@pytest.fixture(scope="module")
def apart(serve_cluster: ServeCluster, demo_models: Path) -> PipelineSpec:
    """tabular_only with the feature stage and both models each in a deployment of its own."""
    data = pipeline_on("tabular_only.yaml", demo_models, name="tabular_apart").resolved()
    data["serving"]["feature_stage"] = "deployment"
    for model in data["models"].values():
        model["placement"] = "deployment"
    spec = parse_pipeline(data, source="tabular_apart")
    deploy(spec)
    return spec


def _stub(chan: grpc.Channel) -> pb_grpc.RiskPipelineStub:
    return pb_grpc.RiskPipelineStub(chan)  # type: ignore[no-untyped-call]


def _md(app: str) -> list[tuple[str, str]]:
    return [("application", app)]


def _ingress(app: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle("ingress", app_name=app)


def _model(app: str, name: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle(f"model-{name}", app_name=app)


def _status(app: str, model: str) -> Any:
    """The model's ``ModelStatus``, asked through the ingress wherever the model runs."""
    return _ingress(app).model_status.remote(model).result()


def test_a_decision_carries_every_model_with_its_artifact_version(
    stubs: dict[str, pb_grpc.RiskPipelineStub], demo_models: Path
) -> None:
    response = stubs["card_fraud"].Decide(_request(LEGIT, "legit-1"), metadata=_md("card_fraud"), timeout=30)
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


def test_the_tabular_models_run_in_the_ingress_and_the_llm_in_a_deployment_of_its_own(
    pipelines: dict[str, PipelineSpec], demo_models: Path
) -> None:
    from ray import serve

    from riskserve.schema.deployments import deployment_names

    applications = serve.status().applications
    assert set(applications["card_fraud"].deployments) == {"ingress", "model-intent", "feedback"}
    assert set(applications["tabular_only"].deployments) == {"ingress"}
    for name, spec in pipelines.items():
        assert set(applications[name].deployments) == set(deployment_names(spec).values())
    ingress_pid = serving_pid(pipelines["card_fraud"])
    for name, kind in (("credit", "treelite"), ("fraud", "sklearn")):
        status = _status("card_fraud", name)
        assert (status.name, status.kind, status.placement) == (name, kind, "ingress")
        assert status.pid == ingress_pid, f"model '{name}' runs in the process serving the gRPC port"
        assert status.ready
        assert status.version == open_artifact(demo_models / name, kind=kind).version
    intent = _status("card_fraud", "intent")
    assert (intent.kind, intent.placement) == ("vllm", "deployment")
    assert intent.pid != ingress_pid
    assert intent == _model("card_fraud", "intent").metadata.remote().result()  # the same typed status
    for name in ("credit", "fraud"):
        assert _status("tabular_only", name).pid == serving_pid(pipelines["tabular_only"]) != ingress_pid


def test_scores_equal_the_models_run_locally_and_the_rules_are_applied(
    stubs: dict[str, pb_grpc.RiskPipelineStub], pipelines: dict[str, PipelineSpec], demo_models: Path
) -> None:
    spec = pipelines["card_fraud"]
    response = stubs["card_fraud"].Decide(_request(RISKY), metadata=_md("card_fraud"), timeout=30)
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
    # Reason codes over the wire: the intent's label first (its YAML text), then the fields that raised
    # the tabular models' log-odds most, each once, strongest first; an APPROVE carries none.
    reasons = list(response.top_reasons)
    assert reasons, "a DECLINE of card_fraud carries reason codes"
    assert len(reasons) <= 4
    assert (reasons[0].field, reasons[0].model, reasons[0].value) == ("text", "intent", "urgent")
    assert spec.reasons is not None
    assert reasons[0].text == spec.reasons.labels["urgent"]
    tabular = reasons[1:]
    assert len({r.field for r in tabular}) == len(tabular)
    assert all(r.contribution > 0 and r.model in ("credit", "fraud") for r in tabular)
    assert [r.contribution for r in tabular] == sorted((r.contribution for r in tabular), reverse=True)
    legit = stubs["card_fraud"].Decide(_request(LEGIT), metadata=_md("card_fraud"), timeout=30)
    assert legit.decision == pb.APPROVE
    assert list(legit.top_reasons) == []


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
    stubs: dict[str, pb_grpc.RiskPipelineStub], change: dict[str, Any], field: str, message: str
) -> None:
    # calls counted where each model runs: intent in its deployment, credit and fraud in the ingress
    before = {n: _status("card_fraud", n).calls for n in ("intent", "credit", "fraud")}
    with pytest.raises(grpc.RpcError) as info:
        stubs["card_fraud"].Decide(_request({**LEGIT, **change}), metadata=_md("card_fraud"), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}: ")
    assert message in info.value.details()
    after = {n: _status("card_fraud", n).calls for n in ("intent", "credit", "fraud")}
    assert after == before
    stubs["card_fraud"].Decide(_request(LEGIT), metadata=_md("card_fraud"), timeout=30)
    counted = {n: _status("card_fraud", n).calls for n in ("intent", "credit", "fraud")}
    assert counted == {n: calls + 1 for n, calls in before.items()}  # a valid decision is counted


def _five_and_a_batch_of_seven(stub: pb_grpc.RiskPipelineStub, app: str) -> None:
    for i in range(5):
        stub.Decide(_request(LEGIT | {"text": ""}, f"once-{i}"), metadata=_md(app), timeout=30)
    batch = pb.DecideBatchRequest(requests=[_request(LEGIT | {"text": ""}, f"b{i}") for i in range(7)])
    stub.DecideBatch(batch, metadata=_md(app), timeout=30)


def test_the_feature_stage_runs_once_per_decision_in_the_ingress(
    stubs: dict[str, pb_grpc.RiskPipelineStub],
) -> None:
    ingress = _ingress("tabular_only")
    before = ingress.feature_stats.remote().result()
    calls = {n: _status("tabular_only", n).calls for n in ("credit", "fraud")}
    _five_and_a_batch_of_seven(stubs["tabular_only"], "tabular_only")
    stats = ingress.feature_stats.remote().result()
    assert stats["calls"] - before["calls"] == 6  # five decisions and one batch of seven: six matrices
    assert stats["rows"] - before["rows"] == 12
    for name in ("credit", "fraud"):  # each model called once per matrix, in the ingress
        assert _status("tabular_only", name).calls - calls[name] == 6


def test_models_in_their_own_deployments_read_the_feature_stages_shared_buffer(apart: PipelineSpec) -> None:
    from ray import serve

    assert set(serve.status().applications["tabular_apart"].deployments) == {
        "ingress",
        "features",
        "model-credit",
        "model-fraud",
    }
    ingress = _ingress("tabular_apart")
    before = ingress.feature_stats.remote().result()["calls"]
    calls = {n: _status("tabular_apart", n).calls for n in ("credit", "fraud")}
    with channel(apart) as chan:
        _five_and_a_batch_of_seven(_stub(chan), "tabular_apart")
    stats = ingress.feature_stats.remote().result()
    assert stats["calls"] - before == 6  # five decisions and one batch of seven: six matrices
    for name in ("credit", "fraud"):  # counted in each model deployment's replica
        status = _status("tabular_apart", name)
        assert status.placement == "deployment"
        assert status.calls - calls[name] == 6

    infos = [
        _model("tabular_apart", n).input_info.remote(stats["last_batch_id"]).result()
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
    pids = {_model("tabular_apart", n).metadata.remote().result().pid for n in ("credit", "fraud")}
    assert len(pids) == 2, "the two models are separate processes sharing one buffer"
    assert serving_pid(apart) not in pids


def test_decide_batch_keeps_order_and_equals_single_decisions(
    stubs: dict[str, pb_grpc.RiskPipelineStub],
) -> None:
    stub = stubs["card_fraud"]
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


def test_two_pipelines_side_by_side_each_on_its_own_port_named_by_application(
    stubs: dict[str, pb_grpc.RiskPipelineStub], pipelines: dict[str, PipelineSpec]
) -> None:
    assert endpoint(pipelines["card_fraud"]) != endpoint(pipelines["tabular_only"])
    card = stubs["card_fraud"].Decide(_request(LEGIT), metadata=_md("card_fraud"), timeout=30)
    tabular = stubs["tabular_only"].Decide(
        _request(LEGIT | {"text": ""}), metadata=_md("tabular_only"), timeout=30
    )
    assert (card.pipeline, tabular.pipeline) == ("card_fraud", "tabular_only")
    assert [m.model for m in card.models] == ["intent", "credit", "fraud"]
    assert [m.model for m in tabular.models] == ["credit", "fraud"]
    assert card.models[1].score == pytest.approx(tabular.models[0].score, abs=1e-9)
    for port_of, named in (("card_fraud", "tabular_only"), ("tabular_only", "card_fraud")):
        with pytest.raises(grpc.RpcError) as info:  # never decided by the wrong pipeline
            stubs[port_of].Decide(_request(LEGIT | {"text": ""}), metadata=_md(named), timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert f"pipeline '{named}' is not served here" in (info.value.details() or "")
    for metadata in (_md("no_such_pipeline"), []):
        with pytest.raises(grpc.RpcError) as info:
            stubs["card_fraud"].Decide(_request(LEGIT), metadata=metadata, timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        stubs["tabular_only"].Decide(
            _request(LEGIT | {"text": "hello"}), metadata=_md("tabular_only"), timeout=30
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "text: this pipeline reads no text"


def test_describe_lists_features_and_serving_versions(
    stubs: dict[str, pb_grpc.RiskPipelineStub], demo_models: Path, pipelines: dict[str, PipelineSpec]
) -> None:
    described = stubs["card_fraud"].Describe(pb.DescribeRequest(), metadata=_md("card_fraud"), timeout=30)
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


def test_feedback_needs_a_feedback_section_and_a_recorded_decision(
    stubs: dict[str, pb_grpc.RiskPipelineStub],
) -> None:
    request = pb.FeedbackRequest(request_id="never-decided", label=1, feedback_id="f")
    with pytest.raises(grpc.RpcError) as info:
        stubs["tabular_only"].Feedback(request, metadata=_md("tabular_only"), timeout=30)  # no feedback
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "no 'feedback' section" in (info.value.details() or "")
    with pytest.raises(grpc.RpcError) as info:
        stubs["card_fraud"].Feedback(request, metadata=_md("card_fraud"), timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "never-decided" in (info.value.details() or "")


def test_reflection_lists_the_service_for_generic_clients(pipelines: dict[str, PipelineSpec]) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with channel(pipelines["card_fraud"]) as chan:
        stub = reflection_pb2_grpc.ServerReflectionStub(chan)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = list(stub.ServerReflectionInfo(iter([request]), timeout=30))
    names = {s.name for s in answer.list_services_response.service}
    assert {"riskserve.v1.RiskPipeline", "grpc.health.v1.Health"} <= names
