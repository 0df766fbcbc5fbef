"""Where this install keeps its operating state: the local deployment's state file, log, locks and the
record of what each model serves (``models/``). One module, imported by everything that reads them."""

from __future__ import annotations

import os
from pathlib import Path

from riskserve.platform.artifacts import default_cache_dir

__all__ = ["state_dir"]


def state_dir() -> Path:
    """The install's state directory (``RISKSERVE_STATE_DIR``, default ``<cache>/local``)."""
    return Path(os.environ.get("RISKSERVE_STATE_DIR") or default_cache_dir() / "local")
