"""The durable, append-only feedback log that online learning reads: SQLite in WAL mode.

A pipeline's ``Feedback(decision_id | request_id, label, feedback_id)`` RPC records the true outcome of a
past decision. The decision's features are stored here when it is made (:meth:`FeedbackLog.record_decision`,
kept for ``retention_s``), so a label can be joined to exactly what the model saw. A decision is keyed by
the id the SERVER issued it (``DecideResponse.decision_id``); the caller's ``request_id`` is kept beside it
as a correlation id that need not be unique, so nobody can pre-empt another caller's decision by sending
its ``request_id`` first. A label naming only a ``request_id`` joins the one decision carrying it, and is
refused as ambiguous when there are several. A learner reads the labels it
has not applied yet (:meth:`FeedbackLog.pending`), runs ``partial_fit`` on them as one mini-batch and
moves its cursor (:meth:`FeedbackLog.mark_applied`).

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
receive feedback (:class:`NotFound`). It is deleted with its feedback rows once every label on it has
been applied by every *known* model — the models with a cursor row (:meth:`FeedbackLog.register_model`
or a first :meth:`FeedbackLog.mark_applied`); with no known model nothing with feedback is deleted.
Feedback rows are never deleted alone: while the decision exists the ``feedback_id`` row exists, so a
retry can never be counted twice.
"""

from __future__ import annotations

import itertools
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

from riskserve.platform.errors import AlreadyExists, ConfigError, Conflict, InvalidInput, NotFound
from riskserve.platform.sqlite_wal import open_wal

__all__ = ["SCHEMA_VERSION", "Batch", "Cursor", "DecisionRecord", "FeedbackAck", "FeedbackLog", "Window"]

SCHEMA_VERSION: Final = 3

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS decisions (
    request_id    TEXT PRIMARY KEY,  -- the decision id the server issued (named so since schema 1)
    pipeline      TEXT NOT NULL,
    model_version TEXT NOT NULL,
    features      BLOB NOT NULL,
    columns       TEXT NOT NULL,
    decided_at    REAL NOT NULL,
    caller_id     TEXT               -- the caller's request_id: a correlation id, not unique
);
CREATE INDEX IF NOT EXISTS decisions_decided_at ON decisions (decided_at);
CREATE TABLE IF NOT EXISTS feedback (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    feedback_id TEXT NOT NULL UNIQUE,
    request_id  TEXT NOT NULL REFERENCES decisions (request_id),
    label       INTEGER NOT NULL CHECK (label IN (0, 1)),
    source      TEXT NOT NULL,
    received_at REAL NOT NULL
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
    ],
}
_INDEXES: Final = ["CREATE INDEX IF NOT EXISTS decisions_caller_id ON decisions (caller_id)"]
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


@dataclass(frozen=True)
class DecisionRecord:
    """What one decision's models saw, kept so a later label can be joined to it."""

    decision_id: str
    """The id the server issued the decision (the log's key)."""
    pipeline: str
    model_version: str
    """The serving versions at decision time (riskserve stores them as JSON ``{model: version}``)."""
    features: NDArray[np.float32]
    columns: tuple[str, ...]
    request_id: str = ""
    """The caller's request_id (a correlation id, not unique); '' means the same as ``decision_id``."""

    def __post_init__(self) -> None:
        if not self.request_id:
            object.__setattr__(self, "request_id", self.decision_id)


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

    def __len__(self) -> int:
        return int(self.seqs.shape[0])

    @property
    def last_seq(self) -> int:
        """The seq to mark applied after this batch (``after_seq`` when the batch is empty)."""
        return int(self.seqs[-1]) if len(self) else self.after_seq


class FeedbackLog:
    """One SQLite file of decisions, labels and per-model cursors; safe to share between threads.

    Several processes may open the same file (WAL allows concurrent readers and one writer; writers wait
    up to ``busy_timeout_s``). Every write is one ``BEGIN IMMEDIATE`` ... ``COMMIT`` transaction.
    """

    def __init__(
        self,
        path: Path,
        *,
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
        # Each write below opens its own transaction explicitly; FULL: fsync the WAL on every commit.
        self._db = open_wal(self.path, busy_timeout_s=busy_timeout_s, synchronous="FULL")
        try:
            self._configure()
        except BaseException:
            self._db.close()
            raise

    def _configure(self) -> None:
        db = self._db
        db.execute("PRAGMA foreign_keys = ON")
        if self.pragma("synchronous") != 2:  # 2 == FULL: fsync the WAL on every commit
            raise ConfigError(f"{self.path}: SQLite did not accept synchronous=FULL")
        with self._write() as cur:  # schema and its version in one transaction: racing openers agree
            for statement in filter(str.strip, _SCHEMA.split(";")):
                cur.execute(statement)
            rows = cur.execute("SELECT version FROM schema_version").fetchall()
            if not rows:
                cur.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
                for statement in _INDEXES:
                    cur.execute(statement)
                return
            found = rows[0][0] if len(rows) == 1 else None
            while found in _MIGRATIONS:  # older files are upgraded in the same transaction
                for statement in _MIGRATIONS[found]:
                    if not _column_exists(cur, statement):  # a table the schema just created has it
                        cur.execute(statement)
                found += 1
                cur.execute("UPDATE schema_version SET version = ?", (found,))
            if found != SCHEMA_VERSION:
                raise ConfigError(
                    f"{self.path}: schema version {[r[0] for r in rows]}, this code reads {SCHEMA_VERSION}"
                )
            for statement in _INDEXES:
                cur.execute(statement)

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

    def __enter__(self) -> FeedbackLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- decisions and feedback -------------------------------------------------------------------

    def record_decision(
        self,
        decision_id: str,
        pipeline: str,
        model_version: str,
        features: NDArray[np.float32],
        columns: Sequence[str],
        request_id: str = "",
    ) -> None:
        """Keep what the model saw for one decision, so later feedback can be joined to it.

        Idempotent on ``decision_id``: recording the same decision again is a no-op.

        Raises:
            InvalidInput: empty ids, features that are not a 1-D float32 row matching ``columns``.
            Conflict: ``decision_id`` was already recorded with a different payload.
        """
        record = DecisionRecord(decision_id, pipeline, model_version, features, tuple(columns), request_id)
        conflicts = self.record_decisions([record])
        if conflicts:
            raise Conflict(f"decision '{decision_id}' was already recorded with a different payload")

    def record_decisions(self, records: Sequence[DecisionRecord]) -> list[str]:
        """Keep many decisions in ONE commit (one fsync); return the decision ids that were already
        recorded with another payload (kept as first recorded: a retried Decide cannot rewrite history).

        Raises:
            InvalidInput: a record with empty ids or features that do not match its columns; nothing
                of the batch is written then.
        """
        rows = [self._decision_row(record) for record in records]  # validate all before writing any
        now = self._clock()
        conflicts = []
        with self._write() as cur:
            for row in rows:
                cur.execute(
                    "INSERT OR IGNORE INTO decisions"
                    " (request_id, pipeline, model_version, features, columns, caller_id, decided_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (*row, now),
                )
                if cur.rowcount == 0:
                    kept = cur.execute(
                        "SELECT pipeline, model_version, features, columns, caller_id FROM decisions"
                        " WHERE request_id = ?",
                        (row[0],),
                    ).fetchone()
                    if tuple(kept) != row[1:]:
                        conflicts.append(row[0])
        return conflicts

    @staticmethod
    def _decision_row(record: DecisionRecord) -> tuple[str, str, str, bytes, str, str]:
        _require_text(record.decision_id, "decision_id")
        _require_text(record.request_id, "request_id")
        _require_text(record.pipeline, "pipeline")
        _require_text(record.model_version, "model_version")
        features = record.features
        if not isinstance(features, np.ndarray) or features.dtype != np.float32 or features.ndim != 1:
            raise InvalidInput("must be a 1-D float32 numpy array", field="features")
        names = list(record.columns)
        if len(names) != features.shape[0] or len(set(names)) != len(names):
            raise InvalidInput(
                f"{features.shape[0]} features need as many distinct column names, got {names}",
                field="columns",
            )
        for name in names:
            _require_text(name, "columns")
        blob = np.ascontiguousarray(features, dtype="<f4").tobytes()
        return (
            record.decision_id,
            record.pipeline,
            record.model_version,
            blob,
            json.dumps(names),
            record.request_id,
        )

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
                "SELECT f.seq, f.request_id, f.label, d.caller_id FROM feedback AS f"
                " LEFT JOIN decisions AS d ON d.request_id = f.request_id WHERE f.feedback_id = ?",
                (feedback_id,),
            ).fetchone()
            if seen is not None:
                same = seen[1] == decision_id if decision_id else request_id in (seen[1], seen[3])
                if not same or seen[2] != value:
                    raise Conflict(
                        f"feedback '{feedback_id}' was recorded for decision '{seen[1]}' with label {seen[2]}"
                    )
                return FeedbackAck(accepted=True, duplicate=True, seq=int(seen[0]))
            key = decision_id or self._decision_of(cur, request_id)
            decided = cur.execute(
                "SELECT decided_at, caller_id FROM decisions WHERE request_id = ?", (key,)
            ).fetchone()
            if decided is None or decided[0] < now - self.retention_s:
                raise NotFound(f"no decision '{named}' is kept (never recorded or past retention)")
            if decision_id and request_id and request_id not in (decided[1], key):
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
                "INSERT INTO feedback (feedback_id, request_id, label, source, received_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (feedback_id, key, value, source, now),
            )
            seq = cur.lastrowid
        assert seq is not None
        return FeedbackAck(accepted=True, duplicate=False, seq=int(seq))

    @staticmethod
    def _decision_of(cur: sqlite3.Cursor, request_id: str) -> str:
        """The one decision whose caller's request_id is ``request_id`` (an older client's label)."""
        rows = cur.execute(
            "SELECT request_id FROM decisions WHERE caller_id = ? LIMIT 2", (request_id,)
        ).fetchall()
        if not rows:
            raise NotFound(f"no decision '{request_id}' is kept (never recorded or past retention)")
        if len(rows) > 1:
            raise InvalidInput(
                f"request_id '{request_id}' names several decisions; send the decision_id the Decide "
                "answer gave",
                field="decision_id",
            )
        return str(rows[0][0])

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
        layout = json.dumps(list(columns))
        with self._lock:
            rows = self._db.execute(
                "SELECT f.seq, f.label, d.features FROM holdout AS h"
                " JOIN feedback AS f ON f.seq = h.seq JOIN decisions AS d ON d.request_id = f.request_id"
                " WHERE h.model = ? AND d.columns = ? ORDER BY h.seq DESC LIMIT ?",
                (model, layout, limit),
            ).fetchall()
        rows.reverse()
        x = np.empty((len(rows), len(columns)), dtype=np.float32)
        for i, r in enumerate(rows):
            x[i] = np.frombuffer(r[2], dtype="<f4")
        return Window(
            seqs=np.array([r[0] for r in rows], dtype=np.int64),
            x=x,
            y=np.array([r[1] for r in rows], dtype=np.int64),
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
        columns than the first one, and the next batch starts there.
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
                    "SELECT f.seq, f.feedback_id, f.label, d.features, d.columns, f.received_at"
                    " FROM feedback AS f"
                    " JOIN decisions AS d ON d.request_id = f.request_id"
                    " WHERE f.seq > ? ORDER BY f.seq LIMIT ?",
                    (after, limit),
                ).fetchall()
            finally:
                self._db.execute("COMMIT")
        if not rows:
            return Batch(
                after, np.empty(0, np.int64), np.empty((0, 0), np.float32), np.empty(0, np.int64), (), ()
            )
        layout = rows[0][4]
        rows = list(itertools.takewhile(lambda r: r[4] == layout, rows))
        x = np.empty((len(rows), len(json.loads(layout))), dtype=np.float32)
        for i, r in enumerate(rows):
            x[i] = np.frombuffer(r[3], dtype="<f4")
        return Batch(
            after_seq=after,
            seqs=np.array([r[0] for r in rows], dtype=np.int64),
            x=x,
            y=np.array([r[2] for r in rows], dtype=np.int64),
            feedback_ids=tuple(r[1] for r in rows),
            columns=tuple(json.loads(layout)),
            first_received_at=float(rows[0][5]),
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
        """Delete decisions past retention whose labels every known model has applied; return how many.

        A decision with a label above the lowest cursor is kept (its features are still needed), and
        with no known model every decision with feedback is kept. Its feedback rows go with it.
        """
        cutoff = self._clock() - self.retention_s
        with self._write() as cur:
            low = cur.execute("SELECT MIN(last_seq) FROM cursor").fetchone()[0]
            floor = 0 if low is None else int(low)
            doomed = (
                "SELECT d.request_id FROM decisions AS d WHERE d.decided_at < ? AND NOT EXISTS"
                " (SELECT 1 FROM feedback AS f WHERE f.request_id = d.request_id AND f.seq > ?)"
            )
            cur.execute(f"DELETE FROM feedback WHERE request_id IN ({doomed})", (cutoff, floor))
            cur.execute(f"DELETE FROM decisions WHERE request_id IN ({doomed})", (cutoff, floor))
            purged = int(cur.rowcount)
            cur.execute("DELETE FROM holdout WHERE seq NOT IN (SELECT seq FROM feedback)")
            return purged


def _column_exists(cur: sqlite3.Cursor, statement: str) -> bool:
    """Whether ``statement`` is an ``ALTER TABLE t ADD COLUMN c ...`` whose column ``t`` already has."""
    words = statement.split()
    if words[:2] != ["ALTER", "TABLE"] or words[3:5] != ["ADD", "COLUMN"]:
        return False
    return any(row[1] == words[5] for row in cur.execute(f"PRAGMA table_info({words[2]})"))


def _require_text(value: object, field: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"must be a non-empty string, got {value!r}", field=field)
