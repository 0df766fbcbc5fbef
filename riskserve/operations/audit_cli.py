"""``riskserve audit show ID`` and ``riskserve audit export``: the trail read from its files, no Ray.

The trail is found from a pipeline: its YAML (``--pipeline deploy/pipelines/card_fraud.yaml``), the name of
a pipeline the local ``riskserve up`` runs (``--pipeline card_fraud``; the only one when omitted), or a
directory (``--dir``). Labels are joined from the pipeline's feedback log when it has one and it is in an
embedded SQLite state database (the trail's reader reads that file; a PostgreSQL state is not read yet).
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from riskserve.audit.export import Format, to_table, write_table
from riskserve.audit.trail import AuditTrail
from riskserve.platform.errors import ConfigError, InvalidInput, NotFound
from riskserve.schema.pipeline import PipelineSpec, load_pipeline

__all__ = ["export_audit", "find_trail", "parse_time", "show_audit"]

_AGO = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_time(text: str, *, field: str, now: float | None = None) -> float:
    """Seconds since the epoch: ISO 8601 (no zone: UTC) or a time ago (``30m``, ``24h``, ``7d``)."""
    now = time.time() if now is None else now
    ago = _AGO.match(text.strip())
    if ago:
        return now - float(ago.group(1)) * _UNIT_S[ago.group(2)]
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidInput(
            f"expected ISO 8601 (2026-12-03T15:00:00, UTC unless a zone is given) or a time ago "
            f"(30m, 24h, 7d), got {text!r}",
            field=field,
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def _spec(pipeline: str | None) -> PipelineSpec:
    if pipeline is not None and (pipeline.endswith((".yaml", ".yml")) or Path(pipeline).is_file()):
        return load_pipeline(pipeline)
    from riskserve.operations.local import read_state

    state = read_state()
    if state is None:
        raise NotFound("no local riskserve is running: name the pipeline's YAML (--pipeline FILE) or --dir")
    names = [pipeline] if pipeline is not None else list(state.pipeline_files)
    if pipeline is None and len(names) != 1:
        raise InvalidInput(f"several pipelines run ({', '.join(names)}): name one", field="--pipeline")
    name = names[0]
    if name not in state.pipeline_files:
        raise NotFound(f"no pipeline '{name}' is running (running: {', '.join(state.pipeline_files)})")
    return load_pipeline(state.pipeline_files[name])


def find_trail(pipeline: str | None = None, directory: Path | None = None) -> AuditTrail:
    """The audit trail of a pipeline (YAML file or running pipeline's name) or of a directory."""
    if directory is not None:
        return AuditTrail(directory)
    spec = _spec(pipeline)
    if spec.audit is None:
        raise ConfigError(f"pipeline '{spec.name}' keeps no audit trail (its YAML has no 'audit' section)")
    return AuditTrail(spec.audit_dir(), feedback_log=_labels_file(spec))


def _labels_file(spec: PipelineSpec) -> Path | None:
    """The SQLite file holding the pipeline's labels (its state database's ``feedback`` table), or ``None``:
    no feedback, or a PostgreSQL state database, which the trail's file reader cannot open."""
    if spec.feedback is None:
        return None
    dsn = urlsplit(spec.state_dsn())
    return Path(dsn.path) if dsn.scheme == "sqlite" else None


def show_audit(trail: AuditTrail, decision_id: str) -> dict[str, Any]:
    """One decision's record, its time in UTC and its label (if it has one), as printable data."""
    record: dict[str, Any] = dict(trail.get(decision_id))
    record["decided_at_utc"] = dt.datetime.fromtimestamp(record["decided_at"], dt.UTC).isoformat()
    label = trail.labels([decision_id]).get(decision_id)
    record["label"] = None if label is None else {
        "label": label.label, "source": label.source, "feedback_id": label.feedback_id,
        "received_at_utc": dt.datetime.fromtimestamp(label.received_at, dt.UTC).isoformat(),
    }  # fmt: skip
    return record


def export_audit(trail: AuditTrail, since: float, until: float, fmt: Format, out: Path) -> int:
    """Write the records decided in ``[since, until)`` with their labels to ``out``; returns how many."""
    if until <= since:
        raise InvalidInput("must be after --since", field="--until")
    records = trail.records(since, until)
    table = to_table(records, trail.labels(r["decision_id"] for r in records))
    write_table(table, out, fmt)
    return len(records)


def dumps(data: Any) -> str:
    """Pretty JSON for a terminal."""
    return json.dumps(data, indent=2, sort_keys=False)
