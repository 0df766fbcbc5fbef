"""A decision's outcome: one definition for the rules that choose it and the metrics that count it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal

__all__ = ["OUTCOMES", "SEVERITY", "Outcome"]

Outcome = Literal["APPROVE", "REVIEW", "DECLINE"]
"""What a pipeline decides for one request (the wire's ``DecideResponse.decision`` carries the same words)."""

OUTCOMES: Final[tuple[Outcome, ...]] = ("APPROVE", "REVIEW", "DECLINE")
"""Every outcome, least severe first."""

SEVERITY: Final[Mapping[str, int]] = {outcome: rank for rank, outcome in enumerate(OUTCOMES)}
"""Rank of each outcome: the most severe outcome of the rules that matched wins."""
