"""The durable, append-only feedback log that online learning reads: SQLite in WAL mode.

A pipeline's ``Feedback(decision_id | request_id, label, feedback_id)`` RPC records the true outcome of a
past decision. The log keeps labels, cursors, held-out labels and batch reports, and NO copy of the
decisions: the pipeline's audit trail is the record of every decision (its records carry the encoded
feature row the models saw), and a label is joined to its audit record by decision id
(:class:`~riskserve.audit.lookup.DecisionLookup`), when it is recorded (the decision must exist, within
``retention_s``) and when a learner reads it (the row it trains on). A decision is keyed by the id the
SERVER issued it (``DecideResponse.decision_id``); the caller's ``request_id`` is kept beside it as a
correlation id that need not be unique, so nobody can pre-empt another caller's decision by sending its
``request_id`` first. A label naming only a ``request_id`` joins the one decision carrying it, and is
refused as ambiguous when there are several. A learner reads the labels it has not applied yet
(:meth:`FeedbackLog.pending`), runs ``partial_fit`` on them as one mini-batch and moves its cursor
(:meth:`FeedbackLog.mark_applied`).

A log written before schema 4 has its own ``decisions`` table (the copy the ingress used to send): it is
kept, read-only, as a second source of decisions, so labels recorded (or pending) before the upgrade keep
their rows; its rows past retention are purged as before, and no new row is ever written to it.

Durability. The connection runs ``journal_mode=WAL`` with ``synchronous=FULL``: every COMMIT fsyncs the
WAL before it returns, so an acknowledged label survives ``kill -9`` *and* power loss (``NORMAL`` would
survive a process crash but could lose the last commits on power loss). Both pragmas are read back after
they are set; a file system that refuses WAL is a :class:`ConfigError`, not a silent downgrade.
:meth:`FeedbackLog.record_feedback` returns only after its COMMIT, so "acknowledged" implies "durable".
``feedback_id`` is UNIQUE: a retried call finds the committed row and answers ``duplicate=True``.

Exactly once. Each model has one ``cursor(model, last_seq, version)`` row, a high-water mark over the
``feedback.seq`` order, rather than an ``applied(model, seq)`` row per label. The claim to prove is
"every label with ``seq <= last_seq`` is in model ``version`` exactly once and no other label is", and
it holds because of the order the learner follows:

1. ``batch = pending(model)`` reads the labels ``(after_seq, last_seq]`` in seq order;
2. ``partial_fit`` runs on a copy of the model at ``cursor.version``, giving a new state;
3. the new state is saved durably as an artifact named by its content version;
4. ``mark_applied(model, batch.last_seq, new_version, expected_last_seq=batch.after_seq)`` moves
   ``last_seq`` *and* ``version`` in ONE transaction.

A crash before step 4 commits leaves the cursor at the old (last_seq, version): the new state is an
orphan that nothing refers to, and the restarted learner loads ``cursor.version`` and replays the same
labels onto it, so they end up applied once in the lineage that survives. A crash after the commit
leaves the new pair. There is no moment at which the version and the high-water mark disagree, which
is what a separate "mark applied" step after publishing would allow. Serving should publish a learned
version only after step 4 (or treat versions newer than the cursor as provisional). The mark is
compare-and-set (``expected_last_seq``) so two learners, or a stale retry, cannot both advance it, and
it refuses to move backwards or past the last recorded label.

Retention (:meth:`FeedbackLog.purge_expired`). A decision older than ``retention_s`` can no longer
receive feedback (:class:`NotFound`). Its label (each label row keeps its decision's time) is deleted
once it has been applied by every *known* model — the models with a cursor row
(:meth:`FeedbackLog.register_model` or a first :meth:`FeedbackLog.mark_applied`); with no known model
nothing is deleted. A label row is only deleted once its decision is past retention, when no label can be
taken for it any more, so a retry can never be counted twice. The audit trail's retention
(``audit.retention_days``) must be at least as long (the pipeline schema checks it), and a label whose
audit record is gone all the same (the trail was purged or removed) is skipped by the learner, logged.
"""

from __future__ import annotations

import json
import math
import operator
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from riskserve.audit.lookup import DecisionLookup, DecisionRef, FeatureRow
from riskserve.platform.errors import AlreadyExists, ConfigError, Conflict, InvalidInput, NotFound
from riskserve.platform.sqlite_wal import install_schema, open_wal

__all__ = ["SCHEMA_VERSION", "Batch", "Cursor", "FeedbackAck", "FeedbackLog", "Window"]

SCHEMA_VERSION: Final = 4

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS feedback (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    feedback_id TEXT NOT NULL UNIQUE,
    request_id  TEXT NOT NULL,       -- the decision id the server issued (named so since schema 1)
    label       INTEGER NOT NULL CHECK (label IN (0, 1)),
    source      TEXT NOT NULL,
    received_at REAL NOT NULL,
    caller_id   TEXT,                -- the decision's caller request_id: a correlation id, not unique
    decided_at  REAL                 -- when the decision was made (retention)
);
CREATE INDEX IF NOT EXISTS feedback_request_id ON feedback (request_id);
CREATE TABLE IF NOT EXISTS cursor (
    model      TEXT PRIMARY KEY,
    last_seq   INTEGER NOT NULL CHECK (last_seq >= 0),
    version    TEXT,
    updated_at REAL NOT NULL,
    artifact   TEXT,
    baseline   TEXT,
    paused     TEXT
);
CREATE TABLE IF NOT EXISTS holdout (
    model TEXT NOT NULL,
    seq   INTEGER NOT NULL,
    PRIMARY KEY (model, seq)
);
CREATE TABLE IF NOT EXISTS batches (
    model      TEXT NOT NULL,
    last_seq   INTEGER NOT NULL,
    after_seq  INTEGER NOT NULL,
    version    TEXT NOT NULL,
    report     TEXT NOT NULL,
    applied_at REAL NOT NULL,
    PRIMARY KEY (model, last_seq)
);
"""
_MIGRATIONS: Final = {
    # 1 -> 2: the cursor names the artifact of its version; held-out labels and batch reports are kept.
    1: ["ALTER TABLE cursor ADD COLUMN artifact TEXT"],
    # 2 -> 3: the served baseline a model's drift is measured from, and why its learning is paused.
    # ... and the caller's request_id beside the server-issued decision id (old rows: the same id).
    2: [
        "ALTER TABLE cursor ADD COLUMN baseline TEXT",
        "ALTER TABLE cursor ADD COLUMN paused TEXT",
        "ALTER TABLE decisions ADD COLUMN caller_id TEXT",
        "UPDATE decisions SET caller_id = request_id",
        "CREATE INDEX IF NOT EXISTS decisions_caller_id ON decisions (caller_id)",
    ],
    # 3 -> 4: decisions live in the audit trail; each label keeps its decision's caller id and time, and
    # the old ``decisions`` table stays, read-only, as a fallback source (its foreign key goes unenforced).
    3: [
        "ALTER TABLE feedback ADD COLUMN caller_id TEXT",
        "ALTER TABLE feedback ADD COLUMN decided_at REAL",
        "UPDATE feedback SET caller_id = (SELECT d.caller_id FROM decisions AS d"
        " WHERE d.request_id = feedback.request_id), decided_at = (SELECT d.decided_at FROM decisions AS d"
        " WHERE d.request_id = feedback.request_id)",
    ],
}
_INDEXES: Final = ["CREATE INDEX IF NOT EXISTS feedback_decided_at ON feedback (decided_at)"]
"""Created after the migrations (they may add the indexed columns)."""


@dataclass(frozen=True)
class FeedbackAck:
    """The answer to one feedback call; it exists only once the label is committed (durable)."""

    accepted: bool
    """The label is in the log (true for a first call and for a retry)."""
    duplicate: bool
    """This ``feedback_id`` was already recorded; the label is applied once, not again."""
    seq: int
    """Position of the label in the log's total order."""


@dataclass(frozen=True)
class Cursor:
    """A model's high-water mark: labels ``seq <= last_seq`` (since ``version``'s lineage was adopted)
    are in ``version``, no others are."""

    model: str
    last_seq: int
    """0 for a model that has applied nothing."""
    version: str | None
    """Model version holding exactly those labels (``None`` before the first mark)."""
    artifact: str | None = None
    """Artifact directory of ``version``, where the learner wrote (or adopted) it."""
    baseline: str | None = None
    """Artifact directory of the served baseline (the version last adopted: the YAML's or a swap's); the
    model's total drift is measured from it."""
    paused: str = ""
    """Why learning is paused ('' when it is not): the drift bound was reached; adopting a version resumes."""


@dataclass(frozen=True, eq=False)
class Window:
    """Held-out labels with their features (most recent last), for judging a candidate version."""

    seqs: NDArray[np.int64]
    x: NDArray[np.float32]
    y: NDArray[np.int64]

    def __len__(self) -> int:
        return int(self.seqs.shape[0])


@dataclass(frozen=True, eq=False)
class Batch:
    """Labels a model has not applied yet, joined with the features of their decisions, in seq order."""

    after_seq: int
    """The cursor the batch was read after; pass it to ``mark_applied(expected_last_seq=...)``."""
    seqs: NDArray[np.int64]
    x: NDArray[np.float32]
    """``(n, d)`` float32, C-contiguous: what the model saw at decision time."""
    y: NDArray[np.int64]
    """``(n,)`` labels, 0 or 1."""
    feedback_ids: tuple[str, ...]
    columns: tuple[str, ...]
    """Feature names of ``x``; every row of one batch has the same columns."""
    first_received_at: float = 0.0
    """When the oldest label of the batch was recorded (0 for an empty batch)."""
    covered_seq: int = 0
    """The last seq the batch accounts for, labels skipped for want of a row included."""
    unjoined: tuple[str, ...] = ()
    """Feedback ids of labels skipped: their decision's audit record (its row) is gone."""

    def __len__(self) -> int:
        return int(self.seqs.shape[0])

    @property
    def last_seq(self) -> int:
        """The seq to mark applied after this batch (``after_seq`` when it accounts for no label)."""
        return max(int(self.seqs[-1]) if len(self) else self.after_seq, self.covered_seq)


class FeedbackLog:
    """One SQLite file of labels and per-model cursors, joined to the audit trail in ``audit`` (the
    pipeline's audit directory; ``None``: only a pre-schema-4 log's own decisions); thread-safe.

    Several processes may open the same file (WAL allows concurrent readers and one writer; writers wait
    up to ``busy_timeout_s``). Every write is one ``BEGIN IMMEDIATE`` ... ``COMMIT`` transaction.
    """

    def __init__(
        self,
        path: Path,
        *,
        audit: Path | None = None,
        retention_s: float = 7 * 24 * 3600,
        clock: Callable[[], float] = time.time,
        busy_timeout_s: float = 5.0,
    ) -> None:
        if not (math.isfinite(retention_s) and retention_s > 0):
            raise InvalidInput(f"must be positive seconds, got {retention_s}", field="retention_s")
        self.path = Path(path)
        self.retention_s = float(retention_s)
        self._clock = clock
        self._lock = threading.Lock()
        self.decisions = DecisionLookup(audit) if audit is not None else None
        self._legacy = False
        """Whether the file has the ``decisions`` table of schema 1-3 (read-only)."""
        # Each write below opens its own transaction explicitly; FULL: fsync the WAL on every commit.
        self._db = open_wal(self.path, busy_timeout_s=busy_timeout_s, synchronous="FULL")
        try:
            self._configure()
        except BaseException:
            self._db.close()
            raise

    def _configure(self) -> None:
        if self.pragma("synchronous") != 2:  # 2 == FULL: fsync the WAL on every commit
            raise ConfigError(f"{self.path}: SQLite did not accept synchronous=FULL")
        with self._write() as cur:  # schema and its version in one transaction: racing openers agree
            legacy = _table_exists(cur, "decisions")

            def applies(statement: str) -> bool:
                if "decisions" in statement and not legacy:
                    return False  # a file that never held a decision (this schema no longer makes the table)
                return not _column_exists(cur, statement)  # a table the schema just created has it

            install_schema(
                cur,
                path=self.path,
                schema=_SCHEMA,
                version=SCHEMA_VERSION,
                migrations=_MIGRATIONS,
                indexes=_INDEXES,
                label="schema version",
                applies=applies,
            )
            self._legacy = _table_exists(cur, "decisions")

    # -- plumbing ---------------------------------------------------------------------------------

    def pragma(self, name: str) -> Any:
        """Read one PRAGMA (``journal_mode``, ``synchronous``, ...) as SQLite reports it now."""
        if not name.isidentifier():
            raise InvalidInput(f"not a pragma name: {name!r}", field="name")
        with self._lock:
            return self._db.execute(f"PRAGMA {name}").fetchone()[0]

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Cursor]:
        """One write transaction: COMMIT (fsynced) on success, ROLLBACK on any exception."""
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                yield cur
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")

    def close(self) -> None:
        """Close the connection (the last one to close checkpoints the WAL into the main file)."""
        with self._lock:
            self._db.close()
        if self.decisions is not None:
            self.decisions.close()

    def __enter__(self) -> FeedbackLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- decisions and feedback -------------------------------------------------------------------

    def seen(self, feedback_id: str) -> bool:
        """Whether ``feedback_id`` is already in the log (a retry is answered without rate limiting)."""
        with self._lock:
            row = self._db.execute("SELECT 1 FROM feedback WHERE feedback_id = ?", (feedback_id,)).fetchone()
        return row is not None

    def record_feedback(
        self, request_id: str, label: int, feedback_id: str, source: str = "", *, decision_id: str = ""
    ) -> FeedbackAck:
        """Append the true outcome of a decision; return only once it is committed (durable).

        The decision is ``decision_id`` (the id the server issued it) when given, else the ONE decision
        whose caller's ``request_id`` is ``request_id``. Both given: they must belong together.

        A retry with the same ``feedback_id`` for the same decision and label answers ``duplicate=True``
        with the original seq; the label stays in the log once. ``source`` is provenance, not payload,
        and is not compared. A decision takes at most ONE label: a later label for it with the same value
        (under another ``feedback_id``) is answered as a duplicate of the first (nothing is added), one
        with the other value is refused. So nobody can outvote a label by repeating or flipping it; a real
        correction is an operator's job, not an API call.

        Raises:
            InvalidInput: ``label`` not 0 or 1, empty ids, a ``request_id`` that several decisions carry
                (send ``decision_id``), or a ``request_id`` that is not the decision's (the field is named).
            Conflict: ``feedback_id`` was already used for a different decision or label.
            AlreadyExists: the decision already has a label with the other value.
            NotFound: no such decision was recorded, or it is past retention.
        """
        if not decision_id:
            _require_text(request_id, "request_id")
        elif not isinstance(request_id, str):
            raise InvalidInput("must be a string", field="request_id")
        _require_text(feedback_id, "feedback_id")
        if not isinstance(source, str) or not isinstance(decision_id, str):
            raise InvalidInput(
                "must be a string", field="source" if not isinstance(source, str) else "decision_id"
            )
        try:
            value = operator.index(label)
        except TypeError:
            raise InvalidInput(f"must be 0 or 1, got {label!r}", field="label") from None
        if value not in (0, 1):
            raise InvalidInput(f"must be 0 or 1, got {label!r}", field="label")
        now = self._clock()
        named = decision_id or request_id
        with self._write() as cur:
            seen = cur.execute(
                "SELECT seq, request_id, label, caller_id FROM feedback WHERE feedback_id = ?",
                (feedback_id,),
            ).fetchone()
            if seen is not None:
                same = seen[1] == decision_id if decision_id else request_id in (seen[1], seen[3])
                if not same or seen[2] != value:
                    raise Conflict(
                        f"feedback '{feedback_id}' was recorded for decision '{seen[1]}' with label {seen[2]}"
                    )
                return FeedbackAck(accepted=True, duplicate=True, seq=int(seen[0]))
            decided = self._find(cur, decision_id) if decision_id else self._decision_of(cur, request_id)
            if decided is None or decided.decided_at < now - self.retention_s:
                raise NotFound(f"no decision '{named}' is kept (never recorded or past retention)")
            key = decided.decision_id
            if decision_id and request_id and request_id not in (decided.request_id, key):
                raise InvalidInput(
                    f"decision '{decision_id}' was not made for request '{request_id}'", field="request_id"
                )
            first = cur.execute(
                "SELECT seq, label FROM feedback WHERE request_id = ? ORDER BY seq LIMIT 1", (key,)
            ).fetchone()
            if first is not None:
                if int(first[1]) != value:
                    raise AlreadyExists(
                        f"decision '{named}' already has label {first[1]}; a decision takes one label"
                    )
                return FeedbackAck(accepted=True, duplicate=True, seq=int(first[0]))
            cur.execute(
                "INSERT INTO feedback"
                " (feedback_id, request_id, label, source, received_at, caller_id, decided_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (feedback_id, key, value, source, now, decided.request_id, decided.decided_at),
            )
            seq = cur.lastrowid
        assert seq is not None
        return FeedbackAck(accepted=True, duplicate=False, seq=int(seq))

    def _find(self, cur: sqlite3.Cursor, decision_id: str) -> DecisionRef | None:
        """The decision with this id: in the audit trail, else in the log's own pre-schema-4 table."""
        found = self.decisions.find(decision_id) if self.decisions is not None else None
        if found is None and self._legacy:
            row = cur.execute(
                "SELECT request_id, decided_at, caller_id FROM decisions WHERE request_id = ?", (decision_id,)
            ).fetchone()
            if row is not None:
                found = DecisionRef(str(row[0]), float(row[1]), str(row[2] or row[0]))
        return found

    def _decision_of(self, cur: sqlite3.Cursor, request_id: str) -> DecisionRef:
        """The one decision whose caller's request_id is ``request_id`` (an older client's label)."""
        found = {r.decision_id: r for r in (self.decisions.by_request(request_id) if self.decisions else [])}
        if len(found) < 2 and self._legacy:
            for row in cur.execute(
                "SELECT request_id, decided_at, caller_id FROM decisions WHERE caller_id = ? LIMIT 2",
                (request_id,),
            ):
                found.setdefault(str(row[0]), DecisionRef(str(row[0]), float(row[1]), str(row[2])))
        if not found:
            raise NotFound(f"no decision '{request_id}' is kept (never recorded or past retention)")
        if len(found) > 1:
            raise InvalidInput(
                f"request_id '{request_id}' names several decisions; send the decision_id the Decide "
                "answer gave",
                field="decision_id",
            )
        return next(iter(found.values()))

    def _rows(self, decision_ids: Sequence[str]) -> dict[str, FeatureRow]:
        """The feature row of each decision: from the audit trail, else the log's pre-schema-4 table."""
        rows = self.decisions.rows(decision_ids) if self.decisions is not None else {}
        missing = [i for i in dict.fromkeys(decision_ids) if i not in rows]
        if missing and self._legacy:
            with self._lock:
                for start in range(0, len(missing), 500):
                    chunk = missing[start : start + 500]
                    marks = ",".join("?" * len(chunk))
                    for decision_id, blob, layout in self._db.execute(
                        f"SELECT request_id, features, columns FROM decisions WHERE request_id IN ({marks})",
                        chunk,
                    ):
                        rows[str(decision_id)] = FeatureRow(tuple(json.loads(layout)), bytes(blob))
        return rows

    # -- learners ---------------------------------------------------------------------------------

    def cursor(self, model: str) -> Cursor:
        """Where ``model`` stands: the last applied seq and the version that holds those labels."""
        _require_text(model, "model")
        with self._lock:
            return self._cursor_in(self._db.cursor(), model)

    def adopt(self, model: str, version: str, artifact: str) -> Cursor:
        """Make ``version`` (at ``artifact``) the one later labels are applied to, without moving the
        high-water mark: a swap or the first version a learner sees. Labels already applied stay applied.

        The adopted version is also the new served baseline (drift is measured from it) and a paused
        model resumes: adopting is the operator's (or the YAML's) word on what should serve.
        """
        _require_text(model, "model")
        _require_text(version, "version")
        _require_text(artifact, "artifact")
        with self._write() as cur:
            cur.execute(
                "INSERT INTO cursor (model, last_seq, version, updated_at, artifact, baseline, paused)"
                " VALUES (?, 0, ?, ?, ?, ?, NULL) ON CONFLICT (model) DO UPDATE SET"
                " version = excluded.version, artifact = excluded.artifact, updated_at = excluded.updated_at,"
                " baseline = excluded.baseline, paused = NULL",
                (model, version, self._clock(), artifact, artifact),
            )
        return self.cursor(model)

    def set_baseline(self, model: str, artifact: str) -> Cursor:
        """Name the served baseline of ``model`` where none is recorded yet (a log from before drift
        bounds: its current version becomes the baseline). A recorded baseline is kept."""
        _require_text(artifact, "artifact")
        with self._write() as cur:
            cur.execute(
                "UPDATE cursor SET baseline = ? WHERE model = ? AND baseline IS NULL", (artifact, model)
            )
        return self.cursor(model)

    def pause(self, model: str, reason: str) -> Cursor:
        """Stop applying labels to ``model`` (its pending labels stay in the log) and say why."""
        _require_text(reason, "reason")
        with self._write() as cur:
            cur.execute(
                "UPDATE cursor SET paused = ?, updated_at = ? WHERE model = ?", (reason, self._clock(), model)
            )
            if cur.rowcount == 0:
                raise NotFound(f"model '{model}' has no cursor to pause")
        return self.cursor(model)

    def pending_count(self, model: str) -> int:
        """How many labels ``model`` has not applied yet."""
        with self._lock:
            row = self._db.execute(
                "SELECT COUNT(*) FROM feedback"
                " WHERE seq > COALESCE((SELECT last_seq FROM cursor WHERE model = ?), 0)",
                (model,),
            ).fetchone()
        return int(row[0])

    def holdout_window(self, model: str, columns: Sequence[str], limit: int) -> Window:
        """The ``limit`` most recent labels held out for ``model`` whose decisions have ``columns``."""
        wanted = tuple(columns)
        picked: list[tuple[int, int, FeatureRow]] = []
        before = None
        while len(picked) < limit:  # most recent first, a page at a time, until enough have the columns
            with self._lock:
                rows = self._db.execute(
                    "SELECT f.seq, f.label, f.request_id FROM holdout AS h"
                    " JOIN feedback AS f ON f.seq = h.seq WHERE h.model = ? AND (? IS NULL OR h.seq < ?)"
                    " ORDER BY h.seq DESC LIMIT ?",
                    (model, before, before, limit),
                ).fetchall()
            if not rows:
                break
            found = self._rows([str(r[2]) for r in rows])
            for seq, label, decision_id in rows:
                row = found.get(decision_id)
                if row is not None and row.columns == wanted and len(picked) < limit:
                    picked.append((int(seq), int(label), row))
            before = int(rows[-1][0])
        picked.reverse()
        x = np.empty((len(picked), len(wanted)), dtype=np.float32)
        for i, (_, _, row) in enumerate(picked):
            x[i] = np.frombuffer(row.data, dtype="<f4")
        return Window(
            seqs=np.array([p[0] for p in picked], dtype=np.int64),
            x=x,
            y=np.array([p[1] for p in picked], dtype=np.int64),
        )

    def batch_reports(self, model: str) -> list[dict[str, Any]]:
        """What each applied mini-batch of ``model`` did, in order (written with its cursor move)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT report FROM batches WHERE model = ? ORDER BY last_seq", (model,)
            ).fetchall()
        return [json.loads(r[0]) for r in rows]

    def register_model(self, model: str) -> Cursor:
        """Make ``model`` known (cursor at 0 if new) so purging keeps the labels it has not applied."""
        _require_text(model, "model")
        with self._write() as cur:
            cur.execute(
                "INSERT OR IGNORE INTO cursor (model, last_seq, version, updated_at) VALUES (?, 0, NULL, ?)",
                (model, self._clock()),
            )
        return self.cursor(model)

    def pending(self, model: str, limit: int = 256) -> Batch:
        """Up to ``limit`` labels after ``model``'s cursor with their decision features, in seq order.

        A batch never mixes feature layouts: it stops before the first label whose decision has other
        columns than the first one, and the next batch starts there. A label whose decision's row cannot
        be found any more (its audit record was purged or removed) is skipped: the batch accounts for it
        (``covered_seq``, ``unjoined``) so the cursor moves past it.
        """
        _require_text(model, "model")
        if not isinstance(limit, int) or limit < 1:
            raise InvalidInput(f"must be a positive integer, got {limit!r}", field="limit")
        with self._lock:
            # One read transaction, so the cursor and the labels come from the same snapshot.
            self._db.execute("BEGIN")
            try:
                row = self._db.execute("SELECT last_seq FROM cursor WHERE model = ?", (model,)).fetchone()
                after = 0 if row is None else int(row[0])
                rows = self._db.execute(
                    "SELECT seq, feedback_id, label, request_id, received_at FROM feedback"
                    " WHERE seq > ? ORDER BY seq LIMIT ?",
                    (after, limit),
                ).fetchall()
            finally:
                self._db.execute("COMMIT")
        found = self._rows([str(r[3]) for r in rows])
        kept: list[tuple[int, str, int, float, FeatureRow]] = []
        unjoined: list[str] = []
        covered = after
        for seq, feedback_id, label, decision_id, received_at in rows:
            features = found.get(decision_id)
            if features is None:
                unjoined.append(feedback_id)
            elif kept and features.columns != kept[0][4].columns:
                break
            else:
                kept.append((int(seq), feedback_id, int(label), float(received_at), features))
            covered = int(seq)
        if not kept:
            return Batch(
                after,
                np.empty(0, np.int64),
                np.empty((0, 0), np.float32),
                np.empty(0, np.int64),
                (),
                (),
                covered_seq=covered,
                unjoined=tuple(unjoined),
            )
        columns = kept[0][4].columns
        x = np.empty((len(kept), len(columns)), dtype=np.float32)
        for i, k in enumerate(kept):
            x[i] = np.frombuffer(k[4].data, dtype="<f4")
        return Batch(
            after_seq=after,
            seqs=np.array([k[0] for k in kept], dtype=np.int64),
            x=x,
            y=np.array([k[2] for k in kept], dtype=np.int64),
            feedback_ids=tuple(k[1] for k in kept),
            columns=columns,
            first_received_at=kept[0][3],
            covered_seq=covered,
            unjoined=tuple(unjoined),
        )

    def mark_applied(
        self,
        model: str,
        last_seq: int,
        version: str,
        *,
        expected_last_seq: int | None = None,
        artifact: str | None = None,
        holdout_seqs: Sequence[int] = (),
        report: dict[str, Any] | None = None,
    ) -> Cursor:
        """Record that ``version`` holds every label up to ``last_seq``: cursor and version in ONE commit.

        Repeating the current (``last_seq``, ``version``) is a no-op, so a retried mark is harmless.
        Pass ``expected_last_seq=batch.after_seq`` to prove no label was skipped: the mark then applies
        only if the cursor is still where the batch was read. ``artifact`` (where ``version`` is),
        ``holdout_seqs`` (labels of the batch held out for validation) and ``report`` (what the batch
        did) are written in the same commit.

        Raises:
            Conflict: ``last_seq`` is behind the cursor, equal with another version, past the last
                recorded label, or the cursor is not at ``expected_last_seq``.
        """
        _require_text(model, "model")
        _require_text(version, "version")
        if not isinstance(last_seq, int) or last_seq < 1:
            raise InvalidInput(f"must be a positive integer, got {last_seq!r}", field="last_seq")
        with self._write() as cur:
            row = cur.execute(
                "SELECT last_seq, version, artifact FROM cursor WHERE model = ?", (model,)
            ).fetchone()
            current, current_version = (0, None) if row is None else (int(row[0]), row[1])
            if last_seq == current and version == current_version:
                return self._cursor_in(cur, model)
            if expected_last_seq is not None and expected_last_seq != current:
                raise Conflict(
                    f"model '{model}' cursor is at {current}, not {expected_last_seq}: "
                    "another learner moved it"
                )
            if last_seq <= current:
                raise Conflict(f"model '{model}' cursor is at {current}; it cannot move back to {last_seq}")
            exists = cur.execute("SELECT 1 FROM feedback WHERE seq = ?", (last_seq,)).fetchone()
            if exists is None:
                raise Conflict(f"no label has seq {last_seq}; a cursor cannot move past the recorded labels")
            kept_artifact = artifact if artifact is not None else (None if row is None else row[2])
            if artifact is None and version != current_version:
                kept_artifact = None  # a new version without a known artifact
            now = self._clock()
            cur.execute(
                "INSERT INTO cursor (model, last_seq, version, updated_at, artifact) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (model) DO UPDATE SET last_seq = excluded.last_seq, version = excluded.version,"
                " updated_at = excluded.updated_at, artifact = excluded.artifact",
                (model, last_seq, version, now, kept_artifact),
            )
            cur.executemany(
                "INSERT OR IGNORE INTO holdout (model, seq) VALUES (?, ?)",
                [(model, int(seq)) for seq in holdout_seqs],
            )
            if report is not None:
                cur.execute(
                    "INSERT INTO batches VALUES (?, ?, ?, ?, ?, ?)",
                    (model, last_seq, current, version, json.dumps(report, sort_keys=True), now),
                )
            return self._cursor_in(cur, model)

    @staticmethod
    def _cursor_in(cur: sqlite3.Cursor, model: str) -> Cursor:
        """``model``'s cursor as the transaction of ``cur`` sees it."""
        row = cur.execute(
            "SELECT last_seq, version, artifact, baseline, paused FROM cursor WHERE model = ?", (model,)
        ).fetchone()
        if row is None:
            return Cursor(model, 0, None)
        return Cursor(model, int(row[0]), row[1], row[2], row[3], row[4] or "")

    def purge_expired(self) -> int:
        """Delete labels of decisions past retention that every known model has applied (and a
        pre-schema-4 log's decisions past retention with no label left to apply); return how many labels.

        With no known model nothing with a label is deleted.
        """
        cutoff = self._clock() - self.retention_s
        with self._write() as cur:
            low = cur.execute("SELECT MIN(last_seq) FROM cursor").fetchone()[0]
            floor = 0 if low is None else int(low)
            cur.execute("DELETE FROM feedback WHERE decided_at < ? AND seq <= ?", (cutoff, floor))
            purged = int(cur.rowcount)
            if self._legacy:
                cur.execute(
                    "DELETE FROM decisions WHERE decided_at < ? AND NOT EXISTS (SELECT 1 FROM feedback AS f"
                    " WHERE f.request_id = decisions.request_id AND f.seq > ?)",
                    (cutoff, floor),
                )
            cur.execute("DELETE FROM holdout WHERE seq NOT IN (SELECT seq FROM feedback)")
            return purged


def _table_exists(cur: sqlite3.Cursor, name: str) -> bool:
    row = cur.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone()
    return row is not None


def _column_exists(cur: sqlite3.Cursor, statement: str) -> bool:
    """Whether ``statement`` is an ``ALTER TABLE t ADD COLUMN c ...`` whose column ``t`` already has."""
    words = statement.split()
    if words[:2] != ["ALTER", "TABLE"] or words[3:5] != ["ADD", "COLUMN"]:
        return False
    return any(row[1] == words[5] for row in cur.execute(f"PRAGMA table_info({words[2]})"))


def _require_text(value: object, field: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"must be a non-empty string, got {value!r}", field=field)
