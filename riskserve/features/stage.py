"""The shared feature stage: one Serve deployment computes the feature matrix once per request batch.

It validates every request (so bad input reaches no model), encodes the batch, and puts the matrix in
Ray's object store once; every model replica on the node then reads that same buffer without a copy.
"""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from riskserve.features.encoder import FeatureEncoder, RawRequest, ValidRow
from riskserve.features.spec import FeatureSpec
from riskserve.platform.errors import InvalidInput
from riskserve.platform.shared_matrix import SharedMatrix
from riskserve.platform.tracing import (
    SPAN_FEATURES,
    SpanKind,
    TracingSettings,
    configure_tracing,
    extract,
    start_span,
)

__all__ = ["FeatureStage", "StageResult"]

_COLUMNS_FROM = 16
"""Batches of this many requests or more are validated column by column (below it, row by row is faster)."""


@dataclass
class StageResult:
    """Validated rows, the matrix (in process) and/or its shared reference, the texts, and the time taken."""

    rows: list[ValidRow]
    texts: list[str]
    latency_ms: float
    columns: tuple[str, ...]
    matrix: np.ndarray | None = None
    """The matrix itself: always from a stage inside the ingress; from a stage deployment when asked."""
    shared: SharedMatrix | None = None
    """The matrix in Ray's object store, put by a feature-stage deployment for remote models."""
    put: SharedMatrix | None = None
    """The matrix put by the ingress for remote models (once per batch, when large enough to pay)."""

    @property
    def rows_count(self) -> int:
        """Number of rows (decisions) in the batch."""
        return len(self.rows)


class FeatureStage:
    """Serve deployment: validate, encode, ``ray.put`` once. Counts its calls so tests can prove 'once'.

    The stage owns every matrix it puts and keeps a reference to it for ``retain_s``: the ref reaches
    the models inside a Serve response, and a Serve response is not a Ray task return, so Ray's borrowing
    protocol does not see the ingress and the models as borrowers. Without this the owner could free the
    matrix before a model read it (``ReferenceCountingAssertionError``, seen under hot swaps).
    """

    def __init__(
        self, spec: dict[str, Any], tracing: dict[str, Any] | None = None, retain_s: float = 30.0
    ) -> None:
        self._tracing = configure_tracing(TracingSettings.model_validate(tracing or {}))
        self._encoder = FeatureEncoder(FeatureSpec.model_validate(spec))
        self._retain_s = retain_s
        self._retained: collections.deque[tuple[float, Any]] = collections.deque()
        self._calls = 0
        self._rows = 0
        self._last_batch_id = ""

    def encode(
        self,
        requests: Sequence[RawRequest],
        trace: dict[str, str] | None = None,
        keep_matrix: bool = False,
        *,
        share: bool = True,
    ) -> StageResult:
        """Validate and encode a batch; a bad request fails the batch naming ``requests[i].field``.

        ``share`` puts the matrix in Ray's object store (a stage deployment, for models in other
        processes); ``keep_matrix`` also returns it by value (always, when not shared).

        Raises:
            InvalidInput: for the first bad request (in a batch of one, the field alone is named).
        """
        if trace is None and not share:  # inside the ingress, unsampled: no span at all
            return self._encode(requests, keep_matrix, share)
        with start_span(
            SPAN_FEATURES, context=extract(trace), kind=SpanKind.SERVER, attributes={"rows": len(requests)}
        ):
            return self._encode(requests, keep_matrix, share)

    def _encode(self, requests: Sequence[RawRequest], keep_matrix: bool, share: bool) -> StageResult:
        started = time.perf_counter()
        rows = self._encoder.validate_columns(requests) if len(requests) >= _COLUMNS_FROM else None
        if rows is None:
            rows = []
            for i, request in enumerate(requests):
                try:
                    rows.append(self._encoder.validate(request))
                except InvalidInput as error:
                    if len(requests) == 1:
                        raise
                    raise InvalidInput(str(error), field=f"requests[{i}]") from error
        if not rows:
            raise InvalidInput("no requests", field="requests")
        batch = self._encoder.encode(rows)
        columns = tuple(batch.columns)
        shared = None
        if share:
            ref = ray.put(batch.matrix)
            now = time.monotonic()
            self._retained.append((now + self._retain_s, ref))
            while self._retained and self._retained[0][0] < now:
                self._retained.popleft()
            shared = SharedMatrix(ref=ref, rows=len(rows), columns=columns, batch_id=uuid.uuid4().hex)
            self._last_batch_id = shared.batch_id
        self._calls += 1
        self._rows += len(rows)
        return StageResult(
            rows=rows,
            texts=batch.texts,
            latency_ms=(time.perf_counter() - started) * 1e3,
            columns=columns,
            matrix=batch.matrix if keep_matrix or not share else None,
            shared=shared,
        )

    def __del__(self) -> None:
        """Release this stage's tracing lease (an in-ingress stage shares the ingress's provider)."""
        lease = getattr(self, "_tracing", None)  # None when the constructor failed before taking it
        if lease is not None:
            lease.release()

    def check_health(self) -> None:
        """Serve's liveness probe: the stage is stateless, so a live replica is a healthy one."""

    def stats(self) -> dict[str, Any]:
        """How many batches and rows this replica encoded, and the id of the last batch."""
        return {"calls": self._calls, "rows": self._rows, "last_batch_id": self._last_batch_id}
