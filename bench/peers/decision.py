"""The tabular decision as a peer's own code computes it: numpy only, so it runs in every peer's venv.

A team serving the demo pipeline on MLServer, KServe, Triton or plain Ray Serve writes this part itself:
check the request's fields, encode them into the models' 20 columns, combine the two scores and apply
the thresholds. It reads a *decision spec*, a JSON document the harness writes from
``deploy/pipelines/tabular_only.yaml`` (:func:`decision_spec`), so every peer encodes exactly what
riskserve encodes; it never imports riskserve (the peers' venvs do not have it).

Scoring is the caller's: the peers run XGBoost and scikit-learn through their own runtimes or libraries.
Bad input raises :class:`BadRequest` naming the field; each peer turns it into its own error.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["BadRequest", "DecisionSpec", "decision_spec", "sklearn_fraud", "xgboost_credit"]

UNKNOWN = "<unknown>"


class BadRequest(ValueError):
    """A request field is missing, not a number, out of range or unknown; the message names it."""


def decision_spec(pipeline: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-able decision spec of a parsed pipeline YAML (its ``features`` and the demo's rules).

    The rules are the tabular demo's (``risk = 0.5 fraud + 0.5 credit``; >= 0.6 DECLINE, >= 0.3 REVIEW),
    the ones ``bench/floor_server.py`` hard-codes too.
    """
    return {
        "fields": pipeline["features"]["fields"],
        "columns": pipeline["features"]["columns"],
        "weights": {"fraud": 0.5, "credit": 0.5},
        "rules": [
            [0.6, "DECLINE", "combined risk score is 0.6 or more"],
            [0.3, "REVIEW", "combined risk score is 0.3 or more"],
        ],
        "default": ["APPROVE", "low risk"],
    }


class DecisionSpec:
    """Encode requests into the feature matrix and turn two scores into decisions."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.fields: dict[str, dict[str, Any]] = dict(spec["fields"])
        self.columns: list[dict[str, Any]] = list(spec["columns"])
        self.weights: dict[str, float] = dict(spec["weights"])
        self.rules: list[tuple[float, str, str]] = [(float(t), o, r) for t, o, r in spec["rules"]]
        self.default: tuple[str, str] = (spec["default"][0], spec["default"][1])
        self.numeric = [n for n, f in self.fields.items() if f["kind"] == "numeric"]
        self.categorical = [n for n, f in self.fields.items() if f["kind"] == "categorical"]
        self.index = {n: {v: i for i, v in enumerate(self.fields[n]["vocabulary"])} for n in self.categorical}
        self.names = self._names()

    @classmethod
    def read(cls, path: Path | str) -> DecisionSpec:
        """Load a spec written by the harness."""
        return cls(json.loads(Path(path).read_text()))

    def _names(self) -> list[str]:
        names: list[str] = []
        for column in self.columns:
            if column.get("encoding") == "one_hot":
                vocabulary = self.fields[column["field"]]["vocabulary"]
                names += [f"{column['name']}={v}" for v in [*vocabulary, UNKNOWN]]
            elif "encoding" in column:
                raise ValueError(f"column {column['name']}: encoding {column['encoding']} is not supported")
            else:
                names.append(column["name"])
        return names

    def check_columns(self, model: str, columns: Sequence[str]) -> None:
        """Refuse a model whose columns are not the spec's, in order."""
        if list(columns) != self.names:
            raise ValueError(f"model {model} reads {list(columns)}, the spec gives {self.names}")

    def _numeric(self, name: str, values: Sequence[float] | None, rows: int) -> NDArray[np.float64]:
        field = self.fields[name]
        if values is None:
            if field.get("required", True):
                raise BadRequest(f"{name}: required numeric field is missing")
            return np.full(rows, float(field["default"]))
        array = np.asarray(values, dtype=np.float64).reshape(-1)
        if array.shape[0] != rows:
            raise BadRequest(f"{name}: {array.shape[0]} values for {rows} rows")
        if not np.isfinite(array).all():
            raise BadRequest(f"{name}: not a finite number")
        low, high = field.get("min"), field.get("max")
        if low is not None and (array < low).any():
            raise BadRequest(f"{name}: {array.min()} is below the minimum {low}")
        if high is not None and (array > high).any():
            raise BadRequest(f"{name}: {array.max()} is above the maximum {high}")
        return array

    def encode(self, inputs: Mapping[str, Sequence[Any] | None], rows: int) -> NDArray[np.float32]:
        """The float32 feature matrix of ``rows`` requests given column-wise (field -> values)."""
        unknown = set(inputs) - set(self.fields)
        if unknown:
            raise BadRequest(f"{sorted(unknown)[0]}: unknown field")
        numeric = {n: self._numeric(n, inputs.get(n), rows) for n in self.numeric}
        blocks: list[NDArray[np.float64]] = []
        for column in self.columns:
            name = column["field"]
            if column.get("encoding") == "one_hot":
                blocks.append(self._one_hot(name, inputs.get(name), rows))
                continue
            values = numeric[name]
            for transform in column.get("transforms", []):
                if transform["op"] == "log1p":
                    values = np.log1p(values)
                elif transform["op"] == "clip":
                    values = np.clip(values, transform["min"], transform["max"])
                else:
                    raise ValueError(f"transform {transform['op']} is not supported")
            blocks.append(values[:, None])
        return np.ascontiguousarray(np.hstack(blocks), dtype=np.float32)

    def _one_hot(self, name: str, values: Sequence[Any] | None, rows: int) -> NDArray[np.float64]:
        if values is None:
            raise BadRequest(f"{name}: required categorical field is missing")
        if len(values) != rows:
            raise BadRequest(f"{name}: {len(values)} values for {rows} rows")
        index = self.index[name]
        codes = [index.get(v.decode() if isinstance(v, bytes) else str(v), len(index)) for v in values]
        out = np.zeros((rows, len(index) + 1))
        out[np.arange(rows), codes] = 1.0
        return out

    def decide(
        self, credit: NDArray[np.floating[Any]], fraud: NDArray[np.floating[Any]]
    ) -> tuple[NDArray[np.float64], list[str]]:
        """Risk scores and outcomes (``APPROVE`` / ``REVIEW`` / ``DECLINE``) from the two models' scores."""
        risk = self.weights["fraud"] * np.asarray(fraud, np.float64)
        risk = risk + self.weights["credit"] * np.asarray(credit, np.float64)
        outcomes = []
        for value in risk:
            outcome = self.default[0]
            for threshold, rule_outcome, _ in self.rules:
                if value >= threshold and not math.isnan(value):
                    outcome = rule_outcome
                    break
            outcomes.append(outcome)
        return risk, outcomes


def sklearn_fraud(params_path: Path | str) -> Any:
    """The fraud model as a scikit-learn estimator (``StandardScaler`` then ``LogisticRegression``) built
    from its ``params.json`` attributes: what a peer serving scikit-learn runs; nothing is unpickled."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    params = json.loads(Path(params_path).read_text())
    scaler = StandardScaler()
    scaler.mean_ = np.asarray(params["scaler"]["mean"], np.float64)
    scaler.var_ = np.asarray(params["scaler"]["var"], np.float64)
    scaler.scale_ = np.asarray(params["scaler"]["scale"], np.float64)
    scaler.n_features_in_ = scaler.mean_.shape[0]
    scaler.n_samples_seen_ = int(params["scaler"]["n_samples_seen"])
    classifier = LogisticRegression()
    classifier.coef_ = np.asarray(params["coef"], np.float64)[None, :]
    classifier.intercept_ = np.asarray([params["intercept"]], np.float64)
    classifier.classes_ = np.asarray(params["classes"])
    classifier.n_features_in_ = scaler.n_features_in_
    return make_pipeline(scaler, classifier)


def xgboost_credit(model_json: Path | str) -> Any:
    """The credit model as an ``xgboost.Booster`` from its JSON file, one thread (the machine has two cores
    and the client shares them; XGBoost's docs advise ``nthread`` at most the free cores)."""
    import xgboost

    booster = xgboost.Booster()
    booster.load_model(str(model_json))
    booster.set_param({"nthread": 1})
    return booster
