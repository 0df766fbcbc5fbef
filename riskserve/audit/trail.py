"""Reading a pipeline's audit trail: every slot's store, the records still only in journals, and labels.

Each ingress replica writes its own slot (``slot-N.sqlite`` and ``slot-N.journal/``); a reader sees them
all, so ``riskserve audit show/export`` need not know how many replicas ran. A record that is still only
in a journal (written ahead, not committed yet, or left by a replica that was killed and not replayed
yet) is read from there; a record in both is read once. Labels are joined from the pipeline's feedback
log by decision id (the id the feedback log keys decisions by): the trail keeps no copy of them.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from riskserve.audit.journal import read_segment
from riskserve.audit.store import AuditRecord
from riskserve.platform.errors import NotFound

__all__ = ["AuditTrail", "Label"]


@dataclass(frozen=True)
class Label:
    """The true outcome a decision was given through ``Feedback`` (from the feedback log)."""

    label: int
    source: str
    received_at: float
    feedback_id: str


class AuditTrail:
    """Every slot of one audit directory, read-only; ``feedback_log``: where labels are joined from."""

    def __init__(self, directory: Path, feedback_log: Path | None = None) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise NotFound(f"no audit trail at {self.directory}")
        self.feedback_log = feedback_log

    def _stores(self) -> list[Path]:
        return sorted(self.directory.glob("slot-*.sqlite"))

    def _journal_records(self) -> Iterable[AuditRecord]:
        for path in sorted(self.directory.glob("slot-*.journal/*.jsonl")):
            try:
                for entry in read_segment(path):
                    if entry is not None:
                        yield entry[0]
            except FileNotFoundError:  # drained and deleted while we read: it is in the store now
                continue

    def get(self, decision_id: str) -> AuditRecord:
        """The record of one decision, wherever it is kept.

        Raises:
            NotFound: no slot holds it (never decided here, or purged by retention).
        """
        for path in self._stores():
            with _reader(path) as db:
                row = db.execute(
                    "SELECT record FROM decisions WHERE decision_id = ?", (decision_id,)
                ).fetchone()
            if row is not None:
                return _load(row[0])
        for record in self._journal_records():
            if record["decision_id"] == decision_id:
                return record
        raise NotFound(f"no audit record of decision '{decision_id}' in {self.directory}")

    def records(self, since: float, until: float) -> list[AuditRecord]:
        """Every record decided in ``[since, until)``, oldest first, each once."""
        found: dict[str, AuditRecord] = {}
        for path in self._stores():
            with _reader(path) as db:
                rows = db.execute(
                    "SELECT decision_id, record FROM decisions WHERE decided_at >= ? AND decided_at < ?",
                    (since, until),
                ).fetchall()
            for decision_id, text in rows:
                found.setdefault(decision_id, _load(text))
        for record in self._journal_records():
            if since <= record["decided_at"] < until:
                found.setdefault(record["decision_id"], record)
        return sorted(found.values(), key=lambda r: (r["decided_at"], r["decision_id"]))

    def labels(self, decision_ids: Iterable[str]) -> dict[str, Label]:
        """The label of each decision that has one (none without a feedback log)."""
        if self.feedback_log is None or not self.feedback_log.exists():
            return {}
        ids = list(decision_ids)
        out: dict[str, Label] = {}
        with _reader(self.feedback_log) as db:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                marks = ",".join("?" * len(chunk))
                rows = db.execute(
                    "SELECT request_id, label, source, received_at, feedback_id FROM feedback"
                    f" WHERE request_id IN ({marks}) ORDER BY seq",
                    chunk,
                ).fetchall()
                for decision_id, label, source, received_at, feedback_id in rows:
                    out.setdefault(decision_id, Label(int(label), source, float(received_at), feedback_id))
        return out


class _reader:  # noqa: N801 -- used as a context manager like open()
    """A connection that only reads (closed on exit); busy waits bounded like the writers'."""

    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(path, timeout=5.0)

    def __enter__(self) -> sqlite3.Connection:
        return self._db

    def __exit__(self, *exc: object) -> None:
        self._db.close()


def _load(text: str) -> AuditRecord:
    import json

    record: AuditRecord = json.loads(text)
    return record
