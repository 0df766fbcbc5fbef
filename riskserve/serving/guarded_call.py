"""The guarded model call: breaker, timeout and fallback around one model, wherever the model runs.

A model placed in the ingress is a :class:`LocalEndpoint` (a function call on the matrix the feature stage
just built; a small batch on the event loop, a large one in a worker thread); a model in its own Serve
deployment is a :class:`RemoteEndpoint` (one handle call, the matrix by value when small, through the
object store when large). :class:`GuardedModel` wraps either the same way: a model that fails, whose
breaker is open, whose queue is full or that runs past ``timeout_ms`` is replaced by its YAML fallback,
so the pipeline still decides.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import ray
from ray.serve.exceptions import BackPressureError

from riskserve.features.stage import StageResult
from riskserve.platform.breaker import CircuitBreaker
from riskserve.platform.errors import DeadlineExceeded, InlineBusy, InvalidInput, Overloaded
from riskserve.platform.metrics import FallbackReason, ModelMetrics
from riskserve.platform.runner import ModelAnswer, ModelRunner
from riskserve.platform.shared_matrix import SharedMatrix
from riskserve.platform.tracing import (
    SPAN_MODEL,
    SPAN_MODEL_PREDICT,
    SpanKind,
    inject,
    mark_error,
    optional_span,
)
from riskserve.schema.pipeline import ModelSpec
from riskserve.schema.rules import ModelResult
from riskserve.serving.model_lane import LaneDown, Lanes

__all__ = ["GuardedModel", "LocalEndpoint", "MatrixSharer", "ModelEndpoint", "RemoteEndpoint"]


class ModelEndpoint(Protocol):
    """Where a model runs, as the guarded call sees it."""

    def runs_now(self, rows: int) -> bool:
        """Whether a batch of ``rows`` is answered on the calling thread (no await, no timeout needed)."""

    def predict_now(self, stage: StageResult) -> ModelAnswer:
        """The answer on the calling thread (only when :meth:`runs_now`); may raise ``InlineBusy``."""

    async def predict(self, stage: StageResult, trace: dict[str, str]) -> ModelAnswer:
        """The answer, off the event loop or from another process."""

    def cancel(self) -> None:
        """Give up the call in flight (a timeout): cancel remote work where possible."""


class LocalEndpoint:
    """A model inside the ingress: a function call on the stage's matrix, no copy, no hop (an LLM placed
    there, ``reads_text``, gets the decision's texts and is always awaited: its engine has a thread)."""

    def __init__(self, runner: ModelRunner, inline_rows: int, reads_text: bool = False) -> None:
        self.runner = runner
        self._inline_rows = inline_rows
        self._reads_text = reads_text

    def runs_now(self, rows: int) -> bool:
        return not self._reads_text and rows <= self._inline_rows

    def predict_now(self, stage: StageResult) -> ModelAnswer:
        return self.runner.predict_matrix_now(_matrix(stage))

    async def predict(self, stage: StageResult, trace: dict[str, str]) -> ModelAnswer:
        if self._reads_text:
            return await self.runner.predict_texts(_texts(stage))
        return await self.runner.predict_matrix(_matrix(stage))

    def cancel(self) -> None:
        """A worker thread cannot be stopped; its result is dropped (it runs microseconds a row)."""


def _texts(stage: StageResult) -> list[str]:
    """The batch's texts a text model labels: the rows without one get no call (see ``_results``)."""
    return [text for text in stage.texts if text.strip()]


def _matrix(stage: StageResult) -> Any:
    if stage.matrix is None:
        raise InvalidInput("the feature stage returned no matrix", field="features")
    return stage.matrix


class MatrixSharer:
    """Puts a matrix in Ray's object store once per decision batch, for every remote model that reads it.

    The ingress owns each ref and keeps it for ``retain_s``: the ref reaches the model inside a Serve
    request, which Ray's borrowing protocol does not track, so the owner must outlive the read.
    """

    def __init__(self, by_value_rows: int, retain_s: float) -> None:
        self.by_value_rows = by_value_rows
        self._retain_s = retain_s
        self._retained: collections.deque[tuple[float, Any]] = collections.deque()
        self.last_batch_id = ""
        """The id of the last matrix put (tests ask a model replica how it read that batch)."""

    def shared(self, stage: StageResult) -> SharedMatrix | Any:
        """What to send a remote model: the matrix itself when small, a shared ref when large."""
        if stage.shared is not None:
            if stage.rows_count > self.by_value_rows or stage.matrix is None:
                return stage.shared
            return stage.matrix
        matrix = _matrix(stage)
        if matrix.shape[0] <= self.by_value_rows:
            return matrix
        if stage.put is None:
            ref = ray.put(matrix)
            now = time.monotonic()
            self._retained.append((now + self._retain_s, ref))
            while self._retained and self._retained[0][0] < now:
                self._retained.popleft()
            batch_id = uuid.uuid4().hex
            stage.put = SharedMatrix(
                ref=ref, rows=int(matrix.shape[0]), columns=stage.columns, batch_id=batch_id
            )
            self.last_batch_id = batch_id
        return stage.put


class RemoteEndpoint:
    """A model in its own Serve deployment: one call per batch, through a replica's loopback lane when one
    runs on this node (:mod:`~riskserve.serving.model_lane`), else through the Serve handle."""

    def __init__(
        self, handle: Any, reads_text: bool, sharer: MatrixSharer, lanes: Lanes | None = None
    ) -> None:
        self._handle = handle
        self._reads_text = reads_text
        self._sharer = sharer
        self.lanes = lanes
        self.lane_calls = 0
        """Calls a lane answered (the rest went through the handle: :attr:`handle_calls`)."""
        self.handle_calls = 0

    def runs_now(self, rows: int) -> bool:
        return False

    def predict_now(self, stage: StageResult) -> ModelAnswer:
        raise InlineBusy("a remote model is never called inline")

    async def predict(self, stage: StageResult, trace: dict[str, str]) -> ModelAnswer:
        lanes = self.lanes
        if self._reads_text:
            texts = _texts(stage)
            if lanes is not None:
                with contextlib.suppress(LaneDown):  # no lane took it: the handle does
                    return self._by_lane(await lanes.predict_texts(texts, trace))
            call = self._handle.predict_texts.remote(texts, trace=trace)
        else:
            matrix = self._sharer.shared(stage)
            if lanes is not None and not isinstance(matrix, SharedMatrix):
                with contextlib.suppress(LaneDown):
                    return self._by_lane(await lanes.predict_features(matrix, trace))
            call = self._handle.predict_features.remote(matrix, trace=trace)
        self.handle_calls += 1
        try:
            answer: ModelAnswer = await call
        except asyncio.CancelledError:
            call.cancel()
            raise
        return answer

    def _by_lane(self, answer: ModelAnswer) -> ModelAnswer:
        self.lane_calls += 1
        return answer

    def cancel(self) -> None:
        """Cancellation reaches the replica through the awaited response (see :meth:`predict`)."""


def breaker_for(name: str, spec: ModelSpec, metrics: ModelMetrics) -> CircuitBreaker:
    """The model's breaker, its transitions exported as the breaker-state metric."""
    breaker = CircuitBreaker(
        spec.breaker, name=name, on_transition=lambda old, new: metrics.breaker_state(new)
    )
    metrics.breaker_state(breaker.state)
    return breaker


@dataclass
class GuardedModel:
    """One model of the pipeline behind its breaker, timeout and fallback."""

    name: str
    spec: ModelSpec
    endpoint: ModelEndpoint
    metrics: ModelMetrics
    breaker: CircuitBreaker

    @classmethod
    def build(cls, name: str, spec: ModelSpec, endpoint: ModelEndpoint) -> GuardedModel:
        metrics = ModelMetrics(name, spec.kind)
        return cls(name, spec, endpoint, metrics, breaker_for(name, spec, metrics))

    def runs_now(self, stage: StageResult) -> bool:
        """Whether this batch is answered on the calling thread (:meth:`call_now`)."""
        return self.endpoint.runs_now(stage.rows_count)

    def call_now(self, stage: StageResult, deadline: float, traced: bool) -> list[ModelResult]:
        """The results on the calling thread: a function call of microseconds, so no timer is set; the
        breaker still sees it (slow if past ``timeout_ms``, failed if it raised).

        Unsampled (``traced`` false, nearly every decision) no span object, attribute dict or context
        manager is made at all: they recorded nothing and cost each model of each decision about 2.5 µs.
        """
        if not traced:
            return self._now(stage, deadline, False)
        with self._span(stage, True) as span:
            return self._traced(span, self._now(stage, deadline, True))

    def _now(self, stage: StageResult, deadline: float, traced: bool) -> list[ModelResult]:
        """:meth:`call_now` inside its span (if any): deadline, breaker, the call, its fallback."""
        started = time.monotonic()
        if started >= deadline:
            raise DeadlineExceeded("the decision's deadline passed before the models ran")
        permit = self.breaker.try_acquire()
        if permit is None:
            return self._fallback(stage, "CIRCUIT_OPEN", started)
        try:
            if traced:
                with self._predict_span(stage, True):
                    answer = self.endpoint.predict_now(stage)
            else:
                answer = self.endpoint.predict_now(stage)
        except InlineBusy:
            permit.ignore()
            raise
        except InvalidInput:
            permit.ignore()  # a client error never counts against the model
            raise
        except Exception:
            permit.failure(time.monotonic() - started)
            return self._fallback(stage, "ERROR", started)
        permit.success(time.monotonic() - started)
        return self._results(stage, answer)

    async def call(self, stage: StageResult, deadline: float, traced: bool) -> list[ModelResult]:
        """The results for the whole batch, awaited within min(``timeout_ms``, the decision's deadline)."""
        with self._span(stage, traced) as span:
            return self._traced(span, await self._call(stage, deadline, inject() if traced else {}))

    def _span(self, stage: StageResult, traced: bool) -> Any:
        attributes: dict[str, str | int] = {
            "model.name": self.name,
            "model.kind": self.spec.kind,
            "rows": stage.rows_count,
        }
        return optional_span(traced, SPAN_MODEL, kind=SpanKind.CLIENT, attributes=attributes)

    def _predict_span(self, stage: StageResult, traced: bool) -> Any:
        """The model's own work, as a model replica records it; remote replicas record their own."""
        local = isinstance(self.endpoint, LocalEndpoint)
        attributes: dict[str, str | int] = {"model.name": self.name, "rows": stage.rows_count}
        return optional_span(traced and local, SPAN_MODEL_PREDICT, attributes=attributes)

    @staticmethod
    def _traced(span: Any, results: list[ModelResult]) -> list[ModelResult]:
        first = results[0]
        span.set_attributes(
            {
                "model.version": first.version,
                "model.fallback": first.fallback,
                "model.fallback_reason": first.fallback_reason,
            }
        )
        if first.fallback:
            mark_error(first.fallback_reason, span)
        return results

    async def _call(self, stage: StageResult, deadline: float, trace: dict[str, str]) -> list[ModelResult]:
        spec = self.spec
        if spec.reads_text and not any(text.strip() for text in stage.texts):
            return [ModelResult(name=self.name, version="", score=0.0) for _ in range(stage.rows_count)]
        started = time.monotonic()
        permit = self.breaker.try_acquire()
        if permit is None:
            return self._fallback(stage, "CIRCUIT_OPEN", started)
        budget = min(spec.timeout_ms / 1e3, deadline - started)
        if budget <= 0:
            permit.ignore()
            raise DeadlineExceeded("the decision's deadline passed before the models ran")
        try:
            # asyncio.timeout, not wait_for: no second task, so the call reaches its socket in this task's
            # first step (the flow lets remote calls take that step before it runs the inline models)
            with self._predict_span(stage, bool(trace)):
                async with asyncio.timeout(budget):
                    answer = await self.endpoint.predict(stage, trace)
        except TimeoutError:
            self.endpoint.cancel()
            if spec.timeout_ms / 1e3 > budget:
                permit.ignore()  # the caller's deadline ran out, not the model's budget
            else:
                permit.failure(time.monotonic() - started)
            return self._fallback(stage, "TIMEOUT", started)
        except asyncio.CancelledError:
            permit.ignore()
            raise
        except Exception as error:
            cause = getattr(error, "cause", error)
            if isinstance(cause, (BackPressureError, Overloaded)) or isinstance(error, BackPressureError):
                permit.ignore()  # our queue limit, not the model's health
                return self._fallback(stage, "OVERLOADED", started)
            if isinstance(cause, InvalidInput):
                permit.ignore()  # a client error never counts against the model
                raise cause from error
            permit.failure(time.monotonic() - started)
            return self._fallback(stage, "ERROR", started)
        permit.success(time.monotonic() - started)
        return self._results(stage, answer)

    def _results(self, stage: StageResult, answer: ModelAnswer) -> list[ModelResult]:
        """One result per row; a text model's answers go to the rows that had a text."""
        name, version, latency_ms = self.name, answer.version, answer.latency_ms
        labels = answer.labels or [""] * len(answer.scores)
        if not self.spec.reads_text:
            return [  # positional: half the cost of keywords, on every row of every batch
                ModelResult(name, version, s, label, False, "", latency_ms)
                for s, label in zip(answer.scores, labels, strict=True)
            ]
        with_text = [i for i, text in enumerate(stage.texts) if text.strip()]
        out = [ModelResult(name=name, version=version, score=0.0, latency_ms=latency_ms)] * stage.rows_count
        for row, score, label in zip(with_text, answer.scores, labels, strict=True):
            out[row] = ModelResult(
                name=name, version=version, score=score, label=label, latency_ms=latency_ms
            )
        return out

    def _fallback(self, stage: StageResult, reason: FallbackReason, started: float) -> list[ModelResult]:
        self.metrics.fallback(reason)
        fallback = self.spec.fallback
        result = ModelResult(
            name=self.name,
            version="",
            score=fallback.score if fallback.score is not None else 0.0,
            label=fallback.label or "",
            fallback=True,
            fallback_reason=reason,
            latency_ms=(time.monotonic() - started) * 1e3,
        )
        return [result] * stage.rows_count
