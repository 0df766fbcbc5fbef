# mypy: ignore-errors
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

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
