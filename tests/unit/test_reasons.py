"""Reason codes against independent references: each model's own margin, the feature spec's columns, and a
transaction made extreme on purpose. Real compiled trees, real logistic regression, the real decision flow
(in process, no Ray: the models placed in the ingress run there as function calls anyway)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xgboost

from riskserve.demo.tabular import TabularData, make_tabular_data, train_fraud_lr, train_xgboost
from riskserve.features.spec import FeatureSpec
from riskserve.platform.errors import ConfigError
from riskserve.platform.runner import ModelRunner
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline
from riskserve.serving.flow import DecisionFlow
from riskserve.serving.messages import raw_request
from riskserve.serving.reasons import FEW_ROWS, ReasonExplainer, field_map
from tests.flow_helpers import flow_of, serve_runners, tabular_document

TYPICAL = {
    "numeric": {"amount": 40.0, "account_age_days": 900.0, "txn_velocity_1h": 1.0, "hour": 14.0},
    "categorical": {"merchant_category": "grocery", "channel": "pos"},
}
"""A card-present grocery purchase on an old account: APPROVE."""
EXTREME = {"txn_velocity_1h": 12.0, "country_mismatch": 1.0, "device_change": 1.0}
"""The fields made extreme in the crafted transaction (every other field stays typical)."""


@dataclass
class Pipeline:
    spec: PipelineSpec
    data: TabularData
    runners: dict[str, ModelRunner]
    flow: DecisionFlow
    explainer: ReasonExplainer
    credit_file: Path


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Pipeline:
    """tabular_only on small demo models (40 trees, so the compile is quick), and its decision flow."""
    models = tmp_path_factory.mktemp("models")
    data = make_tabular_data(5, train_rows=6000, test_rows=2000)
    train_xgboost(data, models / "credit", seed=5, rounds=40, progress=False)
    train_fraud_lr(data, models / "fraud", seed=5)
    document = tabular_document(models, top=3)
    spec = parse_pipeline(document)
    runners = asyncio.run(serve_runners(spec))
    flow = flow_of(document, runners)
    assert flow.explainer is not None
    return Pipeline(spec, data, runners, flow, flow.explainer, models / "credit" / "model.json")


def _decide(pipeline: Pipeline, *requests: pb.DecideRequest) -> list[pb.DecideResponse]:
    return asyncio.run(pipeline.flow.decide(list(requests), "trace", time.monotonic() + 30, False))


def test_lr_contributions_plus_intercept_equal_sklearn_decision_function(pipeline: Pipeline) -> None:
    runner = pipeline.runners["fraud"]
    x = pipeline.data.x_test
    contributions = runner.contributions(x)
    from riskserve.wrappers.sklearn_model import load_sklearn_artifact

    _, snapshot = load_sklearn_artifact(runner.artifact or "")
    margin = snapshot.make_classifier().decision_function(snapshot.make_scaler().transform(x))
    assert contributions.values.shape == (len(x), x.shape[1])
    np.testing.assert_allclose(
        contributions.values.sum(axis=1) + contributions.bias, margin, rtol=0, atol=1e-9
    )


def test_tree_contributions_plus_bias_equal_xgboost_margin(pipeline: Pipeline) -> None:
    reference = xgboost.Booster(model_file=str(pipeline.credit_file))  # an independent reading of the model
    x = pipeline.data.x_test
    contributions = pipeline.runners["credit"].contributions(x)
    margin = reference.predict(xgboost.DMatrix(x), output_margin=True)
    assert contributions.values.shape == (len(x), x.shape[1])
    np.testing.assert_allclose(
        contributions.values.sum(axis=1) + contributions.bias, margin, rtol=0, atol=1e-4
    )
    served = np.array(pipeline.runners["credit"].predict_matrix_now(x).scores)  # the compiled library
    np.testing.assert_allclose(1 / (1 + np.exp(-margin.astype(np.float64))), served, rtol=0, atol=1e-5)


def test_one_hot_and_transformed_columns_map_exactly_to_their_field() -> None:
    spec = FeatureSpec.model_validate(
        {
            "fields": {
                "amount": {"kind": "numeric", "min": 0},
                "shop": {"kind": "categorical", "vocabulary": ["a", "b"]},
                "city": {"kind": "categorical", "vocabulary": ["x"]},
                "mcc": {"kind": "categorical", "vocabulary": ["1", "2"]},
            },
            "columns": [
                {"name": "amount_log", "field": "amount", "transforms": [{"op": "log1p"}]},
                {"name": "shop", "field": "shop", "encoding": "one_hot"},
                {
                    "name": "amount_clip",
                    "field": "amount",
                    "transforms": [{"op": "clip", "min": 0, "max": 9}],
                },
                {"name": "city", "field": "city", "encoding": "hash", "buckets": 3},
                {"name": "mcc", "field": "mcc", "encoding": "ordinal"},
            ],
        }
    )
    assert spec.column_fields() == {
        "amount_log": "amount",
        "shop=a": "shop",
        "shop=b": "shop",
        "shop=<unknown>": "shop",
        "amount_clip": "amount",
        "city#0": "city",
        "city#1": "city",
        "city#2": "city",
        "mcc": "mcc",
    }
    fields = ["amount", "shop", "city", "mcc"]
    mapping = field_map(spec.column_names(), spec.column_fields(), fields)
    values = np.arange(1.0, 10.0)[None, :]  # column i contributes i + 1
    assert (values @ mapping).tolist() == [[1 + 5, 2 + 3 + 4, 6 + 7 + 8, 9]]
    with pytest.raises(ConfigError, match="'shop=c' is not produced"):
        field_map(["shop=c"], spec.column_fields(), fields)


def test_field_contributions_sum_the_models_columns_exactly(pipeline: Pipeline) -> None:
    x = pipeline.data.x_test[:200]
    for name in ("credit", "fraud"):
        per_column = pipeline.runners[name].contributions(x)
        per_field, version = pipeline.explainer.field_contributions(name, x)
        assert version == per_column.version
        np.testing.assert_allclose(per_field.sum(axis=1), per_column.values.sum(axis=1), rtol=0, atol=1e-9)
        merchant = [i for i, c in enumerate(per_column.columns) if c.startswith("merchant_category=")]
        assert len(merchant) == 9
        column = list(pipeline.spec.features.fields).index("merchant_category")
        np.testing.assert_allclose(
            per_field[:, column], per_column.values[:, merchant].sum(axis=1), atol=1e-9
        )


def test_a_crafted_transaction_is_declined_for_the_fields_made_extreme(pipeline: Pipeline) -> None:
    typical = pb.DecideRequest(request_id="typical", **TYPICAL)  # type: ignore[arg-type]
    crafted = pb.DecideRequest(request_id="crafted", **TYPICAL)  # type: ignore[arg-type]
    for name, value in EXTREME.items():
        crafted.numeric[name] = value
    before = pipeline.explainer.rows_explained
    approve, decline = _decide(pipeline, typical, crafted)
    assert (approve.decision, decline.decision) == (pb.APPROVE, pb.DECLINE)
    assert list(approve.top_reasons) == []
    assert pipeline.explainer.rows_explained == before + 1  # only the DECLINE was explained
    assert {r.field for r in decline.top_reasons} == set(EXTREME)
    texts = pipeline.spec.reasons.texts if pipeline.spec.reasons else {}
    for reason in decline.top_reasons:
        assert reason.text == texts[reason.field]
        assert reason.contribution > 0
        assert reason.model in ("credit", "fraud")
        assert float(reason.value) == EXTREME[reason.field]
    contributions = [r.contribution for r in decline.top_reasons]
    assert contributions == sorted(contributions, reverse=True)


def test_approvals_compute_no_reasons(pipeline: Pipeline) -> None:
    before = pipeline.explainer.rows_explained
    responses = _decide(pipeline, *(pb.DecideRequest(request_id=f"ok-{i}", **TYPICAL) for i in range(8)))  # type: ignore[arg-type]
    assert {r.decision for r in responses} == {pb.APPROVE}
    assert all(len(r.top_reasons) == 0 for r in responses)
    assert pipeline.explainer.rows_explained == before


@pytest.mark.parametrize(
    ("reasons", "message"),
    [
        ({"texts": {"amout": "typo"}}, "reasons.texts.amout: unknown field"),
        ({"for": ["DECLINE", "MAYBE"]}, "reasons.for[1]: Input should be 'APPROVE', 'REVIEW' or 'DECLINE'"),
        ({"models": ["credit", "nope"]}, "reasons.models[1]: unknown model 'nope'"),
        ({"labels": {"urgent": "x"}}, "reasons.labels: the pipeline has no text model"),
        ({"top": 0}, "reasons.top: Input should be greater than or equal to 1"),
        ({"topp": 3}, "reasons.topp: Extra inputs are not permitted"),
    ],
)
def test_a_reasons_section_naming_something_unknown_is_refused_with_its_path(
    reasons: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_pipeline(tabular_document(Path("/nonexistent"), **reasons))
    assert message in str(refused.value)


def test_a_model_that_fell_back_or_was_swapped_since_gives_no_reasons(pipeline: Pipeline) -> None:
    from riskserve.features.encoder import FeatureEncoder, RawRequest
    from riskserve.schema.rules import ModelResult

    encoder = FeatureEncoder(pipeline.spec.features)
    row = encoder.validate(
        RawRequest(numeric={**TYPICAL["numeric"], **EXTREME}, categorical=TYPICAL["categorical"])
    )  # type: ignore[arg-type]
    matrix = encoder.encode([row]).matrix
    versions = {name: runner.status().version or "" for name, runner in pipeline.runners.items()}

    def models_named(**results: ModelResult) -> set[str]:
        (reasons,) = pipeline.explainer.explain(matrix, [row], [results])
        return {r.model for r in reasons}

    served = {name: ModelResult(name, versions[name], 0.9) for name in ("credit", "fraud")}
    assert models_named(**served) <= {"credit", "fraud"}
    assert "fraud" in models_named(**served)
    fell_back = ModelResult("fraud", "", 0.5, fallback=True, fallback_reason="TIMEOUT")
    assert models_named(credit=served["credit"], fraud=fell_back) == {"credit"}
    swapped = ModelResult("fraud", "another-version", 0.9)
    assert models_named(credit=served["credit"], fraud=swapped) == {"credit"}


def test_a_declined_row_is_explained_on_the_event_loop_and_a_large_batch_in_a_thread(
    pipeline: Pipeline,
) -> None:
    assert pipeline.runners["credit"].contributions_us_per_row() < 1000.0  # the tables, not XGBoost
    assert pipeline.explainer.inline_for(1)
    assert not pipeline.explainer.inline_for(1000)


def test_a_large_batchs_reasons_computed_in_a_thread_reach_the_rows_they_explain(
    pipeline: Pipeline,
) -> None:
    crafted = pb.DecideRequest(**TYPICAL)  # type: ignore[arg-type]
    for name, value in EXTREME.items():
        crafted.numeric[name] = value
    alone = _decide(pipeline, crafted)[0]  # one row: explained on the event loop
    assert alone.decision == pb.DECLINE
    # A batch too large to explain on the loop: every third row declined, the others approved.
    requests = []
    for i in range(600):
        request = pb.DecideRequest()
        request.CopyFrom(crafted if i % 3 == 0 else pb.DecideRequest(**TYPICAL))  # type: ignore[arg-type]
        request.request_id = f"row-{i}"
        requests.append(request)
    assert not pipeline.explainer.inline_for(200)
    into = pb.DecideBatchResponse()
    before = pipeline.explainer.rows_explained
    responses = asyncio.run(pipeline.flow.decide(requests, "trace", time.monotonic() + 30, False, into))
    assert pipeline.explainer.rows_explained == before + 200
    assert list(into.responses) == responses  # added to the batch's own messages, not to copies
    for i, response in enumerate(into.responses):
        assert response.request_id == f"row-{i}"
        if i % 3 == 0:
            assert response.decision == pb.DECLINE
            assert list(response.top_reasons) == list(alone.top_reasons)
        else:
            assert response.decision == pb.APPROVE
            assert list(response.top_reasons) == []


def test_a_batchs_reasons_are_each_rows_strongest_usable_fields(pipeline: Pipeline) -> None:
    """The whole-batch ranking against a row-by-row reference: per field the largest contribution of a
    model that scored the row with the version that computed it, above the minimum, strongest first."""
    from riskserve.demo.dataset import generate_transactions
    from riskserve.schema.rules import ModelResult

    data = generate_transactions(120, seed=11)
    requests = []
    for i in range(120):
        row = data.row(i)
        request = pb.DecideRequest(
            numeric={k: float(row[k]) for k in TYPICAL["numeric"]},
            categorical={k: str(row[k]) for k in TYPICAL["categorical"]},
        )
        request.numeric["txn_velocity_1h"] = float(i % 15)  # many rows declined or sent to review
        requests.append(request)
    decided = _decide(pipeline, *requests)  # scores each row (and its version) as served
    explainer = pipeline.explainer
    stage = pipeline.flow._local_stage.encode(  # type: ignore[union-attr]
        [raw_request(r) for r in requests], None, share=False
    )
    results = []
    for i, response in enumerate(decided):
        scored = {m.model: ModelResult(m.model, m.version, m.score) for m in response.models}
        if i % 4 == 1:  # fell back: its contributions must not count
            scored["fraud"] = ModelResult("fraud", scored["fraud"].version, 0.5, fallback=True)
        if i % 4 == 2:  # scored by a version swapped out since
            scored["credit"] = ModelResult("credit", "retired", scored["credit"].score)
        results.append(scored)
    explained = explainer.explain(stage.matrix, stage.rows, results)
    # One row at a time takes the plain-Python ranking (FEW_ROWS), the batch the numpy one: the same reasons.
    assert len(requests) > FEW_ROWS
    alone = [
        explainer.explain(stage.matrix[i : i + 1], [stage.rows[i]], [results[i]])
        for i in range(len(requests))
    ]
    # (The contributions of a row alone may differ from the batch's in the last bit: the sums run in
    # another order.)
    assert [[(r.field, r.model, r.value) for r in reasons] for [reasons] in alone] == [
        [(r.field, r.model, r.value) for r in reasons] for reasons in explained
    ]
    np.testing.assert_allclose(
        [r.contribution for [reasons] in alone for r in reasons],
        [r.contribution for reasons in explained for r in reasons],
        rtol=1e-12,
    )

    per_model = {name: explainer.field_contributions(name, stage.matrix) for name in ("credit", "fraud")}
    settings = explainer.settings
    fields = [f for f in pipeline.spec.features.fields if f != pipeline.spec.features.text_field]
    assert any(len(reasons) == settings.top for reasons in explained)
    for i, reasons in enumerate(explained):
        best: dict[str, tuple[float, str]] = {}
        for name, (values, version) in per_model.items():
            result = results[i][name]
            if result.fallback or result.version != version:
                continue
            for j, field in enumerate(fields):
                value = float(values[i, j])
                if value > settings.min_contribution and value > best.get(field, (-np.inf, ""))[0]:
                    best[field] = (value, name)
        expected = sorted(best.items(), key=lambda item: -item[1][0])[: settings.top]
        assert [(r.field, r.contribution, r.model) for r in reasons] == [
            (field, value, name) for field, (value, name) in expected
        ]
