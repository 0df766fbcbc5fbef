"""The feedback log: durable acks, idempotent retries, joins, cursors, retention, kill -9 and exactly-once."""

from __future__ import annotations

import hashlib
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

from riskserve.learning import Batch, FeedbackLog
from riskserve.learning.feedback_log import SCHEMA_VERSION
from riskserve.platform.errors import Conflict, InvalidInput, NotFound

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
def log(tmp_path: Path, clock: FakeClock) -> Iterator[FeedbackLog]:
    opened = FeedbackLog(tmp_path / "feedback.db", retention_s=100.0, clock=clock)
    yield opened
    opened.close()


def row(i: int) -> NDArray[np.float32]:
    return np.array([i, i + 0.5, -i], dtype=np.float32)


def decide(log: FeedbackLog, i: int) -> str:
    log.record_decision(f"r{i}", "card", "v1", row(i), COLUMNS)
    return f"r{i}"


def test_wal_and_fsync_on_commit_are_in_effect(log: FeedbackLog) -> None:
    assert log.pragma("journal_mode") == "wal"
    assert log.pragma("synchronous") == 2  # FULL
    assert log.pragma("foreign_keys") == 1
    # A second, independent connection sees the file in WAL mode too (it is persistent in the file).
    with closing(sqlite3.connect(log.path)) as other:
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert other.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]


def test_a_retried_feedback_id_is_a_duplicate_and_the_label_is_logged_once(log: FeedbackLog) -> None:
    decide(log, 1)
    first = log.record_feedback("r1", 1, "fb-1", source="chargebacks")
    again = log.record_feedback("r1", 1, "fb-1", source="chargebacks")
    assert (first.accepted, first.duplicate) == (True, False)
    assert (again.accepted, again.duplicate, again.seq) == (True, True, first.seq)
    batch = log.pending("m", 10)
    assert batch.feedback_ids == ("fb-1",)
    decide(log, 1)  # re-recording the same decision is a no-op
    with pytest.raises(Conflict):
        log.record_decision("r1", "card", "v2", row(1), COLUMNS)


def test_a_feedback_id_reused_for_another_payload_is_a_conflict(log: FeedbackLog) -> None:
    decide(log, 1)
    decide(log, 2)
    log.record_feedback("r1", 1, "fb-1")
    with pytest.raises(Conflict):
        log.record_feedback("r1", 0, "fb-1")
    with pytest.raises(Conflict):
        log.record_feedback("r2", 1, "fb-1")
    assert len(log.pending("m", 10)) == 1


def test_feedback_for_an_unknown_or_expired_decision_is_not_found(log: FeedbackLog, clock: FakeClock) -> None:
    with pytest.raises(NotFound):
        log.record_feedback("nope", 1, "fb-1")
    decide(log, 1)
    clock.now += 101.0
    with pytest.raises(NotFound):
        log.record_feedback("r1", 1, "fb-2")


@pytest.mark.parametrize("label", [2, -1, 0.5, "1", None])
def test_a_bad_label_is_invalid_input_naming_label(log: FeedbackLog, label: object) -> None:
    decide(log, 1)
    with pytest.raises(InvalidInput) as caught:
        log.record_feedback("r1", label, "fb-1")  # type: ignore[arg-type]
    assert caught.value.field == "label"


def test_bad_features_are_invalid_input(log: FeedbackLog) -> None:
    with pytest.raises(InvalidInput) as caught:
        log.record_decision("r1", "card", "v1", row(1).astype(np.float64), COLUMNS)
    assert caught.value.field == "features"
    with pytest.raises(InvalidInput) as caught:
        log.record_decision("r1", "card", "v1", row(1), COLUMNS[:2])
    assert caught.value.field == "columns"


def test_pending_joins_labels_to_their_features_in_seq_order(log: FeedbackLog) -> None:
    for i in range(5):
        decide(log, i)
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


def test_a_batch_never_mixes_feature_layouts(log: FeedbackLog) -> None:
    decide(log, 1)
    log.record_decision("r2", "card", "v2", np.ones(2, np.float32), ["a", "b"])
    log.record_feedback("r1", 1, "fb-1")
    log.record_feedback("r2", 0, "fb-2")
    first = log.pending("m", 10)
    assert first.feedback_ids == ("fb-1",)
    log.mark_applied("m", first.last_seq, "v-a")
    assert log.pending("m", 10).columns == ("a", "b")


def test_mark_applied_hides_labels_and_never_moves_back_or_skips(log: FeedbackLog) -> None:
    for i in range(4):
        decide(log, i)
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


def test_purge_keeps_what_some_known_model_still_needs(log: FeedbackLog, clock: FakeClock) -> None:
    for i in range(3):
        decide(log, i)
    log.record_feedback("r0", 1, "fb-0")
    log.register_model("slow")
    clock.now += 50.0
    decide(log, 3)  # still within retention later
    clock.now += 60.0
    assert log.purge_expired() == 2  # r1, r2: expired, no labels
    assert log.pending("slow", 10).feedback_ids == ("fb-0",)  # r0 kept: 'slow' has not applied fb-0
    log.mark_applied("fast", 1, "v-f")
    assert log.purge_expired() == 0
    log.mark_applied("slow", 1, "v-s")
    assert log.purge_expired() == 1
    with pytest.raises(NotFound):  # a late retry is refused, never counted twice
        log.record_feedback("r0", 1, "fb-0")
    log.record_feedback("r3", 0, "fb-3")


CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import numpy as np
    from riskserve.learning import FeedbackLog

    log = FeedbackLog(Path(sys.argv[1]))
    features = np.arange(64, dtype=np.float32)
    columns = [f"c{j}" for j in range(64)]
    print("ready", flush=True)
    for i in range(1_000_000):
        log.record_decision(f"r{i}", "card", "v1", features + i, columns)
        ack = log.record_feedback(f"r{i}", i % 2, f"fb-{i}")
        assert ack.accepted and not ack.duplicate
        print(f"fb-{i}", flush=True)
    """
)


def test_every_acknowledged_label_survives_kill_9_exactly_once(tmp_path: Path) -> None:
    path = tmp_path / "feedback.db"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True, env=env
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

    with FeedbackLog(path) as log:
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
    with FeedbackLog(path) as log:
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
    with FeedbackLog(path) as log:
        for i in range(45):
            features = rng.normal(size=len(COLUMNS)).astype(np.float32)
            log.record_decision(f"r{i}", "card", "v1", features, COLUMNS)
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
    with FeedbackLog(path) as log:
        assert log.cursor("fraud").last_seq == int(everything.seqs[-1])
        assert len(log.pending("fraud", 10)) == 0
        assert (
            load_state(log.cursor("fraud").version, store, len(COLUMNS)).coef_.tolist()
            == final.coef_.tolist()
        )
