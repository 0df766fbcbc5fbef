"""A label's way from an ingress replica to the feedback log, within the ``Feedback`` call's own deadline.

Two waits stand between a label and its answer: this replica's audit records leaving memory (so the label
finds a decision made a moment before), and the feedback service committing it. Both are bounded by the
deadline the front door computed for the call, less :data:`ANSWER_MARGIN_S`, so the caller gets a status
that says what happened (DEADLINE_EXCEEDED, UNAVAILABLE) before its own timer fires. A label the caller
stopped waiting for is not cancelled: the service commits it anyway, and a resend with the same
``feedback_id`` answers ``duplicate=true``, so an acknowledged label is never lost and none is applied twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from riskserve.platform.errors import DeadlineExceeded, ModelUnavailable, RiskServeError
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb

__all__ = ["ANSWER_MARGIN_S", "FLUSH_SHARE", "FLUSH_TIMEOUT_S", "AuditFlush", "record_label"]

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 5.0
"""Longest ``Feedback`` waits for this replica's audit records to leave memory."""
FLUSH_SHARE = 0.5
"""At most this share of the time left to the call goes to that wait; the rest is the feedback log's.
A label whose decision is still in memory is looked up anyway (the log reads the audit journals too)."""
ANSWER_MARGIN_S = 0.1
"""Kept back from the deadline to send the answer: a status sent at the deadline itself races the
caller's own timer, which would end the call with no word on what happened."""


class AuditFlush(Protocol):
    """What a label needs of the replica's audit writer."""

    def flush_submitted(self, timeout_s: float) -> bool: ...


def _seen(task: asyncio.Future[Any]) -> None:
    """Retrieve the outcome of a call nobody waits for any more (its error is the resend's business)."""
    if not task.cancelled():
        task.exception()


async def record_label(
    service: Any, audit: AuditFlush | None, request: pb.FeedbackRequest, source: str, deadline: float
) -> dict[str, Any]:
    """Flush this replica's audit records, then have ``service`` (the feedback deployment's handle) record the
    label; returns its acknowledgement (``accepted``, ``duplicate``, ``model_version``, ``seq``).

    Raises:
        DeadlineExceeded: the deadline (less :data:`ANSWER_MARGIN_S`) came first; the label was not sent,
            or it was and may still be kept (the message says which; resend it with the same id).
        ModelUnavailable: the feedback log is unreachable.
        RiskServeError: the service's own verdict (NOT_FOUND, ABORTED, ALREADY_EXISTS, ...), as it is.
    """
    answer_by = deadline - ANSWER_MARGIN_S
    if audit is not None:
        wait_s = min(FLUSH_TIMEOUT_S, max(answer_by - time.monotonic(), 0.0) * FLUSH_SHARE)
        if not await asyncio.to_thread(audit.flush_submitted, wait_s):
            logger.warning("the audit store took longer than %.2fs; the label is looked up anyway", wait_s)
    if time.monotonic() >= answer_by:
        raise DeadlineExceeded("the call's deadline passed before the label was sent; nothing was recorded")
    try:
        call = asyncio.ensure_future(
            service.record_feedback.remote(
                request.request_id, int(request.label), request.feedback_id, source,
                decision_id=request.decision_id,
            )
        )  # fmt: skip
    except Exception as error:
        raise ModelUnavailable(f"the feedback log is unreachable: {error}") from error
    call.add_done_callback(_seen)
    try:  # shielded: the call runs to its end (the label committed) even if this wait is given up
        ack: dict[str, Any] = await asyncio.wait_for(
            asyncio.shield(call), timeout=max(answer_by - time.monotonic(), 0.0)
        )
    except TimeoutError:
        raise DeadlineExceeded(
            "the feedback log did not answer before the call's deadline; the label may still be kept: "
            "send it again with the same feedback_id (a kept label answers duplicate=true)"
        ) from None
    except Exception as error:
        if isinstance(getattr(error, "cause", error), RiskServeError):
            raise  # the service's own verdict (NOT_FOUND, ABORTED, ...); status_of unwraps it
        raise ModelUnavailable(f"the feedback log is unreachable: {error}") from error
    return ack
