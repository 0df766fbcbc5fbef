# mypy: ignore-errors
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Decision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECISION_UNSPECIFIED: _ClassVar[Decision]
    APPROVE: _ClassVar[Decision]
    REVIEW: _ClassVar[Decision]
    DECLINE: _ClassVar[Decision]
DECISION_UNSPECIFIED: Decision
APPROVE: Decision
REVIEW: Decision
DECLINE: Decision

class DecideRequest(_message.Message):
    __slots__ = ("request_id", "numeric", "categorical", "text")
    class NumericEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class CategoricalEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUMERIC_FIELD_NUMBER: _ClassVar[int]
    CATEGORICAL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    numeric: _containers.ScalarMap[str, float]
    categorical: _containers.ScalarMap[str, str]
    text: str
    def __init__(self, request_id: _Optional[str] = ..., numeric: _Optional[_Mapping[str, float]] = ..., categorical: _Optional[_Mapping[str, str]] = ..., text: _Optional[str] = ...) -> None: ...

class ModelScore(_message.Message):
    __slots__ = ("model", "version", "score", "label", "fallback", "fallback_reason", "latency_ms")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    score: float
    label: str
    fallback: bool
    fallback_reason: str
    latency_ms: float
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., score: _Optional[float] = ..., label: _Optional[str] = ..., fallback: _Optional[bool] = ..., fallback_reason: _Optional[str] = ..., latency_ms: _Optional[float] = ...) -> None: ...

class DecideResponse(_message.Message):
    __slots__ = ("request_id", "decision", "risk_score", "models", "reasons", "pipeline", "pipeline_version", "trace_id", "decision_id", "top_reasons")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    RISK_SCORE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    TOP_REASONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decision: Decision
    risk_score: float
    models: _containers.RepeatedCompositeFieldContainer[ModelScore]
    reasons: _containers.RepeatedScalarFieldContainer[str]
    pipeline: str
    pipeline_version: str
    trace_id: str
    decision_id: str
    top_reasons: _containers.RepeatedCompositeFieldContainer[Reason]
    def __init__(self, request_id: _Optional[str] = ..., decision: _Optional[_Union[Decision, str]] = ..., risk_score: _Optional[float] = ..., models: _Optional[_Iterable[_Union[ModelScore, _Mapping]]] = ..., reasons: _Optional[_Iterable[str]] = ..., pipeline: _Optional[str] = ..., pipeline_version: _Optional[str] = ..., trace_id: _Optional[str] = ..., decision_id: _Optional[str] = ..., top_reasons: _Optional[_Iterable[_Union[Reason, _Mapping]]] = ...) -> None: ...

class Reason(_message.Message):
    __slots__ = ("field", "text", "contribution", "model", "value")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    field: str
    text: str
    contribution: float
    model: str
    value: str
    def __init__(self, field: _Optional[str] = ..., text: _Optional[str] = ..., contribution: _Optional[float] = ..., model: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class DecideBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[DecideRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[DecideRequest, _Mapping]]] = ...) -> None: ...

class DecideBatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[DecideResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[DecideResponse, _Mapping]]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FeatureInfo(_message.Message):
    __slots__ = ("name", "kind", "required", "min", "max", "categories")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    CATEGORIES_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    required: bool
    min: float
    max: float
    categories: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., required: _Optional[bool] = ..., min: _Optional[float] = ..., max: _Optional[float] = ..., categories: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "kind", "version", "pool", "replicas")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    version: str
    pool: str
    replicas: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., version: _Optional[str] = ..., pool: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("pipeline", "version", "features", "models")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    version: str
    features: _containers.RepeatedCompositeFieldContainer[FeatureInfo]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, pipeline: _Optional[str] = ..., version: _Optional[str] = ..., features: _Optional[_Iterable[_Union[FeatureInfo, _Mapping]]] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class FeedbackRequest(_message.Message):
    __slots__ = ("request_id", "label", "feedback_id", "source", "decision_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    label: int
    feedback_id: str
    source: str
    decision_id: str
    def __init__(self, request_id: _Optional[str] = ..., label: _Optional[int] = ..., feedback_id: _Optional[str] = ..., source: _Optional[str] = ..., decision_id: _Optional[str] = ...) -> None: ...

class FeedbackResponse(_message.Message):
    __slots__ = ("accepted", "duplicate", "model_version", "seq")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    duplicate: bool
    model_version: str
    seq: int
    def __init__(self, accepted: _Optional[bool] = ..., duplicate: _Optional[bool] = ..., model_version: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...
