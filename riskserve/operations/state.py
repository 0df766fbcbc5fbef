"""Where this install keeps its operating state: the local deployment's state file, log, locks and the
record of what each model serves (``models/``). One module, imported by everything that reads them."""

from __future__ import annotations

from pathlib import Path

from riskserve.platform.artifacts import default_state_dir

__all__ = ["state_dir"]


def state_dir() -> Path:
    """The install's state directory (``RISKSERVE_STATE_DIR``, default ``<cache>/local``)."""
    return default_state_dir()
