"""``serving.feature_stage: ingress`` (the default): the same decisions as a feature-stage deployment, with
one Serve hop fewer; the tabular models read the matrix in the ingress process, and models placed in
deployments of their own still read one shared buffer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from riskserve.demo.dataset import generate_transactions
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline

from .conftest import ServeCluster, channel, deploy, pipeline_on, serving_pid

pytestmark = pytest.mark.slow

MODELS = ("credit", "fraud")
REQUEST = pb.DecideRequest(
    numeric={"amount": 30.0, "account_age_days": 800.0, "txn_velocity_1h": 1.0, "hour": 12.0},
    categorical={"merchant_category": "grocery", "channel": "pos"},
)


@pytest.fixture(scope="module")
def specs(
    serve_cluster: ServeCluster, demo_models: Path, tabular_only: PipelineSpec
) -> dict[str, PipelineSpec]:
    """``inline``: the defaults (the session's tabular_only); ``staged``: a feature-stage deployment."""
    staged = pipeline_on(
        "tabular_only.yaml", demo_models, name="tabular_staged", serving={"feature_stage": "deployment"}
    )
    deploy(staged)
    return {"inline": tabular_only, "staged": staged}


@pytest.fixture(scope="module")
def shared_spec(serve_cluster: ServeCluster, demo_models: Path) -> PipelineSpec:
    """Feature stage in the ingress, both models in deployments of their own, every matrix shared."""
    data = pipeline_on("tabular_only.yaml", demo_models, name="tabular_inline_shared").resolved()
    data["serving"]["by_value_rows"] = 0
    for name in MODELS:
        data["models"][name]["placement"] = "deployment"
    spec = parse_pipeline(data, source="tabular_inline_shared")
    deploy(spec)
    return spec


@pytest.fixture(scope="module")
def stubs() -> Iterator[Callable[[PipelineSpec], pb_grpc.RiskPipelineStub]]:
    """A stub on a pipeline's own port (one channel per pipeline, closed with the module)."""
    channels: dict[str, grpc.Channel] = {}

    def stub(spec: PipelineSpec) -> pb_grpc.RiskPipelineStub:
        if spec.name not in channels:
            channels[spec.name] = channel(spec)
        return pb_grpc.RiskPipelineStub(channels[spec.name])  # type: ignore[no-untyped-call]

    yield stub
    for chan in channels.values():
        chan.close()


def _md(spec: PipelineSpec) -> tuple[tuple[str, str], ...]:
    return (("application", spec.name),)


def _handle(app: str, deployment: str = "ingress") -> Any:
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=app)


def test_no_feature_deployment_by_default_and_the_same_decisions(
    specs: dict[str, PipelineSpec], stubs: Callable[[PipelineSpec], pb_grpc.RiskPipelineStub]
) -> None:
    from ray import serve

    from riskserve.schema.deployments import deployment_names

    inline, staged = specs["inline"], specs["staged"]
    assert inline.serving.feature_stage == "ingress"
    applications = serve.status().applications
    assert set(applications[inline.name].deployments) == {"ingress"}
    assert set(applications[staged.name].deployments) == {"ingress", "features"}
    for spec in (inline, staged):
        assert set(applications[spec.name].deployments) == set(deployment_names(spec).values())
    inline_stub, staged_stub = stubs(inline), stubs(staged)
    tx = generate_transactions(20, seed=31)
    for i in range(len(tx)):
        row = tx.row(i)
        request = pb.DecideRequest(
            request_id=f"tx-{i}",
            numeric={k: float(v) for k, v in row.items() if isinstance(v, float)},
            categorical={k: str(row[k]) for k in ("merchant_category", "channel")},
        )
        in_ingress = inline_stub.Decide(request, metadata=_md(inline), timeout=30)
        in_stage = staged_stub.Decide(request, metadata=_md(staged), timeout=30)
        assert (in_ingress.decision, in_ingress.risk_score, list(in_ingress.reasons)) == (
            in_stage.decision,
            in_stage.risk_score,
            list(in_stage.reasons),
        )
    staged_stats = _handle("tabular_staged").feature_stats.remote().result()
    assert staged_stats["calls"] >= len(tx)  # the staged pipeline did encode in its stage deployment
    assert staged_stats["last_batch_id"]


def test_encoded_once_per_call_and_the_models_score_it_in_the_ingress_process(
    specs: dict[str, PipelineSpec], stubs: Callable[[PipelineSpec], pb_grpc.RiskPipelineStub]
) -> None:
    spec = specs["inline"]
    ingress = _handle(spec.name)
    before = ingress.feature_stats.remote().result()
    calls_before = {name: ingress.model_status.remote(name).result().calls for name in MODELS}
    stub = stubs(spec)
    for _ in range(3):
        stub.Decide(REQUEST, metadata=_md(spec), timeout=30)
    stub.DecideBatch(pb.DecideBatchRequest(requests=[REQUEST] * 5), metadata=_md(spec), timeout=30)
    stats = ingress.feature_stats.remote().result()
    assert stats["calls"] - before["calls"] == 4  # three decisions and one batch of five: four matrices
    assert stats["rows"] - before["rows"] == 8
    pid = serving_pid(spec)
    for name in MODELS:
        status = ingress.model_status.remote(name).result()
        assert status.placement == "ingress"
        assert status.pid == pid, f"model '{name}' runs in the process that serves the gRPC port"
        assert status.calls - calls_before[name] == 4  # one call per matrix, each on the ingress's matrix


def test_models_in_their_own_deployments_read_one_buffer_the_ingress_shared(
    shared_spec: PipelineSpec, stubs: Callable[[PipelineSpec], pb_grpc.RiskPipelineStub]
) -> None:
    from ray import serve

    app = shared_spec.name
    ingress = _handle(app)
    assert set(serve.status().applications[app].deployments) == {"ingress", "model-credit", "model-fraud"}
    before = ingress.feature_stats.remote().result()["calls"]
    calls_before = {name: ingress.model_status.remote(name).result().calls for name in MODELS}
    stub = stubs(shared_spec)
    for _ in range(3):
        stub.Decide(REQUEST, metadata=_md(shared_spec), timeout=30)
    batch = stub.DecideBatch(
        pb.DecideBatchRequest(requests=[REQUEST] * 5), metadata=_md(shared_spec), timeout=30
    )
    assert [m.fallback for r in batch.responses for m in r.models] == [False] * 10
    stats = ingress.feature_stats.remote().result()
    assert stats["calls"] - before == 4
    statuses = {name: ingress.model_status.remote(name).result() for name in MODELS}
    pid = serving_pid(shared_spec)
    for name, status in statuses.items():
        assert status.placement == "deployment"
        assert status.calls - calls_before[name] == 4  # counted in the model deployment's replica
    assert len({pid, *(status.pid for status in statuses.values())}) == 3, "three separate processes"

    assert stats["last_batch_id"], "the ingress names the last matrix it shared"
    infos = [
        _handle(app, f"model-{name}").input_info.remote(stats["last_batch_id"]).result() for name in MODELS
    ]
    assert all(info is not None and "plasma" in info.mapping and info.read_only for info in infos)
    assert not any(info.owns_data for info in infos)
    credit, fraud = infos
    where = (credit.mapping, credit.inode, credit.file_offset)
    assert where == (fraud.mapping, fraud.inode, fraud.file_offset)


def test_bad_input_is_refused_in_the_ingress_naming_the_field(
    specs: dict[str, PipelineSpec], stubs: Callable[[PipelineSpec], pb_grpc.RiskPipelineStub]
) -> None:
    spec = specs["inline"]
    ingress = _handle(spec.name)
    calls_before = {name: ingress.model_status.remote(name).result().calls for name in MODELS}
    request = pb.DecideRequest(
        numeric={"amount": -5.0, "account_age_days": 800.0, "txn_velocity_1h": 1.0, "hour": 12.0},
        categorical={"merchant_category": "grocery", "channel": "pos"},
    )
    with pytest.raises(grpc.RpcError) as info:
        stubs(spec).Decide(request, metadata=_md(spec), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (info.value.details() or "").startswith("amount:")
    assert {name: ingress.model_status.remote(name).result().calls for name in MODELS} == calls_before
