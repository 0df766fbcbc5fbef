"""The ingress's decision buffer (``learning/recorder.py``): bounded, and no decision silently lost.

A decision is either sent to the feedback log or counted as dropped (``dropped`` and ``on_drop``); once
the buffer (sends in progress included) is full, NEW decisions are refused and counted, and a decision
once accepted is never dropped: not by an overflow during a send, not after a send fails. The send is a
real coroutine the test holds open, standing in for the feedback service's ``record_decisions`` (fault
injected: a service that is slow, then unreachable).
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np

from riskserve.learning.feedback_log import DecisionRecord
from riskserve.learning.recorder import DecisionRecorder


def _records(start: int, count: int) -> list[DecisionRecord]:
    row = np.zeros(2, dtype=np.float32)
    return [
        DecisionRecord(f"d-{i}", "p", "{}", row, ("a", "b"), f"r-{i}") for i in range(start, start + count)
    ]


def test_an_overflow_during_a_send_drops_only_buffered_records_and_counts_each() -> None:
    async def scenario() -> tuple[list[str], list[int], DecisionRecorder]:
        sent: list[str] = []
        drops: list[int] = []
        release = asyncio.Event()
        sending = asyncio.Event()

        async def send(batch: list[DecisionRecord]) -> None:
            sending.set()
            await release.wait()  # the feedback service is slow: the buffer fills meanwhile
            sent.extend(r.decision_id for r in batch)

        recorder = DecisionRecorder(send, flush_s=3600, max_rows=6, on_drop=drops.append)
        recorder.add(_records(0, 4))
        flush = asyncio.create_task(recorder.flush())
        await sending.wait()
        recorder.add(_records(4, 5))  # 4 in flight + 5 > 6: room for 2, the 3 newest are refused
        release.set()
        await flush
        await recorder.flush()
        return sent, drops, recorder

    sent, drops, recorder = asyncio.run(scenario())
    assert sent == ["d-0", "d-1", "d-2", "d-3", "d-4", "d-5"]  # every accepted decision reached the log
    assert sum(drops) == recorder.dropped == 3  # d-6, d-7, d-8: refused and counted, not silent
    assert recorder.sent + recorder.dropped == 9  # every decision accounted for
    assert recorder.buffered == 0


def test_a_failed_send_keeps_its_records_in_front_for_the_next_flush() -> None:
    async def scenario() -> tuple[list[str], DecisionRecorder]:
        sent: list[str] = []
        calls = 0

        async def send(batch: list[DecisionRecord]) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise ConnectionError("feedback service restarting")  # fault injected
            sent.extend(r.decision_id for r in batch)

        recorder = DecisionRecorder(send, flush_s=3600, max_rows=4)
        recorder.add(_records(0, 3))
        with contextlib.suppress(ConnectionError):
            await recorder.flush()
        assert recorder.buffered == 3
        recorder.add(_records(3, 2))  # room for one: d-4 is refused, none of the accepted ones goes
        await recorder.flush()
        return sent, recorder

    sent, recorder = asyncio.run(scenario())
    assert sent == ["d-0", "d-1", "d-2", "d-3"]
    assert (recorder.sent, recorder.dropped) == (4, 1)


def test_a_label_that_stops_waiting_does_not_cancel_the_send_in_progress() -> None:
    """A label's flush timing out (its deadline) must not cancel the shared send: cancelling it threw the
    service's commit away and put the batch back, so each later flush re-sent a bigger batch while labels
    kept timing out (the fault drill's labels DEADLINE_EXCEEDED for as long as the load lasted)."""

    async def scenario() -> tuple[list[list[str]], int, int, bool]:
        sends: list[list[str]] = []
        cancelled = False
        release = asyncio.Event()

        async def send(batch: list[DecisionRecord]) -> None:
            nonlocal cancelled
            try:
                await release.wait()  # the feedback service is slow for a moment
            except asyncio.CancelledError:
                cancelled = True
                raise
            sends.append([r.decision_id for r in batch])

        recorder = DecisionRecorder(send, flush_s=3600, max_rows=100)
        recorder.add(_records(0, 5))
        with contextlib.suppress(TimeoutError):  # the label gives up (its deadline), as in Feedback
            await asyncio.wait_for(recorder.flush(), timeout=0.05)
        recorder.add(_records(5, 2))
        release.set()
        await recorder.flush()  # the next label's flush
        return sends, recorder.sent, recorder.buffered, cancelled

    sends, sent, buffered, cancelled = asyncio.run(scenario())
    assert not cancelled
    assert sends == [[f"d-{i}" for i in range(5)], ["d-5", "d-6"]]  # each decision sent once
    assert (sent, buffered) == (7, 0)
