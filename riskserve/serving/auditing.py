"""The audit trail of a pipeline's decisions: the records the flow hands to the replica's audit writer.

A record is built from what the decision answered (the same objects the response is built from), so the
trail says exactly what the caller was told: scores, versions, fallbacks, fired rules, reasons, outcome,
trace id, and the input fields as the caller sent them. In a pipeline that learns online (``feedback``) a
record also keeps the encoded row the models saw and its column layout: the feedback log joins labels to
these records, it keeps no copy of the decisions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from riskserve.audit.store import AuditRecord, encode_row
from riskserve.audit.writer import AuditWriter
from riskserve.features.encoder import RawRequest
from riskserve.platform.metrics import AuditMetrics
from riskserve.schema.pipeline import PipelineSpec
from riskserve.schema.rules import Decision, ModelResult
from riskserve.serving.reasons import Reason
from riskserve.serving.version_watch import replica_identity
from riskserve.state.db import Database

__all__ = ["audit_records", "audit_writer"]


def audit_writer(spec: PipelineSpec, db: Database) -> AuditWriter | None:
    """The started audit writer of an ingress replica, or ``None`` when the pipeline keeps no trail: it
    ships to ``db`` (the pipeline's state database, the caller's to close) and buffers in ``audit.path`` on
    this node's disk. Nothing is connected here, so a replica starts while the database is down (its
    records wait in the journal)."""
    audit = spec.audit
    if audit is None or not audit.enabled:
        return None
    metrics = AuditMetrics(spec.name)
    writer = AuditWriter(
        spec.audit_dir(),
        db,
        buffer_rows=audit.buffer,
        flush_s=audit.flush_ms / 1e3,
        batch_rows=audit.batch_rows,
        spill_bytes=int(audit.spill_mb * (1 << 20)),
        write_ahead=audit.write_ahead,
        retention_s=audit.retention_days * 86400.0,
        purge_rows=audit.purge_rows,
        on_count=metrics.records,
        node=replica_identity()[1],  # the Ray node: where a record was made, whatever the host names
    )
    if spec.feedback is not None:
        writer.layout(spec.features.column_names())  # kept before any record names it
    return writer.start()


def _fired_rules(spec: PipelineSpec) -> Callable[[Sequence[str]], list[str]]:
    """The names of the rules that fired, read from a decision's reasons: the rules engine gives each fired
    rule's reason as ``"NAME: REASON"`` (or ``"NAME: could not be evaluated (...)"``), in rule order; a
    fallback's reason or the default reason names no rule."""
    exact = {f"{rule.name}: {rule.reason}": rule.name for rule in spec.decision.rules}
    failed = [(f"{rule.name}: could not be evaluated", rule.name) for rule in spec.decision.rules]

    def fired(reasons: Sequence[str]) -> list[str]:
        out = []
        for reason in reasons:
            name = exact.get(reason)
            if name is None:
                name = next((n for prefix, n in failed if reason.startswith(prefix)), None)
            if name is not None:
                out.append(name)
        return out

    return fired


def audit_records(
    spec: PipelineSpec,
    *,
    raw: Sequence[RawRequest],
    request_ids: Sequence[str],
    decision_ids: Sequence[str],
    decided: Sequence[tuple[Decision, Mapping[str, ModelResult]]],
    reasons: Mapping[int, Sequence[Reason]],
    trace_id: str,
    rows: NDArray[np.float32] | None = None,
    layout: str = "",
) -> list[AuditRecord]:
    """One record per decision of a batch, in the batch's order. ``rows`` (the encoded matrix) and
    ``layout`` (its columns' digest, :meth:`AuditWriter.layout`): kept with each record when given."""
    now = time.time()
    values = np.ascontiguousarray(rows, dtype="<f4") if rows is not None and layout else None
    names = list(spec.models)
    fired = _fired_rules(spec)
    records: list[AuditRecord] = []
    for i, (decision, results) in enumerate(decided):
        request = raw[i]
        records.append(
            {
                "decision_id": decision_ids[i],
                "decided_at": now,
                "pipeline": spec.name,
                "pipeline_version": spec.version,
                "request_id": request_ids[i],
                "trace_id": trace_id,
                "inputs": {
                    "numeric": dict(request.numeric),
                    "categorical": dict(request.categorical),
                    "text": request.text,
                },
                "models": [
                    {
                        "model": r.name,
                        "version": r.version,
                        "score": r.score,
                        "label": r.label,
                        "fallback": r.fallback,
                        "fallback_reason": r.fallback_reason,
                    }
                    for r in (results[name] for name in names)
                ],
                "risk_score": decision.risk_score,
                "outcome": decision.outcome,
                "rules": fired(decision.reasons),
                "rule_reasons": list(decision.reasons),
                "top_reasons": [
                    {
                        "field": x.field,
                        "text": x.text,
                        "contribution": x.contribution,
                        "model": x.model,
                        "value": x.value,
                    }
                    for x in reasons.get(i, ())
                ],
            }
        )
        if values is not None:
            records[-1]["features"] = encode_row(values[i].tobytes())
            records[-1]["layout"] = layout
    return records
