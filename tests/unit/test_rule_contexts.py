"""The decision engine gives each CEL program only the variables it reads (converting nested maps into CEL
costs microseconds an entry); these tests hold it to deciding exactly as with every variable present."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import yaml

from riskserve.demo.dataset import generate_transactions
from riskserve.features.encoder import FeatureEncoder, RawRequest
from riskserve.schema import rules
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline
from riskserve.schema.rules import ModelResult, _Needs

from ..conftest import PIPELINES


def _spec(name: str, decision: dict[str, Any] | None = None) -> PipelineSpec:
    data = copy.deepcopy(yaml.safe_load((PIPELINES / f"{name}.yaml").read_text()))
    if decision is not None:
        data["decision"] = decision
    return parse_pipeline(data, base_dir=PIPELINES, source=name)


TRICKY = {
    # whole maps, indexing, has(), functions, text, a string literal that looks like a path
    "risk_score": "max(models['fraud'].score, models.credit.score)",
    "rules": [
        {"name": "by_index", "when": "models['fraud'].score > 0.5", "outcome": "DECLINE", "reason": "i"},
        {"name": "has_label", "when": "has(models.credit.label) && models.credit.fallback",
         "outcome": "REVIEW", "reason": "h"},
        {"name": "feature_map", "when": "size(features) > 100 || features.amount > 900.0",
         "outcome": "REVIEW", "reason": "f"},
        {"name": "texty", "when": "text.contains('urgent') && 'models.x.y' != ''", "outcome": "REVIEW",
         "reason": "t"},
        {"name": "plain", "when": "risk_score >= 0.3", "outcome": "REVIEW", "reason": "p"},
    ],
}  # fmt: skip


@pytest.mark.parametrize(
    ("pipeline", "decision"), [("card_fraud", None), ("tabular_only", None), ("tabular_only", TRICKY)]
)
def test_trimmed_contexts_decide_exactly_as_full_ones(
    pipeline: str, decision: dict[str, Any] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(pipeline, decision)
    encoder = FeatureEncoder(spec.features)
    transactions = generate_transactions(300, seed=5)
    rng = np.random.default_rng(5)
    with_text = any(f.kind == "text" for f in spec.features.fields.values())
    raw = [RawRequest(**_fields(transactions.row(i), with_text)) for i in range(len(transactions))]
    rows = [encoder.validate(request) for request in raw]
    results = [
        {
            name: ModelResult(
                name=name,
                version="v",
                score=float(rng.random()),
                label=str(rng.choice(["urgent", "gift"])),
                fallback=bool(rng.random() < 0.1),
            )
            for name in spec.models
        }
        for _ in rows
    ]
    # CEL itself (``_decide_cel``): the compiled forms of tabular_only's rules read no context at all
    engine = spec.decision_engine()
    trimmed = [engine._decide_cel(row, result) for row, result in zip(rows, results, strict=True)]
    monkeypatch.setattr(rules._Needs, "of", classmethod(lambda cls, expressions: cls(None, None, True)))
    engine = spec.decision_engine()
    full = [engine._decide_cel(row, result) for row, result in zip(rows, results, strict=True)]
    assert trimmed == full
    assert len({d.outcome for d in full}) > 1, "the sample exercises more than one outcome"


def _fields(row: dict[str, float | str], with_text: bool) -> dict[str, Any]:
    numeric = {k: float(v) for k, v in row.items() if isinstance(v, float)}
    categorical = {k: str(v) for k, v in row.items() if k in ("merchant_category", "channel")}
    return {"numeric": numeric, "categorical": categorical, "text": str(row["text"]) if with_text else ""}


def test_needs_reads_only_the_paths_used() -> None:
    needs = _Needs.of(["0.5 * models.fraud.score + 0.5 * models.credit.score", "risk_score > 0.3"])
    assert needs == _Needs(frozenset({("fraud", "score"), ("credit", "score")}), frozenset(), False)
    assert _Needs.of(["models['fraud'].score > 0.1"]).models is None  # not recognised: everything
    assert _Needs.of(["features.amount >= 500.0 && text != ''"]) == _Needs(
        frozenset(), frozenset({"amount"}), True
    )
