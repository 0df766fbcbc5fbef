"""Conversions between the gRPC messages of ``riskserve.v1`` and riskserve's own types."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from riskserve.features.encoder import RawRequest
from riskserve.features.spec import CategoricalField, NumericField
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.schema.pipeline import PipelineSpec
from riskserve.schema.rules import Decision, ModelResult
from riskserve.serving.reasons import Reason

__all__ = ["decide_response", "describe_response", "raw_request", "response_maker"]


def raw_request(request: pb.DecideRequest) -> RawRequest:
    """The feature part of a ``DecideRequest``.

    The maps are copied key by key: protobuf's map types are registered ``Mapping``s, so ``dict(map)``
    goes through the ABC's Python ``keys()`` view (1.30 against 0.84 us a map, 0.9 ms a 1,000-row batch).
    """
    numeric, categorical = request.numeric, request.categorical
    return RawRequest(
        numeric={name: numeric[name] for name in numeric},
        categorical={name: categorical[name] for name in categorical},
        text=request.text,
    )


def response_maker(into: pb.DecideBatchResponse | None) -> Callable[..., pb.DecideResponse]:
    """What makes a ``DecideResponse``: a message of its own, or, with ``into``, the next of that batch's
    responses (a batch's responses made apart are copied again by ``DecideBatchResponse(responses=...)``:
    0.74 ms for 1,000). Every ``Pipeline.decide`` makes its responses with it."""
    make: Callable[..., Any] = pb.DecideResponse if into is None else into.responses.add
    return make


def decide_response(
    *,
    request_id: str,
    decision_id: str = "",
    decision: Decision,
    results: Mapping[str, ModelResult],
    spec: PipelineSpec,
    trace_id: str,
    top_reasons: Sequence[Reason] = (),
    into: pb.DecideBatchResponse | None = None,
) -> pb.DecideResponse:
    """A ``DecideResponse`` with one ``ModelScore`` per model, in the pipeline's model order; with ``into``,
    made as the next of that batch's responses.

    Nested messages are added in place (``add``) and fields left at their defaults are not passed: building
    ModelScore messages first and handing the list over copies each, about twice the time for a batch.
    """
    response = response_maker(into)(
        request_id=request_id,
        decision_id=decision_id,
        decision=decision.outcome,
        risk_score=decision.risk_score,
        reasons=decision.reasons,
        pipeline=spec.name,
        pipeline_version=spec.version,
        trace_id=trace_id,
    )
    add_score = response.models.add
    for name in spec.models:
        r = results[name]
        if r.fallback or r.label:
            add_score(
                model=r.name,
                version=r.version,
                score=r.score,
                label=r.label,
                fallback=r.fallback,
                fallback_reason=r.fallback_reason,
                latency_ms=r.latency_ms,
            )
        else:
            add_score(model=r.name, version=r.version, score=r.score, latency_ms=r.latency_ms)
    add_reason = response.top_reasons.add
    for reason in top_reasons:
        add_reason(
            field=reason.field,
            text=reason.text,
            contribution=reason.contribution,
            model=reason.model,
            value=reason.value,
        )
    return response


def describe_response(spec: PipelineSpec, versions: Mapping[str, str]) -> pb.DescribeResponse:
    """The pipeline's features and models, with each model's serving version."""
    features = []
    for name, field in spec.features.fields.items():
        info = pb.FeatureInfo(name=name, kind=field.kind, required=field.required)
        if isinstance(field, NumericField):
            if field.min is not None:
                info.min = field.min
            if field.max is not None:
                info.max = field.max
        elif isinstance(field, CategoricalField):
            info.categories.extend(field.vocabulary)
        features.append(info)
    models = [
        pb.ModelInfo(name=name, kind=m.kind, version=versions.get(name, ""), pool=m.pool, replicas=m.replicas)
        for name, m in spec.models.items()
    ]
    return pb.DescribeResponse(pipeline=spec.name, version=spec.version, features=features, models=models)
