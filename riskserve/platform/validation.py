"""Checks every tabular backend applies to its input, so a bad batch is refused with the column named."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from riskserve.platform.errors import InvalidInput

__all__ = ["FeatureMatrix", "check_feature_matrix", "check_texts"]

FeatureMatrix = NDArray[np.float32]
"""A batch of rows: float32, C-contiguous, shape ``(rows, columns)``; possibly a read-only shared buffer."""


def check_feature_matrix(batch: object, feature_names: Sequence[str]) -> FeatureMatrix:
    """Return ``batch`` unchanged (never copied) if it is a finite float32 C-contiguous matrix this wide.

    Raises:
        InvalidInput: naming ``features`` for a wrong type/shape/layout, or the column holding a NaN/Inf.
    """
    if not isinstance(batch, np.ndarray):
        raise InvalidInput(f"expected a numpy float32 matrix, got {type(batch).__name__}", field="features")
    if batch.ndim != 2:
        raise InvalidInput(
            f"expected a 2-D matrix (rows, columns), got shape {batch.shape}", field="features"
        )
    if batch.shape[1] != len(feature_names):
        raise InvalidInput(
            f"expected {len(feature_names)} columns ({', '.join(feature_names)}), got {batch.shape[1]}",
            field="features",
        )
    if batch.shape[0] == 0:
        raise InvalidInput("the batch has no rows", field="features")
    if batch.dtype != np.float32:
        raise InvalidInput(f"expected dtype float32, got {batch.dtype}", field="features")
    if not batch.flags.c_contiguous:
        raise InvalidInput("expected a C-contiguous matrix (use np.ascontiguousarray)", field="features")
    finite = np.isfinite(batch)
    if not finite.all():
        row, column = (int(i) for i in np.argwhere(~finite)[0])
        raise InvalidInput(
            f"row {row} holds {batch[row, column]}, a finite number is required", field=feature_names[column]
        )
    return batch


def check_texts(batch: object, *, max_chars: int) -> list[str]:
    """Return ``batch`` as a list of strings if it is a non-empty sequence of non-empty strings.

    Raises:
        InvalidInput: naming ``text`` (with the row) for a non-string, an empty or an over-long text.
    """
    if isinstance(batch, str) or not isinstance(batch, Sequence):
        raise InvalidInput("expected a sequence of strings", field="text")
    if len(batch) == 0:
        raise InvalidInput("the batch has no texts", field="text")
    texts: list[str] = []
    for row, text in enumerate(batch):
        if not isinstance(text, str):
            raise InvalidInput(f"row {row} is a {type(text).__name__}, expected a string", field="text")
        if not text.strip():
            raise InvalidInput(f"row {row} is empty", field="text")
        if len(text) > max_chars:
            raise InvalidInput(
                f"row {row} has {len(text)} characters, at most {max_chars} allowed", field="text"
            )
        texts.append(text)
    return texts
