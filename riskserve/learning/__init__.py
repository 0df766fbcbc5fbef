"""Online learning: the durable feedback log that joins labels to decisions and feeds ``partial_fit``."""

from riskserve.learning.feedback_log import Batch, Cursor, FeedbackAck, FeedbackLog

__all__ = ["Batch", "Cursor", "FeedbackAck", "FeedbackLog"]
