"""Reason codes: which request fields pushed a decision's score up, by how much, in the YAML's words.

Computed in the ingress, where the models live, after the rules decided, and only for the outcomes the
pipeline's ``reasons.for`` lists, so an APPROVE pays nothing. Each tabular model attributes its margin
(log-odds) exactly to its columns (:meth:`ModelRunner.contributions`); the columns are summed back to the
request field that produced them (a one-hot block to its categorical field, a transformed column to its
numeric field), so contributions plus the model's bias equal its margin. The text model contributes its
label and score when the YAML gives that label a text.

A reason names one field once: across models, a field's strongest positive contribution is the one kept,
then the fields are ranked by it. The text model's reason, when there is one, comes first (its
``contribution`` is the label's probability, not log-odds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from riskserve.features.encoder import ValidRow
from riskserve.platform.errors import ConfigError
from riskserve.platform.outcome import Outcome
from riskserve.platform.runner import ModelRunner
from riskserve.platform.validation import FeatureMatrix
from riskserve.schema.pipeline import PipelineSpec, ReasonsSpec
from riskserve.schema.rules import ModelResult

__all__ = ["FEW_ROWS", "INLINE_BUDGET_US", "Reason", "ReasonExplainer", "field_map"]

INLINE_BUDGET_US = 500.0
"""Reasons estimated to cost more than this run in a worker thread: one declined row (~80 µs of tree
tables and coefficients) stays on the event loop, a large batch leaves it."""

FEW_ROWS = 4
"""Batches of at most this many explained rows are ranked in plain Python (one declined row: ~15 µs
against ~80 µs of small numpy calls), larger ones as whole-batch numpy."""


@dataclass(frozen=True)
class Reason:
    """One reason of a decision: the field, its words, how much it raised the model's score, and which."""

    field: str
    text: str
    contribution: float
    """Log-odds added to ``model``'s margin by this field (the text model: its label's probability)."""
    model: str
    value: str = ""
    """The field's value as the caller sent it (the text model: its label)."""


def field_map(
    columns: Sequence[str], column_fields: Mapping[str, str], fields: Sequence[str]
) -> NDArray[np.float64]:
    """The 0/1 matrix (columns × fields) that sums per-column attributions into per-field ones.

    Raises:
        ConfigError: a column the features do not produce.
    """
    index = {name: j for j, name in enumerate(fields)}
    out = np.zeros((len(columns), len(fields)), dtype=np.float64)
    for i, column in enumerate(columns):
        field = column_fields.get(column)
        if field is None:
            raise ConfigError(f"column '{column}' is not produced by the features")
        out[i, index[field]] = 1.0
    return out


class ReasonExplainer:
    """Computes the reasons of decided rows, from the runners of the models placed in the ingress."""

    def __init__(self, spec: PipelineSpec, runners: Mapping[str, ModelRunner]) -> None:
        if spec.reasons is None:
            raise ConfigError(f"pipeline '{spec.name}' has no reasons section")
        self.settings: ReasonsSpec = spec.reasons
        self.outcomes: frozenset[Outcome] = frozenset(self.settings.for_)
        chosen = self.settings.models
        self._tabular = {
            name: runner
            for name, runner in runners.items()
            if (chosen is None or name in chosen) and spec.models[name].kind in ("treelite", "sklearn")
        }
        self._text_models = [
            name
            for name, model in spec.models.items()
            if model.reads_text and (chosen is None or name in chosen)
        ]
        self._text_field = spec.features.text_field or "text"
        self._column_fields = spec.features.column_fields()
        self._fields = [name for name in spec.features.fields if name != spec.features.text_field]
        self._maps: dict[tuple[str, tuple[str, ...]], NDArray[np.float64]] = {}
        self.rows_explained = 0
        """Rows this explainer computed reasons for (tests prove an APPROVE costs nothing)."""

    def inline_for(self, rows: int) -> bool:
        """Whether explaining ``rows`` rows costs at most :data:`INLINE_BUDGET_US` and may run on the event
        loop (a thread hop costs more); asked per call, since a swap may change what a model costs."""
        cost = sum(runner.contributions_us_per_row() for runner in self._tabular.values())
        return cost * rows <= INLINE_BUDGET_US

    def wanted(self, outcome: str) -> bool:
        """Whether decisions of ``outcome`` carry reasons."""
        return outcome in self.outcomes

    def field_contributions(self, name: str, matrix: FeatureMatrix) -> tuple[NDArray[np.float64], str]:
        """One model's per-field contributions of every row (rows × fields, fields in spec order), and the
        version that computed them."""
        contributions = self._tabular[name].contributions(matrix)
        key = (name, contributions.columns)
        mapping = self._maps.get(key)
        if mapping is None:
            mapping = field_map(contributions.columns, self._column_fields, self._fields)
            self._maps[key] = mapping
        return contributions.values @ mapping, contributions.version

    def explain(
        self,
        matrix: FeatureMatrix,
        rows: Sequence[ValidRow],
        results: Sequence[Mapping[str, ModelResult]],
    ) -> list[list[Reason]]:
        """The reasons of each row of ``matrix`` (blocking; see :attr:`inline`).

        A model that fell back for a row, or whose serving version changed since it scored the row (a
        swap in between), gives that row no reasons.
        """
        top = self.settings.top
        best, model_of, order = self._strongest(matrix, results)
        out: list[list[Reason]] = []
        for i, (row, answers) in enumerate(zip(rows, results, strict=True)):
            reasons = self._text_reasons(answers)
            for rank, j in enumerate(order[i][: max(top - len(reasons), 0)]):
                value = best[i][rank]
                if not value > self.settings.min_contribution:
                    break  # strongest first: the rest are weaker still
                field = self._fields[j]
                reasons.append(
                    Reason(
                        field=field,
                        text=self.settings.texts.get(field, field),
                        contribution=value,
                        model=model_of[i][rank],
                        value=_value(row, field),
                    )
                )
            out.append(reasons[:top])
        self.rows_explained += len(out)
        return out

    def _strongest(
        self, matrix: FeatureMatrix, results: Sequence[Mapping[str, ModelResult]]
    ) -> tuple[list[list[float]], list[list[str]], list[list[int]]]:  # (values, models, fields)
        """Each row's ``top`` strongest field indexes, strongest first (ties in field order) and, in that
        order, the field's largest contribution from any model that scored the row with the version that
        computed it (``-inf`` when none did) and that model's name. Whole-batch numpy: no Python loop over
        fields, and only the ``top`` columns a row can use are turned into lists; a few rows (a declined
        decision) go through :meth:`_strongest_few` instead, since a dozen small numpy calls cost more
        than the row's arithmetic."""
        names = list(self._tabular)
        if len(results) <= FEW_ROWS:
            return self._strongest_few(names, matrix, results)
        rows, fields = len(results), len(self._fields)
        stacked = np.full((max(len(names), 1), rows, fields), -np.inf)
        for k, name in enumerate(names):
            values, version = self.field_contributions(name, matrix)
            usable = np.fromiter(
                (_scored_by(answers.get(name), version) for answers in results), dtype=bool, count=rows
            )
            stacked[k][usable] = values[usable]
        best = stacked.max(axis=0)
        order = np.argsort(-best, axis=1, kind="stable")[:, : self.settings.top]
        model_index = stacked.argmax(axis=0)  # the first model on a tie, as they are listed
        model_names = np.array(names or [""], dtype=object)
        return (
            np.take_along_axis(best, order, axis=1).tolist(),
            model_names[np.take_along_axis(model_index, order, axis=1)].tolist(),
            order.tolist(),
        )

    def _strongest_few(
        self, names: list[str], matrix: FeatureMatrix, results: Sequence[Mapping[str, ModelResult]]
    ) -> tuple[list[list[float]], list[list[str]], list[list[int]]]:
        """:meth:`_strongest` row by row in plain Python, with the same ties: fields in field order, models
        in the order listed (a later model replaces an earlier one only when strictly larger)."""
        fields, top = len(self._fields), self.settings.top
        per_model = [(name, *self.field_contributions(name, matrix)) for name in names]
        values_out: list[list[float]] = []
        models_out: list[list[str]] = []
        order_out: list[list[int]] = []
        for i, answers in enumerate(results):
            best = [-math.inf] * fields
            model_of = [names[0] if names else ""] * fields
            for name, values, version in per_model:
                if not _scored_by(answers.get(name), version):
                    continue
                for j, value in enumerate(values[i].tolist()):
                    if value > best[j]:
                        best[j], model_of[j] = value, name
            order = sorted(range(fields), key=lambda j: -best[j])[:top]  # stable: ties in field order
            values_out.append([best[j] for j in order])
            models_out.append([model_of[j] for j in order])
            order_out.append(order)
        return values_out, models_out, order_out

    def _text_reasons(self, answers: Mapping[str, ModelResult]) -> list[Reason]:
        reasons = []
        for name in self._text_models:
            result = answers.get(name)
            if result is None or result.fallback or result.label not in self.settings.labels:
                continue
            reasons.append(
                Reason(
                    field=self._text_field,
                    text=self.settings.labels[result.label],
                    contribution=result.score,
                    model=name,
                    value=result.label,
                )
            )
        return reasons


def _scored_by(result: ModelResult | None, version: str) -> bool:
    """Whether ``result`` is the model's own score, from the version whose contributions we hold (not a
    fallback, not a version swapped out since)."""
    return result is not None and not result.fallback and result.version == version


def _value(row: ValidRow, field: str) -> str:
    if field in row.numeric:
        return f"{row.numeric[field]:g}"
    return row.categorical.get(field, "")
