"""Shadow models: a verified candidate scores a sample of live decisions beside the serving model, off the
request path, and never in the answer.

Each ingress replica holds the shadows its Serve ``user_config`` names (``riskserve shadow`` publishes them
like a swap publishes artifacts). After a decision batch is answered, a sample of its rows (``sample``) is
queued for a background task on the replica's event loop, which works only while no decision is in flight
there (:class:`IdleGate`): in chunks of 16 rows it scores them with the candidate (inline, microseconds)
and runs the rules again with the candidate's score in place of the serving model's, then yields. A
sample that finds ``max_in_flight`` samples already queued is dropped (counted): under load the shadow
loses rows, and the decisions no time beyond one chunk's tens of microseconds.

:class:`ShadowComparison` keeps the figures: rows compared, the two scores' Pearson correlation and mean
difference (candidate - serving), decisions that would flip (by outcome pair), both models' latency, and,
once labels arrive through ``Feedback``, both models' log-loss and AUC on the same labelled decisions.
The figures are those of one ingress replica (``riskserve shadow status`` asks each; the metrics carry
every replica's counts).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel as _Schema
from pydantic import ConfigDict, Field

from riskserve.features.encoder import ValidRow
from riskserve.features.stage import StageResult
from riskserve.platform.errors import InvalidInput, RiskServeError
from riskserve.platform.metrics import ShadowMetrics
from riskserve.platform.runner import ModelRunner
from riskserve.schema.pipeline import PipelineSpec
from riskserve.schema.rules import Decision, DecisionEngine, ModelResult
from riskserve.wrappers import backend

__all__ = ["IdleGate", "ShadowComparison", "ShadowFigures", "ShadowModel", "ShadowSettings", "Shadows"]

logger = logging.getLogger(__name__)

_LATENCY_SAMPLES = 10_000
"""Latencies kept per model for the percentiles (the most recent)."""
FIGURES_EVERY_S = 1.0
"""How often a shadow's correlation and mean difference gauges are updated (its counters: every chunk)."""
CHUNK_ROWS = 16
"""Rows a shadow scores and re-decides at a time on the event loop (tens of µs) before it yields again."""
_PAIRS_KEPT = 200_000
"""Compared decisions kept (newest) for labels to join; older ones can no longer be labelled."""


class ShadowSettings(_Schema):
    """One shadow, as ``riskserve shadow`` publishes it to the ingress replicas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    artifact: str = Field(min_length=1)
    """The candidate's artifact directory (verified like a swap candidate before it is loaded)."""
    sample: float = Field(default=0.2, gt=0, le=1)
    """Share of live decisions the candidate also scores."""
    max_in_flight: int = Field(default=4, ge=1, le=64)
    """Sampled batches waiting for or being scored by the candidate per replica; a sample past this is
    dropped."""


class ShadowFigures(_Schema):
    """What a shadow has shown so far (``riskserve shadow status``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    serving_version: str
    candidate_version: str
    artifact: str
    sample: float
    compared: int
    """Decisions scored by both models (the serving one not a fallback)."""
    dropped: int
    """Sampled decisions the shadow dropped because it was busy (under load) or failed."""
    failed: int
    """Sampled decisions the candidate failed to score."""
    score_correlation: float | None
    """Pearson correlation of the two scores (None below 2 rows or with a constant score)."""
    mean_difference: float | None
    """Mean of candidate score - serving score."""
    flips: dict[str, int]
    """Decisions whose outcome the candidate would change, by ``SERVING->CANDIDATE``."""
    serving_latency_ms: dict[str, float]
    """p50 and p99 of the serving model's calls on the compared batches."""
    candidate_latency_ms: dict[str, float]
    """p50 and p99 of the candidate's calls (off the request path)."""
    labelled: int
    """Compared decisions whose true label arrived through ``Feedback`` (on this replica)."""
    serving_logloss: float | None
    candidate_logloss: float | None
    serving_auc: float | None
    """None until the labelled decisions hold both classes."""
    candidate_auc: float | None
    error: str = ""
    """Why the shadow is not running, if it is not (a candidate refused at load)."""
    replica: str = ""
    """The ingress replica (Ray actor id) these figures are from: each replica compares its own sample."""


@dataclass
class ShadowComparison:
    """The running figures of one serving model against one candidate (pure: no I/O, no clock)."""

    compared: int = 0
    dropped: int = 0
    failed: int = 0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _syy: float = 0.0
    _sxy: float = 0.0
    flips: collections.Counter[str] = field(default_factory=collections.Counter)
    serving_latency_ms: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=_LATENCY_SAMPLES)
    )
    candidate_latency_ms: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=_LATENCY_SAMPLES)
    )
    _pairs: collections.OrderedDict[str, tuple[float, float]] = field(default_factory=collections.OrderedDict)
    labels: list[tuple[int, float, float]] = field(default_factory=list)
    """(label, serving score, candidate score) of every labelled compared decision."""

    def add(self, request_id: str, serving: float, candidate: float, outcomes: tuple[str, str]) -> None:
        """One decision scored by both: the scores and the outcomes (serving, candidate)."""
        self.compared += 1
        self._sx += serving
        self._sy += candidate
        self._sxx += serving * serving
        self._syy += candidate * candidate
        self._sxy += serving * candidate
        if outcomes[0] != outcomes[1]:
            self.flips[f"{outcomes[0]}->{outcomes[1]}"] += 1
        self._pairs[request_id] = (serving, candidate)
        if len(self._pairs) > _PAIRS_KEPT:
            self._pairs.popitem(last=False)

    def label(self, request_id: str, label: int) -> bool:
        """Join a true label to a compared decision; False when this replica did not compare it."""
        pair = self._pairs.pop(request_id, None)
        if pair is None:
            return False
        self.labels.append((label, *pair))
        return True

    @property
    def correlation(self) -> float | None:
        """Pearson correlation of the serving and candidate scores."""
        n = self.compared
        if n < 2:
            return None
        sxx = self._sxx - self._sx * self._sx / n
        syy = self._syy - self._sy * self._sy / n
        if sxx <= 0 or syy <= 0:
            return None
        return (self._sxy - self._sx * self._sy / n) / math.sqrt(sxx * syy)

    @property
    def mean_difference(self) -> float | None:
        """Mean of candidate - serving score."""
        return (self._sy - self._sx) / self.compared if self.compared else None

    def quality(self) -> dict[str, float | None]:
        """Both models' log-loss and AUC on the same labelled decisions."""
        out: dict[str, float | None] = dict.fromkeys(
            ("serving_logloss", "candidate_logloss", "serving_auc", "candidate_auc")
        )
        if not self.labels:
            return out
        data = np.asarray(self.labels, dtype=np.float64)
        y = data[:, 0]
        for which, column in (("serving", 1), ("candidate", 2)):
            p = np.clip(data[:, column], 1e-15, 1 - 1e-15)
            out[f"{which}_logloss"] = float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
            out[f"{which}_auc"] = _auc(y, data[:, column])
        return out


def _auc(y: np.ndarray[Any, Any], scores: np.ndarray[Any, Any]) -> float | None:
    """ROC AUC by the rank-sum (Mann-Whitney) formula, ties averaged; None without both classes."""
    positives = int(y.sum())
    negatives = len(y) - positives
    if positives == 0 or negatives == 0:
        return None
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):  # average ranks over ties
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[y == 1].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    last = len(ordered) - 1
    return {"p50": ordered[round(0.5 * last)], "p99": ordered[round(0.99 * last)]}


class IdleGate:
    """Counts the decisions in flight on an ingress replica's event loop; shadows work only while none is."""

    def __init__(self) -> None:
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        """A decision call started."""
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        """A decision call ended."""
        self.in_flight -= 1
        if self.in_flight <= 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no decision is in flight."""
        await self._idle.wait()


@dataclass
class _Sampled:
    """The rows of one answered batch a shadow scores: their features, ids and serving results."""

    matrix: np.ndarray[Any, Any]
    ids: list[str]
    rows: list[ValidRow]
    results: list[dict[str, ModelResult]]
    outcomes: list[str]


class ShadowModel:
    """One candidate beside one serving model of the ingress, and its comparison."""

    def __init__(
        self,
        model: str,
        settings: ShadowSettings,
        candidate: ModelRunner,
        engine: DecisionEngine,
        metrics: ShadowMetrics,
        gate: IdleGate,
        *,
        chance: Callable[[], float] = random.random,
    ) -> None:
        self.model = model
        self.settings = settings
        self.candidate = candidate
        self.comparison = ShadowComparison()
        self._engine = engine
        self._metrics = metrics
        self._chance = chance
        self._gate = gate
        self._figures_at = -math.inf
        self._tasks: set[asyncio.Task[None]] = set()

    def offer(
        self,
        stage: StageResult,
        ids: Sequence[str],
        decided: Sequence[tuple[Decision, dict[str, ModelResult]]],
    ) -> None:
        """Hand a sample of an answered batch to the candidate, in the background; drop it if busy."""
        if stage.matrix is None:
            return
        picked = [
            i
            for i, (_, results) in enumerate(decided)
            if not results[self.model].fallback and self._chance() < self.settings.sample
        ]
        if not picked:
            return
        if len(self._tasks) >= self.settings.max_in_flight:
            self.comparison.dropped += len(picked)
            self._metrics.dropped(len(picked))
            return
        sampled = _Sampled(
            matrix=stage.matrix[picked],
            ids=[ids[i] for i in picked],
            rows=[stage.rows[i] for i in picked],
            results=[decided[i][1] for i in picked],
            outcomes=[decided[i][0].outcome for i in picked],
        )
        task = asyncio.get_running_loop().create_task(self._score(sampled))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _score(self, sampled: _Sampled) -> None:
        """Score the sample in chunks, each only while no decision is in flight on this replica."""
        comparison = self.comparison
        comparison.serving_latency_ms.append(sampled.results[0][self.model].latency_ms)
        for start in range(0, len(sampled.ids), CHUNK_ROWS):
            await self._gate.wait_idle()
            end = min(start + CHUNK_ROWS, len(sampled.ids))
            try:  # a compiled or linear model scores a chunk inline in microseconds
                answer = self.candidate.predict_matrix_now(sampled.matrix[start:end])
            except Exception as error:  # the candidate's failure never reaches a decision
                logger.warning("shadow of '%s' failed to score %d rows: %s", self.model, end - start, error)
                comparison.failed += len(sampled.ids) - start
                comparison.dropped += len(sampled.ids) - start
                self._metrics.dropped(len(sampled.ids) - start)
                return
            comparison.candidate_latency_ms.append(answer.latency_ms)
            self._metrics.latency(answer.latency_ms / 1e3)
            for i, score in enumerate(answer.scores, start=start):
                results = sampled.results[i]
                serving = results[self.model]
                candidate = serving.replace(score=score, version=answer.version)
                outcome = self._engine.decide(sampled.rows[i], {**results, self.model: candidate}).outcome
                comparison.add(sampled.ids[i], serving.score, score, (sampled.outcomes[i], outcome))
                if outcome != sampled.outcomes[i]:
                    self._metrics.flip(sampled.outcomes[i], outcome)
            now = time.monotonic()
            if now - self._figures_at >= FIGURES_EVERY_S:  # gauges: a Ray call each, so not every chunk
                self._figures_at = now
                self._metrics.compared(end - start, comparison.correlation, comparison.mean_difference)
            else:
                self._metrics.compared(end - start, None, None)
            await asyncio.sleep(0)  # a decision that arrived meanwhile goes first

    async def idle(self) -> None:
        """Wait until every sample handed over so far is scored (tests, and before a figure is read)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Finish the samples in flight, unload the candidate and stop exporting its figures."""
        await self.idle()
        await self.candidate.stop()
        self._metrics.forget()

    def label(self, request_id: str, label: int) -> None:
        """A true label arrived for a decision: join it if this shadow compared it."""
        if self.comparison.label(request_id, label):
            self._metrics.quality(self.comparison.quality())

    def figures(self, serving_version: str) -> ShadowFigures:
        """The comparison so far."""
        comparison = self.comparison
        return ShadowFigures(
            model=self.model,
            serving_version=serving_version,
            candidate_version=self.candidate.status().version or "",
            artifact=self.settings.artifact,
            sample=self.settings.sample,
            compared=comparison.compared,
            dropped=comparison.dropped,
            failed=comparison.failed,
            score_correlation=comparison.correlation,
            mean_difference=comparison.mean_difference,
            flips=dict(comparison.flips),
            serving_latency_ms=_percentiles(comparison.serving_latency_ms),
            candidate_latency_ms=_percentiles(comparison.candidate_latency_ms),
            labelled=len(comparison.labels),
            **comparison.quality(),
        )


class Shadows:
    """The shadows of one ingress replica: loaded from its ``user_config``, offered every answered batch."""

    def __init__(self, spec: PipelineSpec, runners: Mapping[str, ModelRunner]) -> None:
        self._spec = spec
        self._runners = runners
        self._engine = spec.decision_engine()
        self.gate = IdleGate()
        """The flow enters and leaves it around every decision call; the shadows wait for it to be idle."""
        self.active: dict[str, ShadowModel] = {}
        self.errors: dict[str, tuple[ShadowSettings, str]] = {}

    def config(self) -> dict[str, dict[str, Any]]:
        """The shadows this replica runs or was asked to run, as published (to keep them on a redeploy)."""
        out = {model: shadow.settings.model_dump() for model, shadow in self.active.items()}
        out.update({model: settings.model_dump() for model, (settings, _) in self.errors.items()})
        return out

    async def configure(self, config: Mapping[str, Mapping[str, Any]]) -> None:
        """Run exactly the shadows ``config`` names: load new ones (verified), unload the others.

        A candidate that fails its checks is not run; why is kept for ``status`` (a ``reconfigure`` must
        not fail: it would take the replica's serving models down with it).
        """
        wanted = {model: ShadowSettings.model_validate(settings) for model, settings in config.items()}
        for model in list(self.active):
            if wanted.get(model) != self.active[model].settings:
                await self.active.pop(model).close()
        self.errors = {}  # a refused candidate is tried again (its artifact may have been fixed in place)
        for model, settings in wanted.items():
            if model in self.active:
                continue
            try:
                self.active[model] = await self._load(model, settings)
            except (RiskServeError, ValueError) as error:
                logger.error("shadow of '%s' refused: %s", model, error)
                self.errors[model] = (settings, str(error))

    async def _load(self, model: str, settings: ShadowSettings) -> ShadowModel:
        serving = self._runners.get(model)
        if serving is None:
            raise InvalidInput(
                f"only models placed in the ingress can be shadowed; '{model}' is not one of "
                f"{sorted(self._runners)}",
                field="model",
            )
        report = await serving.verify_candidate(settings.artifact)  # the swap's checks, nothing served
        spec = self._spec.models[model]
        candidate = ModelRunner(
            f"{model}-shadow", spec.kind, dict(spec.settings), self._spec.features.column_names(),
            self._spec.model_columns(model), backends=backend, placement="ingress",
        )  # fmt: skip
        await candidate.serve(settings.artifact)
        metrics = ShadowMetrics(self._spec.name, model, report.version)
        return ShadowModel(model, settings, candidate, self._engine, metrics, self.gate)

    def offer(
        self,
        stage: StageResult,
        ids: Sequence[str],
        decided: Sequence[tuple[Decision, dict[str, ModelResult]]],
    ) -> None:
        """Offer an answered batch to every shadow."""
        for shadow in self.active.values():
            shadow.offer(stage, ids, decided)

    def label(self, request_id: str, label: int) -> None:
        """A true label arrived through ``Feedback``."""
        for shadow in self.active.values():
            shadow.label(request_id, label)

    async def idle(self) -> None:
        """Wait for every shadow's samples in flight."""
        for shadow in list(self.active.values()):
            await shadow.idle()

    def figures(self, versions: Mapping[str, str]) -> list[ShadowFigures]:
        """Every shadow's figures (a refused one with its error and no figures)."""
        out = [shadow.figures(versions.get(model, "")) for model, shadow in self.active.items()]
        for model, (settings, error) in self.errors.items():
            out.append(_refused(model, settings, versions.get(model, ""), error))
        return out

    async def stop(self) -> None:
        """Unload every candidate (the replica is shutting down)."""
        for shadow in self.active.values():
            await shadow.close()
        self.active.clear()


def _refused(model: str, settings: ShadowSettings, serving_version: str, error: str) -> ShadowFigures:
    return ShadowFigures(
        model=model, serving_version=serving_version, candidate_version="", artifact=settings.artifact,
        sample=settings.sample, compared=0, dropped=0, failed=0, score_correlation=None,
        mean_difference=None, flips={}, serving_latency_ms={}, candidate_latency_ms={}, labelled=0,
        serving_logloss=None, candidate_logloss=None, serving_auc=None, candidate_auc=None, error=error,
    )  # fmt: skip
