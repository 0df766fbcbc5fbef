"""The decision's CEL expressions compiled for whole batches (numpy) and single rows (Python) decide exactly
as CEL does, row for row, or are not compiled at all; rows CEL would refuse go to CEL."""

from __future__ import annotations

import copy
import math
from typing import Any

import cel
import numpy as np
import pytest
import yaml

from riskserve.schema import rules
from riskserve.schema.batch_rules import (
    BatchInputs,
    NotCompilable,
    RowInputs,
    Unsure,
    compile_expression,
)
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline
from riskserve.schema.rules import ModelResult

from ..conftest import PIPELINES

MODELS = ("fraud", "credit")
LABELS = ("", "urgent", "account", "other")
FEATURES = ("amount", "hour")
SUPPORTED = [
    "0.5 * models.fraud.score + 0.5 * models.credit.score",
    "models.fraud.score / models.credit.score",
    "max(models.fraud.score, models.credit.score) - min(0.2, models.credit.score)",
    "-models.fraud.score + 1.0",
    "risk_score >= 0.6",
    "risk_score >= 1",
    "risk_score > 0.3 && !(risk_score >= 0.6)",
    "models.fraud.fallback || features.amount > 900.0",
    "features.amount / 1000.0 >= risk_score && features.hour <= 6",
    "(models.credit.fallback == true) != false",
    "(features.hour - 12.0) * (features.hour - 12.0) > 30.0 || risk_score != 0.5",
    "risk_score * 1e3 > .5e3",
    "models.fraud.label == 'urgent'",
    'models.credit.label != "account" && risk_score > 0.3',
    "models.fraud.label in ['urgent', 'account'] || models.credit.label in ['']",
    "risk_score > 0.5 ? true : models.fraud.fallback",
    "0.5 * models.credit.score + 0.5 * (models.fraud.label in ['urgent'] ? models.fraud.score : 0.0)",
    "(models.fraud.label == 'urgent' ? risk_score : 1.0 - risk_score) >= 0.5",
    "models.fraud.fallback ? 0.0 : max(models.fraud.score, models.credit.score) / 2.0",
    "models.fraud.label == 'urgent' ? models.credit.label == 'account' : false ? true : risk_score < 0.2",
]
NOT_COMPILED = [
    "models.intent.label == 'urgent'",
    "models.fraud.label < 'b'",
    "'a' in models.fraud.label",
    "risk_score in [0.5, 0.6]",
    "models.fraud.label in ['a', 1]",
    "models.fraud.label == 'it\\'s'",
    "models.fraud.label == 1.0",
    "risk_score > 0.5 ? 1 : 0.0",
    "risk_score > 0.5 ? 'a' : 0.0",
    "models.fraud.score ? 1.0 : 0.0",
    "2 * risk_score > 1.0",
    "1 + 2 > 2",
    "has(models.fraud.score)",
    "models['fraud'].score > 0.5",
    "features.merchant_category == 'crypto'",
    "text.contains('x')",
    "risk_score >= 1u",
    "risk_score % 2.0 == 0.0",
    "0.1 < risk_score < 0.5",
    "size(features) > 3",
    "models.nosuch.score > 0.1",
]


def _cel(source: str, row: RowInputs) -> Any:
    variables: dict[str, Any] = {
        "models": {
            n: {"score": row.scores[n], "fallback": row.fallbacks[n], "label": row.labels[n]} for n in MODELS
        },
        "features": dict(row.features),
        "risk_score": row.risk_score,
    }
    functions = {"max": rules._max, "min": rules._min}
    return cel.compile(source).execute(cel.Context(variables=variables, functions=functions))


def _rows(count: int, seed: int) -> list[RowInputs]:
    rng = np.random.default_rng(seed)
    special = [0.0, 1.0, 0.5, 0.6, 0.3, math.inf, -math.inf, math.nan, 1e308]
    out = []
    for _ in range(count):

        def value() -> float:
            return float(rng.choice(special)) if rng.random() < 0.25 else float(rng.random())

        out.append(
            RowInputs(
                scores={n: value() for n in MODELS},
                fallbacks={n: bool(rng.random() < 0.3) for n in MODELS},
                features={"amount": float(rng.uniform(0, 2000)), "hour": float(rng.integers(0, 24))},
                risk_score=value(),
                labels={n: str(rng.choice(LABELS)) for n in MODELS},
            )
        )
    return out


def _batch(rows: list[RowInputs]) -> BatchInputs:
    return BatchInputs(
        rows=len(rows),
        scores={n: np.array([r.scores[n] for r in rows]) for n in MODELS},
        fallbacks={n: np.array([r.fallbacks[n] for r in rows]) for n in MODELS},
        features={f: np.array([r.features[f] for r in rows]) for f in FEATURES},
        risk_score=np.array([r.risk_score for r in rows]),
        labels={n: [r.labels[n] for r in rows] for n in MODELS},
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


@pytest.mark.parametrize("source", SUPPORTED)
def test_compiled_forms_give_cels_value_on_every_row_or_mark_it(source: str) -> None:
    compiled = compile_expression(source, models=MODELS, features=FEATURES, risk_score=True)
    rows = _rows(400, seed=len(source))
    batch = compiled.evaluate(_batch(rows))
    checked = marked = 0
    for i, row in enumerate(rows):
        try:
            expected = _cel(source, row)
        except (RuntimeError, TypeError, ValueError):
            expected = Unsure
        unsure = batch.unsure is not None and bool(batch.unsure[i])
        if expected is Unsure:  # CEL refuses the row: both compiled forms must hand it back to CEL
            assert unsure, f"row {i} {row}: CEL raises, the batch form gave {batch.values[i]}"
            with pytest.raises(Unsure):
                compiled.evaluate_row(row)
            marked += 1
            continue
        if unsure:  # handing a row back to CEL is always allowed (it then decides it)
            marked += 1
            continue
        value = batch.values[i].item()
        assert _same(value, float(expected) if compiled.type != "bool" else expected), (
            i,
            row,
            value,
            expected,
        )
        single = compiled.evaluate_row(row)
        assert _same(float(single) if compiled.type != "bool" else single, value), (i, row, single, value)
        checked += 1
    assert checked > 200, f"only {checked} rows compared ({marked} handed back)"


@pytest.mark.parametrize("source", NOT_COMPILED)
def test_cel_beyond_the_subset_is_not_compiled(source: str) -> None:
    with pytest.raises(NotCompilable):
        compile_expression(source, models=MODELS, features=FEATURES, risk_score=True)


def test_the_risk_score_expression_cannot_read_the_risk_score() -> None:
    with pytest.raises(NotCompilable):
        compile_expression("risk_score * 0.5", models=MODELS, features=FEATURES, risk_score=False)


def _spec(name: str, decision: dict[str, Any] | None = None) -> PipelineSpec:
    data = copy.deepcopy(yaml.safe_load((PIPELINES / f"{name}.yaml").read_text()))
    if decision is not None:
        data["decision"] = decision
    return parse_pipeline(data, base_dir=PIPELINES, source=name)


def _results(spec: PipelineSpec, count: int, seed: int) -> dict[str, list[ModelResult]]:
    rng = np.random.default_rng(seed)
    special = [math.nan, math.inf, 0.6, 0.3, 0.0, 1.0]
    return {
        name: [
            ModelResult(
                name=name,
                version="v",
                score=float(rng.choice(special)) if rng.random() < 0.1 else float(rng.random()),
                label=str(rng.choice(LABELS)),
                fallback=bool(rng.random() < 0.1),
                fallback_reason="TIMEOUT",
            )
            for _ in range(count)
        ]
        for name in spec.models
    }


FEATURE_RULES = {
    "risk_score": "max(0.6 * models.fraud.score, 0.4 * models.credit.score) + features.amount / 1e7",
    "rules": [
        {"name": "big", "when": "features.amount >= 500.0 && risk_score > 0.2", "outcome": "REVIEW",
         "reason": "large amount"},
        {"name": "night", "when": "features.hour < 5 || models.fraud.fallback", "outcome": "REVIEW",
         "reason": "at night"},
        {"name": "high", "when": "risk_score >= 0.6", "outcome": "DECLINE", "reason": "high"},
    ],
}  # fmt: skip


@pytest.mark.parametrize(
    ("pipeline", "decision"), [("tabular_only", None), ("tabular_only", FEATURE_RULES), ("card_fraud", None)]
)
@pytest.mark.parametrize("count", [1, 5, 300])
def test_engine_decides_batches_and_rows_exactly_as_cel(
    pipeline: str, decision: dict[str, Any] | None, count: int
) -> None:
    """``card_fraud`` reads the intent model's label (``in``, ``==``) and a conditional: compiled too."""
    spec = _spec(pipeline, decision)
    engine = spec.decision_engine()
    assert engine.compiled
    rows, _ = rules._samples(spec, count)
    per_model = _results(spec, count, seed=count)
    expected = [
        engine._decide_cel(row, {n: r[i] for n, r in per_model.items()}) for i, row in enumerate(rows)
    ]
    assert engine.decide_batch(rows, per_model) == expected
    assert [
        engine.decide(row, {n: r[i] for n, r in per_model.items()}) for i, row in enumerate(rows)
    ] == expected
    if count == 300:  # NaN scores were in the sample: CEL's REVIEW with its reason, in every form
        assert any("could not be computed" in " ".join(d.reasons) for d in expected)
        assert {d.outcome for d in expected} == {"APPROVE", "REVIEW", "DECLINE"}


def test_pipelines_beyond_the_subset_decide_in_cel() -> None:
    beyond = copy.deepcopy(FEATURE_RULES)
    beyond["rules"][0]["when"] = "features.merchant_category == 'crypto' && risk_score > 0.2"
    spec = _spec("card_fraud", beyond)
    engine = spec.decision_engine()
    assert not engine.compiled  # a categorical feature is not compiled
    rows, _ = rules._samples(spec, 50)
    per_model = _results(spec, 50, seed=3)
    decided = engine.decide_batch(rows, per_model)
    in_cel = [engine._decide_cel(r, {n: v[i] for n, v in per_model.items()}) for i, r in enumerate(rows)]
    assert decided == in_cel


def test_fault_injected_wrong_program_is_caught_by_the_load_check() -> None:
    """A compiled program that disagreed with CEL (injected: the rules' thresholds shifted) is refused at
    load and the engine decides in CEL."""
    spec = _spec("tabular_only")
    engine = spec.decision_engine()
    program = engine._batch
    assert program is not None
    wrong = compile_expression("risk_score >= 0.55", models=MODELS, features=(), risk_score=True)
    engine._batch = rules._BatchProgram(program.score, [wrong, *program.rules[1:]], program.features)
    assert not engine._batch_agrees(spec)
