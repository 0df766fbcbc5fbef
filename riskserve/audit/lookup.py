"""Decisions of an audit trail found by id, for the feedback log that joins labels to them.

The feedback service keeps no copy of the decisions: a label names a decision the audit trail holds, and
the learner reads each labelled decision's feature row from its audit record. :class:`DecisionLookup`
reads the pipeline's state database, where every node's writer ships its records, so a label finds its
decision whichever node made it. Given this node's journal directory it also reads the records still only
in a journal here (written ahead and not shipped yet, spilled, or left by a replica killed before it was
replayed), so a decision made on this node is found as soon as its answer has left. A decision made on
another node reaches the database within about one shipping interval: :meth:`DecisionLookup.find` can wait
for it (``wait_s``).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from riskserve.audit.journal import read_layout
from riskserve.audit.store import AuditRecord, AuditStore, decode_row
from riskserve.state.db import Database

__all__ = ["POLL_S", "DecisionLookup", "DecisionRef", "FeatureRow"]

POLL_S = 0.02
"""How often :meth:`DecisionLookup.find` looks again while it waits (one indexed read each)."""
_FIELDS = {
    key: re.compile(rb'"' + key.encode() + rb'":("(?:[^"\\]|\\.)*")') for key in ("decision_id", "request_id")
}
"""A journal line's id fields as the writer's compact JSON spells them (read without parsing the line)."""


@dataclass(frozen=True)
class DecisionRef:
    """What the feedback log checks of a decision before it takes a label."""

    decision_id: str
    decided_at: float
    request_id: str
    """The caller's request id (a correlation id, not unique)."""


@dataclass(frozen=True)
class FeatureRow:
    """The encoded row a decision's models saw, with its column names."""

    columns: tuple[str, ...]
    data: bytes
    """The row's little-endian float32 bytes."""


class DecisionLookup:
    """Read-only lookups in the audit trail of ``db`` and, given ``journal_dir`` (the YAML's ``audit.path``
    on this node), in this node's journals; safe to share between threads.

    Raises (every lookup):
        StoreUnavailable: the database cannot be reached now (retry later).
    """

    def __init__(self, db: Database, journal_dir: Path | None = None) -> None:
        self.store = AuditStore(db)
        self.journal_dir = None if journal_dir is None else Path(journal_dir)
        self._lock = threading.Lock()
        self._layouts: dict[str, tuple[str, ...]] = {}

    # -- this node's journals ----------------------------------------------------------------------------

    def _journal_records(self, key: str, wanted: set[str]) -> Iterator[AuditRecord]:
        """The records of every slot's journal whose ``key`` field is one of ``wanted``. A journal holds
        megabytes before it is rotated, so a segment is searched for the ids' bytes first and only
        matching lines are parsed (a lookup of an unknown id parses nothing)."""
        if self.journal_dir is None:
            return
        needles = [json.dumps(w).encode() for w in wanted]
        field = _FIELDS[key]
        for path in sorted(self.journal_dir.glob("slot-*.journal/*.jsonl")):
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # drained meanwhile: it is in the database now
                continue
            if len(needles) <= 8 and not any(n in data for n in needles):
                continue
            for line in data.splitlines():
                found = field.search(line)
                if found is None or json.loads(found.group(1)) not in wanted:
                    continue
                try:
                    record: AuditRecord = json.loads(line)
                except ValueError:  # a torn line (the writer counts it when it replays the segment)
                    continue
                yield record

    # -- lookups ---------------------------------------------------------------------------------------

    def find(self, decision_id: str, wait_s: float = 0.0) -> DecisionRef | None:
        """The decision with this server-issued id, or ``None`` (never made, purged, or not shipped within
        ``wait_s``). On a miss it looks in this node's journals, then again in the database every
        :data:`POLL_S` until ``wait_s`` has passed: a label may reach this node before the node that made
        the decision shipped it (pass about two shipping intervals). No lock is held while it waits."""
        deadline = time.monotonic() + wait_s
        found = self._find_stored(decision_id)
        if found is not None:
            return found
        for record in self._journal_records("decision_id", {decision_id}):
            return DecisionRef(decision_id, float(record["decided_at"]), record["request_id"])
        while True:  # shipped meanwhile (its journal segment deleted), here or by another node
            found = self._find_stored(decision_id)
            left = deadline - time.monotonic()
            if found is not None or left <= 0:
                return found
            time.sleep(min(POLL_S, left))

    def _find_stored(self, decision_id: str) -> DecisionRef | None:
        rows = self.store.refs("decision_id", decision_id, 1)
        return _ref(*rows[0]) if rows else None

    def by_request(self, request_id: str) -> list[DecisionRef]:
        """Up to two decisions made for the caller's ``request_id`` (two: it is ambiguous)."""
        found = {ref[0]: _ref(*ref) for ref in self.store.refs("request_id", request_id, 2)}
        if len(found) < 2:
            for record in self._journal_records("request_id", {request_id}):
                if record["decision_id"] not in found:
                    found[record["decision_id"]] = DecisionRef(
                        record["decision_id"], float(record["decided_at"]), request_id
                    )
                if len(found) >= 2:
                    break
        return list(found.values())[:2]

    def rows(self, decision_ids: Iterable[str]) -> dict[str, FeatureRow]:
        """The feature row of each decision that has one (absent: not found, or kept no row)."""
        wanted = list(dict.fromkeys(decision_ids))
        out = self._rows_of(self.store.many(wanted).values())
        missing = {i for i in wanted if i not in out}
        if missing and self.journal_dir is not None:
            out.update(self._rows_of(self._journal_records("decision_id", missing)))
            late = [i for i in wanted if i not in out]
            if late:  # shipped (and their segments deleted) while the journals were read
                out.update(self._rows_of(self.store.many(late).values()))
        return out

    def _rows_of(self, records: Iterable[AuditRecord]) -> dict[str, FeatureRow]:
        out: dict[str, FeatureRow] = {}
        for record in records:
            row = self._row(record.get("layout", ""), record.get("features"))
            if row is not None:
                out[record["decision_id"]] = row
        return out

    def _row(self, layout: str, features: object) -> FeatureRow | None:
        if not layout or not isinstance(features, str):
            return None
        columns = self._columns(layout)
        try:
            data = decode_row(features)
        except ValueError:
            return None
        if columns is None or len(data) != 4 * len(columns):
            return None
        return FeatureRow(columns, data)

    def _columns(self, layout: str) -> tuple[str, ...] | None:
        """The column names of ``layout``: from the database, else from this node's journal directory (a
        writer keeps them there before any record names them)."""
        with self._lock:
            cached = self._layouts.get(layout)
        if cached is None:
            cached = self.store.layout_columns(layout)
            if cached is None and self.journal_dir is not None:
                cached = read_layout(self.journal_dir, layout)
            if cached is not None:
                with self._lock:
                    self._layouts[layout] = cached
        return cached

    def close(self) -> None:
        """Forget the cached layouts. The database stays open: it is the caller's."""
        with self._lock:
            self._layouts.clear()


def _ref(decision_id: str, decided_at: float, request_id: str) -> DecisionRef:
    return DecisionRef(decision_id, decided_at, request_id or decision_id)
