"""The audit trail's store, writer, journal, retention and export, on real SQLite files and processes.

Faults (a store that refuses writes) are injected by name; everything else is the real code: real files,
real ``flock`` slots, a real child process killed with SIGKILL.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import threading
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from riskserve.audit import AuditStore, AuditTrail, AuditWriter
from riskserve.audit.export import to_table, write_table
from riskserve.audit.lookup import DecisionLookup
from riskserve.audit.store import encode_row
from riskserve.learning.feedback_log import FeedbackLog
from riskserve.platform.metrics import AUDIT_RECORDS, AuditMetrics, recorded
from riskserve.state.db import open_database

from .audit_records import record

REPO = Path(__file__).resolve().parents[2]


class FailingStore(AuditStore):
    """Fault injected: refuses every insert while ``failing`` is set (a full or locked disk)."""

    failing = True

    def insert(self, records: Any, lines: Any = None) -> int:
        if FailingStore.failing:
            raise OSError("injected fault: the store refuses writes")
        return super().insert(records, lines)


@pytest.fixture(autouse=True)
def _heal() -> Any:
    FailingStore.failing = True
    yield
    FailingStore.failing = True


def ids_in(directory: Path) -> set[str]:
    trail = AuditTrail(directory)
    return {r["decision_id"] for r in trail.records(0, 1e12)}


def stored_ids(directory: Path) -> set[str]:
    out: set[str] = set()
    for path in directory.glob("slot-*.sqlite"):
        with AuditStore(path) as store:
            out |= {r["decision_id"] for r in store.between(0, 1e12)}
    return out


# -- the store ------------------------------------------------------------------------------------------


def test_the_store_keeps_whole_records_once_in_a_private_wal_file(tmp_path: Path) -> None:
    with AuditStore(tmp_path / "a.sqlite") as store:
        assert store.insert([record(i) for i in range(5)]) == 5
        changed = record(1)
        changed["outcome"] = "DECLINE"
        assert store.insert([changed, record(9)]) == 1  # a kept id is never rewritten
        assert store.get("d000001") == record(1)
        assert store.get("nope") is None
        window = store.between(record(1)["decided_at"], record(4)["decided_at"])
        assert [r["decision_id"] for r in window] == ["d000001", "d000002", "d000003"]
        assert str(store.pragma("journal_mode")).lower() == "wal"
        assert store.pragma("synchronous") == 1  # NORMAL: survives a kill; the journal covers the rest
    assert stat.S_IMODE((tmp_path / "a.sqlite").stat().st_mode) == 0o600


def test_between_pages_through_many_records_in_order(tmp_path: Path) -> None:
    with AuditStore(tmp_path / "a.sqlite") as store:
        store.insert([record(i, decided_at=1000.0) for i in range(2500)])
        got = [r["decision_id"] for r in store.between(0, 1e12)]
    assert got == [f"d{i:06d}" for i in range(2500)]


# -- the writer -----------------------------------------------------------------------------------------


def test_every_submitted_record_reaches_the_store_and_the_journal_is_deleted(tmp_path: Path) -> None:
    writer = AuditWriter(tmp_path / "audit", flush_s=0.01, batch_rows=64).start()
    for start in range(0, 1000, 10):
        writer.submit([record(i) for i in range(start, start + 10)])
    assert writer.flush()
    counts = writer.counts()
    writer.close()
    assert (counts.submitted, counts.written, counts.dropped, counts.spilled) == (1000, 1000, 0, 0)
    assert stored_ids(tmp_path / "audit") == {f"d{i:06d}" for i in range(1000)}
    assert list((tmp_path / "audit").glob("slot-0.journal/*.jsonl")) == []  # closed cleanly: no replay
    assert stat.S_IMODE((tmp_path / "audit").stat().st_mode) == 0o700


def test_flush_submitted_waits_for_what_was_submitted_before_it_not_for_later_records(tmp_path: Path) -> None:
    writer = AuditWriter(tmp_path / "audit", flush_s=3600, batch_rows=4).start()  # commits only when woken
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


def test_every_file_of_the_trail_is_private(tmp_path: Path) -> None:
    """They hold the requests' input fields: the directory 0700, each file 0600 (SQLite's WAL and shared
    memory files included), whatever the umask."""
    old = os.umask(0o022)
    try:
        writer = AuditWriter(tmp_path / "audit")
        writer.submit([record(i) for i in range(3)])
        writer.cycle()  # committed: the WAL and shared memory files exist now
        found = {p.relative_to(tmp_path / "audit").as_posix(): stat.S_IMODE(p.stat().st_mode)
                 for p in (tmp_path / "audit").rglob("*")}  # fmt: skip
        writer.close()
    finally:
        os.umask(old)
    assert {
        "slot-0.sqlite",
        "slot-0.sqlite-wal",
        "slot-0.sqlite-shm",
        "slot-0.lock",
        "slot-0.journal",
    } <= set(found)
    for name, mode in found.items():
        assert mode == (0o700 if name == "slot-0.journal" else 0o600), (name, oct(mode))


def test_a_record_written_ahead_is_readable_before_it_is_committed(tmp_path: Path) -> None:
    writer = AuditWriter(tmp_path / "audit")  # not started: nothing is committed
    writer.submit([record(1)])
    assert AuditTrail(tmp_path / "audit").get("d000001") == record(1)
    journal = next((tmp_path / "audit").glob("slot-0.journal/*.jsonl"))
    assert stat.S_IMODE(journal.stat().st_mode) == 0o600
    writer.close()


def test_with_the_store_failing_records_spill_past_the_buffer_and_are_replayed(tmp_path: Path) -> None:
    metrics: dict[str, int] = {}
    writer = AuditWriter(
        tmp_path / "audit", buffer_rows=10, batch_rows=8, store_factory=FailingStore,
        on_count=lambda outcome, n: metrics.__setitem__(outcome, metrics.get(outcome, 0) + n),
    )  # fmt: skip
    writer.submit([record(i) for i in range(50)])
    assert not writer.cycle()  # the store refuses: nothing is lost, nothing is committed
    counts = writer.counts()
    assert (counts.buffered, counts.spilled, counts.dropped, counts.errors) == (10, 40, 0, 1)
    FailingStore.failing = False
    assert writer.flush()
    counts = writer.counts()
    writer.close()
    assert (counts.written, counts.replayed, counts.dropped) == (10, 40, 0)
    assert metrics == {"written": 10, "replayed": 40, "spilled": 40}
    assert stored_ids(tmp_path / "audit") == {f"d{i:06d}" for i in range(50)}


def test_without_write_ahead_the_overflow_is_appended_to_the_journal_then_replayed(tmp_path: Path) -> None:
    writer = AuditWriter(tmp_path / "audit", buffer_rows=10, write_ahead=False, store_factory=FailingStore)
    writer.submit([record(i) for i in range(8)])
    assert list((tmp_path / "audit").glob("slot-0.journal/*.jsonl")) == []  # in memory only
    writer.submit([record(i) for i in range(8, 30)])
    assert writer.counts().spilled == 20
    FailingStore.failing = False
    assert writer.flush()
    writer.close()
    assert stored_ids(tmp_path / "audit") == {f"d{i:06d}" for i in range(30)}


def test_past_the_spill_bound_records_are_dropped_counted_in_metrics_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spill = sum(len(json.dumps(record(i), separators=(",", ":"))) + 1 for i in range(10, 15))
    metrics = AuditMetrics("drops_test")
    before = recorded(AUDIT_RECORDS, pipeline="drops_test", outcome="dropped")
    writer = AuditWriter(
        tmp_path / "audit", buffer_rows=10, write_ahead=False, spill_bytes=spill + 20,
        store_factory=FailingStore, on_count=metrics.records,
    )  # fmt: skip
    for i in range(40):  # one at a time, like single Decide calls
        writer.submit([record(i)])
    counts = writer.counts()
    assert (counts.buffered, counts.spilled, counts.dropped) == (10, 5, 25)
    with caplog.at_level(logging.ERROR, logger="riskserve.audit.writer"):
        writer.cycle()
    assert "25 decision records DROPPED" in caplog.text
    assert recorded(AUDIT_RECORDS, pipeline="drops_test", outcome="dropped") - before == 25
    FailingStore.failing = False
    assert writer.flush()
    writer.close()
    assert stored_ids(tmp_path / "audit") == {f"d{i:06d}" for i in range(15)}  # 40 - 25, counted


def test_two_writers_take_two_slots_and_the_trail_reads_both(tmp_path: Path) -> None:
    first = AuditWriter(tmp_path / "audit")
    second = AuditWriter(tmp_path / "audit")
    assert (first.slot, second.slot) == ("slot-0", "slot-1")
    first.submit([record(i) for i in range(5)])
    second.submit([record(i) for i in range(5, 10)])
    first.close()
    second.close()
    assert stored_ids(tmp_path / "audit") == {f"d{i:06d}" for i in range(10)}
    assert AuditWriter(tmp_path / "audit").slot == "slot-0"  # freed slots are taken again


def test_a_dead_slots_journal_is_replayed_by_a_live_writer(tmp_path: Path) -> None:
    alive = AuditWriter(tmp_path / "audit")
    dead = AuditWriter(tmp_path / "audit", flush_s=3600)
    dead.submit([record(i) for i in range(7)])
    os.close(dead._lock_fd)  # fault injected: the process "died" (the kernel released its lock)
    alive.start()
    assert alive.flush()
    alive.close()
    assert stored_ids(tmp_path / "audit") == {f"d{i:06d}" for i in range(7)}
    assert list((tmp_path / "audit").glob("slot-1.journal/*.jsonl")) == []


_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    from tests.unit.audit_records import record
    from riskserve.audit import AuditWriter
    writer = AuditWriter({directory!r}, flush_s=3600, write_ahead={write_ahead}).start()
    for i in range(0, 300, 3):
        writer.submit([record(j) for j in range(i, i + 3)])
    print("answered", flush=True)  # every record above was "answered" before this line
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize("write_ahead", [True, False])
def test_kill_9_after_answering_loses_nothing_with_write_ahead(tmp_path: Path, write_ahead: bool) -> None:
    """Real process death: with write-ahead every answered record is replayed at the next start; without
    it the records still in memory are lost, uncounted (the case write-ahead exists for)."""
    directory = tmp_path / "audit"
    code = _CHILD.format(repo=str(REPO), directory=str(directory), write_ahead=write_ahead)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert child.stdout.strip() == "answered"
    restarted = AuditWriter(directory).start()
    assert restarted.slot == "slot-0"
    assert restarted.flush()
    counts = restarted.counts()
    restarted.close()
    if write_ahead:
        assert stored_ids(directory) == {f"d{i:06d}" for i in range(300)}
        assert counts.replayed == 300
    else:
        assert stored_ids(directory) == set()
        assert counts.replayed == counts.dropped == 0


def test_a_torn_journal_line_is_skipped_and_counted_as_dropped(tmp_path: Path) -> None:
    writer = AuditWriter(tmp_path / "audit")
    writer.submit([record(1), record(2)])
    os.close(writer._lock_fd)
    segment = next((tmp_path / "audit").glob("slot-0.journal/*.jsonl"))
    with segment.open("ab") as handle:
        handle.write(b'{"decision_id": "d0000')  # a write cut short
    restarted = AuditWriter(tmp_path / "audit").start()
    assert restarted.flush()
    counts = restarted.counts()
    restarted.close()
    assert (counts.replayed, counts.dropped) == (2, 1)


# -- retention ------------------------------------------------------------------------------------------


def test_retention_purges_old_records_in_small_transactions(tmp_path: Path) -> None:
    now = 1_800_000_000.0
    writer = AuditWriter(tmp_path / "audit", retention_s=86400.0, purge_rows=500, clock=lambda: now)
    old = [record(i, decided_at=now - 3 * 86400) for i in range(1200)]
    young = [record(i, decided_at=now - 3600) for i in range(2000, 2010)]
    writer.store.insert(old + young)
    assert writer.purge_expired() == (1200, 3)  # 500 + 500 + 200, one transaction each
    assert writer.purge_expired() == (0, 1)
    assert {r["decision_id"] for r in writer.store.between(0, 1e12)} == {r["decision_id"] for r in young}
    writer.close()


# -- export ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_export_writes_what_the_records_say_with_labels_joined(tmp_path: Path, fmt: str) -> None:
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    records = [record(i) for i in range(20)]
    (tmp_path / "audit").mkdir()
    with AuditStore(tmp_path / "audit" / "slot-0.sqlite") as store:
        store.insert(records)
    state_path = tmp_path / "state.sqlite"
    # The learner's log (in the pipeline's state database, an embedded SQLite file here): it takes labels
    # for the trail's decisions; the export joins them back by id.
    state = open_database(f"sqlite:///{state_path}")
    with FeedbackLog(state, lookup=DecisionLookup(tmp_path / "audit"), retention_s=1e10) as log:
        log.record_feedback("", 1, "fb-3", "chargebacks", decision_id="d000003")
        log.record_feedback("", 0, "fb-4", "review", decision_id="d000004")
    state.close()
    trail = AuditTrail(tmp_path / "audit", feedback_log=state_path)
    found = trail.records(records[5]["decided_at"], records[15]["decided_at"])
    assert [r["decision_id"] for r in trail.records(0, 1e12)] == [r["decision_id"] for r in records]
    chosen = trail.records(0, 1e12)
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
    assert labels["d000003"] == (1, "chargebacks")
    assert labels["d000004"] == (0, "review")
    assert labels["d000005"] == (None, None)


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


def test_a_record_keeps_the_encoded_row_exactly_with_its_layout(tmp_path: Path) -> None:
    from riskserve.features.encoder import RawRequest
    from riskserve.schema.pipeline import load_pipeline
    from riskserve.schema.rules import Decision, ModelResult
    from riskserve.serving.auditing import audit_records

    spec = load_pipeline(REPO / "deploy" / "pipelines" / "card_fraud.yaml")
    columns = spec.features.column_names()
    matrix = np.random.default_rng(3).normal(size=(2, len(columns))).astype(np.float32)
    results = {name: ModelResult(name, f"v-{name}", 0.1) for name in spec.models}
    writer = AuditWriter(tmp_path / "audit")
    records = audit_records(
        spec, raw=[RawRequest({}, {}, "")] * 2, request_ids=["a", "b"], decision_ids=["d1", "d2"],
        decided=[(Decision("APPROVE", 0.1, ["low"]), results)] * 2, reasons={}, trace_id="t" * 32,
        rows=matrix, layout=writer.layout(columns),
    )  # fmt: skip
    writer.submit(records)
    writer.close()  # not started: commits in this thread
    rows = DecisionLookup(tmp_path / "audit").rows(["d2", "d1"])
    assert rows["d1"].columns == tuple(columns)  # the names, from the slot's layouts table
    # the float32 bytes themselves: what the learner trains on is exactly what the models saw
    np.testing.assert_array_equal(np.frombuffer(rows["d1"].data, "<f4"), matrix[0])
    np.testing.assert_array_equal(np.frombuffer(rows["d2"].data, "<f4"), matrix[1])


def test_a_schema_1_slot_is_upgraded_by_its_writer_and_then_found_by_the_lookup(tmp_path: Path) -> None:
    directory = tmp_path / "audit"
    directory.mkdir()
    old = record(1)
    with closing(sqlite3.connect(directory / "slot-0.sqlite")) as db:  # a slot written before rows were kept
        db.executescript(
            "CREATE TABLE schema_version (version INTEGER NOT NULL); INSERT INTO schema_version VALUES (1);"
            "CREATE TABLE decisions (decision_id TEXT PRIMARY KEY, decided_at REAL NOT NULL, pipeline TEXT"
            " NOT NULL, pipeline_version TEXT NOT NULL, outcome TEXT NOT NULL, record TEXT NOT NULL);"
        )
        db.execute(
            "INSERT INTO decisions VALUES (?, ?, 'card_fraud', 'v', 'APPROVE', ?)",
            (old["decision_id"], old["decided_at"], json.dumps(old)),
        )
        db.commit()
    lookup = DecisionLookup(directory)
    assert lookup.find(old["decision_id"]) is None  # schema 1: its decisions are in the old feedback log
    with AuditStore(directory / "slot-0.sqlite") as store:  # a replica takes the slot: upgraded in place
        row = np.array([1.5, -2.0], "<f4")
        new = record(2) | {"features": encode_row(row.tobytes()), "layout": store.add_layout(["a", "b"])}
        store.insert([new])
    assert lookup.find(new["decision_id"]) is not None  # looked at again on a miss
    found = lookup.by_request(old["request_id"])  # the caller's id of an old record, now a column
    assert [(r.decision_id, r.decided_at) for r in found] == [(old["decision_id"], old["decided_at"])]
    rows = lookup.rows([old["decision_id"], new["decision_id"]])
    assert list(rows) == [new["decision_id"]]  # an old record kept no row
    assert (rows[new["decision_id"]].columns, rows[new["decision_id"]].data) == (("a", "b"), row.tobytes())
    lookup.close()
