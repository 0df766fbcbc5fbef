"""A ``Feedback`` call ends within its own deadline with a status that says what happened, and a label the
caller stopped waiting for is still kept once: its commit is not cancelled, and a resend is a duplicate.

The feedback service here is a stand-in with injected faults (slow, unreachable, refusing); the real
service's exactly-once rule per ``feedback_id`` is tested in ``test_feedback_log.py``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from riskserve.platform.errors import DeadlineExceeded, ModelUnavailable, NotFound
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.serving.labels import ANSWER_MARGIN_S, FLUSH_SHARE, FLUSH_TIMEOUT_S, record_label

LABEL = pb.FeedbackRequest(decision_id="d1", label=1, feedback_id="fb1", source="s")


class FaultyLog:
    """The feedback service's ``record_feedback`` behind a handle, with a fault injected: it answers after
    ``delay_s``, or raises ``error``. Keeps each ``feedback_id`` once (a resend is a duplicate)."""

    def __init__(self, delay_s: float = 0.0, error: Exception | None = None) -> None:
        self.delay_s, self.error = delay_s, error
        self.kept: dict[str, int] = {}
        self.calls = 0
        self.record_feedback = self

    def remote(self, request_id: str, label: int, feedback_id: str, source: str, **_: Any) -> Any:
        self.calls += 1
        return self._record(label, feedback_id)

    async def _record(self, label: int, feedback_id: str) -> dict[str, Any]:
        await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        duplicate = feedback_id in self.kept
        self.kept.setdefault(feedback_id, label)
        return {"accepted": True, "duplicate": duplicate, "model_version": "v1", "seq": len(self.kept)}


class Flush:
    """An audit writer whose records leave memory at once; remembers how long it was let wait."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def flush_submitted(self, timeout_s: float) -> bool:
        self.timeouts.append(timeout_s)
        return True


def test_a_label_the_log_answers_too_late_is_deadline_exceeded_and_still_kept_once() -> None:
    async def scenario() -> tuple[str, dict[str, int], bool]:
        log = FaultyLog(delay_s=0.6)
        with pytest.raises(DeadlineExceeded, match="same feedback_id") as late:
            await record_label(log, Flush(), LABEL, "s", time.monotonic() + 0.3)
        kept_when_refused = dict(log.kept)
        await asyncio.sleep(0.6)  # the commit the caller gave up on runs to its end
        log.delay_s = 0.0
        again = await record_label(log, Flush(), LABEL, "s", time.monotonic() + 5)
        assert kept_when_refused == {}, "the answer waited for the slow commit"
        return str(late.value), log.kept, again["duplicate"]

    message, kept, duplicate = asyncio.run(scenario())
    assert "did not answer before the call's deadline" in message
    assert kept == {"fb1": 1}
    assert duplicate is True


def test_a_label_with_no_time_left_is_not_sent() -> None:
    log = FaultyLog()
    with pytest.raises(DeadlineExceeded, match="nothing was recorded"):
        asyncio.run(record_label(log, Flush(), LABEL, "s", time.monotonic() + ANSWER_MARGIN_S / 2))
    assert log.calls == 0


def test_the_audit_flush_gets_at_most_its_share_of_the_time_left() -> None:
    flush = Flush()
    asyncio.run(record_label(FaultyLog(), flush, LABEL, "s", time.monotonic() + 2.0))
    asyncio.run(record_label(FaultyLog(), flush, LABEL, "s", time.monotonic() + 60.0))
    short, long = flush.timeouts
    assert (2.0 - ANSWER_MARGIN_S) * FLUSH_SHARE * 0.9 < short <= (2.0 - ANSWER_MARGIN_S) * FLUSH_SHARE
    assert long == FLUSH_TIMEOUT_S


def test_an_unreachable_log_is_unavailable_and_its_own_verdicts_pass_through() -> None:
    died = FaultyLog(error=RuntimeError("the actor died unexpectedly"))
    with pytest.raises(ModelUnavailable, match="feedback log is unreachable: the actor died"):
        asyncio.run(record_label(died, Flush(), LABEL, "s", time.monotonic() + 5))
    unknown = FaultyLog(error=NotFound("no decision 'd1'"))
    with pytest.raises(NotFound, match="no decision"):
        asyncio.run(record_label(unknown, Flush(), LABEL, "s", time.monotonic() + 5))
