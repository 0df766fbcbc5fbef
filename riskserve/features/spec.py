"""The feature spec written in a pipeline YAML: request fields and the columns computed from them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel as _Schema
from pydantic import ConfigDict, Field, model_validator

__all__ = [
    "CategoricalColumn",
    "CategoricalField",
    "Clip",
    "ColumnSpec",
    "FeatureSpec",
    "FieldSpec",
    "Log1p",
    "NumericColumn",
    "NumericField",
    "NumericTransform",
    "Standardize",
    "TextField",
]

_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class _Strict(_Schema):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NumericField(_Strict):
    """A number in the request's ``numeric`` map."""

    kind: Literal["numeric"]
    required: bool = True
    """A request without it is refused with INVALID_ARGUMENT naming the field."""
    default: float | None = None
    """Value used when the field is absent and not required."""
    min: float | None = None
    """Smallest allowed value (inclusive)."""
    max: float | None = None
    """Largest allowed value (inclusive)."""

    @model_validator(mode="after")
    def _consistent(self) -> NumericField:
        if not self.required and self.default is None:
            raise ValueError("an optional numeric field needs a default")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        if self.default is not None and not _within(self.default, self.min, self.max):
            raise ValueError(f"default {self.default} is outside [{self.min}, {self.max}]")
        return self


def _within(value: float, low: float | None, high: float | None) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


class CategoricalField(_Strict):
    """A string in the request's ``categorical`` map, from a closed vocabulary."""

    kind: Literal["categorical"]
    vocabulary: list[str] = Field(min_length=1)
    """The known values, in the order their columns appear."""
    unknown: Literal["bucket", "reject"] = "bucket"
    """What a value outside the vocabulary does: go to the unknown bucket, or be refused."""
    required: bool = True
    default: str | None = None
    """Value used when the field is absent and not required."""

    @model_validator(mode="after")
    def _consistent(self) -> CategoricalField:
        if len(set(self.vocabulary)) != len(self.vocabulary):
            raise ValueError("the vocabulary repeats a value")
        if not self.required and self.default is None:
            raise ValueError("an optional categorical field needs a default")
        return self


class TextField(_Strict):
    """The request's free text (``DecideRequest.text``), read by text models such as the intent LLM."""

    kind: Literal["text"]
    required: bool = False
    max_chars: int = Field(default=1000, gt=0, le=100_000)
    """Longer texts are refused with INVALID_ARGUMENT."""


FieldSpec = Annotated[NumericField | CategoricalField | TextField, Field(discriminator="kind")]


class Log1p(_Strict):
    """``log(1 + x)``; the field must be > -1 (set ``min``)."""

    op: Literal["log1p"]


class Clip(_Strict):
    """Clamp into ``[min, max]``."""

    op: Literal["clip"]
    min: float
    max: float

    @model_validator(mode="after")
    def _ordered(self) -> Clip:
        if self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        return self


class Standardize(_Strict):
    """``(x - mean) / std``."""

    op: Literal["standardize"]
    mean: float
    std: float = Field(gt=0)


NumericTransform = Annotated[Log1p | Clip | Standardize, Field(discriminator="op")]


class NumericColumn(_Strict):
    """One column from a numeric field through a chain of transforms (applied in order)."""

    name: str = Field(pattern=_NAME)
    field: str
    transforms: list[NumericTransform] = Field(default_factory=list)


class CategoricalColumn(_Strict):
    """Columns from a categorical field.

    ``one_hot``: one column per vocabulary value plus ``name=<unknown>``; ``ordinal``: one column, the
    value's index (unknown = len(vocabulary)); ``hash``: ``buckets`` columns ``name#i``, one-hot of a stable
    hash (for vocabularies too large to list).
    """

    name: str = Field(pattern=_NAME)
    field: str
    encoding: Literal["one_hot", "ordinal", "hash"]
    buckets: int | None = Field(default=None, gt=1, le=1 << 16)
    """Number of hash buckets (``hash`` only)."""

    @model_validator(mode="after")
    def _buckets(self) -> CategoricalColumn:
        if (self.encoding == "hash") != (self.buckets is not None):
            raise ValueError("'buckets' is required with encoding 'hash' and only there")
        return self


ColumnSpec = NumericColumn | CategoricalColumn


class FeatureSpec(_Strict):
    """Request fields and the float32 matrix columns computed from them, once per request."""

    fields: dict[str, FieldSpec] = Field(min_length=1)
    columns: list[NumericColumn | CategoricalColumn] = Field(min_length=1)

    @model_validator(mode="after")
    def _references(self) -> FeatureSpec:
        texts = [name for name, spec in self.fields.items() if isinstance(spec, TextField)]
        if len(texts) > 1:
            raise ValueError(f"at most one text field, got {texts}")
        for i, column in enumerate(self.columns):
            spec = self.fields.get(column.field)
            wanted = NumericField if isinstance(column, NumericColumn) else CategoricalField
            if not isinstance(spec, wanted):
                kind = "numeric" if wanted is NumericField else "categorical"
                raise ValueError(f"columns[{i}] ({column.name}): '{column.field}' is not a {kind} field")
            if isinstance(column, NumericColumn) and isinstance(spec, NumericField):
                for transform in column.transforms:
                    if isinstance(transform, Log1p) and (spec.min is None or spec.min <= -1):
                        raise ValueError(f"columns[{i}] ({column.name}): log1p needs the field's min > -1")
        names = [name for column in self.columns for name in self.column_names_of(column)]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"column names repeat: {duplicates}")
        return self

    @property
    def text_field(self) -> str | None:
        """Name of the text field, if the spec has one."""
        return next((name for name, spec in self.fields.items() if isinstance(spec, TextField)), None)

    def column_names_of(self, column: NumericColumn | CategoricalColumn) -> list[str]:
        """The matrix columns one column spec produces, in order."""
        if isinstance(column, NumericColumn) or column.encoding == "ordinal":
            return [column.name]
        if column.encoding == "hash":
            assert column.buckets is not None
            return [f"{column.name}#{i}" for i in range(column.buckets)]
        field = self.fields[column.field]
        assert isinstance(field, CategoricalField)
        return [f"{column.name}={value}" for value in field.vocabulary] + [f"{column.name}=<unknown>"]

    def column_names(self) -> list[str]:
        """Every matrix column, in order."""
        return [name for column in self.columns for name in self.column_names_of(column)]

    def column_fields(self) -> dict[str, str]:
        """Each matrix column's request field (every one-hot, hash or transformed column names the field it
        was computed from), so per-column attributions can be summed back to what the caller sent."""
        return {name: column.field for column in self.columns for name in self.column_names_of(column)}
