"""Decision rules in CEL: compiled once at load, evaluated per request, never Python ``eval``.

Variables a rule sees: ``risk_score`` (double), ``models.<name>`` with ``score`` (double), ``label``
(string), ``fallback`` (bool) and ``version`` (string), ``features.<field>`` (the request's validated
values) and ``text``. Functions added to CEL's standard library: ``max(a, b)``, ``min(a, b)``.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import cel
import numpy as np
from pydantic import Field

from riskserve.features.encoder import ValidRow
from riskserve.features.spec import CategoricalField, FeatureSpec, NumericField
from riskserve.platform.errors import ConfigError
from riskserve.platform.outcome import SEVERITY, Outcome
from riskserve.schema.base import NAME, Strict
from riskserve.schema.batch_rules import (
    STRING_LITERAL,
    BatchInputs,
    CompiledExpression,
    NotCompilable,
    RowInputs,
    Unsure,
    compile_expression,
)

__all__ = [
    "Decision",
    "DecisionEngine",
    "DecisionSpec",
    "ModelResult",
    "RuleScope",
    "RuleSpec",
    "rule_errors",
]

logger = logging.getLogger(__name__)


class RuleSpec(Strict):
    """A decision rule: a CEL condition, the outcome it asks for, and the reason given to the caller."""

    name: str = Field(pattern=NAME)
    when: str = Field(min_length=1)
    """CEL boolean over ``risk_score``, ``models.<name>.{score,label,fallback}``, ``features.<field>``."""
    outcome: Outcome
    reason: str = Field(min_length=1)


class DecisionSpec(Strict):
    """How model outputs combine into one risk score, and the rules that turn it into an outcome.

    Every rule is evaluated; the most severe outcome that matched wins (DECLINE > REVIEW > APPROVE) and the
    reasons of all matched rules are returned in order.
    """

    risk_score: str = Field(min_length=1)
    """CEL expression giving a double; clamped into [0, 1]."""
    rules: list[RuleSpec] = Field(default_factory=list)
    default: Outcome = "APPROVE"
    default_reason: str = "no rule matched"


@dataclass(frozen=True)
class RuleScope:
    """What the rules of one pipeline see of it: its decision section, its features and its models.

    Built by :meth:`riskserve.schema.pipeline.PipelineSpec.rule_scope`; the rules need no more of the
    pipeline, so this module stays below the pipeline schema that checks its rules with it.
    """

    name: str
    decision: DecisionSpec
    features: FeatureSpec
    models: tuple[str, ...]
    review_on_fallback: frozenset[str]
    """Models whose fallback forces a REVIEW (``fallback.review``)."""


def _max(a: float, b: float) -> float:
    return a if a >= b else b


def _min(a: float, b: float) -> float:
    return a if a <= b else b


_FUNCTIONS = {"max": _max, "min": _min}


class ModelResult:
    """One model's answer for one request, real or fallback, as the decision step sees it.

    Made once per row per model on the request path, so it is a ``__slots__`` class with a plain
    ``__init__``: about 2.5x cheaper to create than the frozen dataclass it was (ARCHITECTURE.md has the
    figure). Treat it as immutable; :meth:`replace` gives a changed copy.
    """

    __slots__ = ("fallback", "fallback_reason", "label", "latency_ms", "name", "score", "version")

    def __init__(
        self,
        name: str,
        version: str,
        score: float,
        label: str = "",
        fallback: bool = False,
        fallback_reason: str = "",
        latency_ms: float = 0.0,
    ) -> None:
        self.name = name
        self.version = version
        self.score = score
        self.label = label
        self.fallback = fallback
        self.fallback_reason = fallback_reason
        self.latency_ms = latency_ms

    def _fields(self) -> tuple[str, str, float, str, bool, str, float]:
        return (self.name, self.version, self.score, self.label, self.fallback, self.fallback_reason,
                self.latency_ms)  # fmt: skip

    def replace(self, *, score: float, version: str) -> ModelResult:
        """This result with another score and version (a shadow candidate's answer in its place)."""
        return ModelResult(self.name, version, score, self.label, self.fallback, self.fallback_reason,
                           self.latency_ms)  # fmt: skip

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelResult) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return (f"ModelResult(name={self.name!r}, version={self.version!r}, score={self.score!r}, "
                f"label={self.label!r}, fallback={self.fallback!r}, "
                f"fallback_reason={self.fallback_reason!r}, latency_ms={self.latency_ms!r})")  # fmt: skip


@dataclass(slots=True)
class Decision:
    """The outcome for one request, its risk score and the reasons, most important first (made once per
    row: slotted, not frozen, as ``ModelResult``; treat it as immutable)."""

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

    def __init__(self, spec: RuleScope) -> None:
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
        self._review_on_fallback = set(spec.review_on_fallback)
        self._fallback_order = sorted(self._review_on_fallback)
        self._verdicts = [(rule.outcome, f"{rule.name}: {rule.reason}") for rule in decision.rules]
        """Each rule's outcome and reason, in rule order, for the compiled forms."""
        self._batch = _BatchProgram.build(spec)
        if self._batch is not None and not self._batch_agrees(spec):
            self._batch = None

    @property
    def compiled(self) -> bool:
        """Whether the expressions run compiled (numpy for batches, Python for a row), else in CEL."""
        return self._batch is not None

    def decide_batch(
        self, rows: Sequence[ValidRow], per_model: Mapping[str, Sequence[ModelResult]]
    ) -> list[Decision]:
        """:meth:`decide` for every row, in order: in numpy where the expressions allow it (see
        :mod:`riskserve.schema.batch_rules`), row by row for the rest and for rows CEL would refuse."""
        program = self._batch
        if program is None or len(rows) < _BATCH_FROM:
            return [self.decide(row, {n: r[i] for n, r in per_model.items()}) for i, row in enumerate(rows)]
        count = len(rows)
        fallbacks = {
            name: np.fromiter((r.fallback for r in results), dtype=bool, count=count)
            for name, results in per_model.items()
        }
        inputs = BatchInputs(
            rows=count,
            scores={
                name: np.fromiter((r.score for r in results), dtype=np.float64, count=count)
                for name, results in per_model.items()
            },
            fallbacks=fallbacks,
            features={
                name: np.fromiter((row.numeric[name] for row in rows), dtype=np.float64, count=count)
                for name in program.features
            },
            labels={name: [r.label for r in per_model[name]] for name in program.labels if name in per_model},
        )
        score = program.score.evaluate(inputs)
        raw = score.values
        unsure = np.isnan(raw) if score.unsure is None else score.unsure | np.isnan(raw)
        risk = np.clip(np.nan_to_num(raw, nan=1.0), 0.0, 1.0) + 0.0  # + 0.0: no -0.0, as min/max give
        inputs = BatchInputs(
            inputs.rows, inputs.scores, fallbacks, inputs.features, risk_score=risk, labels=inputs.labels
        )
        matched: list[list[bool]] = []
        for rule in program.rules:
            value = rule.evaluate(inputs)
            if value.unsure is not None:
                unsure |= value.unsure
            matched.append(value.values.tolist())
        reviewing = [name for name in self._fallback_order if name in fallbacks]
        flagged = [(name, fallbacks[name].tolist()) for name in reviewing]
        reviewed = [fallbacks[name] for name in reviewing] or [np.zeros(count, dtype=bool)]
        fallen_rows = np.logical_or.reduce(reviewed).tolist()
        risks = risk.tolist()
        unsure_rows = unsure.tolist()
        row_hits = list(zip(*matched, strict=True)) if matched else [()] * count
        # Outcome and reasons per pattern of matched rules, for rows with no reviewing fallback: a batch
        # has a handful of patterns, so each is concluded once.
        concluded: dict[tuple[bool, ...], tuple[Outcome, list[str]]] = {}
        out: list[Decision] = []
        for i, row in enumerate(rows):
            if unsure_rows[i]:  # CEL raises for this row: decide it the CEL way (REVIEW, with the reason)
                out.append(self._decide_cel(row, {n: r[i] for n, r in per_model.items()}))
                continue
            hits = row_hits[i]
            if fallen_rows[i]:
                fallen = [(name, per_model[name][i]) for name, marks in flagged if marks[i]]
                out.append(self._concluded(hits, fallen, risks[i]))
                continue
            known = concluded.get(hits)
            if known is None:
                decision = self._concluded(hits, (), 0.0)
                known = concluded[hits] = (decision.outcome, decision.reasons)
            out.append(Decision(outcome=known[0], risk_score=risks[i], reasons=list(known[1])))
        return out

    def _batch_agrees(self, spec: RuleScope) -> bool:
        """Whether the compiled program decides sample rows exactly as CEL does, in a batch and one by one
        (at load, once)."""
        rows, per_model = _samples(spec, count=256)
        try:
            batched = self.decide_batch(rows, per_model)
            single = [self.decide(row, {n: r[i] for n, r in per_model.items()}) for i, row in enumerate(rows)]
        except Exception:  # a bug here must cost speed, never a decision
            logger.exception("pipeline '%s': compiled rules failed on samples; deciding in CEL", spec.name)
            return False
        for i, row in enumerate(rows):
            expected = self._decide_cel(row, {n: r[i] for n, r in per_model.items()})
            for decision in (batched[i], single[i]):
                if expected == decision:
                    continue
                logger.warning("pipeline '%s': compiled rules differ from CEL on a sample (%s vs %s); "
                               "deciding in CEL", spec.name, decision, expected)  # fmt: skip
                return False
        return True

    def decide(self, row: ValidRow, results: Mapping[str, ModelResult]) -> Decision:
        """Combine model results into one decision; a rule failing at run time forces REVIEW, not an error."""
        program = self._batch
        if program is None:
            return self._decide_cel(row, results)
        scores = {name: r.score for name, r in results.items()}
        fallbacks = {name: r.fallback for name, r in results.items()}
        features = {name: row.numeric[name] for name in program.features}
        labels = {name: results[name].label for name in program.labels if name in results}
        try:
            raw = program.score.evaluate_row(RowInputs(scores, fallbacks, features, labels=labels))
            if raw != raw:
                raise Unsure("NaN risk score")
            risk_score = min(1.0, max(0.0, float(raw)))
            inputs = RowInputs(scores, fallbacks, features, risk_score, labels)
            matched = [rule.evaluate_row(inputs) for rule in program.rules]
        except Unsure:  # CEL raises for this row: decide it the CEL way (REVIEW, with the reason)
            return self._decide_cel(row, results)
        fallen = [
            (name, result)
            for name in self._fallback_order
            if (result := results.get(name)) is not None and result.fallback
        ]
        return self._concluded(matched, fallen, risk_score)

    def _concluded(
        self, hits: Sequence[bool], fallen: Sequence[tuple[str, ModelResult]], risk_score: float
    ) -> Decision:
        """The decision from which rules matched (in rule order) and which reviewing models fell back, as
        CEL's path concludes it: the worst outcome wins, each its reason, else the default reason."""
        outcome: Outcome = self._default
        reasons: list[str] = []
        for (rule_outcome, reason), hit in zip(self._verdicts, hits, strict=True):
            if hit:
                reasons.append(reason)
                outcome = _worse(outcome, rule_outcome)
        for name, result in fallen:
            reasons.append(_unavailable(name, result))
            outcome = _worse(outcome, "REVIEW")
        if not reasons:
            reasons.append(self._default_reason)
        return Decision(outcome=outcome, risk_score=risk_score, reasons=reasons)

    def _decide_cel(self, row: ValidRow, results: Mapping[str, ModelResult]) -> Decision:
        """:meth:`decide` in CEL itself, the reference the compiled forms are checked against."""
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
                reasons.append(_unavailable(name, result))
                outcome = _worse(outcome, "REVIEW")
        if not reasons:
            reasons.append(self._default_reason)
        return Decision(outcome=outcome, risk_score=risk_score, reasons=reasons)


_BATCH_FROM = 16
"""Smallest batch decided in numpy; below it, row by row in Python is cheaper than a dozen numpy calls."""


@dataclass(frozen=True)
class _BatchProgram:
    """The risk score and the rules compiled for whole batches, and the numeric features they read."""

    score: CompiledExpression
    rules: list[CompiledExpression]
    features: tuple[str, ...]
    labels: tuple[str, ...] = ()
    """The models whose label an expression reads."""

    @classmethod
    def build(cls, spec: RuleScope) -> _BatchProgram | None:
        """The compiled program, or ``None`` when an expression is beyond the compiled subset."""
        numeric = [name for name, f in spec.features.fields.items() if isinstance(f, NumericField)]
        models = list(spec.models)
        decision = spec.decision
        try:
            score = compile_expression(decision.risk_score, models=models, features=numeric, risk_score=False)
            rules = [
                compile_expression(rule.when, models=models, features=numeric, risk_score=True)
                for rule in decision.rules
            ]
        except NotCompilable as error:
            logger.info("pipeline '%s': rules decided row by row in CEL (%s)", spec.name, error)
            return None
        if score.type != "double" or any(rule.type != "bool" for rule in rules):
            return None
        needs = _Needs.of([decision.risk_score, *(rule.when for rule in decision.rules)])
        used = needs.features
        features = tuple(numeric) if used is None else tuple(f for f in numeric if f in used)
        read = models if needs.models is None else sorted({m for m, f in needs.models if f == "label"})
        return cls(score, rules, features, tuple(read))


def _samples(spec: RuleScope, count: int) -> tuple[list[ValidRow], dict[str, list[ModelResult]]]:
    """Rows and model results that reach the edges: bounds, defaults, scores 0 and 1, fallbacks."""
    chooser = random.Random(20261203)
    scores = [0.0, 1.0, 0.5, 0.3, 0.6, 0.25, 0.75, 0.1, 0.9]
    scores += [float(r) for r in (str(round(x, 3)) for x in np.linspace(0.0, 1.0, 41))]
    rows: list[ValidRow] = []
    for _ in range(count):
        numeric: dict[str, float] = {}
        categorical: dict[str, str] = {}
        for name, field in spec.features.fields.items():
            if isinstance(field, NumericField):
                low = field.min if field.min is not None else -1e6
                high = field.max if field.max is not None else 1e6
                edges = [low, high, field.default if field.default is not None else low, 0.0, 1.0]
                edges = [v for v in edges if low <= v <= high]
                numeric[name] = (
                    chooser.choice(edges) if chooser.random() < 0.3 else chooser.uniform(low, high)
                )
            elif isinstance(field, CategoricalField):
                categorical[name] = chooser.choice(field.vocabulary)
        rows.append(ValidRow(numeric=numeric, categorical=categorical, text="sample"))
    # Labels: every string the expressions name, none at all, and one they do not name.
    expressions = [spec.decision.risk_score, *(rule.when for rule in spec.decision.rules)]
    labels = sorted({"", "sample"} | {m[1:-1] for e in expressions for m in STRING_LITERAL.findall(e)})
    per_model = {
        name: [
            ModelResult(
                name=name,
                version="sample",
                score=chooser.choice(scores) if chooser.random() < 0.5 else chooser.random(),
                label=chooser.choice(labels),
                fallback=chooser.random() < 0.1,
                fallback_reason="sample",
            )
            for _ in range(count)
        ]
        for name in spec.models
    }
    return rows, per_model


def _unavailable(name: str, result: ModelResult) -> str:
    return f"{name}: model unavailable ({result.fallback_reason}), decided without it"


def _worse(a: Outcome, b: Outcome) -> Outcome:
    return a if SEVERITY[a] >= SEVERITY[b] else b


def _clamp(value: float) -> float:
    if value != value:  # NaN
        raise ValueError("risk score is NaN")
    return min(1.0, max(0.0, value))


def _sample_row(spec: RuleScope) -> ValidRow:
    numeric: dict[str, float] = {}
    categorical: dict[str, str] = {}
    for name, field in spec.features.fields.items():
        if isinstance(field, NumericField):
            numeric[name] = field.default if field.default is not None else (field.min or 0.0)
        elif isinstance(field, CategoricalField):
            categorical[name] = field.default or field.vocabulary[0]
    return ValidRow(numeric=numeric, categorical=categorical, text="sample")


def rule_errors(spec: RuleScope) -> list[str]:
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
