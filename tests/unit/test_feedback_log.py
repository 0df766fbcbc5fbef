"""The feedback log: durable acks, idempotent retries, joins to the audit trail's records, cursors,
retention, the schema 3 -> 4 upgrade, kill -9 and exactly-once."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray
from sklearn.linear_model import SGDClassifier

from riskserve.audit.store import encode_row
from riskserve.audit.writer import AuditWriter
from riskserve.learning import Batch, FeedbackLog
from riskserve.learning.feedback_log import SCHEMA_VERSION
from riskserve.platform.errors import Conflict, InvalidInput, NotFound

from .audit_records import DecisionTrail, record

REPO = Path(__file__).resolve().parents[2]
COLUMNS = ["amount", "age", "hour"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def trail(tmp_path: Path, clock: FakeClock) -> Iterator[DecisionTrail]:
    kept = DecisionTrail(tmp_path / "audit", clock=clock)
    yield kept
    kept.close()


@pytest.fixture
def log(tmp_path: Path, clock: FakeClock, trail: DecisionTrail) -> Iterator[FeedbackLog]:
    opened = FeedbackLog(tmp_path / "feedback.db", audit=trail.directory, retention_s=100.0, clock=clock)
    yield opened
    opened.close()


def row(i: int) -> NDArray[np.float32]:
    return np.array([i, i + 0.5, -i], dtype=np.float32)


def decide(trail: DecisionTrail, i: int) -> str:
    """Decision ``r{i}`` in the audit trail (its caller's request id is the same)."""
    trail.keep(f"r{i}", row(i), COLUMNS)
    return f"r{i}"


def test_wal_and_fsync_on_commit_are_in_effect(log: FeedbackLog) -> None:
    assert log.pragma("journal_mode") == "wal"
    assert log.pragma("synchronous") == 2  # FULL
    # A second, independent connection sees the file in WAL mode too (it is persistent in the file).
    with closing(sqlite3.connect(log.path)) as other:
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert other.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]


def test_a_retried_feedback_id_is_a_duplicate_and_the_label_is_logged_once(
    log: FeedbackLog, trail: DecisionTrail
) -> None:
    decide(trail, 1)
    first = log.record_feedback("r1", 1, "fb-1", source="chargebacks")
    again = log.record_feedback("r1", 1, "fb-1", source="chargebacks")
    assert (first.accepted, first.duplicate) == (True, False)
    assert (again.accepted, again.duplicate, again.seq) == (True, True, first.seq)
    batch = log.pending("m", 10)
    assert batch.feedback_ids == ("fb-1",)
    assert log.record_feedback("", 1, "fb-1", decision_id="r1").duplicate  # by its decision id too


def test_a_feedback_id_reused_for_another_payload_is_a_conflict(
    log: FeedbackLog, trail: DecisionTrail
) -> None:
    decide(trail, 1)
    decide(trail, 2)
    log.record_feedback("r1", 1, "fb-1")
    with pytest.raises(Conflict):
        log.record_feedback("r1", 0, "fb-1")
    with pytest.raises(Conflict):
        log.record_feedback("r2", 1, "fb-1")
    assert len(log.pending("m", 10)) == 1


def test_feedback_for_an_unknown_or_expired_decision_is_not_found(
    log: FeedbackLog, trail: DecisionTrail, clock: FakeClock
) -> None:
    with pytest.raises(NotFound):
        log.record_feedback("nope", 1, "fb-1")
    with pytest.raises(NotFound):
        log.record_feedback("", 1, "fb-1", decision_id="nope")
    decide(trail, 1)
    clock.now += 101.0
    with pytest.raises(NotFound):
        log.record_feedback("r1", 1, "fb-2")


@pytest.mark.parametrize("label", [2, -1, 0.5, "1", None])
def test_a_bad_label_is_invalid_input_naming_label(
    log: FeedbackLog, trail: DecisionTrail, label: object
) -> None:
    decide(trail, 1)
    with pytest.raises(InvalidInput) as caught:
        log.record_feedback("r1", label, "fb-1")  # type: ignore[arg-type]
    assert caught.value.field == "label"


def test_pending_joins_labels_to_their_audit_records_rows_in_seq_order(
    log: FeedbackLog, trail: DecisionTrail
) -> None:
    for i in range(5):
        decide(trail, i)
    for i, label in [(3, 1), (0, 0), (4, 1), (1, 0)]:  # feedback arrives in another order than decisions
        log.record_feedback(f"r{i}", label, f"fb-{i}")
    batch = log.pending("m", 3)
    assert batch.feedback_ids == ("fb-3", "fb-0", "fb-4")
    assert list(batch.seqs) == sorted(batch.seqs)
    assert batch.x.dtype == np.float32
    assert batch.x.flags.c_contiguous
    assert batch.x.shape == (3, 3)
    np.testing.assert_array_equal(batch.x, np.stack([row(3), row(0), row(4)]))
    assert batch.y.dtype == np.int64
    assert list(batch.y) == [1, 0, 1]
    assert batch.columns == tuple(COLUMNS)


def test_a_batch_never_mixes_feature_layouts(log: FeedbackLog, trail: DecisionTrail) -> None:
    decide(trail, 1)
    trail.keep("r2", np.ones(2, np.float32), ["a", "b"])
    log.record_feedback("r1", 1, "fb-1")
    log.record_feedback("r2", 0, "fb-2")
    first = log.pending("m", 10)
    assert first.feedback_ids == ("fb-1",)
    log.mark_applied("m", first.last_seq, "v-a")
    assert log.pending("m", 10).columns == ("a", "b")


def test_mark_applied_hides_labels_and_never_moves_back_or_skips(
    log: FeedbackLog, trail: DecisionTrail
) -> None:
    for i in range(4):
        decide(trail, i)
        log.record_feedback(f"r{i}", i % 2, f"fb-{i}")
    batch = log.pending("m", 2)
    log.mark_applied("m", batch.last_seq, "v-a", expected_last_seq=batch.after_seq)
    assert log.cursor("m").last_seq == batch.last_seq
    assert log.cursor("m").version == "v-a"
    assert log.pending("m", 10).feedback_ids == ("fb-2", "fb-3")
    assert log.pending("other", 10).feedback_ids == ("fb-0", "fb-1", "fb-2", "fb-3")  # cursors are per model
    log.mark_applied("m", batch.last_seq, "v-a")  # a retried mark is a no-op
    with pytest.raises(Conflict):
        log.mark_applied("m", batch.last_seq, "v-b")  # same seq, other version
    with pytest.raises(Conflict):
        log.mark_applied("m", int(batch.seqs[0]), "v-b")  # backwards
    with pytest.raises(Conflict):
        log.mark_applied("m", 999, "v-b")  # past the last recorded label
    with pytest.raises(Conflict):
        log.mark_applied("m", 4, "v-b", expected_last_seq=batch.after_seq)  # stale batch
    assert log.cursor("m").version == "v-a"


def test_purge_keeps_what_some_known_model_still_needs(
    log: FeedbackLog, trail: DecisionTrail, clock: FakeClock
) -> None:
    for i in range(3):
        decide(trail, i)
    log.record_feedback("r0", 1, "fb-0")
    log.register_model("slow")
    clock.now += 50.0
    decide(trail, 3)  # still within retention later
    log.record_feedback("r3", 0, "fb-3")
    clock.now += 60.0
    assert log.purge_expired() == 0  # fb-0 is past retention, but 'slow' has not applied it
    assert log.pending("slow", 10).feedback_ids == ("fb-0", "fb-3")
    log.mark_applied("fast", 2, "v-f")
    assert log.purge_expired() == 0
    log.mark_applied("slow", 2, "v-s")
    assert log.purge_expired() == 1  # fb-0; fb-3's decision is within retention: kept
    with pytest.raises(NotFound):  # a late retry is refused, never counted twice
        log.record_feedback("r0", 1, "fb-0")
    assert log.record_feedback("r3", 0, "fb-3").duplicate


CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import numpy as np
    from riskserve.learning import FeedbackLog
    from tests.unit.audit_records import DecisionTrail

    trail = DecisionTrail(Path(sys.argv[2]))
    log = FeedbackLog(Path(sys.argv[1]), audit=trail.directory)
    features = np.arange(64, dtype=np.float32)
    columns = [f"c{j}" for j in range(64)]
    print("ready", flush=True)
    for i in range(1_000_000):
        trail.keep(f"r{i}", features + i, columns)
        ack = log.record_feedback(f"r{i}", i % 2, f"fb-{i}")
        assert ack.accepted and not ack.duplicate
        print(f"fb-{i}", flush=True)
    """
)


def test_every_acknowledged_label_survives_kill_9_exactly_once(tmp_path: Path) -> None:
    path = tmp_path / "feedback.db"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(tmp_path / "audit")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None
    try:
        assert child.stdout.readline() == "ready\n"
        for _ in range(150):
            assert child.stdout.readline().startswith("fb-")
        child.send_signal(signal.SIGKILL)
        rest = child.stdout.read()
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    # Only complete lines were acknowledged (printed after record_feedback returned).
    acked = [f"fb-{i}" for i in range(150)] + rest.split("\n")[:-1]
    assert acked == [f"fb-{i}" for i in range(len(acked))]

    with FeedbackLog(path, audit=tmp_path / "audit") as log:
        stored = log.pending("m", 1_000_000)
        assert log.pragma("integrity_check") == "ok"
    ids = list(stored.feedback_ids)
    assert len(ids) == len(set(ids))
    assert set(acked) <= set(ids)  # every ack is durable; at most the in-flight call may be extra
    assert len(ids) - len(acked) <= 1
    for fid, features, label in zip(ids, stored.x, stored.y, strict=True):  # nothing half-written
        i = int(fid.removeprefix("fb-"))
        np.testing.assert_array_equal(features, np.arange(64, dtype=np.float32) + i)
        assert label == i % 2


# -- exactly-once learning across crashes ---------------------------------------------------------


class Crash(Exception):
    pass


def new_classifier() -> SGDClassifier:
    return SGDClassifier(loss="log_loss", learning_rate="constant", eta0=0.05, shuffle=False, random_state=0)


def save_state(classifier: SGDClassifier, store: Path) -> str:
    """Write the learner's state durably under its content version (an artifact, in miniature)."""
    state = np.concatenate([classifier.coef_.ravel(), classifier.intercept_, [classifier.t_]])
    data = state.astype("<f8").tobytes()
    version = hashlib.sha256(data).hexdigest()[:16]
    (store / f"{version}.bin").write_bytes(data)
    return version


def load_state(version: str | None, store: Path, width: int) -> SGDClassifier:
    classifier = new_classifier()
    if version is None:
        return classifier
    state = np.frombuffer((store / f"{version}.bin").read_bytes(), dtype="<f8")
    classifier.classes_ = np.array([0, 1])
    classifier.coef_ = state[:width].reshape(1, -1).copy()
    classifier.intercept_ = state[width : width + 1].copy()
    classifier.t_ = float(state[-1])
    classifier.n_features_in_ = width
    return classifier


def run_learner(path: Path, store: Path, *, batch_size: int, crash_at: int | None = None) -> SGDClassifier:
    """The learner loop; ``crash_at`` dies after partial_fit *and* saving, before mark_applied."""
    with FeedbackLog(path, audit=path.parent / "audit") as log:
        classifier = load_state(log.cursor("fraud").version, store, len(COLUMNS))
        step = 0
        while len(batch := log.pending("fraud", batch_size)):
            classifier.partial_fit(batch.x.astype(np.float64), batch.y, classes=np.array([0, 1]))
            version = save_state(classifier, store)
            if step == crash_at:
                raise Crash
            log.mark_applied("fraud", batch.last_seq, version, expected_last_seq=batch.after_seq)
            step += 1
        return classifier


def reference(batches: list[Batch]) -> SGDClassifier:
    classifier = new_classifier()
    for batch in batches:
        classifier.partial_fit(batch.x.astype(np.float64), batch.y, classes=np.array([0, 1]))
    return classifier


def test_labels_are_applied_exactly_once_across_crashes(tmp_path: Path) -> None:
    path, store = tmp_path / "feedback.db", tmp_path / "models"
    store.mkdir()
    rng = np.random.default_rng(0)
    trail = DecisionTrail(tmp_path / "audit")
    with FeedbackLog(path, audit=trail.directory) as log:
        for i in range(45):
            features = rng.normal(size=len(COLUMNS)).astype(np.float32)
            trail.keep(f"r{i}", features, COLUMNS)
        for i in rng.permutation(45):  # labels arrive in another order than the decisions
            log.record_feedback(f"r{i}", int(i % 3 == 0), f"fb-{i}")
        everything = log.pending("fraud", 1000)
    batches = [
        Batch(0, everything.seqs[s], everything.x[s], everything.y[s], (), everything.columns)
        for s in (slice(k, k + 10) for k in range(0, 45, 10))
    ]

    with pytest.raises(Crash):
        run_learner(path, store, batch_size=10, crash_at=2)  # batches 0, 1 marked; 2 trained, lost
    with pytest.raises(Crash):
        run_learner(path, store, batch_size=10, crash_at=0)  # batch 2 retrained, lost again
    final = run_learner(path, store, batch_size=10)

    expected = reference(batches)
    np.testing.assert_array_equal(final.coef_, expected.coef_)
    np.testing.assert_array_equal(final.intercept_, expected.intercept_)
    assert final.t_ == expected.t_
    assert not np.array_equal(reference([*batches[:3], batches[2], *batches[3:]]).coef_, expected.coef_)
    trail.close()
    with FeedbackLog(path, audit=trail.directory) as log:
        assert log.cursor("fraud").last_seq == int(everything.seqs[-1])
        assert len(log.pending("fraud", 10)) == 0
        assert (
            load_state(log.cursor("fraud").version, store, len(COLUMNS)).coef_.tolist()
            == final.coef_.tolist()
        )


# -- the decisions are the audit trail's records ---------------------------------------------------


def test_a_decision_still_only_in_a_journal_takes_its_label_and_trains_on_its_row(
    tmp_path: Path, clock: FakeClock
) -> None:
    audit = tmp_path / "audit"
    log = FeedbackLog(tmp_path / "feedback.db", audit=audit, retention_s=100.0, clock=clock)
    with pytest.raises(NotFound):  # the lookup has looked at the (empty) directory already
        log.record_feedback("", 1, "fb-0", decision_id="d000001")
    writer = AuditWriter(audit)  # a replica that started since, written ahead, not committed yet
    kept = record(1, clock.now)
    kept |= {"features": encode_row(row(1).tobytes()), "layout": writer.layout(COLUMNS)}
    writer.submit([kept])
    assert writer.store.count() == 0
    ack = log.record_feedback("", 1, "fb-1", decision_id="d000001")
    assert not ack.duplicate
    batch = log.pending("m", 10)  # the row comes from the journal
    np.testing.assert_array_equal(batch.x, row(1)[None, :])
    assert log.record_feedback("tx-1", 1, "fb-3").duplicate  # found by its caller's request id there too
    writer.close()  # committed now, the journal drained
    again = log.pending("m", 10)  # now from the slot's store: the same row
    np.testing.assert_array_equal(again.x, batch.x)
    assert log.record_feedback("tx-1", 1, "fb-2").duplicate  # by the caller's request id: its one label
    log.close()


def test_a_label_whose_audit_record_is_gone_is_skipped_and_accounted_for(
    log: FeedbackLog, trail: DecisionTrail, clock: FakeClock
) -> None:
    decide(trail, 0)
    trail.keep("r1", row(1), COLUMNS, decided_at=clock.now - 50)
    decide(trail, 2)
    for i in range(3):
        log.record_feedback(f"r{i}", i % 2, f"fb-{i}")
    assert trail.store.purge(clock.now - 10, 100) == 1  # the trail lost r1 (its retention was shorter)
    batch = log.pending("m", 10)
    assert batch.feedback_ids == ("fb-0", "fb-2")
    assert batch.unjoined == ("fb-1",)
    assert batch.last_seq == 3  # the cursor moves past the skipped label too
    np.testing.assert_array_equal(batch.x, np.stack([row(0), row(2)]))
    log.mark_applied("m", batch.last_seq, "v-a", expected_last_seq=batch.after_seq)
    assert len(log.pending("m", 10)) == 0


V3_SCHEMA = """
CREATE TABLE schema_version (version INTEGER NOT NULL); INSERT INTO schema_version VALUES (3);
CREATE TABLE decisions (request_id TEXT PRIMARY KEY, pipeline TEXT NOT NULL, model_version TEXT NOT NULL,
    features BLOB NOT NULL, columns TEXT NOT NULL, decided_at REAL NOT NULL, caller_id TEXT);
CREATE TABLE feedback (seq INTEGER PRIMARY KEY AUTOINCREMENT, feedback_id TEXT NOT NULL UNIQUE,
    request_id TEXT NOT NULL REFERENCES decisions (request_id), label INTEGER NOT NULL,
    source TEXT NOT NULL, received_at REAL NOT NULL);
CREATE TABLE cursor (model TEXT PRIMARY KEY, last_seq INTEGER NOT NULL, version TEXT,
    updated_at REAL NOT NULL, artifact TEXT, baseline TEXT, paused TEXT);
CREATE TABLE holdout (model TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (model, seq));
CREATE TABLE batches (model TEXT NOT NULL, last_seq INTEGER NOT NULL, after_seq INTEGER NOT NULL,
    version TEXT NOT NULL, report TEXT NOT NULL, applied_at REAL NOT NULL, PRIMARY KEY (model, last_seq));
"""


def test_a_schema_3_log_keeps_its_decisions_read_only_beside_the_audit_trail(
    tmp_path: Path, clock: FakeClock, trail: DecisionTrail
) -> None:
    path = tmp_path / "v3.sqlite"
    with closing(sqlite3.connect(path)) as db:
        db.executescript(V3_SCHEMA)
        for i in range(3):  # decisions the old ingress copied into the log; a label on the first one
            db.execute(
                "INSERT INTO decisions VALUES (?, 'card', '{}', ?, ?, ?, ?)",
                (
                    f"old-{i}",
                    row(10 + i).astype("<f4").tobytes(),
                    json.dumps(COLUMNS),
                    clock.now,
                    f"tx-old-{i}",
                ),
            )
        db.execute("INSERT INTO feedback VALUES (1, 'fb-old-0', 'old-0', 1, 'bank', ?)", (clock.now,))
        db.commit()
    decide(trail, 1)  # a decision made after the upgrade: only in the audit trail
    with FeedbackLog(path, audit=trail.directory, retention_s=100.0, clock=clock) as log:
        log.record_feedback("", 0, "fb-new", decision_id="r1")  # no foreign key to the old table bites
        log.record_feedback("tx-old-1", 1, "fb-old-1")  # an old decision, by its caller's request id
        assert log.record_feedback("tx-old-0", 1, "fb-old-0").duplicate  # an old label's retry
        batch = log.pending("m", 10)
        assert batch.feedback_ids == ("fb-old-0", "fb-new", "fb-old-1")
        np.testing.assert_array_equal(batch.x, np.stack([row(10), row(1), row(11)]))
        log.mark_applied("m", batch.last_seq, "v-a")
        clock.now += 101.0
        assert log.purge_expired() == 3  # every label applied, their decisions past retention
    with closing(sqlite3.connect(path)) as db:
        assert db.execute("SELECT version FROM schema_version").fetchall() == [(4,)]
        assert db.execute("SELECT COUNT(*) FROM decisions").fetchone() == (0,)  # old copies purged too
        assert db.execute("SELECT COUNT(*) FROM feedback").fetchone() == (0,)
