"""The pipeline's gRPC ingress on Ray Serve: feature stage -> every model in parallel -> decision rules.

Ray Serve's gRPC proxy calls the method named like the RPC with the parsed request. Every error is turned
into its gRPC status here (never Ray's INTERNAL traceback): bad input is INVALID_ARGUMENT naming the field
and reaches no model, because the feature stage validates before any model is called. A model that fails
or runs past its ``timeout_ms`` is replaced by its YAML fallback, so the pipeline still decides.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2
from ray.serve.exceptions import BackPressureError

from riskserve.features.stage import FeatureStage, StageResult
from riskserve.learning.feedback_log import DecisionRecord
from riskserve.learning.recorder import DecisionRecorder
from riskserve.pipelines.grpc_status import set_status
from riskserve.pipelines.messages import decide_response, describe_response, raw_request
from riskserve.pipelines.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.pipelines.rules import DecisionEngine, ModelResult
from riskserve.pipelines.spec import PipelineSpec
from riskserve.platform.breaker import BreakerSettings, CircuitBreaker
from riskserve.platform.errors import DeadlineExceeded, InvalidInput, ModelUnavailable, RiskServeError
from riskserve.platform.metrics import FallbackReason, ModelMetrics, PipelineMetrics
from riskserve.platform.replica import ReplicaAnswer
from riskserve.platform.tracing import (
    SPAN_DECIDE,
    SPAN_DECISION,
    SPAN_MODEL,
    SpanKind,
    carrier_from_grpc,
    configure_tracing,
    current_trace_id,
    extract,
    inject,
    mark_error,
    shutdown_tracing,
    start_span,
)

__all__ = ["PipelineIngress"]

logger = logging.getLogger(__name__)

MAX_BATCH = 1024
INLINE_ENCODE_ROWS = 64
"""With ``serving.feature_stage: ingress``, batches up to this many rows are encoded on the event loop
(tens of µs a row); larger ones in a worker thread, so the loop keeps serving other calls."""
HEALTH_PROBE_TIMEOUT_S = 1.0
"""A model that does not answer its metadata call within this is counted as having no healthy replica."""
WATCH_INTERVAL_S = 1.0
SERVICE_NAME = "riskserve.v1.RiskPipeline"
DEADLINE_METADATA = "riskserve-timeout-ms"
"""Metadata key with the caller's remaining time budget in ms (Ray's proxy hides the gRPC deadline)."""
FEEDBACK_FLUSH_TIMEOUT_S = 5.0
"""How long ``Feedback`` waits for this replica's buffered decisions to reach the log."""


def _deadline(context: Any, default_ms: float) -> float:
    """Monotonic time by which to answer: the caller's budget, capped by the pipeline's own."""
    budget_ms = default_ms
    for key, value in context.invocation_metadata() if context is not None else ():
        if key == DEADLINE_METADATA:
            try:
                budget_ms = min(budget_ms, float(value))
            except ValueError:
                raise InvalidInput(
                    f"'{value}' is not a number of milliseconds", field=DEADLINE_METADATA
                ) from None
    return time.monotonic() + budget_ms / 1e3


class PipelineIngress:
    """Serve deployment behind the gRPC proxy; one per pipeline (Serve application)."""

    def __init__(
        self, spec: dict[str, Any], features: Any, models: dict[str, Any], feedback: Any = None
    ) -> None:
        self._spec = PipelineSpec.model_validate(spec)
        configure_tracing(self._spec.tracing)
        self._engine = DecisionEngine(self._spec)
        self._features = features
        self._local_stage = (
            FeatureStage(spec["features"], spec.get("tracing"), self._spec.serving.matrix_retain_s)
            if self._spec.serving.feature_stage == "ingress"
            else None
        )
        self._models = models
        self._metrics = PipelineMetrics(self._spec.name)
        self._model_metrics = {name: ModelMetrics(name, m.kind) for name, m in self._spec.models.items()}
        self._breakers = {name: self._breaker(name) for name in self._spec.models}
        self._draining = False
        self._feedback = feedback
        self._recorder: DecisionRecorder | None = None
        if feedback is not None and self._spec.feedback is not None:
            self._recorder = DecisionRecorder(
                lambda records: _result(feedback.record_decisions.remote(records)),
                flush_s=self._spec.feedback.flush_ms / 1e3,
                max_rows=self._spec.feedback.buffer_rows,
            )

    def _breaker(self, name: str) -> CircuitBreaker:
        model = self._spec.models[name]
        settings = BreakerSettings(
            **model.breaker.model_dump(exclude={"slow_call_ms"}),
            slow_call_ms=model.breaker.slow_call_ms or model.timeout_ms,
        )
        metrics = self._model_metrics[name]
        breaker = CircuitBreaker(
            settings, name=name, on_transition=lambda old, new: metrics.breaker_state(new)
        )
        metrics.breaker_state(breaker.state)
        return breaker

    def _failed(self, error: Exception, span: Any, grpc_context: Any) -> None:
        """Record a failed call (an invalid field is counted by name) and set its gRPC status."""
        cause = getattr(error, "cause", error)
        if isinstance(cause, InvalidInput):
            self._metrics.invalid(cause.field or "request")
        mark_error(error, span)
        set_status(grpc_context, error)

    async def Decide(self, request: pb.DecideRequest, grpc_context: Any = None) -> pb.DecideResponse:  # noqa: N802
        """One decision, traced as one trace (continuing the caller's ``traceparent`` if it sent one)."""
        with self._root_span(grpc_context, "Decide", 1) as span:
            try:
                deadline = _deadline(grpc_context, self._spec.serving.decision_timeout_ms)
                (response,) = await self._decide([request], current_trace_id(), deadline)
            except Exception as error:  # every failure becomes a status, never Ray's INTERNAL traceback
                self._failed(error, span, grpc_context)
                return pb.DecideResponse()
            return response

    def _root_span(self, grpc_context: Any, method: str, count: int) -> Any:
        attributes: dict[str, str | int] = {
            "pipeline": self._spec.name,
            "request.count": count,
            "rpc.method": method,
        }
        context = extract(carrier_from_grpc(grpc_context)) if grpc_context is not None else None
        return start_span(SPAN_DECIDE, context=context, kind=SpanKind.SERVER, attributes=attributes)

    async def DecideBatch(  # noqa: N802
        self, request: pb.DecideBatchRequest, grpc_context: Any = None
    ) -> pb.DecideBatchResponse:
        """Many decisions in one call: one feature matrix, one call per model; same order as requested."""
        with self._root_span(grpc_context, "DecideBatch", len(request.requests)) as span:
            try:
                if not 0 < len(request.requests) <= MAX_BATCH:
                    count = len(request.requests)
                    raise InvalidInput(f"expected 1 to {MAX_BATCH} requests, got {count}", field="requests")
                deadline = _deadline(grpc_context, self._spec.serving.decision_timeout_ms)
                responses = await self._decide(list(request.requests), current_trace_id(), deadline)
            except Exception as error:
                self._failed(error, span, grpc_context)
                return pb.DecideBatchResponse()
            return pb.DecideBatchResponse(responses=responses)

    async def Describe(  # noqa: N802
        self, request: pb.DescribeRequest, grpc_context: Any = None
    ) -> pb.DescribeResponse:
        """The pipeline's features and models with their serving versions."""
        try:
            versions = await self.model_versions()
        except Exception as error:
            set_status(grpc_context, error)
            return pb.DescribeResponse()
        return describe_response(self._spec, versions)

    async def Feedback(  # noqa: N802
        self, request: pb.FeedbackRequest, grpc_context: Any = None
    ) -> pb.FeedbackResponse:
        """Record the true outcome of a past decision; answered only once the label is durable.

        A retried ``feedback_id`` answers ``duplicate=true`` and is applied once. Errors: no such decision
        (NOT_FOUND), label not 0/1 or empty ids (INVALID_ARGUMENT, field named), the id reused for another
        label (ABORTED), the source over its rate (RESOURCE_EXHAUSTED), the log unreachable (UNAVAILABLE).
        """
        try:
            if self._feedback is None or self._recorder is None:
                if grpc_context is not None:
                    grpc_context.set_code(grpc.StatusCode.UNIMPLEMENTED)
                    grpc_context.set_details(
                        f"pipeline '{self._spec.name}' keeps no feedback (its YAML has no 'feedback' section)"
                    )
                return pb.FeedbackResponse()
            if request.label not in (0, 1):
                raise InvalidInput(f"must be 0 or 1, got {request.label}", field="label")
            try:  # a label sent right after its decision must find it: send this replica's buffer first
                await asyncio.wait_for(self._recorder.flush(), timeout=FEEDBACK_FLUSH_TIMEOUT_S)
            except Exception as error:
                raise ModelUnavailable(f"the feedback log is unreachable: {error}") from error
            try:
                ack = await self._feedback.record_feedback.remote(
                    request.request_id, int(request.label), request.feedback_id, request.source
                )
            except Exception as error:
                if isinstance(getattr(error, "cause", error), RiskServeError):
                    raise  # the service's own verdict (NOT_FOUND, ABORTED, ...); set_status unwraps it
                raise ModelUnavailable(f"the feedback log is unreachable: {error}") from error
        except Exception as error:
            self._failed(error, None, grpc_context)
            return pb.FeedbackResponse()
        return pb.FeedbackResponse(
            accepted=ack["accepted"],
            duplicate=ack["duplicate"],
            model_version=ack["model_version"],
            seq=ack["seq"],
        )

    async def learning_status(self) -> dict[str, Any]:
        """The feedback service's status (cursor, pending labels, batch outcomes per online model)."""
        if self._feedback is None:
            raise InvalidInput(f"pipeline '{self._spec.name}' has no feedback section", field="feedback")
        status: dict[str, Any] = await self._feedback.status.remote()
        status["decisions_buffered"] = self._recorder.buffered if self._recorder else 0
        status["decisions_dropped"] = self._recorder.dropped if self._recorder else 0
        return status

    async def Check(  # noqa: N802
        self, request: health_pb2.HealthCheckRequest, grpc_context: Any = None
    ) -> health_pb2.HealthCheckResponse:
        """``grpc.health.v1``: SERVING only when every model answers and the pipeline is not draining.

        The service is ``""``, ``riskserve.v1.RiskPipeline`` or the pipeline's name; Ray's proxy picks the
        pipeline by the ``application`` metadata, as for every other call.
        """
        if request.service not in ("", SERVICE_NAME, self._spec.name):
            if grpc_context is not None:
                grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
                grpc_context.set_details(f"unknown service '{request.service}'")
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=await self._serving_status())

    async def Watch(  # noqa: N802
        self, request: health_pb2.HealthCheckRequest, grpc_context: Any = None
    ) -> Any:
        """``grpc.health.v1`` Watch: the current status at once, then every change (checked each second)."""
        if request.service not in ("", SERVICE_NAME, self._spec.name):
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            return
        last = None
        while True:
            status = await self._serving_status()
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def _serving_status(self) -> int:
        if self._draining:
            return int(health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            metadata = await asyncio.wait_for(
                asyncio.gather(*(_result(self._models[n].metadata.remote()) for n in self._models)),
                timeout=HEALTH_PROBE_TIMEOUT_S,
            )
        except Exception:
            return int(health_pb2.HealthCheckResponse.NOT_SERVING)
        ready = all(meta["ready"] for meta in metadata)
        return int(
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )

    def reconfigure(self, config: dict[str, Any]) -> None:
        """Serve's ``user_config`` hook, applied to every ingress replica: ``{"draining": true}`` makes
        health checks report NOT_SERVING (before a shutdown), so load balancers stop sending traffic."""
        self._draining = bool(config.get("draining", False))

    def draining(self) -> bool:
        """Whether this pipeline is draining (before a shutdown); a redeploy must keep it so."""
        return self._draining

    def check_health(self) -> None:
        """Serve's liveness probe of this replica: the ingress holds no state that can break."""

    async def model_versions(self) -> dict[str, str]:
        """Each model's serving version, asked of its replicas."""
        names = list(self._models)
        metadata = await asyncio.gather(*(self._models[n].metadata.remote() for n in names))
        return {name: str(meta["version"] or "") for name, meta in zip(names, metadata, strict=True)}

    async def _decide(
        self, requests: list[pb.DecideRequest], trace_id: str, deadline: float
    ) -> list[pb.DecideResponse]:
        started = time.perf_counter()
        ids = [r.request_id or uuid.uuid4().hex for r in requests]
        raw = [raw_request(r) for r in requests]
        keep = self._recorder is not None
        stage: StageResult
        if self._local_stage is None:
            stage_call = self._features.encode.remote(raw, trace=inject(), keep_matrix=keep)
            stage = await _within(stage_call, deadline, "the feature stage")
        elif len(raw) <= INLINE_ENCODE_ROWS:
            stage = self._local_stage.encode(raw, trace=inject(), keep_matrix=keep)
        else:
            stage = await asyncio.to_thread(self._local_stage.encode, raw, inject(), keep)
        self._metrics.feature_latency(stage.latency_ms / 1e3)
        names = list(self._spec.models)
        per_model = await asyncio.gather(*(self._call_model(name, stage, deadline) for name in names))
        if time.monotonic() >= deadline:
            raise DeadlineExceeded("the decision's deadline passed while the models ran")
        responses = []
        for i, request_id in enumerate(ids):
            results = {name: rows[i] for name, rows in zip(names, per_model, strict=True)}
            with start_span(SPAN_DECISION, attributes={"request.id": request_id}) as span:
                decision = self._engine.decide(stage.rows[i], results)
                span.set_attributes({"outcome": decision.outcome, "risk_score": decision.risk_score})
            self._metrics.decision(decision.outcome)
            responses.append(
                decide_response(
                    request_id=request_id,
                    decision=decision,
                    results=results,
                    spec=self._spec,
                    trace_id=trace_id,
                )
            )
        if self._recorder is not None:
            self._record(ids, stage, names, per_model)
        self._metrics.decision_latency(time.perf_counter() - started)
        return responses

    def _record(
        self, ids: list[str], stage: StageResult, names: list[str], per_model: list[list[ModelResult]]
    ) -> None:
        """Buffer what each decision's models saw, for the feedback log (written off the request path).

        Never fails the decision: a decision that cannot be recorded is logged and counted as dropped.
        """
        assert self._recorder is not None
        matrix = stage.matrix
        if matrix is None:
            logger.error("the feature stage returned no matrix to record; %d decisions not kept", len(ids))
            self._recorder.dropped += len(ids)
            return
        columns = tuple(stage.shared.columns)
        records = []
        for i, request_id in enumerate(ids):
            versions = json.dumps(
                {name: rows[i].version for name, rows in zip(names, per_model, strict=True)}
            )
            features = np.array(matrix[i], dtype=np.float32)
            records.append(DecisionRecord(request_id, self._spec.name, versions, features, columns))
        self._recorder.add(records)

    async def _call_model(self, name: str, stage: StageResult, deadline: float) -> list[ModelResult]:
        """One model's results for the batch, in a ``riskserve.model`` span (version, fallback and reason)."""
        spec = self._spec.models[name]
        attributes: dict[str, str | int] = {
            "model.name": name,
            "model.kind": spec.kind,
            "rows": len(stage.rows),
        }
        with start_span(SPAN_MODEL, kind=SpanKind.CLIENT, attributes=attributes) as span:
            results = await self._call_model_untraced(name, stage, deadline, inject())
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

    async def _call_model_untraced(
        self, name: str, stage: StageResult, deadline: float, trace: dict[str, str]
    ) -> list[ModelResult]:
        """One call to a model for the whole batch, through its breaker, within min(timeout_ms, deadline).

        The model's fallback stands in for every row when the breaker is open (CIRCUIT_OPEN), the call runs
        past ``timeout_ms`` (TIMEOUT), the model's queue is full (OVERLOADED) or it fails (ERROR).
        """
        spec = self._spec.models[name]
        rows = len(stage.rows)
        with_text = [i for i, text in enumerate(stage.texts) if text.strip()]
        if spec.reads_text and not with_text:
            return [ModelResult(name=name, version="", score=0.0) for _ in range(rows)]
        started = time.monotonic()
        permit = self._breakers[name].try_acquire()
        if permit is None:
            return self._fallback(name, rows, "CIRCUIT_OPEN", started)
        budget = min(spec.timeout_ms / 1e3, deadline - started)
        if budget <= 0:
            permit.ignore()
            raise DeadlineExceeded("the decision's deadline passed before the models ran")
        handle = self._models[name]
        if spec.reads_text:
            call = handle.predict_texts.remote([stage.texts[i] for i in with_text], trace=trace)
        else:
            call = handle.predict_features.remote(stage.shared, trace=trace)
        try:
            answer: ReplicaAnswer = await asyncio.wait_for(_result(call), timeout=budget)
        except TimeoutError:
            call.cancel()
            if spec.timeout_ms / 1e3 > budget:
                permit.ignore()  # the caller's deadline ran out, not the model's budget
            else:
                permit.failure(time.monotonic() - started)
            return self._fallback(name, rows, "TIMEOUT", started)
        except asyncio.CancelledError:
            permit.ignore()
            call.cancel()
            raise
        except Exception as error:
            cause = getattr(error, "cause", error)
            if isinstance(error, BackPressureError) or isinstance(cause, BackPressureError):
                permit.ignore()  # our queue limit, not the model's health
                return self._fallback(name, rows, "OVERLOADED", started)
            if isinstance(cause, InvalidInput):
                permit.ignore()  # a client error never counts against the model
                raise cause from error
            permit.failure(time.monotonic() - started)
            return self._fallback(name, rows, "ERROR", started)
        permit.success(time.monotonic() - started)
        latency_ms = (time.monotonic() - started) * 1e3
        labels = answer.labels or [""] * len(answer.scores)
        if not spec.reads_text:
            return [
                ModelResult(name=name, version=answer.version, score=s, label=label, latency_ms=latency_ms)
                for s, label in zip(answer.scores, labels, strict=True)
            ]
        out = [ModelResult(name=name, version=answer.version, score=0.0, latency_ms=latency_ms)] * rows
        for row, score, label in zip(with_text, answer.scores, labels, strict=True):
            out[row] = ModelResult(
                name=name, version=answer.version, score=score, label=label, latency_ms=latency_ms
            )
        return out

    def _fallback(self, name: str, rows: int, reason: FallbackReason, started: float) -> list[ModelResult]:
        self._model_metrics[name].fallback(reason)
        fallback = self._spec.models[name].fallback
        latency_ms = (time.monotonic() - started) * 1e3
        result = ModelResult(
            name=name,
            version="",
            score=fallback.score if fallback.score is not None else 0.0,
            label=fallback.label or "",
            fallback=True,
            fallback_reason=reason,
            latency_ms=latency_ms,
        )
        return [result] * rows

    def __del__(self) -> None:
        shutdown_tracing()

    def breaker_states(self) -> dict[str, str]:
        """Each model's breaker state in this ingress replica."""
        return {name: str(breaker.state) for name, breaker in self._breakers.items()}

    async def feature_stats(self) -> dict[str, Any]:
        """The feature stage's counters (tests prove it ran once per decision)."""
        if self._local_stage is not None:
            return self._local_stage.stats()
        stats: dict[str, Any] = await self._features.stats.remote()
        return stats


async def _result(call: Any) -> Any:
    return await call


async def _within(call: Any, deadline: float, what: str) -> Any:
    """Await a Serve call until ``deadline``; past it, cancel the call and raise ``DeadlineExceeded``."""
    try:
        return await asyncio.wait_for(_result(call), timeout=max(deadline - time.monotonic(), 0.0))
    except TimeoutError:
        call.cancel()
        raise DeadlineExceeded(f"the decision's deadline passed in {what}") from None
