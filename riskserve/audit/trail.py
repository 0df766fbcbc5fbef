"""Reading a pipeline's audit trail: the records in its state database, this node's journals, and labels.

Every ingress replica on every node ships its records to the one state database, so ``riskserve audit
show/export`` need not know how many replicas or nodes ran. Given a journal directory (the YAML's
``audit.path`` on this node), a record still only in a journal there (written ahead, not shipped yet, or
left by a replica that was killed and not replayed yet) is read too; a record in both is read once. Labels
are joined from the feedback log's ``feedback`` table in the same database by decision id: the trail
keeps no copy of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from riskserve.audit.journal import read_segment
from riskserve.audit.store import IDS_PER_QUERY, AuditRecord, AuditStore
from riskserve.platform.errors import NotFound
from riskserve.state.db import Database, Tx, redact

__all__ = ["AuditTrail", "Label"]


@dataclass(frozen=True)
class Label:
    """The true outcome a decision was given through ``Feedback`` (from the feedback log)."""

    label: int
    source: str
    received_at: float
    feedback_id: str


class AuditTrail:
    """The audit trail of ``db`` (and of ``journal_dir``'s journals on this node), read-only.

    Raises (every read):
        StoreUnavailable: the database cannot be reached now.
    """

    def __init__(self, db: Database, journal_dir: Path | None = None) -> None:
        self.db = db
        self.store = AuditStore(db)
        self.journal_dir = None if journal_dir is None else Path(journal_dir)

    def _journal_records(self) -> Iterable[AuditRecord]:
        if self.journal_dir is None:
            return
        for path in sorted(self.journal_dir.glob("slot-*.journal/*.jsonl")):
            try:
                for entry in read_segment(path):
                    if entry is not None:
                        yield entry[0]
            except FileNotFoundError:  # shipped and deleted while we read: it is in the database now
                continue

    def get(self, decision_id: str) -> AuditRecord:
        """The record of one decision, wherever it is kept.

        Raises:
            NotFound: no record of it (never decided, purged by retention, or not shipped yet by another
                node).
        """
        record = self.store.get(decision_id)
        if record is not None:
            return record
        for record in self._journal_records():
            if record["decision_id"] == decision_id:
                return record
        record = self.store.get(decision_id)  # shipped while the journals were read
        if record is not None:
            return record
        raise NotFound(f"no audit record of decision '{decision_id}' in {redact(self.db.dsn)}")

    def records(self, since: float, until: float) -> list[AuditRecord]:
        """Every record decided in ``[since, until)``, oldest first, each once."""
        found: dict[str, AuditRecord] = {}
        journaled = [r for r in self._journal_records() if since <= r["decided_at"] < until]
        for record in self.store.between(since, until):  # after the journals: a segment shipped and
            found.setdefault(record["decision_id"], record)  # deleted meanwhile is in the database
        for record in journaled:
            found.setdefault(record["decision_id"], record)
        return sorted(found.values(), key=lambda r: (r["decided_at"], r["decision_id"]))

    def labels(self, decision_ids: Iterable[str]) -> dict[str, Label]:
        """The label of each decision that has one, from the ``feedback`` table of the same database (none
        while the feedback log has not created it)."""
        ids = list(dict.fromkeys(decision_ids))
        out: dict[str, Label] = {}
        if not ids:
            return out
        with self.db.transaction(write=False) as tx:
            if not _has_table(tx, self.db, "feedback"):
                return out
            for start in range(0, len(ids), IDS_PER_QUERY):
                chunk = ids[start : start + IDS_PER_QUERY]
                marks = ",".join("?" * len(chunk))
                rows = tx.query(
                    "SELECT request_id, label, source, received_at, feedback_id FROM feedback"
                    f" WHERE request_id IN ({marks}) ORDER BY seq",
                    chunk,
                )
                for decision_id, label, source, received_at, feedback_id in rows:
                    out.setdefault(
                        str(decision_id), Label(int(label), str(source), float(received_at), str(feedback_id))
                    )
        return out


def _has_table(tx: Tx, db: Database, name: str) -> bool:
    """Whether the database has table ``name`` (in the schema its connections use)."""
    if db.backend == "sqlite":
        row = tx.one("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,))
    else:
        row = tx.one("SELECT to_regclass(?)", (name,))
        row = None if row is None or row[0] is None else row
    return row is not None
