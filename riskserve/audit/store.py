"""The audit records in a pipeline's state database (component ``audit``): one place for their SQL.

A record is one decision as it was answered (:class:`AuditRecord`), kept whole as JSON beside the columns
a query needs (id, the caller's request id, time, pipeline, outcome) and the node and replica slot that
made it. In a pipeline that learns online it also holds the encoded feature row the models saw (its
float32 bytes, base64) and the digest of its column layout, whose column names the database keeps once in
``audit_layouts``: the feedback log joins labels to these records (:mod:`riskserve.audit.lookup`) rather
than keeping a copy of them. Every node writes the same tables (PostgreSQL on a cluster, a SQLite file on
one machine), so a label finds its decision whichever node made it, and a lost node loses only what it had
not shipped yet (:class:`~riskserve.audit.writer.AuditWriter` states the bound).

Inserts are multi-row ``INSERT ... ON CONFLICT (decision_id) DO NOTHING``: a record shipped twice (a
journal replayed after a crash, a commit whose acknowledgement was lost) is kept once, as first written.
Retention deletes at most ``rows`` per transaction by ``decided_at``; deletes are idempotent, so several
replicas may purge at once.

Slot files of the releases before the state database (``slot-N.sqlite`` in the audit directory) are not
migrated: they stay on their node's disk, readable with ``sqlite3``, and nothing reads them any more.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from riskserve.state.db import Database, Migration

__all__ = [
    "MIGRATIONS",
    "AuditRecord",
    "AuditStore",
    "create_private",
    "decode_row",
    "dumps",
    "encode_row",
    "layout_digest",
]

MIGRATIONS = (
    Migration(
        1,
        """
        CREATE TABLE audit_decisions (
            decision_id      TEXT PRIMARY KEY,
            request_id       TEXT NOT NULL,
            decided_at       DOUBLE PRECISION NOT NULL,
            pipeline         TEXT NOT NULL,
            pipeline_version TEXT NOT NULL,
            outcome          TEXT NOT NULL,
            node             TEXT NOT NULL,
            replica          TEXT NOT NULL,
            record           TEXT NOT NULL
        );
        CREATE INDEX audit_decisions_request_id ON audit_decisions (request_id);
        CREATE INDEX audit_decisions_decided_at ON audit_decisions (decided_at);
        CREATE TABLE audit_layouts (
            digest  TEXT PRIMARY KEY,
            columns TEXT NOT NULL
        )
        """,
    ),
)
"""The audit component's schema; ``record`` is the whole :class:`AuditRecord` as JSON, ``node`` and
``replica`` (the writer's slot on that node) say where it was decided, ``audit_layouts.columns`` is the
names of a layout as a JSON list."""

ROWS_PER_INSERT = 500
"""Records per ``INSERT`` statement (9 parameters each: far under both engines' limits)."""
IDS_PER_QUERY = 500
"""Ids per ``IN (...)`` query."""
_PAGE = 1000
_COLUMNS = "decision_id, request_id, decided_at, pipeline, pipeline_version, outcome, node, replica, record"


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
    absent otherwise."""
    layout: NotRequired[str]
    """:func:`layout_digest` of the row's columns (the names are in the ``audit_layouts`` table)."""


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


def loads(text: str) -> AuditRecord:
    """A record from its JSON."""
    record: AuditRecord = json.loads(text)
    return record


def create_private(path: Path) -> None:
    """Create ``path`` empty with mode 0600 if it does not exist (never loosen an existing file)."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))


@functools.lru_cache(maxsize=8)
def _insert_sql(rows: int) -> str:
    values = ",".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?)"] * rows)
    return f"INSERT INTO audit_decisions ({_COLUMNS}) VALUES {values} ON CONFLICT (decision_id) DO NOTHING"


_PG_INSERT_JSON = (
    f"INSERT INTO audit_decisions ({_COLUMNS}) SELECT r->>'decision_id', r->>'request_id', "
    "(r->>'decided_at')::float8, r->>'pipeline', r->>'pipeline_version', r->>'outcome', ?, ?, r::text "
    "FROM json_array_elements(?::json) AS r ON CONFLICT (decision_id) DO NOTHING"
)
"""PostgreSQL's insert of a batch: the records' JSON lines as ONE parameter, split and read by the server
(nine parameters a record cost the shipping thread ~60 µs of CPU a record in psycopg's adaptation, which
the decisions' event loop waits on; this costs ~20)."""


class AuditStore:
    """The audit tables of one state database; thread-safe (every call is its own transaction; reads take
    no write lock). The schema is installed on first use, so a replica starts while the database is down.

    Raises (every method that reads or writes):
        StoreUnavailable: the database cannot be reached now (nothing was written).
    """

    def __init__(self, db: Database) -> None:
        self.db = db
        self._ready = False
        self._lock = threading.Lock()

    def ensure_schema(self) -> None:
        """Apply the audit migrations once per process (idempotent across processes)."""
        if self._ready:
            return
        with self._lock:
            if not self._ready:
                self.db.migrate("audit", MIGRATIONS)
                self._ready = True

    def insert(
        self,
        records: Sequence[AuditRecord],
        lines: Sequence[str] | None = None,
        *,
        node: str = "",
        replica: str = "",
    ) -> int:
        """Keep ``records`` in ONE transaction; returns how many were new (a kept id is left as it was).

        ``lines``: the records' JSON when the caller has it already (the journal's lines); ``node`` and
        ``replica``: where they were decided."""
        self.ensure_schema()
        texts = lines if lines is not None else [dumps(r) for r in records]
        rows = [
            (r["decision_id"], r["request_id"], r["decided_at"], r["pipeline"], r["pipeline_version"],
             r["outcome"], node, replica, text)
            for r, text in zip(records, texts, strict=True)
        ]  # fmt: skip
        new = 0
        with self.db.transaction() as tx:
            for start in range(0, len(rows), ROWS_PER_INSERT):
                chunk = rows[start : start + ROWS_PER_INSERT]
                if self.db.backend == "postgresql":  # one parameter: PostgreSQL splits the records itself
                    array = "[" + ",".join(texts[start : start + ROWS_PER_INSERT]) + "]"
                    new += tx.execute(_PG_INSERT_JSON, (node, replica, array))
                else:
                    new += tx.execute(_insert_sql(len(chunk)), [value for row in chunk for value in row])
        return new

    def add_layouts(self, layouts: Mapping[str, Sequence[str]]) -> None:
        """Keep the names of column layouts by their digests (a kept digest is left as it was)."""
        if not layouts:
            return
        self.ensure_schema()
        with self.db.transaction() as tx:
            tx.executemany(
                "INSERT INTO audit_layouts (digest, columns) VALUES (?, ?) ON CONFLICT (digest) DO NOTHING",
                [(digest, json.dumps(list(columns))) for digest, columns in sorted(layouts.items())],
            )

    def add_layout(self, columns: Sequence[str]) -> str:
        """Keep the names of one column layout; returns its digest, what records name it by."""
        digest = layout_digest(columns)
        self.add_layouts({digest: columns})
        return digest

    def layout_columns(self, digest: str) -> tuple[str, ...] | None:
        """The column names a layout digest stands for, or ``None`` (not shipped yet)."""
        self.ensure_schema()
        with self.db.transaction(write=False) as tx:
            row = tx.one("SELECT columns FROM audit_layouts WHERE digest = ?", (digest,))
        return None if row is None else tuple(json.loads(row[0]))

    def get(self, decision_id: str) -> AuditRecord | None:
        """The record of one decision, or ``None``."""
        self.ensure_schema()
        with self.db.transaction(write=False) as tx:
            row = tx.one("SELECT record FROM audit_decisions WHERE decision_id = ?", (decision_id,))
        return None if row is None else loads(row[0])

    def refs(self, column: str, value: str, limit: int) -> list[tuple[str, float, str]]:
        """``(decision_id, decided_at, request_id)`` of up to ``limit`` records whose ``column``
        (``decision_id`` or ``request_id``, both indexed) is ``value``."""
        if column not in ("decision_id", "request_id"):
            raise ValueError(f"not an indexed id column: {column!r}")
        self.ensure_schema()
        with self.db.transaction(write=False) as tx:
            rows = tx.query(
                f"SELECT decision_id, decided_at, request_id FROM audit_decisions WHERE {column} = ? "
                "ORDER BY decision_id LIMIT ?",
                (value, limit),
            )
        return [(str(d), float(t), str(r)) for d, t, r in rows]

    def many(self, decision_ids: Iterable[str]) -> dict[str, AuditRecord]:
        """The records of those of ``decision_ids`` that are kept, by id."""
        wanted = list(dict.fromkeys(decision_ids))
        if not wanted:
            return {}
        self.ensure_schema()
        out: dict[str, AuditRecord] = {}
        with self.db.transaction(write=False) as tx:
            for start in range(0, len(wanted), IDS_PER_QUERY):
                chunk = wanted[start : start + IDS_PER_QUERY]
                marks = ",".join("?" * len(chunk))
                for decision_id, text in tx.query(
                    f"SELECT decision_id, record FROM audit_decisions WHERE decision_id IN ({marks})", chunk
                ):
                    out[str(decision_id)] = loads(text)
        return out

    def between(self, since: float, until: float) -> Iterator[AuditRecord]:
        """Records decided in ``[since, until)``, oldest first (read in pages of 1000, one transaction
        each, so no transaction stays open while the caller works)."""
        self.ensure_schema()
        after: tuple[float, str] = (since, "")
        while True:
            with self.db.transaction(write=False) as tx:
                rows = tx.query(
                    "SELECT decided_at, decision_id, record FROM audit_decisions"
                    " WHERE (decided_at > ? OR (decided_at = ? AND decision_id > ?))"
                    " AND decided_at >= ? AND decided_at < ?"
                    " ORDER BY decided_at, decision_id LIMIT ?",
                    (after[0], after[0], after[1], since, until, _PAGE),
                )
            if not rows:
                return
            for row in rows:
                yield loads(row[2])
            after = (float(rows[-1][0]), str(rows[-1][1]))

    def count(self) -> int:
        """How many records the database holds."""
        self.ensure_schema()
        with self.db.transaction(write=False) as tx:
            row = tx.one("SELECT COUNT(*) FROM audit_decisions")
        return 0 if row is None else int(row[0])

    def origins(self) -> dict[str, tuple[str, str]]:
        """Decision id -> (node, replica) that made it, of every record (tests and drills: small trails)."""
        self.ensure_schema()
        with self.db.transaction(write=False) as tx:
            rows = tx.query("SELECT decision_id, node, replica FROM audit_decisions")
        return {str(d): (str(n), str(r)) for d, n, r in rows}

    def purge(self, before: float, rows: int) -> int:
        """Delete at most ``rows`` records decided before ``before`` in one transaction; returns how many."""
        self.ensure_schema()
        with self.db.transaction() as tx:
            return tx.execute(
                "DELETE FROM audit_decisions WHERE decision_id IN (SELECT decision_id FROM audit_decisions"
                " WHERE decided_at < ? ORDER BY decided_at LIMIT ?)",
                (before, rows),
            )
