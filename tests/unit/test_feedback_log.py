"""The feedback log in the state database, on both backends (a SQLite file and a real PostgreSQL server):
durable acks, idempotent retries, joins to the audit trail's records, cursors, retention, checkpoints, the
holdout key, two nodes sharing one database, kill -9 and exactly-once."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from sklearn.linear_model import SGDClassifier

from riskserve.audit.lookup import DecisionLookup
from riskserve.audit.store import encode_row
from riskserve.audit.writer import AuditWriter
from riskserve.learning import Batch, FeedbackLog
from riskserve.learning.feedback_log import COMPONENT, SCHEMA_VERSION, Checkpoint
from riskserve.platform.errors import AlreadyExists, Conflict, InvalidInput, NotFound
from riskserve.state.db import open_database

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
def trail(state_dsn: str, clock: FakeClock) -> Iterator[DecisionTrail]:
    """Decisions kept in the test's state database, with a connection of their own (as the ingress
    replicas that ship them would): the database the feedback logs of the test use."""
    db = open_database(state_dsn)
    kept = DecisionTrail(db, clock=clock)
    yield kept
    kept.close()
    db.close()


Node = Callable[..., FeedbackLog]


@pytest.fixture
def node(state_dsn: str) -> Iterator[Node]:
    """Opens a feedback log on the test's state database with a connection of its own, as another process
    or node would, joined to the audit trail in that same database (and to the journals in
    ``journal_dir``, this node's, if given); all are closed after the test."""
    opened: list[FeedbackLog] = []

    def open_log(journal_dir: Path | None = None, **options: Any) -> FeedbackLog:
        db = open_database(state_dsn)
        opened.append(FeedbackLog(db, lookup=DecisionLookup(db, journal_dir), **options))
        return opened[-1]

    yield open_log
    for log in opened:
        log.close()
        log.db.close()


@pytest.fixture
def log(node: Node, clock: FakeClock) -> FeedbackLog:
    return node(retention_s=100.0, clock=clock)


def row(i: int) -> NDArray[np.float32]:
    return np.array([i, i + 0.5, -i], dtype=np.float32)


def decide(trail: DecisionTrail, i: int) -> str:
    """Decision ``r{i}`` in the audit trail (its caller's request id is the same)."""
    trail.keep(f"r{i}", row(i), COLUMNS)
    return f"r{i}"


def test_labels_are_committed_where_the_audit_reader_reads_them(
    log: FeedbackLog, trail: DecisionTrail, state_dsn: str
) -> None:
    decide(trail, 1)
    decide(trail, 2)
    log.record_feedback("r2", 0, "fb-2", source="review")
    log.record_feedback("r1", 1, "fb-1", source="chargebacks")
    other = open_database(state_dsn)  # another connection: it sees what was acknowledged, committed
    with other.transaction() as tx:
        rows = tx.query(  # the audit trail's reader joins labels with exactly this query
            "SELECT request_id, label, source, received_at, feedback_id FROM feedback"
            " WHERE request_id IN (?, ?) ORDER BY seq",
            ("r1", "r2"),
        )
        migrated = tx.query("SELECT version FROM schema_migrations WHERE component = ?", (COMPONENT,))
    other.close()
    assert rows == [("r2", 0, "review", 1_000_000.0, "fb-2"), ("r1", 1, "chargebacks", 1_000_000.0, "fb-1")]
    assert migrated == [(SCHEMA_VERSION,)]


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


def test_retries_and_duplicates_take_no_number_so_labels_are_numbered_without_gaps(
    log: FeedbackLog, trail: DecisionTrail
) -> None:
    decide(trail, 1)
    decide(trail, 2)
    first = log.record_feedback("r1", 1, "fb-1", source="chargebacks")
    log.record_feedback("r1", 1, "fb-1", source="chargebacks")  # a retry
    log.record_feedback("r1", 1, "fb-other", source="analyst")  # the same verdict for the same decision
    second = log.record_feedback("r2", 0, "fb-2", source="chargebacks")
    assert second.seq == first.seq + 1  # a learner counting labels by number sees every one it waits for


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
    import numpy as np
    from riskserve.audit.lookup import DecisionLookup
    from riskserve.learning import FeedbackLog
    from riskserve.state.db import open_database
    from tests.unit.audit_records import DecisionTrail

    db = open_database(sys.argv[1])
    trail = DecisionTrail(db)  # the decisions are in the log's own database
    log = FeedbackLog(db, lookup=DecisionLookup(db))
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


def test_every_acknowledged_label_survives_kill_9_exactly_once(state_dsn: str, node: Node) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, state_dsn],
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

    stored = node().pending("m", 1_000_000)
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


def run_learner(
    log: FeedbackLog, store: Path, *, batch_size: int, crash_at: int | None = None
) -> SGDClassifier:
    """The learner loop on a freshly opened ``log`` (a new process); ``crash_at`` dies after partial_fit
    *and* saving, before mark_applied."""
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


def test_labels_are_applied_exactly_once_across_crashes(node: Node, tmp_path: Path) -> None:
    store = tmp_path / "models"
    store.mkdir()
    rng = np.random.default_rng(0)
    log = node()
    trail = DecisionTrail(log.db)
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
        run_learner(node(), store, batch_size=10, crash_at=2)  # 0, 1 marked; 2 lost
    with pytest.raises(Crash):
        run_learner(node(), store, batch_size=10, crash_at=0)  # 2 retrained, lost again
    final = run_learner(node(), store, batch_size=10)

    expected = reference(batches)
    np.testing.assert_array_equal(final.coef_, expected.coef_)
    np.testing.assert_array_equal(final.intercept_, expected.intercept_)
    assert final.t_ == expected.t_
    assert not np.array_equal(reference([*batches[:3], batches[2], *batches[3:]]).coef_, expected.coef_)
    trail.close()
    log = node()
    assert log.cursor("fraud").last_seq == int(everything.seqs[-1])
    assert len(log.pending("fraud", 10)) == 0
    assert load_state(log.cursor("fraud").version, store, len(COLUMNS)).coef_.tolist() == final.coef_.tolist()


# -- the decisions are the audit trail's records ---------------------------------------------------


def test_a_decision_still_only_in_a_journal_takes_its_label_and_trains_on_its_row(
    node: Node, tmp_path: Path, clock: FakeClock, state_dsn: str
) -> None:
    audit = tmp_path / "audit"  # this node's journals
    log = node(audit, retention_s=100.0, clock=clock)
    with pytest.raises(NotFound):  # the lookup has looked in the database and the (empty) directory
        log.record_feedback("", 1, "fb-0", decision_id="d000001")
    replica_db = open_database(state_dsn)  # a replica on this node that started since: its connection
    writer = AuditWriter(audit, replica_db)  # written ahead, not shipped to the database yet
    kept = record(1, clock.now)
    kept |= {"features": encode_row(row(1).tobytes()), "layout": writer.layout(COLUMNS)}
    writer.submit([kept])
    assert writer.store.count() == 0
    ack = log.record_feedback("", 1, "fb-1", decision_id="d000001")
    assert not ack.duplicate
    batch = log.pending("m", 10)  # the row comes from the journal
    np.testing.assert_array_equal(batch.x, row(1)[None, :])
    assert log.record_feedback("tx-1", 1, "fb-3").duplicate  # found by its caller's request id there too
    writer.close()  # shipped now, the journal drained
    assert writer.store.count() == 1
    assert not list(audit.glob("slot-*.journal/*.jsonl"))
    again = log.pending("m", 10)  # now from the database: the same row
    np.testing.assert_array_equal(again.x, batch.x)
    assert log.record_feedback("tx-1", 1, "fb-2").duplicate  # by the caller's request id: its one label
    replica_db.close()


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


# -- two nodes, one database ------------------------------------------------------------------------


def test_two_nodes_on_one_database_see_each_others_labels_and_answer_a_retry_as_a_duplicate(
    node: Node, trail: DecisionTrail, clock: FakeClock
) -> None:
    node_a = node(retention_s=100.0, clock=clock)
    node_b = node(retention_s=100.0, clock=clock)  # its migrations: found applied
    for i in range(3):
        decide(trail, i)
    first = node_a.record_feedback("r0", 1, "fb-0", source="bank")
    assert node_b.seen("fb-0")
    retry = node_b.record_feedback("r0", 1, "fb-0", source="bank")  # the client's retry reached node B
    assert (retry.duplicate, retry.seq) == (True, first.seq)
    assert node_b.record_feedback("r0", 1, "fb-other").duplicate  # one label per decision, across nodes
    with pytest.raises(AlreadyExists):
        node_b.record_feedback("r0", 0, "fb-flip")
    with pytest.raises(Conflict):
        node_b.record_feedback("r1", 1, "fb-0")  # fb-0 was recorded on node A for another decision
    node_b.record_feedback("r1", 0, "fb-1")
    node_a.record_feedback("r2", 1, "fb-2")
    assert node_a.pending("m", 10).feedback_ids == ("fb-0", "fb-1", "fb-2")
    assert node_b.pending("m", 10).feedback_ids == ("fb-0", "fb-1", "fb-2")
    batch = node_a.pending("m", 2)
    node_a.mark_applied("m", batch.last_seq, "v-a", expected_last_seq=batch.after_seq)
    with pytest.raises(Conflict, match="another learner moved it"):  # B read the same batch: too late
        node_b.mark_applied("m", batch.last_seq + 1, "v-b", expected_last_seq=batch.after_seq)
    assert node_b.cursor("m").version == "v-a"


def test_concurrent_labels_on_two_nodes_reach_a_concurrent_learner_each_exactly_once(
    node: Node, trail: DecisionTrail, clock: FakeClock
) -> None:
    """Seqs become visible in order, so a learner marking as it reads never steps over a label that
    commits late; and a decision labelled on both nodes at once keeps one label."""
    per_node = 60
    trail.keep_many([(f"r{i}", row(i), COLUMNS, "") for i in range(2 * per_node)])
    nodes = [node(clock=clock) for _ in range(3)]
    start = threading.Barrier(3)
    acks: list[tuple[str, bool]] = []
    errors: list[BaseException] = []

    work = {  # node 0 labels r0..r59; node 1 labels r60..r119 and, at about the same time, r0..r59 again
        0: [f"r{i}" for i in range(per_node)],
        1: [d for i in range(per_node) for d in (f"r{per_node + i}", f"r{i}")],
    }

    def label(n: int) -> None:
        start.wait()
        try:
            for decision in work[n]:
                ack = nodes[n].record_feedback(decision, 1, f"fb-{n}-{decision}")
                acks.append((decision, ack.duplicate))
        except BaseException as error:
            errors.append(error)

    writers = [threading.Thread(target=label, args=(n,)) for n in range(2)]
    for w in writers:
        w.start()
    start.wait()
    applied: list[str] = []
    learner = nodes[2]
    while any(w.is_alive() for w in writers) or learner.pending_count("m"):
        batch = learner.pending("m", 7)
        if len(batch):
            learner.mark_applied("m", batch.last_seq, f"v{batch.last_seq}", expected_last_seq=batch.after_seq)
            applied.extend(batch.feedback_ids)
    for w in writers:
        w.join()
    assert errors == []
    firsts = sorted(decision for decision, duplicate in acks if not duplicate)
    assert firsts == sorted(f"r{i}" for i in range(2 * per_node))  # each decision took one label, once
    assert len(applied) == len(set(applied)) == 2 * per_node  # ... and the learner applied each once


def test_the_holdout_key_is_made_once_and_every_node_reads_the_same(node: Node, tmp_path: Path) -> None:
    node_a, node_b = node(), node()
    key = node_b.holdout_key()
    assert len(key) == 32
    assert node_a.holdout_key() == key
    assert node().holdout_key() == key  # a restart reads it back
    elsewhere = open_database(f"sqlite:///{tmp_path / 'elsewhere.sqlite'}")
    assert FeedbackLog(elsewhere).holdout_key() != key  # random per database, not a constant
    elsewhere.close()


def _checkpoint(version: str) -> Checkpoint:
    golden = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    return Checkpoint(version, f'{{"v": "{version}"}}', tuple(COLUMNS), golden, {"parent": None, "n": 1})


def test_a_checkpoint_is_kept_with_the_cursor_move_that_names_its_version(
    log: FeedbackLog, trail: DecisionTrail
) -> None:
    for i in range(4):
        decide(trail, i)
        log.record_feedback(f"r{i}", i % 2, f"fb-{i}")
    log.adopt("m", "v0", "/models/v0", checkpoint=_checkpoint("v0"))
    with pytest.raises(InvalidInput, match="checkpoint"):  # a checkpoint of another version is refused ...
        log.mark_applied("m", 1, "v1", checkpoint=_checkpoint("v9"))
    assert log.cursor("m").last_seq == 0  # ... and with it the whole mark
    for seq in range(1, 5):
        log.mark_applied("m", seq, f"v{seq}", checkpoint=_checkpoint(f"v{seq}"))
    stored = log.checkpoint("m", "v3")
    assert stored is not None
    assert (stored.params, stored.feature_names, stored.info) == (
        '{"v": "v3"}',
        tuple(COLUMNS),
        {"parent": None, "n": 1},
    )
    np.testing.assert_array_equal(stored.golden_x, _checkpoint("v3").golden_x)  # float32 bytes: exact
    assert log.checkpoint("other", "v3") is None
    assert log.prune_checkpoints("m", keep=2) == 2  # v1, v2 go; v0 is the baseline, v3 and v4 the newest
    assert [v for v in ("v0", "v1", "v2", "v3", "v4") if log.checkpoint("m", v)] == ["v0", "v3", "v4"]
