"""The decision audit trail: every decision kept durably off the request path, read by ``riskserve audit``.

:class:`AuditWriter` (in each ingress replica) keeps records behind a bounded buffer and an append-only
journal on its node's disk and ships them to the pipeline's state database (:class:`AuditStore`), where
every node's records meet; :class:`AuditTrail` and :class:`~riskserve.audit.lookup.DecisionLookup` read
them there; :mod:`riskserve.audit.export` writes them as Parquet or CSV.
"""

from riskserve.audit.store import AuditRecord, AuditStore
from riskserve.audit.trail import AuditTrail, Label
from riskserve.audit.writer import AuditCounts, AuditWriter

__all__ = ["AuditCounts", "AuditRecord", "AuditStore", "AuditTrail", "AuditWriter", "Label"]
