"""Pipeline YAML validation, the feature encoder and CEL decision rules."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from riskserve.demo.dataset import FEATURE_NAMES, generate_transactions, tabular_features
from riskserve.features.encoder import FeatureEncoder, RawRequest
from riskserve.features.stage import FeatureStage
from riskserve.platform.errors import ConfigError, InvalidInput
from riskserve.schema.pipeline import load_pipeline, parse_pipeline
from riskserve.schema.rules import ModelResult

PIPELINES = Path(__file__).resolve().parents[2] / "deploy" / "pipelines"


@pytest.fixture(scope="module")
def card_fraud_yaml() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((PIPELINES / "card_fraud.yaml").read_text())
    return data


def _request(row: dict[str, float | str]) -> RawRequest:
    return RawRequest(
        numeric={k: v for k, v in row.items() if isinstance(v, float)},
        categorical={k: v for k, v in row.items() if isinstance(v, str) and k != "text"},
        text=str(row["text"]),
    )


@pytest.mark.parametrize("name", ["card_fraud.yaml", "tabular_only.yaml"])
def test_shipped_pipelines_validate(name: str) -> None:
    spec = load_pipeline(PIPELINES / name)
    assert spec.features.column_names() == list(FEATURE_NAMES)
    assert all(spec.artifact_path(m).is_absolute() for m in spec.models)


def test_the_feature_stage_reproduces_the_training_features_bit_for_bit() -> None:
    spec = load_pipeline(PIPELINES / "card_fraud.yaml")
    encoder = FeatureEncoder(spec.features)
    tx = generate_transactions(500, seed=11)
    rows = [encoder.validate(_request(tx.row(i))) for i in range(len(tx))]
    batch = encoder.encode(rows)
    assert batch.matrix.dtype == np.float32
    assert batch.matrix.flags.c_contiguous
    assert batch.columns == list(FEATURE_NAMES)
    np.testing.assert_array_equal(batch.matrix, tabular_features(tx))
    assert batch.texts == tx.text


def _errors(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_pipeline(data, base_dir=PIPELINES)
    return str(info.value)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda d: d["models"]["fraud"].update(timeout_ms=0),
            "models.fraud.timeout_ms: Input should be greater than 0",
        ),
        (
            lambda d: d["models"]["fraud"].update(timout_ms=5),
            "models.fraud.timout_ms: Extra inputs are not permitted",
        ),
        (lambda d: d["models"]["credit"].update(pool="gpu9"), "models.credit.pool: unknown pool 'gpu9'"),
        (
            lambda d: d["models"]["credit"].update(kind="onnx"),
            "models.credit.kind: Value error, unknown model kind",
        ),
        (lambda d: d["models"]["fraud"].update(columns=["nope"]), "models.fraud.columns: not produced"),
        (lambda d: d["models"]["fraud"]["fallback"].clear(), "models.fraud.fallback: Value error"),
        (
            lambda d: d["decision"]["rules"][0].update(when="risk_score >"),
            "decision.rules[0].when: Failed to parse",
        ),
        (lambda d: d["decision"]["rules"][1].update(when="risk_score > 1"), None),
        (
            lambda d: d["decision"]["rules"][1].update(when="risk_sore > 0.5"),
            "decision.rules[1].when: Undefined",
        ),
        (
            lambda d: d["decision"]["rules"][1].update(when="risk_score * 2.0"),
            "decision.rules[1].when: gives float",
        ),
        (lambda d: d["decision"].update(risk_score="0.5 * 2"), "decision.risk_score: Unsupported operation"),
        (lambda d: d["features"]["fields"]["amount"].update(min=-5), "log1p needs the field's min > -1"),
        (lambda d: d["features"]["columns"].append({"name": "hour", "field": "hour"}), "column names repeat"),
        (
            lambda d: d["models"]["intent"]["settings"].update(max_num_seqz=3),
            "models.intent.settings.max_num_seqz",
        ),
        # feedback joins labels to the audit trail's records: no trail, no feedback
        (lambda d: d.pop("audit"), "audit: a pipeline with 'feedback' needs an enabled audit trail"),
        (
            lambda d: d["audit"].update(enabled=False),
            "audit: a pipeline with 'feedback' needs an enabled audit trail",
        ),
        (
            lambda d: d["audit"].update(retention_days=1),
            "audit.retention_days: 1 days is shorter than feedback.retention_hours (168 h)",
        ),
        (
            lambda d: d["feedback"].update(buffer_rows=10),
            "feedback.buffer_rows: Extra inputs are not permitted",
        ),
        # labels live in the state database (state.dsn): a YAML still naming a file is told so
        (
            lambda d: d["feedback"].update(log_path="../../var/feedback/card_fraud.sqlite"),
            "feedback.log_path: Extra inputs are not permitted",
        ),
    ],
)
def test_yaml_errors_name_their_path(
    card_fraud_yaml: dict[str, Any], edit: Any, expected: str | None
) -> None:
    data = copy.deepcopy(card_fraud_yaml)
    edit(data)
    if expected is None:
        parse_pipeline(data, base_dir=PIPELINES)  # CEL compares double with int: allowed
    else:
        assert expected in _errors(data)


def test_learned_versions_are_kept_beside_the_audit_trail_unless_the_yaml_names_a_directory(
    card_fraud_yaml: dict[str, Any], tmp_path: Path
) -> None:
    data = copy.deepcopy(card_fraud_yaml)
    data["audit"]["path"] = str(tmp_path / "audit" / "card_fraud")
    spec = parse_pipeline(data, base_dir=PIPELINES)
    assert spec.learned_dir("fraud") == tmp_path / "audit" / "card_fraud.learned" / "fraud"
    resolved = spec.resolved()  # what the feedback service is given: the directory, and no log file
    assert resolved["models"]["fraud"]["online"]["artifact_dir"] == str(spec.learned_dir("fraud"))
    assert "log_path" not in resolved["feedback"]
    data["models"]["fraud"]["online"]["artifact_dir"] = "learned/fraud"  # relative to the YAML
    assert parse_pipeline(data, base_dir=PIPELINES).learned_dir("fraud") == PIPELINES / "learned" / "fraud"


def test_all_errors_are_reported_at_once(card_fraud_yaml: dict[str, Any]) -> None:
    data = copy.deepcopy(card_fraud_yaml)
    data["models"]["fraud"]["timeout_ms"] = -1
    data["models"]["credit"]["replicas"] = 0
    message = _errors(data)
    assert "2 error(s)" in message
    assert "models.credit.replicas" in message
    assert "models.fraud.timeout_ms" in message


GOOD = {"amount": 120.0, "account_age_days": 400.0, "txn_velocity_1h": 1.0, "hour": 13.0}
GOOD_CAT = {"merchant_category": "grocery", "channel": "pos"}


BAD_REQUESTS = pytest.mark.parametrize(
    ("numeric", "categorical", "text", "field", "message"),
    [
        ({k: v for k, v in GOOD.items() if k != "amount"}, GOOD_CAT, "", "amount", "required"),
        ({**GOOD, "amount": float("nan")}, GOOD_CAT, "", "amount", "not a finite"),
        ({**GOOD, "amount": float("inf")}, GOOD_CAT, "", "amount", "not a finite"),
        ({**GOOD, "hour": 24.0}, GOOD_CAT, "", "hour", "above the maximum 23"),
        ({**GOOD, "amount": 0.0}, GOOD_CAT, "", "amount", "below the minimum"),
        (GOOD, {**GOOD_CAT, "channel": "carrier-pigeon"}, "", "channel", "not one of"),
        (GOOD, {"merchant_category": "grocery"}, "", "channel", "required"),
        ({**GOOD, "amout": 5.0}, GOOD_CAT, "", "amout", "unknown numeric field"),
        (GOOD, {**GOOD_CAT, "amount": "5"}, "", "amount", "is a numeric field"),
        (GOOD, GOOD_CAT, "x" * 501, "text", "at most 500"),
        ({**GOOD, "amount": True}, GOOD_CAT, "", "amount", "expected a number, got bool"),
    ],
)


@BAD_REQUESTS
def test_bad_requests_name_the_field(
    numeric: dict[str, float], categorical: dict[str, str], text: str, field: str, message: str
) -> None:
    encoder = FeatureEncoder(load_pipeline(PIPELINES / "card_fraud.yaml").features)
    with pytest.raises(InvalidInput, match=message) as info:
        encoder.validate(RawRequest(numeric=numeric, categorical=categorical, text=text))
    assert info.value.field == field


@BAD_REQUESTS
def test_a_bad_request_in_a_large_batch_is_named_by_its_index(
    numeric: dict[str, float],
    categorical: dict[str, str],
    text: str,
    field: str,
    message: str,
    card_fraud_yaml: dict[str, Any],
) -> None:
    """A large batch is validated column by column; one bad request sends it row by row, so the error is
    the one that request alone gets, under its index."""
    encoder = FeatureEncoder(load_pipeline(PIPELINES / "card_fraud.yaml").features)
    good = RawRequest(numeric=GOOD, categorical=GOOD_CAT)
    batch = [good] * 20 + [RawRequest(numeric=numeric, categorical=categorical, text=text)] + [good] * 19
    assert encoder.validate_columns(batch) is None
    with pytest.raises(InvalidInput, match=message) as info:
        FeatureStage(card_fraud_yaml["features"]).encode(batch, share=False)
    assert info.value.field == "requests[20]"


def test_a_batch_validated_by_columns_equals_one_validated_row_by_row() -> None:
    encoder = FeatureEncoder(load_pipeline(PIPELINES / "card_fraud.yaml").features)
    tx = generate_transactions(300, seed=5)
    batch = []
    for i in range(len(tx)):
        request = _request(tx.row(i))
        if i % 3 == 0:  # the optional fields left to their defaults
            numeric = {
                k: v for k, v in request.numeric.items() if k not in ("country_mismatch", "device_change")
            }
            request = RawRequest(numeric=numeric, categorical=request.categorical, text=request.text)
        batch.append(request)
    by_columns = encoder.validate_columns(batch)
    assert by_columns is not None
    assert by_columns == [encoder.validate(request) for request in batch]
    assert by_columns[0].numeric["country_mismatch"] == 0.0
    # An int is a number to validate() (made a float), not to the column check: the batch goes row by row.
    with_int = [*batch[:5], RawRequest(numeric={**GOOD, "amount": 120}, categorical=GOOD_CAT)]
    assert encoder.validate_columns(with_int) is None
    assert encoder.validate(with_int[-1]).numeric["amount"] == 120.0


def test_defaults_and_the_unknown_bucket() -> None:
    encoder = FeatureEncoder(load_pipeline(PIPELINES / "card_fraud.yaml").features)
    row = encoder.validate(RawRequest(numeric=GOOD, categorical={**GOOD_CAT, "merchant_category": "casino"}))
    assert row.numeric["country_mismatch"] == 0.0
    matrix = encoder.encode([row]).matrix
    assert matrix[0, FEATURE_NAMES.index("merchant_category=<unknown>")] == 1.0
    assert matrix[0, FEATURE_NAMES.index("merchant_category=grocery")] == 0.0


def test_hash_and_ordinal_encodings_are_stable(card_fraud_yaml: dict[str, Any]) -> None:
    data = copy.deepcopy(card_fraud_yaml)
    data["features"]["columns"] += [
        {"name": "mcc_hash", "field": "merchant_category", "encoding": "hash", "buckets": 8},
        {"name": "mcc_code", "field": "merchant_category", "encoding": "ordinal"},
    ]
    data["models"]["fraud"]["columns"] = list(FEATURE_NAMES)
    data["models"]["credit"]["columns"] = list(FEATURE_NAMES)
    encoder = FeatureEncoder(parse_pipeline(data, base_dir=PIPELINES).features)
    rows = [encoder.validate(RawRequest(numeric=GOOD, categorical={**GOOD_CAT, "merchant_category": v}))
            for v in ("travel", "travel", "casino")]  # fmt: skip
    matrix = encoder.encode(rows).matrix
    hashed = matrix[:, 20:28]
    assert hashed.sum(axis=1).tolist() == [1.0, 1.0, 1.0]
    np.testing.assert_array_equal(hashed[0], hashed[1])
    assert matrix[:, 28].tolist() == [4.0, 4.0, 8.0]


def _decide(
    spec_name: str, scores: dict[str, tuple[float, str, bool]], numeric: dict[str, float] | None = None
):  # type: ignore[no-untyped-def]
    spec = load_pipeline(PIPELINES / spec_name)
    encoder = FeatureEncoder(spec.features)
    row = encoder.validate(
        RawRequest(numeric={**GOOD, **(numeric or {})}, categorical=GOOD_CAT, text="hello")
    )
    results = {
        name: ModelResult(
            name=name, version="v", score=s, label=label, fallback=fb, fallback_reason="TIMEOUT" if fb else ""
        )
        for name, (s, label, fb) in scores.items()
    }
    return spec.decision_engine().decide(row, results)


def test_rules_combine_to_the_most_severe_outcome_with_every_reason() -> None:
    low = _decide(
        "card_fraud.yaml",
        {"fraud": (0.01, "", False), "credit": (0.02, "", False), "intent": (0.9, "purchase", False)},
    )
    assert low.outcome == "APPROVE"
    assert low.reasons == ["low risk"]
    assert low.risk_score == pytest.approx(0.45 * 0.01 + 0.35 * 0.02)
    high = _decide(
        "card_fraud.yaml",
        {"fraud": (0.9, "", False), "credit": (0.8, "", False), "intent": (0.95, "urgent", False)},
        numeric={"amount": 900.0},
    )
    assert high.outcome == "DECLINE"
    assert high.risk_score == pytest.approx(0.45 * 0.9 + 0.35 * 0.8 + 0.2 * 0.95)
    assert [r.split(":")[0] for r in high.reasons] == ["high_risk", "pressure_language"]


def test_a_fallback_that_asks_for_review_forces_it() -> None:
    decision = _decide(
        "card_fraud.yaml",
        {"fraud": (0.5, "", True), "credit": (0.01, "", False), "intent": (0.9, "purchase", False)},
    )
    assert decision.outcome == "REVIEW"
    assert "fraud: model unavailable (TIMEOUT), decided without it" in decision.reasons


def _llm_in_the_ingress(data: dict[str, Any]) -> dict[str, Any]:
    """card_fraud with its intent LLM placed in the ingress, on the ingress's pool."""
    data = copy.deepcopy(data)
    data["models"]["intent"].update(placement="ingress", pool="cpu", num_cpus=0.5)
    return data


def test_an_llm_may_run_in_the_ingress_and_the_ingress_then_gets_an_llms_health_timeout(
    card_fraud_yaml: dict[str, Any],
) -> None:
    shipped = parse_pipeline(card_fraud_yaml, base_dir=PIPELINES)
    assert not shipped.models["intent"].in_ingress  # an LLM's default placement
    assert shipped.ingress_health_check_timeout() == 3.0
    spec = parse_pipeline(_llm_in_the_ingress(card_fraud_yaml), base_dir=PIPELINES)
    intent = spec.models["intent"]
    assert intent.in_ingress
    assert intent.reads_text
    assert spec.ingress_health_check_timeout() == 10.0
    data = _llm_in_the_ingress(card_fraud_yaml)
    data.setdefault("serving", {}).setdefault("ingress", {})["health_check_timeout_s"] = 4.0
    assert parse_pipeline(data, base_dir=PIPELINES).ingress_health_check_timeout() == 4.0  # the YAML's


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        ({"pool": "llm"}, "models.intent.pool: a model placed in the ingress runs on the ingress's pool"),
        ({"num_gpus": 0.5}, "models.intent.num_gpus: a model placed in the ingress takes no GPU share"),
        (
            {"batching": {"max_batch_size": 8, "max_wait_ms": 2}},
            "models.intent.batching: only models in their own deployment batch across calls",
        ),
        ({"replicas": 2}, "models.intent.replicas: a model in the ingress runs in every ingress replica"),
    ],
    ids=["pool", "gpu", "batching", "replicas"],
)
def test_an_llm_in_the_ingress_is_held_to_the_ingress_rules(
    card_fraud_yaml: dict[str, Any], edit: dict[str, Any], expected: str
) -> None:
    data = _llm_in_the_ingress(card_fraud_yaml)
    data["models"]["intent"].update(edit)
    assert expected in _errors(data)
