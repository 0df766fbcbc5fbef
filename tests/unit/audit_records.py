"""A decision record as the flow builds it, for the audit and feedback-log tests (imports nothing heavy: a
child process of the kill test uses it too)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from riskserve.audit.store import AuditRecord, AuditStore, encode_row
from riskserve.state.db import Database


def record(i: int, decided_at: float = 1_700_000_000.0) -> AuditRecord:
    """A decision record as the flow builds it (values vary with ``i``)."""
    return {
        "decision_id": f"d{i:06d}",
        "decided_at": decided_at + i,
        "pipeline": "card_fraud",
        "pipeline_version": "2026.12.0",
        "request_id": f"tx-{i}",
        "trace_id": f"{i:032x}",
        "inputs": {
            "numeric": {"amount": 10.5 + i, "hour": float(i % 24)},
            "categorical": {"channel": ["pos", "online"][i % 2]},
            "text": f"message {i}",
        },
        "models": [
            {
                "model": "credit",
                "version": "c1",
                "score": 0.01 * (i % 100),
                "label": "",
                "fallback": False,
                "fallback_reason": "",
            },
            {
                "model": "fraud",
                "version": "f1",
                "score": 0.5,
                "label": "",
                "fallback": i % 7 == 0,
                "fallback_reason": "TIMEOUT" if i % 7 == 0 else "",
            },
        ],
        "risk_score": 0.25 + 0.001 * i,
        "outcome": ["APPROVE", "REVIEW", "DECLINE"][i % 3],
        "rules": ["high_risk"] if i % 3 == 2 else [],
        "rule_reasons": ["high_risk: combined risk score is 0.6 or more"] if i % 3 == 2 else ["low risk"],
        "top_reasons": [
            {
                "field": "amount",
                "text": "amount",
                "contribution": 0.5,
                "model": "fraud",
                "value": f"{10.5 + i}",
            }
        ],
    }


class DecisionTrail:
    """Decisions kept the way an ingress replica ships them for the feedback log: audit records carrying
    their encoded rows, in the state database's audit tables (what the feedback log joins labels to)."""

    def __init__(self, db: Database, *, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self.clock = clock
        self.store = AuditStore(db)

    def keep(
        self,
        decision_id: str,
        features: NDArray[np.float32],
        columns: Sequence[str],
        *,
        request_id: str = "",
        decided_at: float | None = None,
    ) -> None:
        """Keep one decision (decided now by the trail's clock unless ``decided_at``)."""
        self.keep_many([(decision_id, features, columns, request_id)], decided_at=decided_at)

    def keep_many(
        self,
        decisions: Sequence[tuple[str, NDArray[np.float32], Sequence[str], str]],
        *,
        decided_at: float | None = None,
    ) -> None:
        """Keep ``(decision_id, features, columns, request_id)`` decisions in one transaction."""
        when = self.clock() if decided_at is None else decided_at
        records = []
        for decision_id, features, columns, request_id in decisions:
            kept = record(0, when)
            kept["decision_id"] = decision_id
            kept["decided_at"] = when
            kept["request_id"] = request_id or decision_id
            kept["features"] = encode_row(np.asarray(features, dtype="<f4").tobytes())
            kept["layout"] = self.store.add_layout(columns)
            records.append(kept)
        self.store.insert(records)

    def close(self) -> None:
        """Nothing to release: the database is the caller's."""
