"""Audit records as one flat table an analyst loads (pyarrow: Parquet or CSV).

One row per decision. Columns: ``decision_id``, ``decided_at`` (UTC timestamp, µs), ``pipeline``,
``pipeline_version``, ``request_id``, ``trace_id``, ``outcome``, ``risk_score``; every input field as
``input.<field>`` (numbers float64, categories and text strings; null where a request did not send it);
per model ``model.<name>.version``, ``.score``, ``.label``, ``.fallback``, ``.fallback_reason``; ``rules``
(fired rules' names), ``rule_reasons`` and ``top_reasons`` as JSON text (the same in both formats); and the
label joined from the feedback log: ``label`` (null when none), ``label_source``, ``labelled_at``.
The file is written mode 0600: it holds the requests' input fields.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from riskserve.audit.store import AuditRecord, create_private
from riskserve.audit.trail import Label

__all__ = ["Format", "to_table", "write_table"]

Format = Literal["parquet", "csv"]


def to_table(records: Sequence[AuditRecord], labels: Mapping[str, Label] | None = None) -> Any:
    """The records as a ``pyarrow.Table`` (see the module doc for the columns)."""
    import pyarrow as pa

    labels = labels or {}
    columns: dict[str, Any] = {
        "decision_id": pa.array([r["decision_id"] for r in records], pa.string()),
        "decided_at": pa.array([int(r["decided_at"] * 1e6) for r in records], pa.timestamp("us", tz="UTC")),
        "pipeline": pa.array([r["pipeline"] for r in records], pa.string()),
        "pipeline_version": pa.array([r["pipeline_version"] for r in records], pa.string()),
        "request_id": pa.array([r["request_id"] for r in records], pa.string()),
        "trace_id": pa.array([r["trace_id"] for r in records], pa.string()),
        "outcome": pa.array([r["outcome"] for r in records], pa.string()),
        "risk_score": pa.array([r["risk_score"] for r in records], pa.float64()),
    }
    numeric = _keys(r["inputs"].get("numeric", {}) for r in records)
    categorical = _keys(r["inputs"].get("categorical", {}) for r in records)
    for name in numeric:
        values = [r["inputs"].get("numeric", {}).get(name) for r in records]
        columns[f"input.{name}"] = pa.array(values, pa.float64())
    for name in categorical:
        values = [r["inputs"].get("categorical", {}).get(name) for r in records]
        columns[f"input.{name}"] = pa.array(values, pa.string())
    if any(r["inputs"].get("text") for r in records):
        columns["input.text"] = pa.array([r["inputs"].get("text", "") for r in records], pa.string())
    per_model = [{m["model"]: m for m in r["models"]} for r in records]
    for name in _keys(per_model):
        scores = [row.get(name) for row in per_model]
        for key, kind in (("version", pa.string()), ("score", pa.float64()), ("label", pa.string()),
                          ("fallback", pa.bool_()), ("fallback_reason", pa.string())):  # fmt: skip
            columns[f"model.{name}.{key}"] = pa.array(
                [None if s is None else s.get(key) for s in scores], kind
            )
    for key in ("rules", "rule_reasons", "top_reasons"):
        columns[key] = pa.array([json.dumps(r[key]) for r in records], pa.string())  # type: ignore[literal-required]
    joined = [labels.get(r["decision_id"]) for r in records]
    columns["label"] = pa.array([None if x is None else x.label for x in joined], pa.int64())
    columns["label_source"] = pa.array([None if x is None else x.source for x in joined], pa.string())
    columns["labelled_at"] = pa.array(
        [None if x is None else int(x.received_at * 1e6) for x in joined], pa.timestamp("us", tz="UTC")
    )
    return pa.table(columns)


def write_table(table: Any, path: Path, fmt: Format) -> None:
    """Write ``table`` to ``path`` (created mode 0600, replaced if it exists) as Parquet or CSV."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.unlink(missing_ok=True)
    create_private(temporary)
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, temporary)
        elif fmt == "csv":
            import pyarrow.csv as pacsv

            pacsv.write_csv(table, temporary)
        else:
            raise ValueError(f"unknown format {fmt!r}; expected parquet or csv")
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _keys(maps: Any) -> list[str]:
    """Keys of every mapping, in the order first seen."""
    seen: dict[str, None] = {}
    for mapping in maps:
        for key in mapping:
            seen.setdefault(key, None)
    return list(seen)
