# mypy: ignore-errors
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LaneRequest(_message.Message):
    __slots__ = ("call", "token", "trace", "texts", "features", "ping", "cancel")
    class TraceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CALL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    call: int
    token: str
    trace: _containers.ScalarMap[str, str]
    texts: TextsCall
    features: FeaturesCall
    ping: Ping
    cancel: Cancel
    def __init__(self, call: _Optional[int] = ..., token: _Optional[str] = ..., trace: _Optional[_Mapping[str, str]] = ..., texts: _Optional[_Union[TextsCall, _Mapping]] = ..., features: _Optional[_Union[FeaturesCall, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Cancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TextsCall(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...

class FeaturesCall(_message.Message):
    __slots__ = ("rows", "columns", "values")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    rows: int
    columns: int
    values: bytes
    def __init__(self, rows: _Optional[int] = ..., columns: _Optional[int] = ..., values: _Optional[bytes] = ...) -> None: ...

class LaneResponse(_message.Message):
    __slots__ = ("call", "code", "details", "verdict", "field", "reply")
    CALL_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    call: int
    code: int
    details: str
    verdict: bool
    field: str
    reply: ModelReply
    def __init__(self, call: _Optional[int] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., verdict: _Optional[bool] = ..., field: _Optional[str] = ..., reply: _Optional[_Union[ModelReply, _Mapping]] = ...) -> None: ...

class ModelReply(_message.Message):
    __slots__ = ("model", "version", "scores", "has_labels", "labels", "latency_ms", "extra_json")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    HAS_LABELS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    scores: _containers.RepeatedScalarFieldContainer[float]
    has_labels: bool
    labels: _containers.RepeatedScalarFieldContainer[str]
    latency_ms: float
    extra_json: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., scores: _Optional[_Iterable[float]] = ..., has_labels: _Optional[bool] = ..., labels: _Optional[_Iterable[str]] = ..., latency_ms: _Optional[float] = ..., extra_json: _Optional[str] = ...) -> None: ...
