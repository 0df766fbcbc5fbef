"""The pipeline's gRPC ingress on Ray Serve: feature stage -> every model in parallel -> decision rules.

Ray Serve's gRPC proxy calls the method named like the RPC with the parsed request. Every error is turned
into its gRPC status here (never Ray's INTERNAL traceback): bad input is INVALID_ARGUMENT naming the field
and reaches no model, because the feature stage validates before any model is called. A model that fails
or runs past its ``timeout_ms`` is replaced by its YAML fallback, so the pipeline still decides.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from typing import Any

import grpc

from riskserve.features.stage import StageResult
from riskserve.pipelines.grpc_status import set_status
from riskserve.pipelines.messages import decide_response, describe_response, raw_request
from riskserve.pipelines.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.pipelines.rules import DecisionEngine, ModelResult
from riskserve.pipelines.spec import PipelineSpec
from riskserve.platform.errors import InvalidInput
from riskserve.platform.replica import ReplicaAnswer

__all__ = ["PipelineIngress"]

MAX_BATCH = 1024


def _trace_id(context: Any) -> str:
    """The W3C trace id of the caller's ``traceparent``, or a new one."""
    for key, value in context.invocation_metadata() if context is not None else ():
        if key == "traceparent":
            parts = str(value).split("-")
            if len(parts) == 4 and len(parts[1]) == 32:
                return parts[1]
    return secrets.token_hex(16)


class PipelineIngress:
    """Serve deployment behind the gRPC proxy; one per pipeline (Serve application)."""

    def __init__(self, spec: dict[str, Any], features: Any, models: dict[str, Any]) -> None:
        self._spec = PipelineSpec.model_validate(spec)
        self._engine = DecisionEngine(self._spec)
        self._features = features
        self._models = models

    async def Decide(self, request: pb.DecideRequest, grpc_context: Any = None) -> pb.DecideResponse:  # noqa: N802
        """One decision."""
        try:
            (response,) = await self._decide([request], _trace_id(grpc_context))
        except Exception as error:  # every failure becomes a status, never Ray's INTERNAL traceback
            set_status(grpc_context, error)
            return pb.DecideResponse()
        return response

    async def DecideBatch(  # noqa: N802
        self, request: pb.DecideBatchRequest, grpc_context: Any = None
    ) -> pb.DecideBatchResponse:
        """Many decisions in one call: one feature matrix, one call per model; same order as requested."""
        try:
            if not 0 < len(request.requests) <= MAX_BATCH:
                raise InvalidInput(
                    f"expected 1 to {MAX_BATCH} requests, got {len(request.requests)}", field="requests"
                )
            responses = await self._decide(list(request.requests), _trace_id(grpc_context))
        except Exception as error:
            set_status(grpc_context, error)
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
        """Labels for online learning arrive with the hot-swap and online-learning work; not served yet."""
        if grpc_context is not None:
            grpc_context.set_code(grpc.StatusCode.UNIMPLEMENTED)
            grpc_context.set_details("Feedback is not implemented by this pipeline yet")
        return pb.FeedbackResponse()

    async def model_versions(self) -> dict[str, str]:
        """Each model's serving version, asked of its replicas."""
        names = list(self._models)
        metadata = await asyncio.gather(*(self._models[n].metadata.remote() for n in names))
        return {name: str(meta["version"] or "") for name, meta in zip(names, metadata, strict=True)}

    async def _decide(self, requests: list[pb.DecideRequest], trace_id: str) -> list[pb.DecideResponse]:
        ids = [r.request_id or uuid.uuid4().hex for r in requests]
        stage: StageResult = await self._features.encode.remote([raw_request(r) for r in requests])
        names = list(self._spec.models)
        per_model = await asyncio.gather(*(self._call_model(name, stage) for name in names))
        responses = []
        for i, request_id in enumerate(ids):
            results = {name: rows[i] for name, rows in zip(names, per_model, strict=True)}
            decision = self._engine.decide(stage.rows[i], results)
            responses.append(
                decide_response(
                    request_id=request_id,
                    decision=decision,
                    results=results,
                    spec=self._spec,
                    trace_id=trace_id,
                )
            )
        return responses

    async def _call_model(self, name: str, stage: StageResult) -> list[ModelResult]:
        """One call to a model for the whole batch; its fallback for every row if it fails or is late."""
        spec = self._spec.models[name]
        handle = self._models[name]
        started = time.perf_counter()
        rows = len(stage.rows)
        with_text = [i for i, text in enumerate(stage.texts) if text.strip()]
        if spec.kind == "vllm" and not with_text:
            return [ModelResult(name=name, version="", score=0.0) for _ in range(rows)]
        if spec.kind == "vllm":
            call = handle.predict_texts.remote([stage.texts[i] for i in with_text])
        else:
            call = handle.predict_features.remote(stage.shared)
        try:
            answer: ReplicaAnswer = await asyncio.wait_for(_result(call), timeout=spec.timeout_ms / 1e3)
        except TimeoutError:
            call.cancel()
            return self._fallback(name, rows, "TIMEOUT", started)
        except Exception:
            return self._fallback(name, rows, "ERROR", started)
        latency_ms = (time.perf_counter() - started) * 1e3
        labels = answer.labels or [""] * len(answer.scores)
        if spec.kind != "vllm":
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

    def _fallback(self, name: str, rows: int, reason: str, started: float) -> list[ModelResult]:
        fallback = self._spec.models[name].fallback
        latency_ms = (time.perf_counter() - started) * 1e3
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

    async def feature_stats(self) -> dict[str, Any]:
        """The feature stage's counters (tests prove it ran once per decision)."""
        stats: dict[str, Any] = await self._features.stats.remote()
        return stats


async def _result(call: Any) -> Any:
    return await call
