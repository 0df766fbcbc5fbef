"""Decision recording: what each decision's models saw, buffered for the feedback log off the request path.

The ingress keeps every decision's encoded row, its columns and the model versions that scored it, so a
label sent later through ``Feedback`` trains on exactly what was decided. Records go to a bounded buffer
that a background task writes to the log in one commit every ``flush_ms``; recording never fails or
delays a decision (a decision that cannot be kept is logged and counted as dropped).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import numpy as np

from riskserve.features.stage import StageResult
from riskserve.learning.feedback_log import DecisionRecord
from riskserve.learning.recorder import DecisionRecorder
from riskserve.schema.rules import ModelResult

__all__ = ["record_decisions"]

logger = logging.getLogger(__name__)


def record_decisions(
    recorder: DecisionRecorder,
    pipeline: str,
    decision_ids: Sequence[str],
    request_ids: Sequence[str],
    stage: StageResult,
    per_model: dict[str, list[ModelResult]],
) -> None:
    """Buffer one record per decision of the batch, keyed by its server-issued id with the caller's
    request id beside it (the row is copied: the matrix may be shared)."""
    matrix = stage.matrix
    if matrix is None:
        logger.error(
            "the feature stage returned no matrix to record; %d decisions not kept", len(decision_ids)
        )
        recorder.drop(len(decision_ids))
        return
    columns = tuple(stage.columns)
    records = []
    for i, (decision_id, request_id) in enumerate(zip(decision_ids, request_ids, strict=True)):
        versions = json.dumps({name: rows[i].version for name, rows in per_model.items()})
        features = np.array(matrix[i], dtype=np.float32)
        records.append(DecisionRecord(decision_id, pipeline, versions, features, columns, request_id))
    recorder.add(records)
