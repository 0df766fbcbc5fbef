"""The decision audit trail: every decision kept durably off the request path, read by ``riskserve audit``.

:class:`AuditWriter` (in each ingress replica) keeps records in a slot's SQLite file behind a bounded
buffer and an append-only journal; :class:`AuditTrail` reads every slot; :mod:`riskserve.audit.export`
writes the records as Parquet or CSV.
"""

from riskserve.audit.store import AuditRecord, AuditStore
from riskserve.audit.trail import AuditTrail, Label
from riskserve.audit.writer import AuditCounts, AuditWriter

__all__ = ["AuditCounts", "AuditRecord", "AuditStore", "AuditTrail", "AuditWriter", "Label"]
