"""Admitting one label into the feedback log: rate limits, the one-label-per-decision rule, counted refusals.

Kept apart from the Serve deployment (:mod:`riskserve.operations.learning_service`) so the rules a
poisoner meets are tested as plain objects. The order matters: a retry of a recorded ``feedback_id`` is
answered without spending a token (a client retrying after a lost answer is never refused); everything
else spends a token of its source and of the shared bucket before the log is touched, so a refused relabel
costs the sender its rate too.
"""

from __future__ import annotations

from riskserve.learning.feedback_log import FeedbackAck, FeedbackLog
from riskserve.learning.rate_limit import RateLimited, SourceRateLimiter
from riskserve.platform.errors import AlreadyExists
from riskserve.platform.metrics import LearningMetrics

__all__ = ["LabelAdmission"]


class LabelAdmission:
    """Admits labels for one pipeline's log; thread-safe (the log and the limiter are)."""

    def __init__(self, log: FeedbackLog, limiter: SourceRateLimiter, metrics: LearningMetrics) -> None:
        self.log = log
        self.limiter = limiter
        self.metrics = metrics

    def admit(
        self, request_id: str, label: int, feedback_id: str, source: str, *, decision_id: str = ""
    ) -> FeedbackAck:
        """Rate-limit, then record durably; returns only once the label is committed.

        ``source`` is whom the label is charged to: the caller's identity when the front door authenticates
        callers, else the request's ``source`` field.

        Raises:
            RateLimited: the source or all sources are over their rate (RESOURCE_EXHAUSTED), counted.
            AlreadyExists: the decision has a label with the other value (ALREADY_EXISTS), counted.
            InvalidInput, NotFound, Conflict: see :meth:`FeedbackLog.record_feedback`.
        """
        if not (isinstance(feedback_id, str) and feedback_id and self.log.seen(feedback_id)):
            try:
                self.limiter.take(source)
            except RateLimited as error:
                self.metrics.refused("source_rate" if error.scope == "source" else "total_rate")
                raise
        try:
            return self.log.record_feedback(request_id, label, feedback_id, source, decision_id=decision_id)
        except AlreadyExists:
            self.metrics.refused("relabel")
            raise
