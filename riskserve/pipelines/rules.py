"""Decision rules in CEL: compiled once at load, evaluated per request, never Python ``eval``.

Variables a rule sees: ``risk_score`` (double), ``models.<name>`` with ``score`` (double), ``label``
(string), ``fallback`` (bool) and ``version`` (string), ``features.<field>`` (the request's validated
values) and ``text``. Functions added to CEL's standard library: ``max(a, b)``, ``min(a, b)``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import cel

from riskserve.features.encoder import ValidRow
from riskserve.platform.errors import ConfigError

if TYPE_CHECKING:
    from riskserve.pipelines.spec import Outcome, PipelineSpec

__all__ = ["Decision", "DecisionEngine", "ModelResult", "rule_errors"]

_SEVERITY = {"APPROVE": 0, "REVIEW": 1, "DECLINE": 2}


def _max(a: float, b: float) -> float:
    return a if a >= b else b


def _min(a: float, b: float) -> float:
    return a if a <= b else b


_FUNCTIONS = {"max": _max, "min": _min}


@dataclass(frozen=True)
class ModelResult:
    """One model's answer for one request, real or fallback, as the decision step sees it."""

    name: str
    version: str
    score: float
    label: str = ""
    fallback: bool = False
    fallback_reason: str = ""
    latency_ms: float = 0.0


@dataclass(frozen=True)
class Decision:
    """The outcome for one request, its risk score and the reasons, most important first."""

    outcome: Outcome
    risk_score: float
    reasons: list[str]


_MODEL_FIELDS = ("score", "label", "fallback", "version")
_IDENTIFIER = re.compile(r"(?<![\w.])(models|features|text)\b")
_MODEL_PATH = re.compile(r"models\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)")
_FEATURE_PATH = re.compile(r"features\.([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class _Needs:
    """Which variables a set of CEL expressions reads: converting a nested map into CEL costs ~2 µs an
    entry, so a context holds only these. ``None`` means all of that variable (a use not recognised)."""

    models: frozenset[tuple[str, str]] | None
    features: frozenset[str] | None
    text: bool

    @classmethod
    def of(cls, expressions: list[str]) -> _Needs:
        models: set[tuple[str, str]] | None = set()
        features: set[str] | None = set()
        text = False
        for expression in expressions:
            for match in _IDENTIFIER.finditer(expression):
                name, rest = match.group(1), expression[match.start() :]
                if name == "text":
                    text = True
                elif name == "models" and models is not None:
                    path = _MODEL_PATH.match(rest)
                    if path is None or path.group(2) not in _MODEL_FIELDS:
                        models = None  # indexing, a whole map, has(): give it everything
                    else:
                        models.add((path.group(1), path.group(2)))
                elif name == "features" and features is not None:
                    path = _FEATURE_PATH.match(rest)
                    if path is None:
                        features = None
                    else:
                        features.add(path.group(1))
        return cls(
            None if models is None else frozenset(models),
            None if features is None else frozenset(features),
            text,
        )

    def variables(self, row: ValidRow, results: Mapping[str, ModelResult]) -> dict[str, Any]:
        """The CEL variables these expressions read, for one request."""
        out: dict[str, Any] = {}
        if self.models is None:
            out["models"] = {
                name: {"score": r.score, "label": r.label, "fallback": r.fallback, "version": r.version}
                for name, r in results.items()
            }
        elif self.models:
            models: dict[str, dict[str, Any]] = {}
            for name, field in self.models:
                result = results.get(name)
                if result is not None:
                    models.setdefault(name, {})[field] = getattr(result, field)
            out["models"] = models
        if self.features is None:
            out["features"] = {**row.numeric, **row.categorical}
        elif self.features:
            values = {**row.numeric, **row.categorical}
            out["features"] = {f: values[f] for f in self.features if f in values}
        if self.text:
            out["text"] = row.text
        return out


def _context(
    row: ValidRow, results: Mapping[str, ModelResult], risk_score: float | None, needs: _Needs | None = None
) -> cel.Context:
    variables = (needs or _Needs(None, None, True)).variables(row, results)
    if risk_score is not None:
        variables["risk_score"] = risk_score
    return cel.Context(variables=variables, functions=_FUNCTIONS)


class DecisionEngine:
    """Compiled decision: risk-score expression, rules, and the fallbacks that force a review."""

    def __init__(self, spec: PipelineSpec) -> None:
        decision = spec.decision
        try:
            self._score = cel.compile(decision.risk_score)
            self._rules = [(rule, cel.compile(rule.when)) for rule in decision.rules]
        except ValueError as error:
            raise ConfigError(f"decision: {error}") from error
        self._score_needs = _Needs.of([decision.risk_score])
        self._rule_needs = _Needs.of([rule.when for rule in decision.rules])
        self._default = decision.default
        self._default_reason = decision.default_reason
        self._review_on_fallback = {name for name, m in spec.models.items() if m.fallback.review}

    def decide(self, row: ValidRow, results: Mapping[str, ModelResult]) -> Decision:
        """Combine model results into one decision; a rule failing at run time forces REVIEW, not an error."""
        outcome: Outcome = self._default
        reasons: list[str] = []
        try:
            risk_score = _clamp(float(self._score.execute(_context(row, results, None, self._score_needs))))
        except (RuntimeError, TypeError, ValueError) as error:
            risk_score, outcome = 1.0, "REVIEW"
            reasons.append(f"risk score could not be computed ({error}); treated as 1.0")
        context = _context(row, results, risk_score, self._rule_needs)
        for rule, program in self._rules:
            rule_outcome: Outcome
            try:
                matched = program.execute(context) is True
            except (RuntimeError, TypeError, ValueError) as error:
                matched, rule_outcome, reason = (
                    True,
                    "REVIEW",
                    f"{rule.name}: could not be evaluated ({error})",
                )
            else:
                rule_outcome, reason = rule.outcome, f"{rule.name}: {rule.reason}"
            if matched:
                reasons.append(reason)
                outcome = _worse(outcome, rule_outcome)
        for name in sorted(self._review_on_fallback):
            result = results.get(name)
            if result is not None and result.fallback:
                reasons.append(f"{name}: model unavailable ({result.fallback_reason}), decided without it")
                outcome = _worse(outcome, "REVIEW")
        if not reasons:
            reasons.append(self._default_reason)
        return Decision(outcome=outcome, risk_score=risk_score, reasons=reasons)


def _worse(a: Outcome, b: Outcome) -> Outcome:
    return a if _SEVERITY[a] >= _SEVERITY[b] else b


def _clamp(value: float) -> float:
    if value != value:  # NaN
        raise ValueError("risk score is NaN")
    return min(1.0, max(0.0, value))


def _sample_row(spec: PipelineSpec) -> ValidRow:
    from riskserve.features.spec import CategoricalField, NumericField

    numeric: dict[str, float] = {}
    categorical: dict[str, str] = {}
    for name, field in spec.features.fields.items():
        if isinstance(field, NumericField):
            numeric[name] = field.default if field.default is not None else (field.min or 0.0)
        elif isinstance(field, CategoricalField):
            categorical[name] = field.default or field.vocabulary[0]
    return ValidRow(numeric=numeric, categorical=categorical, text="sample")


def rule_errors(spec: PipelineSpec) -> list[str]:
    """Compile every CEL expression and dry-run it on a sample request, so mistakes surface at load."""
    errors: list[str] = []
    row = _sample_row(spec)
    results = {name: ModelResult(name=name, version="sample", score=0.5) for name in spec.models}
    expressions = [("decision.risk_score", spec.decision.risk_score, (int, float))] + [
        (f"decision.rules[{i}].when", rule.when, (bool,)) for i, rule in enumerate(spec.decision.rules)
    ]
    for path, source, wanted in expressions:
        try:
            program = cel.compile(source)
        except ValueError as error:
            errors.append(f"{path}: {error}")
            continue
        try:
            value = program.execute(_context(row, results, 0.5))
        except (RuntimeError, TypeError, ValueError) as error:
            errors.append(f"{path}: {error}")
            continue
        if not isinstance(value, wanted) or (wanted != (bool,) and isinstance(value, bool)):
            errors.append(f"{path}: gives {type(value).__name__}, expected {wanted[0].__name__}")
    return errors
