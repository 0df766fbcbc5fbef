"""What every part of the pipeline YAML shares: strict, frozen models and the pattern of a name."""

from __future__ import annotations

from pydantic import BaseModel as _Schema
from pydantic import ConfigDict

__all__ = ["NAME", "Strict"]

NAME = r"^[A-Za-z][A-Za-z0-9_-]*$"
"""A pipeline's, pool's, model's or rule's name: a letter, then letters, digits, ``_`` or ``-``."""


class Strict(_Schema):
    """A YAML section: unknown keys are errors (a typo is never silently ignored), values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)
