"""The crash journal of an ingress replica's unsent decisions: a real process killed with SIGKILL while it
holds decisions loses none of them (another recorder adopts and sends them, bit-equal), a live owner's
journal is never taken, and a segment is deleted once the log committed what it holds."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from riskserve.learning.feedback_log import DecisionRecord
from riskserve.learning.journal import DecisionJournal, journal_dir
from riskserve.learning.recorder import DecisionRecorder

COLUMNS = ("amount", "hour", "channel=pos")


def _record(i: int) -> DecisionRecord:
    features = np.array([[i * 1.1, 0.1 + i, 1 / 3]], dtype=np.float32)
    return DecisionRecord(f"d{i}", "card", '{"fraud": "v1"}', features, COLUMNS, request_id=f"tx-{i}")


def _same(a: DecisionRecord, b: DecisionRecord) -> bool:
    return (a.decision_id, a.pipeline, a.model_version, a.columns, a.request_id) == (
        b.decision_id, b.pipeline, b.model_version, b.columns, b.request_id,
    ) and np.array_equal(a.features, b.features) and a.features.dtype == b.features.dtype  # fmt: skip


def test_decisions_buffered_by_a_replica_killed_with_sigkill_are_adopted_and_sent(tmp_path: Path) -> None:
    directory = journal_dir(tmp_path / "log.sqlite")
    # A recorder whose log never answers (its sends hang), in a process of its own that is then killed.
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from riskserve.learning.journal import DecisionJournal
        from riskserve.learning.recorder import DecisionRecorder
        from tests.unit.test_decision_journal import _record

        async def main():
            async def send(records):
                await asyncio.sleep(3600)
            recorder = DecisionRecorder(send, flush_s=0.01, max_rows=100,
                                        journal=DecisionJournal({str(directory)!r}))
            for i in range(5):
                recorder.add([_record(i), _record(100 + i)])
                await asyncio.sleep(0.02)
            print("buffered", flush=True)
            await asyncio.sleep(3600)

        asyncio.run(main())
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "buffered"
    live = DecisionJournal(directory)
    assert live.adopt() == [], "a live replica's journal is never adopted"
    os.kill(process.pid, signal.SIGKILL)  # fault injected: the replica dies holding 10 unsent decisions
    process.wait()
    live.close()

    sent: list[DecisionRecord] = []

    async def send(records: list[DecisionRecord]) -> None:
        sent.extend(records)

    async def adopt_and_flush() -> DecisionRecorder:
        recorder = DecisionRecorder(send, flush_s=0.01, max_rows=100, journal=DecisionJournal(directory))
        assert recorder.adopt() == 10
        assert DecisionRecorder(send, flush_s=1, max_rows=1, journal=DecisionJournal(directory)).adopt() == 0
        await recorder.flush()
        return recorder

    recorder = asyncio.run(adopt_and_flush())
    expected = {
        r.decision_id: r for r in [*(_record(i) for i in range(5)), *(_record(100 + i) for i in range(5))]
    }
    assert sorted(r.decision_id for r in sent) == sorted(expected)
    assert all(_same(r, expected[r.decision_id]) for r in sent)
    assert recorder.recovered == 10
    assert [p for p in directory.iterdir() if p.stat().st_size > 0] == [], "sent segments are deleted"
    assert directory.stat().st_mode & 0o777 == 0o700


def test_a_segment_is_deleted_only_after_the_log_committed_it(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    failing = [True]
    sent: list[str] = []

    async def send(records: list[DecisionRecord]) -> None:
        if failing[0]:
            raise ConnectionError("feedback service restarting")
        sent.extend(r.decision_id for r in records)

    def journaled() -> list[str]:
        lines = [line for p in directory.iterdir() for line in p.read_text().splitlines()]
        return sorted(line.split('"decision_id":"', 1)[1].split('"', 1)[0] for line in lines)

    async def scenario() -> None:
        recorder = DecisionRecorder(send, flush_s=10, max_rows=100, journal=DecisionJournal(directory))
        recorder.add([_record(1), _record(2)])
        with contextlib.suppress(ConnectionError):
            await recorder.flush()
        assert journaled() == ["d1", "d2"], "an unsent decision stays journaled"
        recorder.add([_record(3)])
        failing[0] = False
        await recorder.flush()
        assert journaled() == []
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in directory.iterdir())

    asyncio.run(scenario())
    assert sent == ["d1", "d2", "d3"]


def test_a_journal_write_that_fails_costs_no_decision_and_is_counted(tmp_path: Path) -> None:
    journal = DecisionJournal(tmp_path / "journal")
    journal.close()  # fault injected: every write now fails (as on a full disk)
    sent: list[str] = []

    async def send(records: list[DecisionRecord]) -> None:
        sent.extend(r.decision_id for r in records)

    async def scenario() -> None:
        recorder = DecisionRecorder(send, flush_s=10, max_rows=100, journal=journal)
        recorder.add([_record(1), _record(2)])  # does not raise
        await recorder.flush()

    asyncio.run(scenario())
    assert sent == ["d1", "d2"]
    assert journal.unjournaled == 2
