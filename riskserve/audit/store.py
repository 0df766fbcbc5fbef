"""One SQLite file of audit records (WAL), written by one process, read by any.

A record is one decision as it was answered (:class:`AuditRecord`), kept whole as JSON beside the columns
a query needs (id, time, pipeline, outcome, the caller's request id). In a pipeline that learns online it
also holds the encoded feature row the models saw (its float32 bytes, base64) and the digest of its column
layout,
whose column names the file keeps once in ``layouts``: the feedback log joins labels to these records
(:mod:`riskserve.audit.lookup`) rather than keeping a copy of them. Writes are ``INSERT OR IGNORE`` on
the decision id, so a record replayed from the journal after a crash is written once. Every write is one
short ``BEGIN IMMEDIATE`` ... ``COMMIT``; retention deletes at most ``rows`` per transaction, so readers
and the writer never wait long on it.

Durability: ``synchronous=NORMAL`` in WAL mode: a commit survives the process being killed, and the
journal (:mod:`riskserve.audit.journal`) covers what is not committed yet; a power loss may lose the last
commits (and the journal, which is not fsynced either). The file is created mode 0600: it holds the
requests' input fields.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, NotRequired, TypedDict

from riskserve.platform.sqlite_wal import install_schema, open_wal

__all__ = [
    "SCHEMA_VERSION",
    "AuditRecord",
    "AuditStore",
    "create_private",
    "decode_row",
    "dumps",
    "encode_row",
    "layout_digest",
]

SCHEMA_VERSION: Final = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS decisions (
    decision_id      TEXT PRIMARY KEY,
    decided_at       REAL NOT NULL,
    pipeline         TEXT NOT NULL,
    pipeline_version TEXT NOT NULL,
    outcome          TEXT NOT NULL,
    record           TEXT NOT NULL,  -- the whole AuditRecord as JSON
    request_id       TEXT            -- the caller's request id (a correlation id, not unique)
);
CREATE INDEX IF NOT EXISTS decisions_decided_at ON decisions (decided_at);
CREATE TABLE IF NOT EXISTS layouts (
    digest  TEXT PRIMARY KEY,        -- layout_digest(columns): what a record's "layout" names
    columns TEXT NOT NULL            -- the column names as a JSON list
);
"""
_MIGRATIONS: Final = {
    # 1 -> 2: the caller's request id as a column (the feedback log finds a decision by it) and layouts.
    1: [
        "ALTER TABLE decisions ADD COLUMN request_id TEXT",
        "UPDATE decisions SET request_id = json_extract(record, '$.request_id')",
    ],
}
_INDEXES: Final = ["CREATE INDEX IF NOT EXISTS decisions_request_id ON decisions (request_id)"]
"""Created after the migrations (they add the indexed column)."""


class AuditRecord(TypedDict):
    """One decision as it was answered (the JSON of the store, the journal and ``audit show``)."""

    decision_id: str
    decided_at: float
    """Seconds since the epoch (UTC) when the decision was made."""
    pipeline: str
    pipeline_version: str
    request_id: str
    trace_id: str
    inputs: dict[str, Any]
    """The request's fields as the caller sent them: ``{"numeric": {...}, "categorical": {...}, "text"}``."""
    models: list[dict[str, Any]]
    """Per model: ``model``, ``version``, ``score``, ``label``, ``fallback``, ``fallback_reason``."""
    risk_score: float
    outcome: str
    rules: list[str]
    """Names of the rules that fired."""
    rule_reasons: list[str]
    """The decision's reasons as answered (fired rules' texts, fallbacks, the default reason)."""
    top_reasons: list[dict[str, Any]]
    """Reason codes: ``field``, ``text``, ``contribution``, ``model``, ``value``."""
    features: NotRequired[str]
    """The encoded row the models saw: its little-endian float32 bytes in base64 (:func:`encode_row`;
    exact, and ~1 µs where JSON numbers cost tens); kept when the pipeline learns online (``feedback``),
    absent otherwise and in records of schema 1."""
    layout: NotRequired[str]
    """:func:`layout_digest` of the row's columns (the names are in the file's ``layouts`` table)."""


def layout_digest(columns: Sequence[str]) -> str:
    """A short name for a column layout, derived from the names themselves (so it cannot drift)."""
    return hashlib.sha256(json.dumps(list(columns)).encode()).hexdigest()[:16]


def encode_row(data: bytes) -> str:
    """A record's ``features`` from a row's little-endian float32 bytes."""
    return base64.b64encode(data).decode("ascii")


def decode_row(text: str) -> bytes:
    """A row's little-endian float32 bytes from a record's ``features``."""
    return base64.b64decode(text, validate=True)


def dumps(record: AuditRecord) -> str:
    """The record as one line of compact JSON."""
    return json.dumps(record, separators=(",", ":"))


def create_private(path: Path) -> None:
    """Create ``path`` empty with mode 0600 if it does not exist (never loosen an existing file)."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))


class AuditStore:
    """One SQLite audit file; safe to share between threads (one connection behind a lock)."""

    def __init__(self, path: Path, *, busy_timeout_s: float = 5.0) -> None:
        self.path = Path(path)
        create_private(self.path)
        self._lock = threading.Lock()
        self._db = open_wal(self.path, busy_timeout_s=busy_timeout_s, synchronous="NORMAL")
        try:
            self._configure()
        except BaseException:
            self._db.close()
            raise

    def _configure(self) -> None:
        with self._write() as cur:  # an older file is upgraded in the same transaction
            install_schema(
                cur,
                path=self.path,
                schema=_SCHEMA,
                version=SCHEMA_VERSION,
                migrations=_MIGRATIONS,
                indexes=_INDEXES,
                label="audit schema",
            )

    def _write(self) -> _Transaction:
        return _Transaction(self._db, self._lock)

    def insert(self, records: Sequence[AuditRecord], lines: Sequence[str] | None = None) -> int:
        """Keep ``records`` in ONE transaction; returns how many were new (a kept id is left as it was).

        ``lines``: the records' JSON when the caller has it already (the journal's lines)."""
        texts = lines if lines is not None else [dumps(r) for r in records]
        rows = [
            (
                r["decision_id"],
                r["decided_at"],
                r["pipeline"],
                r["pipeline_version"],
                r["outcome"],
                text,
                r["request_id"],
            )
            for r, text in zip(records, texts, strict=True)
        ]
        with self._write() as cur:
            before = self._db.total_changes
            cur.executemany(
                "INSERT OR IGNORE INTO decisions"
                " (decision_id, decided_at, pipeline, pipeline_version, outcome, record, request_id)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            return int(self._db.total_changes - before)

    def add_layout(self, columns: Sequence[str]) -> str:
        """Keep the names of a column layout (once); returns its digest, what records name it by."""
        digest = layout_digest(columns)
        with self._write() as cur:
            cur.execute(
                "INSERT OR IGNORE INTO layouts (digest, columns) VALUES (?, ?)",
                (digest, json.dumps(list(columns))),
            )
        return digest

    def get(self, decision_id: str) -> AuditRecord | None:
        """The record of one decision, or ``None``."""
        with self._lock:
            row = self._db.execute(
                "SELECT record FROM decisions WHERE decision_id = ?", (decision_id,)
            ).fetchone()
        return None if row is None else _load(row[0])

    def between(self, since: float, until: float) -> Iterator[AuditRecord]:
        """Records decided in ``[since, until)``, oldest first (read in pages of 1000)."""
        after = (since, "")
        while True:
            with self._lock:
                rows = self._db.execute(
                    "SELECT decided_at, decision_id, record FROM decisions"
                    " WHERE (decided_at, decision_id) > (?, ?) AND decided_at >= ? AND decided_at < ?"
                    " ORDER BY decided_at, decision_id LIMIT 1000",
                    (*after, since, until),
                ).fetchall()
            if not rows:
                return
            for row in rows:
                yield _load(row[2])
            after = (rows[-1][0], rows[-1][1])

    def count(self) -> int:
        """How many records the file holds."""
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM decisions").fetchone()[0])

    def purge(self, before: float, rows: int) -> int:
        """Delete at most ``rows`` records decided before ``before`` in one transaction; returns how many."""
        with self._write() as cur:
            cur.execute(
                "DELETE FROM decisions WHERE rowid IN"
                " (SELECT rowid FROM decisions WHERE decided_at < ? ORDER BY decided_at LIMIT ?)",
                (before, rows),
            )
            return int(cur.rowcount)

    def pragma(self, name: str) -> Any:
        """One PRAGMA as SQLite reports it now (``journal_mode``, ``synchronous``)."""
        if not name.isidentifier():
            raise ValueError(f"not a pragma name: {name!r}")
        with self._lock:
            return self._db.execute(f"PRAGMA {name}").fetchone()[0]

    def close(self) -> None:
        """Close the connection (the last one to close checkpoints the WAL)."""
        with self._lock:
            self._db.close()

    def __enter__(self) -> AuditStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _Transaction:
    """``with store._write() as cur``: BEGIN IMMEDIATE, COMMIT on success, ROLLBACK on an exception."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock) -> None:
        self._db = db
        self._lock = lock
        self._cur: sqlite3.Cursor | None = None

    def __enter__(self) -> sqlite3.Cursor:
        self._lock.acquire()
        try:
            self._cur = self._db.cursor()
            self._cur.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._lock.release()
            raise
        return self._cur

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._cur is not None
        try:
            if exc_type is not None:
                self._cur.execute("ROLLBACK")
                return
            try:
                self._cur.execute("COMMIT")
            except BaseException:  # e.g. the disk is full: leave no transaction open
                if self._db.in_transaction:
                    self._cur.execute("ROLLBACK")
                raise
        finally:
            self._lock.release()


def _load(text: str) -> AuditRecord:
    record: AuditRecord = json.loads(text)
    return record
