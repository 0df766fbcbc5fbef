"""The durable, append-only feedback log that online learning reads, in the pipeline's state database.

A pipeline's ``Feedback(decision_id | request_id, label, feedback_id)`` RPC records the true outcome of a
past decision. The log keeps labels, cursors, held-out labels, batch reports, learner checkpoints and the
holdout key, all in the pipeline's state database (:mod:`riskserve.state.db`: an embedded SQLite file on
one machine, PostgreSQL on a cluster), so a feedback service or learner restarted on ANY node continues
where the last one stopped. It keeps NO copy of the decisions: the pipeline's audit trail is the record of
every decision (its records carry the encoded feature row the models saw), and a label is joined to its
audit record by decision id (``lookup``: :class:`~riskserve.audit.lookup.DecisionLookup`), when it is
recorded (the decision must exist, within ``retention_s``) and when a learner reads it (the row it trains
on). A decision is keyed by the id the SERVER issued it (``DecideResponse.decision_id``); the caller's
``request_id`` is kept beside it as a correlation id that need not be unique, so nobody can pre-empt
another caller's decision by sending its ``request_id`` first. A label naming only a ``request_id`` joins
the one decision carrying it, and is refused as ambiguous when there are several. A learner reads the
labels it has not applied yet (:meth:`FeedbackLog.pending`), runs ``partial_fit`` on them as one
mini-batch and moves its cursor (:meth:`FeedbackLog.mark_applied`).

Durability. Every write is one :meth:`~riskserve.state.db.Database.transaction`, committed durably before
it returns (the database's job: SQLite's WAL with ``synchronous=FULL``, PostgreSQL's commit).
:meth:`FeedbackLog.record_feedback` returns only after its commit, so "acknowledged" implies "durable".
``feedback_id`` is UNIQUE: a retried call, to this node or another, finds the committed row and answers
``duplicate=True``.

One order of labels for every node. A label's ``seq`` is taken from a one-row counter
(``feedback_seq``) in the label's own transaction. The counter's row lock makes label transactions take
turns until they commit, so seqs become visible in order: a learner that has read seq ``n`` has seen every
label below it. An auto-numbered column would not do on PostgreSQL: it hands numbers out at insert, and a
transaction holding 5 may commit after one holding 6, so a learner that read 6 would skip 5 forever. The
turn also makes "one label per decision" and "one row per ``feedback_id``" hold across nodes: each
transaction checks them after the one before it committed. (SQLite serializes writers anyway.)

Exactly once. Each model has one ``cursor(model, last_seq, version)`` row, a high-water mark over the
``feedback.seq`` order, rather than an ``applied(model, seq)`` row per label. The claim to prove is
"every label with ``seq <= last_seq`` is in model ``version`` exactly once and no other label is", and
it holds because of the order the learner follows:

1. ``batch = pending(model)`` reads the labels ``(after_seq, last_seq]`` in seq order;
2. ``partial_fit`` runs on a copy of the model at ``cursor.version``, giving a new state;
3. the new state is saved durably as an artifact named by its content version;
4. ``mark_applied(model, batch.last_seq, new_version, expected_last_seq=batch.after_seq,
   checkpoint=...)`` moves ``last_seq`` *and* ``version``, and stores the new version's checkpoint, in ONE
   transaction.

A crash before step 4 commits leaves the cursor at the old (last_seq, version): the new state is an
orphan that nothing refers to, and the restarted learner loads ``cursor.version`` and replays the same
labels onto it, so they end up applied once in the lineage that survives. A crash after the commit
leaves the new pair. There is no moment at which the version and the high-water mark disagree, which
is what a separate "mark applied" step after publishing would allow. Serving should publish a learned
version only after step 4 (or treat versions newer than the cursor as provisional). The mark is
compare-and-set (``expected_last_seq``), checked under the cursor row's lock, so two learners (on two
nodes), or a stale retry, cannot both advance it, and it refuses to move backwards or past the last
recorded label.

Checkpoints. The version a cursor names is also kept in the database (:class:`Checkpoint`: its
parameters, feature names, golden rows and manifest notes, everything needed to rewrite its artifact),
written in the same transaction that makes the cursor name it (:meth:`FeedbackLog.mark_applied`,
:meth:`FeedbackLog.adopt`). A learner on a node whose disk lacks the cursor's artifact rebuilds it from
there (:meth:`riskserve.learning.learner.OnlineLearner.restore`); the artifact is content-addressed, so
the rebuilt one has the same version or is refused.

Retention (:meth:`FeedbackLog.purge_expired`). A decision older than ``retention_s`` can no longer
receive feedback (:class:`NotFound`). Its label (each label row keeps its decision's time) is deleted
once it has been applied by every *known* model — the models with a cursor row
(:meth:`FeedbackLog.register_model` or a first :meth:`FeedbackLog.mark_applied`); with no known model
nothing is deleted. A label row is only deleted once its decision is past retention, when no label can be
taken for it any more, so a retry can never be counted twice. The audit trail's retention
(``audit.retention_days``) must be at least as long (the pipeline schema checks it), and a label whose
audit record is gone all the same (the trail was purged or removed) is skipped by the learner, logged.

The holdout key (:meth:`FeedbackLog.holdout_key`), which keys the split of labels into training and
validation, is created once in the database and read back, so every node splits alike; whoever can read
the state database can read it (the SQLite file is mode 0600; guard a PostgreSQL role as such).
"""

from __future__ import annotations

import json
import math
import operator
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from riskserve.audit.lookup import DecisionLookup, DecisionRef, FeatureRow
from riskserve.platform.errors import AlreadyExists, ConfigError, Conflict, InvalidInput, NotFound
from riskserve.state.db import Database, Migration, Tx, redact

__all__ = [
    "COMPONENT",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "Batch",
    "Checkpoint",
    "Cursor",
    "FeedbackAck",
    "FeedbackLog",
    "Window",
]

COMPONENT: Final = "feedback"
"""The log's name among the state database's components (its migrations are numbered under it)."""

MIGRATIONS: Final = (
    Migration(
        1,
        """
        CREATE TABLE feedback (
            seq         BIGINT PRIMARY KEY,
            feedback_id TEXT NOT NULL UNIQUE,
            request_id  TEXT NOT NULL,
            label       BIGINT NOT NULL CHECK (label IN (0, 1)),
            source      TEXT NOT NULL,
            received_at DOUBLE PRECISION NOT NULL,
            caller_id   TEXT NOT NULL,
            decided_at  DOUBLE PRECISION NOT NULL
        );
        CREATE UNIQUE INDEX feedback_request_id ON feedback (request_id);
        CREATE INDEX feedback_decided_at ON feedback (decided_at);
        CREATE TABLE feedback_seq (
            id       BIGINT PRIMARY KEY CHECK (id = 1),
            last_seq BIGINT NOT NULL
        );
        INSERT INTO feedback_seq (id, last_seq) VALUES (1, 0);
        CREATE TABLE cursor (
            model            TEXT PRIMARY KEY,
            last_seq         BIGINT NOT NULL CHECK (last_seq >= 0),
            version          TEXT,
            updated_at       DOUBLE PRECISION NOT NULL,
            artifact         TEXT,
            baseline         TEXT,
            baseline_version TEXT,
            paused           TEXT
        );
        CREATE TABLE holdout (
            model TEXT NOT NULL,
            seq   BIGINT NOT NULL,
            PRIMARY KEY (model, seq)
        );
        CREATE TABLE batches (
            model      TEXT NOT NULL,
            last_seq   BIGINT NOT NULL,
            after_seq  BIGINT NOT NULL,
            version    TEXT NOT NULL,
            report     TEXT NOT NULL,
            applied_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (model, last_seq)
        );
        CREATE TABLE checkpoints (
            n             {id},
            model         TEXT NOT NULL,
            version       TEXT NOT NULL,
            params        TEXT NOT NULL,
            feature_names TEXT NOT NULL,
            golden        {blob} NOT NULL,
            info          TEXT NOT NULL,
            saved_at      DOUBLE PRECISION NOT NULL,
            UNIQUE (model, version)
        );
        CREATE TABLE feedback_keys (
            name   TEXT PRIMARY KEY,
            secret {blob} NOT NULL
        )
        """,
    ),
)
"""The log's tables. ``feedback`` keeps the names and columns it has always had (the audit trail's reader
joins labels with ``SELECT request_id, label, source, received_at, feedback_id FROM feedback``); the
decision id is in ``request_id`` (so named since the log's first schema), the caller's in ``caller_id``."""

SCHEMA_VERSION: Final = MIGRATIONS[-1].version
"""The log's schema version in the state database (component :data:`COMPONENT`)."""

_HOLDOUT_KEY: Final = "holdout"
_KEY_BYTES: Final = 32
_CHUNK: Final = 500
"""Ids per ``IN (...)`` list."""


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
    baseline_version: str | None = None
    """The baseline's content version (its checkpoint's key: a node without ``baseline`` rebuilds it)."""


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """One version's state, enough to rewrite its artifact on any node: ``save_sklearn_artifact`` of the
    snapshot ``params`` describe, with these feature names, golden rows and manifest notes, writes the
    same files (and so the same content version) as the artifact the learner wrote or adopted."""

    version: str
    """The content version; the hash of ``params`` must give it back."""
    params: str
    """The artifact's ``params.json`` verbatim (canonical JSON: coefficients, intercept, scaler, classes,
    hyperparameters, step count, parent)."""
    feature_names: tuple[str, ...]
    golden_x: NDArray[np.float32]
    """``(rows, len(feature_names))`` golden rows (stored as little-endian float32 bytes: exact)."""
    info: dict[str, Any]
    """The manifest's ``info`` (``parent`` included), so the rewritten manifest is the same."""


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
    """A pipeline's labels, per-model cursors and checkpoints in its state database ``db``, joined to the
    decisions ``lookup`` finds (the pipeline's audit trail; ``None``: no decision is known, so every label
    is refused as not found); thread-safe, and any number of instances (processes, nodes) may share ``db``.

    The log owns ``lookup`` (:meth:`close` closes it), not ``db``: one database is shared by everything of
    the pipeline in a process.
    """

    def __init__(
        self,
        db: Database,
        *,
        lookup: DecisionLookup | None = None,
        retention_s: float = 7 * 24 * 3600,
        clock: Callable[[], float] = time.time,
        find_wait_s: float = 0.0,
    ) -> None:
        """``find_wait_s``: how long a label for a decision not in the trail yet waits for it (a decision
        made on another node reaches the database within its replica's shipping interval)."""
        if not (math.isfinite(retention_s) and retention_s > 0):
            raise InvalidInput(f"must be positive seconds, got {retention_s}", field="retention_s")
        self.db = db
        self.decisions = lookup
        self._find_wait_s = find_wait_s
        self.retention_s = float(retention_s)
        self._clock = clock
        self._key: bytes | None = None
        db.migrate(COMPONENT, MIGRATIONS)

    @property
    def location(self) -> str:
        """Where the log is, as it may be shown: the state database's DSN without its password."""
        return redact(self.db.dsn)

    def close(self) -> None:
        """Close the decision lookup (the database stays open: it is shared)."""
        if self.decisions is not None:
            self.decisions.close()

    def __enter__(self) -> FeedbackLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FeedbackLog({self.location!r})"

    # -- the holdout key --------------------------------------------------------------------------

    def holdout_key(self) -> bytes:
        """The secret key of the holdout split, the same for every node: created once (32 random bytes;
        the first writer wins, ``ON CONFLICT DO NOTHING``) and read back.

        Raises:
            ConfigError: the stored key is not 32 bytes (not one riskserve wrote).
        """
        if self._key is None:
            with self.db.transaction() as tx:
                tx.execute(
                    "INSERT INTO feedback_keys (name, secret) VALUES (?, ?) ON CONFLICT (name) DO NOTHING",
                    (_HOLDOUT_KEY, secrets.token_bytes(_KEY_BYTES)),
                )
                row = tx.one("SELECT secret FROM feedback_keys WHERE name = ?", (_HOLDOUT_KEY,))
            key = bytes(row[0]) if row is not None else b""
            if len(key) != _KEY_BYTES:
                raise ConfigError(
                    f"{self.location}: the holdout key holds {len(key)} bytes, not {_KEY_BYTES}; delete its "
                    "feedback_keys row to make a new one (the split of labels changes)"
                )
            self._key = key
        return self._key

    # -- decisions and feedback -------------------------------------------------------------------

    def seen(self, feedback_id: str) -> bool:
        """Whether ``feedback_id`` is already in the log (a retry is answered without rate limiting)."""
        with self.db.transaction() as tx:
            return tx.one("SELECT 1 FROM feedback WHERE feedback_id = ?", (feedback_id,)) is not None

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
        correction is an operator's job, not an API call. All of this holds across the nodes sharing the
        database: the checks run in the label's turn (see the module's docstring).

        Raises:
            InvalidInput: ``label`` not 0 or 1, empty ids, a ``request_id`` that several decisions carry
                (send ``decision_id``), or a ``request_id`` that is not the decision's (the field is named).
            Conflict: ``feedback_id`` was already used for a different decision or label.
            AlreadyExists: the decision already has a label with the other value.
            NotFound: no such decision was recorded, or it is past retention.
            StoreUnavailable: the state database cannot be reached (nothing was recorded: retry).
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
        with self.db.transaction() as tx:  # a retry is answered without looking the decision up
            retry = self._retry(tx, feedback_id, request_id, decision_id, value)
        if retry is not None:
            return retry
        # The lookup reads the audit trail, outside the database: not while holding the label turn.
        now = self._clock()
        named = decision_id or request_id
        decided = self._find(decision_id) if decision_id else self._decision_of(request_id)
        if decided is None or decided.decided_at < now - self.retention_s:
            raise NotFound(f"no decision '{named}' is kept (never recorded or past retention)")
        key = decided.decision_id
        if decision_id and request_id and request_id not in (decided.request_id, key):
            raise InvalidInput(
                f"decision '{decision_id}' was not made for request '{request_id}'", field="request_id"
            )
        with self.db.transaction() as tx:
            # The label's turn: the counter's row lock (a no-op update) until this commits, so labels get
            # their numbers in commit order; a retry or a duplicate takes no number (no gap in the order).
            tx.execute("UPDATE feedback_seq SET last_seq = last_seq WHERE id = 1")
            # Checked again in the turn: a call to another node may have recorded it since.
            retry = self._retry(tx, feedback_id, request_id, decision_id, value)
            if retry is not None:
                return retry
            first = tx.one("SELECT seq, label FROM feedback WHERE request_id = ?", (key,))
            if first is not None:
                if int(first[1]) != value:
                    raise AlreadyExists(
                        f"decision '{named}' already has label {first[1]}; a decision takes one label"
                    )
                return FeedbackAck(accepted=True, duplicate=True, seq=int(first[0]))
            turn = tx.one("UPDATE feedback_seq SET last_seq = last_seq + 1 WHERE id = 1 RETURNING last_seq")
            assert turn is not None, "migration 1 writes the counter's one row"
            seq = int(turn[0])
            tx.execute(
                "INSERT INTO feedback"
                " (seq, feedback_id, request_id, label, source, received_at, caller_id, decided_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (seq, feedback_id, key, value, source, now, decided.request_id, decided.decided_at),
            )
        return FeedbackAck(accepted=True, duplicate=False, seq=seq)

    @staticmethod
    def _retry(tx: Tx, feedback_id: str, request_id: str, decision_id: str, value: int) -> FeedbackAck | None:
        """The answer to a retry of a recorded ``feedback_id`` (``None``: not recorded yet).

        Raises:
            Conflict: it was recorded for another decision or label.
        """
        seen = tx.one(
            "SELECT seq, request_id, label, caller_id FROM feedback WHERE feedback_id = ?", (feedback_id,)
        )
        if seen is None:
            return None
        same = seen[1] == decision_id if decision_id else request_id in (seen[1], seen[3])
        if not same or int(seen[2]) != value:
            raise Conflict(
                f"feedback '{feedback_id}' was recorded for decision '{seen[1]}' with label {seen[2]}"
            )
        return FeedbackAck(accepted=True, duplicate=True, seq=int(seen[0]))

    def _find(self, decision_id: str) -> DecisionRef | None:
        """The decision with this id, as the lookup finds it."""
        if self.decisions is None:
            return None
        return self.decisions.find(decision_id, wait_s=self._find_wait_s)

    def _decision_of(self, request_id: str) -> DecisionRef:
        """The one decision whose caller's request_id is ``request_id`` (an older client's label)."""
        deadline = time.monotonic() + self._find_wait_s
        while True:  # a decision made on another node may not be shipped yet: wait for it a little
            refs = self.decisions.by_request(request_id) if self.decisions else []
            if refs or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        found = {r.decision_id: r for r in refs}
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
        """The feature row of each decision the lookup still has."""
        return self.decisions.rows(decision_ids) if self.decisions is not None else {}

    # -- learners ---------------------------------------------------------------------------------

    def cursor(self, model: str) -> Cursor:
        """Where ``model`` stands: the last applied seq and the version that holds those labels."""
        _require_text(model, "model")
        with self.db.transaction() as tx:
            return self._cursor_in(tx, model)

    def adopt(
        self, model: str, version: str, artifact: str, *, checkpoint: Checkpoint | None = None
    ) -> Cursor:
        """Make ``version`` (at ``artifact``) the one later labels are applied to, without moving the
        high-water mark: a swap or the first version a learner sees. Labels already applied stay applied.

        The adopted version is also the new served baseline (drift is measured from it) and a paused
        model resumes: adopting is the operator's (or the YAML's) word on what should serve.
        ``checkpoint`` (``version``'s state) is stored in the same commit, so any node can rebuild it.
        """
        _require_text(model, "model")
        _require_text(version, "version")
        _require_text(artifact, "artifact")
        _check_checkpoint(checkpoint, version)
        with self.db.transaction() as tx:
            tx.execute(
                "INSERT INTO cursor"
                " (model, last_seq, version, updated_at, artifact, baseline, baseline_version, paused)"
                " VALUES (?, 0, ?, ?, ?, ?, ?, NULL) ON CONFLICT (model) DO UPDATE SET"
                " version = excluded.version, artifact = excluded.artifact, updated_at = excluded.updated_at,"
                " baseline = excluded.baseline, baseline_version = excluded.baseline_version, paused = NULL",
                (model, version, self._clock(), artifact, artifact, version),
            )
            if checkpoint is not None:
                self._save_checkpoint(tx, model, checkpoint)
            return self._cursor_in(tx, model)

    def set_baseline(self, model: str, artifact: str) -> Cursor:
        """Name the served baseline of ``model`` where none is recorded yet (a cursor moved without an
        adoption: its current version becomes the baseline). A recorded baseline is kept."""
        _require_text(artifact, "artifact")
        with self.db.transaction() as tx:
            tx.execute(
                "UPDATE cursor SET baseline = ?, baseline_version = version"
                " WHERE model = ? AND baseline IS NULL",
                (artifact, model),
            )
            return self._cursor_in(tx, model)

    def pause(self, model: str, reason: str) -> Cursor:
        """Stop applying labels to ``model`` (its pending labels stay in the log) and say why."""
        _require_text(reason, "reason")
        with self.db.transaction() as tx:
            changed = tx.execute(
                "UPDATE cursor SET paused = ?, updated_at = ? WHERE model = ?", (reason, self._clock(), model)
            )
            if changed == 0:
                raise NotFound(f"model '{model}' has no cursor to pause")
            return self._cursor_in(tx, model)

    def pending_count(self, model: str) -> int:
        """How many labels ``model`` has not applied yet."""
        with self.db.transaction() as tx:
            row = tx.one(
                "SELECT COUNT(*) FROM feedback"
                " WHERE seq > COALESCE((SELECT last_seq FROM cursor WHERE model = ?), 0)",
                (model,),
            )
        return int(row[0]) if row is not None else 0

    def holdout_window(self, model: str, columns: Sequence[str], limit: int) -> Window:
        """The ``limit`` most recent labels held out for ``model`` whose decisions have ``columns``."""
        wanted = tuple(columns)
        picked: list[tuple[int, int, FeatureRow]] = []
        before: int | None = None
        while len(picked) < limit:  # most recent first, a page at a time, until enough have the columns
            page = "" if before is None else " AND h.seq < ?"
            with self.db.transaction() as tx:
                rows = tx.query(
                    "SELECT f.seq, f.label, f.request_id FROM holdout AS h"
                    f" JOIN feedback AS f ON f.seq = h.seq WHERE h.model = ?{page}"
                    " ORDER BY h.seq DESC LIMIT ?",
                    (model, limit) if before is None else (model, before, limit),
                )
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
        with self.db.transaction() as tx:
            rows = tx.query("SELECT report FROM batches WHERE model = ? ORDER BY last_seq", (model,))
        return [json.loads(r[0]) for r in rows]

    def register_model(self, model: str) -> Cursor:
        """Make ``model`` known (cursor at 0 if new) so purging keeps the labels it has not applied."""
        _require_text(model, "model")
        with self.db.transaction() as tx:
            tx.execute(
                "INSERT INTO cursor (model, last_seq, version, updated_at) VALUES (?, 0, NULL, ?)"
                " ON CONFLICT (model) DO NOTHING",
                (model, self._clock()),
            )
            return self._cursor_in(tx, model)

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
        with self.db.transaction() as tx:
            row = tx.one("SELECT last_seq FROM cursor WHERE model = ?", (model,))
            after = 0 if row is None else int(row[0])
            rows = tx.query(
                "SELECT seq, feedback_id, label, request_id, received_at FROM feedback"
                " WHERE seq > ? ORDER BY seq LIMIT ?",
                (after, limit),
            )
        # The cursor may move after this read (another learner): mark_applied's compare-and-set on
        # ``after`` refuses this batch then, so labels read here are never applied twice.
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
        checkpoint: Checkpoint | None = None,
    ) -> Cursor:
        """Record that ``version`` holds every label up to ``last_seq``: cursor and version in ONE commit.

        Repeating the current (``last_seq``, ``version``) is a no-op, so a retried mark is harmless.
        Pass ``expected_last_seq=batch.after_seq`` to prove no label was skipped: the mark then applies
        only if the cursor is still where the batch was read. ``artifact`` (where ``version`` is),
        ``holdout_seqs`` (labels of the batch held out for validation), ``report`` (what the batch did)
        and ``checkpoint`` (``version``'s state, for a node that lacks ``artifact``) are written in the
        same commit. The checks run under the cursor row's lock, so of two learners that read the same
        cursor (on two nodes) exactly one moves it.

        Raises:
            Conflict: ``last_seq`` is behind the cursor, equal with another version, past the last
                recorded label, or the cursor is not at ``expected_last_seq``.
        """
        _require_text(model, "model")
        _require_text(version, "version")
        if not isinstance(last_seq, int) or last_seq < 1:
            raise InvalidInput(f"must be a positive integer, got {last_seq!r}", field="last_seq")
        _check_checkpoint(checkpoint, version)
        now = self._clock()
        with self.db.transaction() as tx:
            tx.execute(
                "INSERT INTO cursor (model, last_seq, version, updated_at) VALUES (?, 0, NULL, ?)"
                " ON CONFLICT (model) DO NOTHING",
                (model, now),
            )
            # Take the row's lock before reading it: a concurrent mark (another node) waits for this
            # commit, then reads what it wrote (PostgreSQL; SQLite runs one writer at a time anyway).
            tx.execute("UPDATE cursor SET updated_at = updated_at WHERE model = ?", (model,))
            row = tx.one("SELECT last_seq, version, artifact FROM cursor WHERE model = ?", (model,))
            assert row is not None, "inserted above"
            current, current_version = int(row[0]), row[1]
            if last_seq == current and version == current_version:
                return self._cursor_in(tx, model)
            if expected_last_seq is not None and expected_last_seq != current:
                raise Conflict(
                    f"model '{model}' cursor is at {current}, not {expected_last_seq}: "
                    "another learner moved it"
                )
            if last_seq <= current:
                raise Conflict(f"model '{model}' cursor is at {current}; it cannot move back to {last_seq}")
            if tx.one("SELECT 1 FROM feedback WHERE seq = ?", (last_seq,)) is None:
                raise Conflict(f"no label has seq {last_seq}; a cursor cannot move past the recorded labels")
            kept_artifact = artifact if artifact is not None else row[2]
            if artifact is None and version != current_version:
                kept_artifact = None  # a new version without a known artifact
            tx.execute(
                "UPDATE cursor SET last_seq = ?, version = ?, updated_at = ?, artifact = ? WHERE model = ?",
                (last_seq, version, now, kept_artifact, model),
            )
            if holdout_seqs:
                tx.executemany(
                    "INSERT INTO holdout (model, seq) VALUES (?, ?) ON CONFLICT (model, seq) DO NOTHING",
                    [(model, int(seq)) for seq in holdout_seqs],
                )
            if report is not None:
                tx.execute(
                    "INSERT INTO batches (model, last_seq, after_seq, version, report, applied_at)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (model, last_seq, current, version, json.dumps(report, sort_keys=True), now),
                )
            if checkpoint is not None:
                self._save_checkpoint(tx, model, checkpoint)
            return self._cursor_in(tx, model)

    @staticmethod
    def _cursor_in(tx: Tx, model: str) -> Cursor:
        """``model``'s cursor as the transaction ``tx`` sees it."""
        row = tx.one(
            "SELECT last_seq, version, artifact, baseline, paused, baseline_version FROM cursor"
            " WHERE model = ?",
            (model,),
        )
        if row is None:
            return Cursor(model, 0, None)
        return Cursor(model, int(row[0]), row[1], row[2], row[3], row[4] or "", row[5])

    # -- checkpoints ------------------------------------------------------------------------------

    def _save_checkpoint(self, tx: Tx, model: str, checkpoint: Checkpoint) -> None:
        """Store ``checkpoint`` unless ``model`` has one of its version (a version's state never changes)."""
        golden = np.ascontiguousarray(checkpoint.golden_x, dtype="<f4")
        if golden.ndim != 2 or golden.shape[1] != len(checkpoint.feature_names):
            raise InvalidInput(
                f"golden rows of shape {golden.shape} for {len(checkpoint.feature_names)} features",
                field="checkpoint",
            )
        tx.execute(
            "INSERT INTO checkpoints (model, version, params, feature_names, golden, info, saved_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (model, version) DO NOTHING",
            (
                model,
                checkpoint.version,
                checkpoint.params,
                json.dumps(list(checkpoint.feature_names)),
                golden.tobytes(),
                json.dumps(checkpoint.info),
                self._clock(),
            ),
        )

    def checkpoint(self, model: str, version: str) -> Checkpoint | None:
        """``model``'s stored state of ``version`` (``None``: none was stored, or it was pruned)."""
        with self.db.transaction() as tx:
            row = tx.one(
                "SELECT params, feature_names, golden, info FROM checkpoints WHERE model = ? AND version = ?",
                (model, version),
            )
        if row is None:
            return None
        names = tuple(json.loads(row[1]))
        golden = np.frombuffer(bytes(row[2]), dtype="<f4").reshape(-1, len(names)).astype(np.float32)
        return Checkpoint(version, str(row[0]), names, golden, json.loads(row[3]))

    def prune_checkpoints(self, model: str, keep: int) -> int:
        """Delete ``model``'s checkpoints but the ``keep`` newest and those its cursor names (its version
        and baseline); returns how many were deleted."""
        if not isinstance(keep, int) or keep < 1:
            raise InvalidInput(f"must be a positive integer, got {keep!r}", field="keep")
        with self.db.transaction() as tx:
            named = tx.one("SELECT version, baseline_version FROM cursor WHERE model = ?", (model,))
            pinned = {v for v in (named or ()) if v}
            newest = tx.query(
                "SELECT n FROM checkpoints WHERE model = ? ORDER BY n DESC LIMIT ?", (model, keep)
            )
            if len(newest) < keep:
                return 0
            older = tx.query(
                "SELECT n, version FROM checkpoints WHERE model = ? AND n < ?", (model, int(newest[-1][0]))
            )
            stale = [int(n) for n, version in older if version not in pinned]
            for start in range(0, len(stale), _CHUNK):
                chunk = stale[start : start + _CHUNK]
                tx.execute(f"DELETE FROM checkpoints WHERE n IN ({','.join('?' * len(chunk))})", chunk)
        return len(stale)

    # -- retention --------------------------------------------------------------------------------

    def purge_expired(self) -> int:
        """Delete labels of decisions past retention that every known model has applied; return how many.

        With no known model nothing is deleted.
        """
        cutoff = self._clock() - self.retention_s
        with self.db.transaction() as tx:
            low = tx.one("SELECT MIN(last_seq) FROM cursor")
            floor = 0 if low is None or low[0] is None else int(low[0])
            purged = tx.execute("DELETE FROM feedback WHERE decided_at < ? AND seq <= ?", (cutoff, floor))
            tx.execute("DELETE FROM holdout WHERE seq NOT IN (SELECT seq FROM feedback)")
        return purged


def _check_checkpoint(checkpoint: Checkpoint | None, version: str) -> None:
    if checkpoint is not None and checkpoint.version != version:
        raise InvalidInput(
            f"the checkpoint is of version {checkpoint.version}, the cursor is to name {version}",
            field="checkpoint",
        )


def _require_text(value: object, field: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"must be a non-empty string, got {value!r}", field=field)
