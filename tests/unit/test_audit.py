"""The audit trail's store, writer, journal, lookup, retention and export, on both state backends (a SQLite
file and a real PostgreSQL server) and real processes.

Two writers with two journal directories and one database are two nodes. Faults are real where they can be
(a child process killed with SIGKILL, the PostgreSQL server stopped and started) and injected by name where
they cannot (:class:`UnreachableSqlite`, a SQLite state database that refuses every transaction).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from riskserve.audit import AuditStore, AuditTrail, AuditWriter
from riskserve.audit.export import to_table, write_table
from riskserve.audit.lookup import DecisionLookup
from riskserve.audit.store import AuditRecord, encode_row, layout_digest
from riskserve.platform.errors import NotFound
from riskserve.platform.metrics import AUDIT_RECORDS, AuditMetrics, recorded
from riskserve.state.db import TOKENS, Database, SqliteDatabase, StoreUnavailable, open_database
from tests.pg_server import PostgresServer

from .audit_records import record

REPO = Path(__file__).resolve().parents[2]
ALL = 1e12


class UnreachableSqlite(SqliteDatabase):
    """Fault injected: a SQLite state database that refuses every transaction while ``down`` is set, the way
    an unreachable PostgreSQL does (:class:`StoreUnavailable`)."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"sqlite:///{path}", path)
        self.down = True

    def transaction(self, *, write: bool = True) -> Any:
        if self.down:
            raise StoreUnavailable("injected fault: the state database is unreachable")
        return super().transaction(write=write)


@pytest.fixture
def db(state_dsn: str) -> Iterator[Database]:
    opened = open_database(state_dsn)
    yield opened
    opened.close()


@pytest.fixture
def local_db(tmp_path: Path) -> Iterator[Database]:
    """A SQLite state database, for what the backend does not change (slots, journals, the record)."""
    opened = open_database(f"sqlite:///{tmp_path / 'local-state.sqlite'}")
    yield opened
    opened.close()


@pytest.fixture
def connect(state_dsn: str) -> Iterator[Callable[[], Database]]:
    """Another process's (or node's) connection to the same database, closed after the test."""
    opened: list[Database] = []

    def another() -> Database:
        opened.append(open_database(state_dsn))
        return opened[-1]

    yield another
    for each in opened:
        each.close()


@pytest.fixture
def unreachable(tmp_path: Path) -> Iterator[UnreachableSqlite]:
    opened = UnreachableSqlite(tmp_path / "state.sqlite")
    yield opened
    opened.close()


def ids(n: int, start: int = 0) -> set[str]:
    return {f"d{i:06d}" for i in range(start, start + n)}


def stored_ids(db: Database) -> set[str]:
    return {r["decision_id"] for r in AuditStore(db).between(0, ALL)}


def journals(directory: Path) -> list[Path]:
    return sorted(directory.glob("slot-*.journal/*.jsonl"))


def with_row(rec: AuditRecord, row: np.ndarray[Any, Any], layout: str) -> AuditRecord:
    return rec | {"features": encode_row(np.asarray(row, "<f4").tobytes()), "layout": layout}  # type: ignore[return-value]


# -- the store ------------------------------------------------------------------------------------------


def test_records_round_trip_whole_once_with_their_encoded_rows(db: Database) -> None:
    store = AuditStore(db)
    assert store.insert([record(i) for i in range(5)]) == 5
    changed = record(1)
    changed["outcome"] = "DECLINE"
    assert store.insert([changed, record(9)]) == 1  # a kept id is never rewritten
    assert store.get("d000001") == record(1)
    assert store.get("nope") is None
    window = store.between(record(1)["decided_at"], record(4)["decided_at"])
    assert [r["decision_id"] for r in window] == ["d000001", "d000002", "d000003"]
    row = np.random.default_rng(3).normal(size=4).astype(np.float32)
    digest = store.add_layout(["a", "b", "c", "d"])
    assert digest == layout_digest(["a", "b", "c", "d"])
    store.insert([with_row(record(20), row, digest)])
    assert store.get("d000020") == with_row(record(20), row, digest)  # the record JSON, row included
    found = DecisionLookup(db).rows(["d000020", "d000001", "nope"])
    assert list(found) == ["d000020"]  # a record without a row has none
    assert found["d000020"].columns == ("a", "b", "c", "d")
    np.testing.assert_array_equal(np.frombuffer(found["d000020"].data, "<f4"), row)  # the bytes themselves


def test_between_pages_through_many_records_in_order_ties_included(db: Database) -> None:
    records = [record(i) for i in range(2500)]
    for i, rec in enumerate(records):
        rec["decided_at"] = 1000.0 + i // 700  # pages of 1000 end inside runs of equal times
    assert AuditStore(db).insert(records) == 2500  # five multi-row statements in one transaction
    got = [r["decision_id"] for r in AuditStore(db).between(0, ALL)]
    assert got == [f"d{i:06d}" for i in range(2500)]


# -- the writer -----------------------------------------------------------------------------------------


def test_every_submitted_record_reaches_the_store_and_the_journal_is_deleted(
    db: Database, tmp_path: Path
) -> None:
    writer = AuditWriter(tmp_path / "audit", db, flush_s=0.01, batch_rows=64, node="n1").start()
    for start in range(0, 1000, 10):
        writer.submit([record(i) for i in range(start, start + 10)])
    assert writer.flush()
    counts = writer.counts()
    writer.close()
    assert (counts.submitted, counts.written, counts.dropped, counts.spilled) == (1000, 1000, 0, 0)
    assert counts.unshipped == 0
    assert stored_ids(db) == ids(1000)
    assert set(AuditStore(db).origins().values()) == {("n1", "slot-0")}  # who decided them
    assert journals(tmp_path / "audit") == []  # closed cleanly: no replay
    assert stat.S_IMODE((tmp_path / "audit").stat().st_mode) == 0o700


def test_flush_submitted_waits_for_what_was_submitted_before_it_not_for_later_records(
    local_db: Database, tmp_path: Path
) -> None:
    writer = AuditWriter(tmp_path / "audit", local_db, flush_s=3600, batch_rows=4).start()  # ships when woken
    writer.submit([record(i) for i in range(3)])
    assert writer.store.count() == 0
    assert writer.flush_submitted(10.0)  # the feedback RPC's wait: the decisions before the label
    assert writer.store.count() == 3
    stop = threading.Event()

    def flood() -> None:  # decisions keep arriving while a label waits: it must not wait for them
        i = 3
        while not stop.is_set():
            writer.submit([record(i)])
            i += 1

    feeder = threading.Thread(target=flood)
    feeder.start()
    try:
        writer.submit([record(10**6)])
        assert writer.flush_submitted(10.0)
        assert writer.store.get(record(10**6)["decision_id"]) is not None
    finally:
        stop.set()
        feeder.join()
        writer.close()


def test_every_file_of_the_journal_directory_is_private(
    unreachable: UnreachableSqlite, tmp_path: Path
) -> None:
    """They hold the requests' input fields: the directory and each slot's journal 0700, each file 0600,
    whatever the umask."""
    old = os.umask(0o022)
    try:
        writer = AuditWriter(tmp_path / "audit", unreachable)
        writer.layout(["a", "b"])
        writer.submit([record(i) for i in range(3)])  # the store is down: the journal keeps them
        found = {p.relative_to(tmp_path / "audit").as_posix(): stat.S_IMODE(p.stat().st_mode)
                 for p in (tmp_path / "audit").rglob("*")}  # fmt: skip
        mode = stat.S_IMODE((tmp_path / "audit").stat().st_mode)
        unreachable.down = False
        writer.close()
    finally:
        os.umask(old)
    assert mode == 0o700
    assert {"slot-0.lock", "slot-0.journal", "slot-0.journal/00000001.jsonl",
            f"layout-{layout_digest(['a', 'b'])}.json"} == set(found)  # fmt: skip
    for name, mode in found.items():
        assert mode == (0o700 if name == "slot-0.journal" else 0o600), (name, oct(mode))


def test_a_record_written_ahead_is_readable_on_its_node_before_it_is_shipped(
    local_db: Database, tmp_path: Path
) -> None:
    writer = AuditWriter(tmp_path / "audit", local_db)  # not started: nothing is shipped
    writer.submit([record(1)])
    assert AuditTrail(local_db, tmp_path / "audit").get("d000001") == record(1)
    assert DecisionLookup(local_db, tmp_path / "audit").find("d000001") is not None
    with pytest.raises(NotFound):
        AuditTrail(local_db).get("d000001")  # another node (no journal of this one) sees only the database
    writer.close()
    assert AuditTrail(local_db).get("d000001") == record(1)


def test_with_the_store_unreachable_records_spill_past_the_buffer_and_arrive_once(
    unreachable: UnreachableSqlite, tmp_path: Path
) -> None:
    metrics: dict[str, int] = {}
    writer = AuditWriter(
        tmp_path / "audit", unreachable, buffer_rows=10, batch_rows=8,
        on_count=lambda outcome, n: metrics.__setitem__(outcome, metrics.get(outcome, 0) + n),
    )  # fmt: skip
    writer.submit([record(i) for i in range(50)])  # never raises, never waits for the store
    assert not writer.cycle()  # the store refuses: nothing is lost, nothing is shipped
    counts = writer.counts()
    assert (counts.buffered, counts.spilled, counts.dropped, counts.errors) == (10, 40, 0, 1)
    assert counts.unshipped == 50  # what losing this node now would lose
    unreachable.down = False
    assert writer.flush()
    counts = writer.counts()
    writer.close()
    assert (counts.written, counts.replayed, counts.dropped, counts.unshipped) == (10, 40, 0, 0)
    assert metrics == {"written": 10, "replayed": 40, "spilled": 40}
    assert stored_ids(unreachable) == ids(50)
    assert AuditStore(unreachable).count() == 50


def test_without_write_ahead_the_overflow_is_appended_to_the_journal_then_replayed(
    unreachable: UnreachableSqlite, tmp_path: Path
) -> None:
    writer = AuditWriter(tmp_path / "audit", unreachable, buffer_rows=10, write_ahead=False)
    writer.submit([record(i) for i in range(8)])
    assert journals(tmp_path / "audit") == []  # in memory only
    writer.submit([record(i) for i in range(8, 30)])
    assert (writer.counts().spilled, writer.counts().unshipped) == (20, 30)
    unreachable.down = False
    assert writer.flush()
    writer.close()
    assert stored_ids(unreachable) == ids(30)


def test_past_the_spill_bound_records_are_dropped_counted_in_metrics_and_logged(
    unreachable: UnreachableSqlite, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spill = sum(len(json.dumps(record(i), separators=(",", ":"))) + 1 for i in range(10, 15))
    metrics = AuditMetrics("drops_test")
    before = recorded(AUDIT_RECORDS, pipeline="drops_test", outcome="dropped")
    writer = AuditWriter(
        tmp_path / "audit", unreachable, buffer_rows=10, write_ahead=False, spill_bytes=spill + 20,
        on_count=metrics.records,
    )  # fmt: skip
    for i in range(40):  # one at a time, like single Decide calls
        writer.submit([record(i)])
    counts = writer.counts()
    assert (counts.buffered, counts.spilled, counts.dropped, counts.unshipped) == (10, 5, 25, 15)
    with caplog.at_level(logging.ERROR, logger="riskserve.audit.writer"):
        writer.cycle()
    assert "25 decision records DROPPED" in caplog.text
    assert recorded(AUDIT_RECORDS, pipeline="drops_test", outcome="dropped") - before == 25
    unreachable.down = False
    assert writer.flush()
    writer.close()
    assert stored_ids(unreachable) == ids(15)  # 40 - 25, counted


class Outage:
    """The state database down and back: PostgreSQL's server really stopped and started; SQLite's file
    made unreachable by the injected fault (:class:`UnreachableSqlite`)."""

    def __init__(self, state_dsn: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
        self.server: PostgresServer | None = None
        self.db: Database
        if state_dsn.startswith("sqlite"):
            self.db = UnreachableSqlite(tmp_path / "down.sqlite")
            self.db.down = False
        else:
            self.server = request.getfixturevalue("postgres")
            self.db = open_database(state_dsn)
        self.down = False

    def begin(self) -> None:
        self.down = True
        if self.server is not None:
            self.server.stop()
        else:
            assert isinstance(self.db, UnreachableSqlite)
            self.db.down = True

    def end(self) -> None:
        if self.server is not None:
            self.server.start()
        else:
            assert isinstance(self.db, UnreachableSqlite)
            self.db.down = False
        self.down = False


@pytest.fixture
def outage(state_dsn: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Outage]:
    """The database of the test, which it may take down; up again after the test whatever happened, so the
    session's PostgreSQL server serves the tests that follow."""
    made = Outage(state_dsn, tmp_path, request)
    yield made
    if made.down:
        made.end()
    made.db.close()


def test_the_store_down_under_submits_costs_no_decision_and_every_record_arrives_once(
    outage: Outage, tmp_path: Path
) -> None:
    writer = AuditWriter(tmp_path / "audit", outage.db, flush_s=0.02, buffer_rows=50, batch_rows=16).start()
    writer.submit([record(i) for i in range(20)])
    assert writer.flush(30)
    outage.begin()
    with pytest.raises(StoreUnavailable):
        AuditStore(outage.db).count()  # the outage is real: nothing reaches the store now
    slowest = 0.0
    for start in range(20, 220, 4):
        started = time.perf_counter()
        writer.submit([record(i) for i in range(start, start + 4)])  # a decision's answer waits on this
        slowest = max(slowest, time.perf_counter() - started)
    deadline = time.monotonic() + 30
    while writer.counts().errors == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    down = writer.counts()
    outage.end()
    assert slowest < 0.5, f"a submit took {slowest:.3f}s while the store was down"
    assert down.errors >= 1
    assert (down.buffered, down.spilled, down.dropped, down.unshipped) == (50, 150, 0, 200)
    assert writer.flush(60), writer.counts()
    back = writer.counts()
    writer.close()
    assert (back.unshipped, back.dropped) == (0, 0)
    assert back.written + back.replayed == 220  # each record shipped as new exactly once
    assert stored_ids(outage.db) == ids(220)
    assert AuditStore(outage.db).count() == 220
    assert journals(tmp_path / "audit") == []


def test_a_replayed_journal_adds_nothing_twice(db: Database, tmp_path: Path) -> None:
    writer = AuditWriter(tmp_path / "audit", db)
    writer.submit([record(i) for i in range(10)])
    assert writer.cycle()  # shipped from memory; the segment is still on disk (the one appended to)
    assert writer.store.count() == 10
    (segment,) = journals(tmp_path / "audit")
    shutil.copy(segment, segment.with_name("00000099.jsonl"))  # and a second copy of the same records
    os.close(writer._lock_fd)  # fault injected: the process died before it deleted its journal
    restarted = AuditWriter(tmp_path / "audit", db)
    assert restarted.counts().unshipped == 20  # what the node's journal holds, shipped or not
    restarted.start()
    assert restarted.flush()
    counts = restarted.counts()
    restarted.close()
    assert (counts.replayed, counts.dropped, counts.unshipped) == (0, 0, 0)  # every one was there already
    assert AuditStore(db).count() == 10
    assert journals(tmp_path / "audit") == []


def test_two_writers_on_one_node_take_two_slots_and_both_ship(local_db: Database, tmp_path: Path) -> None:
    first = AuditWriter(tmp_path / "audit", local_db)
    second = AuditWriter(tmp_path / "audit", local_db)
    assert (first.slot, second.slot) == ("slot-0", "slot-1")
    first.submit([record(i) for i in range(5)])
    second.submit([record(i) for i in range(5, 10)])
    first.close()
    second.close()
    assert stored_ids(local_db) == ids(10)
    assert AuditWriter(tmp_path / "audit", local_db).slot == "slot-0"  # freed slots are taken again


def test_a_label_side_lookup_finds_a_decision_another_node_shipped(
    connect: Callable[[], Database], tmp_path: Path
) -> None:
    """Two nodes: two writers, each its own journal directory and database connection, one database."""
    node_a = AuditWriter(tmp_path / "a", connect(), node="node-a")
    node_b = AuditWriter(tmp_path / "b", connect(), node="node-b")
    row = np.array([1.5, -2.0], "<f4")
    made_on_b = with_row(record(1), row, node_b.layout(["x", "y"]))
    node_b.submit([made_on_b])
    node_a.submit([record(2)])
    lookup = DecisionLookup(connect(), tmp_path / "a")  # the feedback service on node a
    assert lookup.find("d000001") is None  # only in node b's journal: not shipped yet
    assert lookup.find("d000002") is not None  # node a's own journal
    assert node_b.flush()
    assert node_a.flush()
    found = lookup.find("d000001")
    assert found is not None
    assert (found.decision_id, found.decided_at, found.request_id) == (
        "d000001",
        record(1)["decided_at"],
        "tx-1",
    )
    assert [r.decision_id for r in lookup.by_request("tx-1")] == ["d000001"]
    rows = lookup.rows(["d000001", "d000002"])
    assert list(rows) == ["d000001"]
    assert (rows["d000001"].columns, rows["d000001"].data) == (("x", "y"), row.tobytes())  # b's layout
    assert AuditStore(lookup.store.db).origins() == {
        "d000001": ("node-b", "slot-0"),
        "d000002": ("node-a", "slot-0"),
    }
    node_a.close()
    node_b.close()


def test_find_waits_for_a_decision_shipped_during_the_wait_and_gives_up_after_it(
    connect: Callable[[], Database], tmp_path: Path
) -> None:
    other_node = AuditWriter(tmp_path / "b", connect())  # not started: ships when told
    other_node.submit([record(1)])
    lookup = DecisionLookup(connect())  # this node: no journal of the other one
    assert lookup.find("d000001") is None  # no wait: not shipped yet
    shipper = threading.Timer(0.3, other_node.flush)
    shipper.start()
    started = time.monotonic()
    found = lookup.find("d000001", wait_s=10.0)
    waited = time.monotonic() - started
    shipper.join()
    assert found is not None
    assert found.decision_id == "d000001"
    assert 0.25 <= waited < 5.0  # found while it waited, not at the end of the wait
    missing: list[object] = []
    waiter = threading.Thread(target=lambda: missing.append(lookup.find("d999999", wait_s=0.6)))
    started = time.monotonic()
    waiter.start()
    assert lookup.find("d000001") is not None  # another caller is not held up by the one waiting
    assert time.monotonic() - started < 0.5
    waiter.join()
    assert missing == [None]
    assert time.monotonic() - started >= 0.6  # it waited its whole wait_s before it said None
    other_node.close()


def test_a_dead_slots_journal_is_replayed_by_a_live_writer(local_db: Database, tmp_path: Path) -> None:
    alive = AuditWriter(tmp_path / "audit", local_db)
    dead = AuditWriter(tmp_path / "audit", local_db, flush_s=3600)
    dead.submit([record(i) for i in range(7)])
    os.close(dead._lock_fd)  # fault injected: the process "died" (the kernel released its lock)
    alive.start()
    assert alive.flush()
    alive.close()
    assert stored_ids(local_db) == ids(7)
    assert set(AuditStore(local_db).origins().values()) == {(alive.node, "slot-1")}  # made by the dead slot
    assert journals(tmp_path / "audit") == []


_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    from tests.unit.audit_records import record
    from riskserve.audit import AuditWriter
    from riskserve.state.db import open_database
    writer = AuditWriter({directory!r}, open_database({dsn!r}), flush_s=3600, write_ahead={write_ahead})
    writer.start()
    for i in range(0, 300, 3):
        writer.submit([record(j) for j in range(i, i + 3)])
    print("answered", flush=True)  # every record above was "answered" before this line
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def answer_then_die(directory: Path, dsn: str, *, write_ahead: bool) -> None:
    """A child process submits 300 records as 100 answered decisions, then is killed with SIGKILL."""
    code = _CHILD.format(repo=str(REPO), directory=str(directory), dsn=dsn, write_ahead=write_ahead)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert child.stdout.strip() == "answered"


def test_kill_9_after_answering_loses_no_journaled_record(
    db: Database, state_dsn: str, tmp_path: Path
) -> None:
    """Real process death: every answered record is on the node's journal, replayed into the database by the
    next writer of the slot."""
    answer_then_die(tmp_path / "audit", state_dsn, write_ahead=True)
    assert AuditStore(db).count() == 0  # the child shipped nothing: the journal alone kept them
    restarted = AuditWriter(tmp_path / "audit", db)
    assert (restarted.slot, restarted.counts().unshipped) == ("slot-0", 300)
    restarted.start()
    assert restarted.flush()
    counts = restarted.counts()
    restarted.close()
    assert stored_ids(db) == ids(300)
    assert (counts.replayed, counts.dropped, counts.unshipped) == (300, 0, 0)


def test_kill_9_without_write_ahead_loses_what_was_in_memory_uncounted(tmp_path: Path) -> None:
    """The case write-ahead exists for: the records only in memory die with the process, and nothing can
    count them."""
    db = open_database(f"sqlite:///{tmp_path / 'state.sqlite'}")
    answer_then_die(tmp_path / "audit", db.dsn, write_ahead=False)
    restarted = AuditWriter(tmp_path / "audit", db).start()
    assert restarted.flush()
    counts = restarted.counts()
    restarted.close()
    db.close()
    assert stored_ids(db) == set()
    assert counts.replayed == counts.dropped == 0


def test_a_torn_journal_line_is_skipped_and_counted_as_dropped(
    unreachable: UnreachableSqlite, tmp_path: Path
) -> None:
    unreachable.down = False
    writer = AuditWriter(tmp_path / "audit", unreachable)
    writer.submit([record(1), record(2)])
    os.close(writer._lock_fd)
    (segment,) = journals(tmp_path / "audit")
    with segment.open("ab") as handle:
        handle.write(b'{"decision_id": "d0000')  # a write cut short
    restarted = AuditWriter(tmp_path / "audit", unreachable)
    assert restarted.counts().unshipped == 2  # whole lines only
    restarted.start()
    assert restarted.flush()
    counts = restarted.counts()
    restarted.close()
    assert (counts.replayed, counts.dropped, counts.unshipped) == (2, 1, 0)


def test_a_layout_named_by_a_journal_reaches_the_store_after_a_crash(
    local_db: Database, tmp_path: Path
) -> None:
    """The layout's names are on the node's disk before a record names it, so a replayed journal never
    names a layout the database lacks."""
    writer = AuditWriter(tmp_path / "audit", local_db)
    digest = writer.layout(["a", "b"])
    writer.submit([with_row(record(1), np.array([1.0, 2.0]), digest)])
    assert DecisionLookup(local_db, tmp_path / "audit").rows(["d000001"])["d000001"].columns == ("a", "b")
    os.close(writer._lock_fd)  # fault injected: died before it shipped anything
    restarted = AuditWriter(tmp_path / "audit", local_db).start()
    assert restarted.flush()
    restarted.close()
    assert AuditStore(local_db).layout_columns(digest) == ("a", "b")
    assert DecisionLookup(local_db).rows(["d000001"])["d000001"].columns == (
        "a",
        "b",
    )  # another node reads it


# -- retention ------------------------------------------------------------------------------------------


def test_retention_purges_old_records_in_small_transactions(db: Database, tmp_path: Path) -> None:
    now = 1_800_000_000.0
    writer = AuditWriter(tmp_path / "audit", db, retention_s=86400.0, purge_rows=500, clock=lambda: now)
    old = [record(i, decided_at=now - 3 * 86400) for i in range(1200)]
    young = [record(i, decided_at=now - 3600) for i in range(2000, 2010)]
    writer.store.insert(old + young)
    assert writer.purge_expired() == (1200, 3)  # 500 + 500 + 200, one transaction each
    assert writer.purge_expired() == (0, 1)
    assert stored_ids(db) == {r["decision_id"] for r in young}
    writer.close()


# -- reading: trail, labels, export ---------------------------------------------------------------------


def _feedback_table(db: Database) -> None:
    """The feedback log's table as it keeps it (the columns the trail reads labels from)."""
    with db.transaction() as tx:
        tx.execute(
            f"CREATE TABLE feedback (seq {TOKENS[db.backend]['id']}, feedback_id TEXT NOT NULL UNIQUE, "
            "request_id TEXT NOT NULL, label BIGINT NOT NULL, source TEXT NOT NULL, "
            "received_at DOUBLE PRECISION NOT NULL)"
        )
        tx.executemany(
            "INSERT INTO feedback (feedback_id, request_id, label, source, received_at)"
            " VALUES (?, ?, ?, ?, ?)",
            [("fb-3", "d000003", 1, "chargebacks", 1.8e9), ("fb-4", "d000004", 0, "review", 1.8e9),
             ("fb-3b", "d000003", 0, "late", 1.9e9)],
        )  # fmt: skip


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_export_writes_what_the_records_say_with_labels_joined(
    db: Database, tmp_path: Path, fmt: str
) -> None:
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    records = [record(i) for i in range(20)]
    AuditStore(db).insert(records)
    trail = AuditTrail(db, tmp_path / "no-journal-here")
    assert trail.labels(["d000003"]) == {}  # the feedback log has not made its table yet
    _feedback_table(db)  # the feedback log, in the same database, labels decisions by their ids
    found = trail.records(records[5]["decided_at"], records[15]["decided_at"])
    assert [r["decision_id"] for r in trail.records(0, ALL)] == [r["decision_id"] for r in records]
    chosen = trail.records(0, ALL)
    out = tmp_path / f"decisions.{fmt}"
    write_table(to_table(chosen, trail.labels(r["decision_id"] for r in chosen)), out, fmt)  # type: ignore[arg-type]
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    nulls = pacsv.ConvertOptions(strings_can_be_null=True)  # CSV has no null: an empty cell is one
    table = pq.read_table(out) if fmt == "parquet" else pacsv.read_csv(out, convert_options=nulls)
    rows = table.to_pylist()
    assert len(rows) == 20
    assert len(found) == 10
    for row, rec in zip(rows, records, strict=True):
        assert row["decision_id"] == rec["decision_id"]
        assert row["decided_at"].timestamp() == pytest.approx(rec["decided_at"], abs=1e-6)
        assert row["outcome"] == rec["outcome"]
        assert row["risk_score"] == pytest.approx(rec["risk_score"], abs=1e-12)
        assert row["input.amount"] == rec["inputs"]["numeric"]["amount"]
        assert row["input.channel"] == rec["inputs"]["categorical"]["channel"]
        assert row["input.text"] == rec["inputs"]["text"]
        for model in rec["models"]:
            assert row[f"model.{model['model']}.version"] == model["version"]
            assert row[f"model.{model['model']}.score"] == pytest.approx(model["score"], abs=1e-12)
            assert row[f"model.{model['model']}.fallback"] == model["fallback"]
        assert json.loads(row["rules"]) == rec["rules"]
        assert json.loads(row["top_reasons"]) == rec["top_reasons"]
    labels = {row["decision_id"]: (row["label"], row["label_source"]) for row in rows}
    assert labels["d000003"] == (1, "chargebacks")  # the first label it was given
    assert labels["d000004"] == (0, "review")
    assert labels["d000005"] == (None, None)


def test_an_ingress_replica_ships_to_the_pipelines_state_and_audit_show_reads_it(
    state_dsn: str, db: Database, tmp_path: Path
) -> None:
    from riskserve.operations.audit_cli import find_trail, show_audit
    from riskserve.schema.pipeline import load_pipeline
    from riskserve.serving.auditing import audit_writer

    data = yaml.safe_load((REPO / "deploy" / "pipelines" / "card_fraud.yaml").read_text())
    data["audit"]["path"] = str(tmp_path / "journal")
    data["state"] = {"dsn": state_dsn}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    spec = load_pipeline(tmp_path / "p.yaml")
    shipping = open_database(spec.state_dsn())
    writer = audit_writer(spec, shipping)
    assert writer is not None
    assert writer.journal_dir == tmp_path / "journal"
    writer.submit([record(1)])
    assert writer.flush()
    writer.close()
    shipping.close()
    trail = find_trail(str(tmp_path / "p.yaml"))
    assert trail.journal_dir == tmp_path / "journal"
    assert show_audit(trail, "d000001")["outcome"] == record(1)["outcome"]
    trail.db.close()
    trail = find_trail(dsn=state_dsn)
    assert trail.get("d000001") == record(1)
    trail.db.close()
    columns = spec.features.column_names()  # a pipeline that learns: its layout is in the database
    assert AuditStore(db).layout_columns(layout_digest(columns)) == tuple(columns)


def test_a_record_names_the_fired_rules_and_keeps_what_the_decision_answered() -> None:
    from riskserve.features.encoder import RawRequest
    from riskserve.schema.pipeline import load_pipeline
    from riskserve.schema.rules import Decision, ModelResult
    from riskserve.serving.auditing import audit_records
    from riskserve.serving.reasons import Reason

    spec = load_pipeline(REPO / "deploy" / "pipelines" / "card_fraud.yaml")
    reasons = [f"{rule.name}: {rule.reason}" for rule in spec.decision.rules]
    decided = [
        (Decision("DECLINE", 0.93, [*reasons, "fraud: model unavailable (TIMEOUT), decided without it"]),
         {name: ModelResult(name, f"v-{name}", 0.5, fallback=name == "fraud",
                            fallback_reason="TIMEOUT" if name == "fraud" else "") for name in spec.models}),
        (Decision("REVIEW", 1.0, [f"{spec.decision.rules[0].name}: could not be evaluated (no such key)"]),
         {name: ModelResult(name, f"v-{name}", 0.1) for name in spec.models}),
        (Decision("APPROVE", 0.01, [spec.decision.default_reason]),
         {name: ModelResult(name, f"v-{name}", 0.0) for name in spec.models}),
    ]  # fmt: skip
    raw = [RawRequest({"amount": 5.0}, {"channel": "pos"}, "hi")] * 3
    records = audit_records(
        spec, raw=raw, request_ids=["a", "b", "c"], decision_ids=["d1", "d2", "d3"], decided=decided,
        reasons={0: [Reason("amount", "amount", 1.5, "credit", "5.0")]}, trace_id="t" * 32,
    )  # fmt: skip
    assert [r["rules"] for r in records] == [[rule.name for rule in spec.decision.rules],
                                             [spec.decision.rules[0].name], []]  # fmt: skip
    first = records[0]
    assert (first["decision_id"], first["request_id"], first["outcome"]) == ("d1", "a", "DECLINE")
    assert first["rule_reasons"] == decided[0][0].reasons
    assert [(m["model"], m["version"], m["fallback"]) for m in first["models"]] == [
        (name, f"v-{name}", name == "fraud") for name in spec.models
    ]
    assert first["top_reasons"] == [
        {"field": "amount", "text": "amount", "contribution": 1.5, "model": "credit", "value": "5.0"}
    ]
    assert first["inputs"] == {"numeric": {"amount": 5.0}, "categorical": {"channel": "pos"}, "text": "hi"}
    assert records[1]["top_reasons"] == []
    assert "features" not in first  # no rows given: a pipeline without feedback keeps none


def test_a_record_keeps_the_encoded_row_exactly_with_its_layout(local_db: Database, tmp_path: Path) -> None:
    from riskserve.features.encoder import RawRequest
    from riskserve.schema.pipeline import load_pipeline
    from riskserve.schema.rules import Decision, ModelResult
    from riskserve.serving.auditing import audit_records

    spec = load_pipeline(REPO / "deploy" / "pipelines" / "card_fraud.yaml")
    columns = spec.features.column_names()
    matrix = np.random.default_rng(3).normal(size=(2, len(columns))).astype(np.float32)
    results = {name: ModelResult(name, f"v-{name}", 0.1) for name in spec.models}
    writer = AuditWriter(tmp_path / "audit", local_db)
    records = audit_records(
        spec, raw=[RawRequest({}, {}, "")] * 2, request_ids=["a", "b"], decision_ids=["d1", "d2"],
        decided=[(Decision("APPROVE", 0.1, ["low"]), results)] * 2, reasons={}, trace_id="t" * 32,
        rows=matrix, layout=writer.layout(columns),
    )  # fmt: skip
    writer.submit(records)
    writer.close()  # not started: ships in this thread
    rows = DecisionLookup(local_db).rows(["d2", "d1"])
    assert rows["d1"].columns == tuple(columns)  # the names, from the database's layouts table
    # the float32 bytes themselves: what the learner trains on is exactly what the models saw
    np.testing.assert_array_equal(np.frombuffer(rows["d1"].data, "<f4"), matrix[0])
    np.testing.assert_array_equal(np.frombuffer(rows["d2"].data, "<f4"), matrix[1])
