"""Decisions of an audit trail found by id, for the feedback log that joins labels to them.

The feedback service keeps no copy of the decisions: a label names a decision the audit trail holds, and
the learner reads each labelled decision's feature row from its audit record. :class:`DecisionLookup`
keeps one read-only connection per slot file of the audit directory (opened once, shared between threads)
and looks again for new slot files when an id is not found (a replica started since). A record still only
in a journal (written ahead and not committed yet, spilled, or left by a replica killed before it was
replayed) is read from there on a miss, so a decision is found as soon as its answer has left.

Slot files of schema 1 (from before records carried feature rows) are not read: their decisions were
copied into the feedback log then, which keeps that copy read-only as its fallback.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from riskserve.audit.store import SCHEMA_VERSION, AuditRecord, decode_row

__all__ = ["DecisionLookup", "DecisionRef", "FeatureRow"]

CHUNK = 500
"""Ids per ``IN (...)`` query (SQLite's default limit of host parameters is far above)."""
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
    """Read-only lookups in every slot of one audit directory; safe to share between threads."""

    def __init__(self, directory: Path, *, busy_timeout_s: float = 5.0) -> None:
        self.directory = Path(directory)
        self._timeout = busy_timeout_s
        self._lock = threading.Lock()
        self._slots: dict[Path, sqlite3.Connection] = {}
        """Slot file -> its connection (a file of an older schema is looked at again at each rescan: its
        writer upgrades it when it opens it)."""
        self._layouts: dict[str, tuple[str, ...]] = {}

    # -- connections -----------------------------------------------------------------------------------

    def _rescan(self) -> None:
        """Open the slot files that appeared since the last scan (lock held)."""
        for path in sorted(self.directory.glob("slot-*.sqlite")):
            if path in self._slots:
                continue
            db = sqlite3.connect(
                f"{path.as_uri()}?mode=ro", uri=True, timeout=self._timeout, check_same_thread=False
            )
            try:
                version = db.execute("SELECT version FROM schema_version").fetchone()
            except sqlite3.OperationalError:  # created, not initialised yet: look again next time
                db.close()
                continue
            if version is None or int(version[0]) != SCHEMA_VERSION:
                db.close()
                continue
            self._slots[path] = db

    def _connections(self, rescan: bool) -> list[sqlite3.Connection]:
        with self._lock:
            if rescan or not self._slots:
                self._rescan()
            return list(self._slots.values())

    def _query(self, sql: str, args: tuple[object, ...], rescan: bool) -> list[tuple[object, ...]]:
        """``sql`` on every slot (serialized: the connections are shared); rows of all of them."""
        rows: list[tuple[object, ...]] = []
        for db in self._connections(rescan):
            with self._lock:
                rows.extend(db.execute(sql, args).fetchall())
        return rows

    def _journal_records(self, key: str, wanted: set[str]) -> Iterator[AuditRecord]:
        """The records of every slot's journal whose ``key`` field is one of ``wanted``. A journal holds
        megabytes before it is rotated, so a segment is searched for the ids' bytes first and only
        matching lines are parsed (a lookup of an unknown id parses nothing)."""
        needles = [json.dumps(w).encode() for w in wanted]
        field = _FIELDS[key]
        for path in sorted(self.directory.glob("slot-*.journal/*.jsonl")):
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # drained meanwhile: it is in a store now
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

    def find(self, decision_id: str) -> DecisionRef | None:
        """The decision with this server-issued id, or ``None`` (never made here, or purged)."""
        sql = "SELECT decision_id, decided_at, request_id FROM decisions WHERE decision_id = ?"
        for rescan in (False, True):
            rows = self._query(sql, (decision_id,), rescan)
            if rows:
                return _ref(rows[0])
        for record in self._journal_records("decision_id", {decision_id}):
            return DecisionRef(decision_id, float(record["decided_at"]), record["request_id"])
        rows = self._query(sql, (decision_id,), False)  # committed (and its segment deleted) meanwhile
        return _ref(rows[0]) if rows else None

    def by_request(self, request_id: str) -> list[DecisionRef]:
        """Up to two decisions made for the caller's ``request_id`` (two: it is ambiguous)."""
        sql = "SELECT decision_id, decided_at, request_id FROM decisions WHERE request_id = ? LIMIT 2"
        found: dict[str, DecisionRef] = {}
        for rescan in (False, True):
            for row in self._query(sql, (request_id,), rescan):
                ref = _ref(row)
                found.setdefault(ref.decision_id, ref)
            if found:
                break
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
        out = self._stored_rows(wanted)
        missing = {i for i in wanted if i not in out}
        if missing:
            for record in self._journal_records("decision_id", missing):
                if "features" in record:
                    row = self._row(record.get("layout", ""), record["features"])
                    if row is not None:
                        out[record["decision_id"]] = row
            late = [i for i in wanted if i not in out]
            if late:  # committed (and their segments deleted) while the journals were read
                out.update(self._stored_rows(late, new_slots=False))
        return out

    def _stored_rows(self, wanted: list[str], new_slots: bool = True) -> dict[str, FeatureRow]:
        """Rows of ``wanted`` in the slot stores; ``new_slots``: look for new slot files when some are
        missing."""
        out: dict[str, FeatureRow] = {}
        for rescan in (False, True) if new_slots else (False,):
            missing = [i for i in wanted if i not in out]
            if not missing:
                return out
            for start in range(0, len(missing), CHUNK):
                chunk = missing[start : start + CHUNK]
                marks = ",".join("?" * len(chunk))
                sql = (
                    "SELECT decision_id, json_extract(record, '$.layout'),"
                    f" json_extract(record, '$.features') FROM decisions WHERE decision_id IN ({marks})"
                )
                for decision_id, layout, features in self._query(sql, tuple(chunk), rescan and start == 0):
                    row = self._row(str(layout) if layout else "", features)
                    if row is not None:
                        out[str(decision_id)] = row
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
        """The column names of ``layout`` (from whichever slot keeps them)."""
        cached = self._layouts.get(layout)
        if cached is None:
            for rescan in (False, True):
                rows = self._query("SELECT columns FROM layouts WHERE digest = ?", (layout,), rescan)
                if rows:
                    cached = self._layouts[layout] = tuple(json.loads(str(rows[0][0])))
                    break
        return cached

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            for db in self._slots.values():
                db.close()
            self._slots.clear()


def _ref(row: tuple[object, ...]) -> DecisionRef:
    decision_id, decided_at, request_id = row
    assert isinstance(decided_at, (int, float))
    return DecisionRef(str(decision_id), float(decided_at), str(request_id or decision_id))
