"""One trace per decision, wherever its stages run, read back from the file exporter.

By default the feature stage and the tabular models run inside the ingress, so the whole trace comes from
the process that serves the pipeline's gRPC port; with every stage placed in a deployment of its own, the
trace still is one, continued across four processes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from riskserve.client import RiskClient
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline

from .conftest import ServeCluster, deploy, endpoint, pipeline_on, serving_pid

pytestmark = pytest.mark.slow

REQUEST = {
    "numeric": {"amount": 23.5, "account_age_days": 2400.0, "txn_velocity_1h": 0.0, "hour": 12.0},
    "categorical": {"merchant_category": "grocery", "channel": "pos"},
}
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def _spans(path: Path, trace_id: str, expected: int) -> list[dict[str, object]]:
    deadline = time.monotonic() + 20
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        spans = [s for s in map(json.loads, lines) if s["trace_id"] == trace_id]
        if len(spans) >= expected or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def _every_stage_in_a_deployment(spec: PipelineSpec) -> PipelineSpec:
    data = spec.resolved()
    data["serving"]["feature_stage"] = "deployment"
    for model in data["models"].values():
        model["placement"] = "deployment"
    return parse_pipeline(data, source=spec.name)


@pytest.mark.parametrize("placement", ["ingress", "deployment"])
def test_a_decision_is_one_trace_continuing_the_callers_traceparent(
    serve_cluster: ServeCluster,
    demo_models: Path,
    tmp_path_factory: pytest.TempPathFactory,
    placement: str,
) -> None:
    spans_file = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    spec = pipeline_on(
        "tabular_only.yaml",
        demo_models,
        name=f"traced_{placement}",
        tracing={"exporter": "file", "file_path": str(spans_file)},
    )
    if placement == "deployment":
        spec = _every_stage_in_a_deployment(spec)
    else:  # the defaults: the feature stage and the tabular models run inside the ingress
        assert spec.serving.feature_stage == "ingress"
        assert all(model.in_ingress for model in spec.models.values())
    deploy(spec)
    with RiskClient(endpoint(spec), pipeline=spec.name) as client:
        traceparent = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
        response = client.decide(**REQUEST, metadata=[("traceparent", traceparent)])
    assert response.trace_id == CALLER_TRACE

    # decide, features, decision, and per model (credit, fraud): model (ingress) + model.predict (where
    # the model runs)
    spans = _spans(spans_file, CALLER_TRACE, expected=7)
    assert len(spans) == 7, sorted(str(s["name"]) for s in spans)
    by_name: dict[str, list[dict[str, object]]] = {}
    for span in spans:
        by_name.setdefault(str(span["name"]), []).append(span)
    (root,) = by_name["riskserve.decide"]
    assert root["parent_span_id"] == CALLER_SPAN
    assert root["attributes"]["pipeline"] == spec.name  # type: ignore[index]
    (features,) = by_name["riskserve.features"]
    (decision,) = by_name["riskserve.decision"]
    assert features["parent_span_id"] == root["span_id"]
    assert decision["parent_span_id"] == root["span_id"]
    assert decision["attributes"]["outcome"] == "APPROVE"  # type: ignore[index]
    models = {s["attributes"]["model.name"]: s for s in by_name["riskserve.model"]}  # type: ignore[index]
    assert set(models) == {"credit", "fraud"}
    versions = {m.model: m.version for m in response.models}
    for name, span in models.items():
        assert span["parent_span_id"] == root["span_id"]
        assert span["attributes"]["model.version"] == versions[name]  # type: ignore[index]
        assert span["attributes"]["model.fallback"] is False  # type: ignore[index]
    predicts = {s["parent_span_id"]: s for s in by_name["riskserve.model.predict"]}
    assert set(predicts) == {models["credit"]["span_id"], models["fraud"]["span_id"]}

    pid_of = {str(s["name"]): s["resource"]["process.pid"] for s in spans}  # type: ignore[index]
    ingress = serving_pid(spec)
    assert pid_of["riskserve.decide"] == pid_of["riskserve.decision"] == ingress
    pids = {s["resource"]["process.pid"] for s in spans}  # type: ignore[index]
    if placement == "ingress":
        assert pids == {ingress}, "the feature stage and both models ran in the ingress process"
    else:
        assert len(pids) == 4, "ingress, feature stage and two model replicas each exported their own spans"
        assert pid_of["riskserve.features"] != ingress
        assert {p["resource"]["process.pid"] for p in predicts.values()}.isdisjoint(  # type: ignore[index]
            {ingress, pid_of["riskserve.features"]}
        )
