"""A decision record as the flow builds it, for the audit tests (imports nothing heavy: a child process
of the kill test uses it too)."""

from __future__ import annotations

from riskserve.audit.store import AuditRecord


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
