"""Import optional backends with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from riskserve.platform.errors import MissingExtra

__all__ = ["require"]


def require(module: str, *, backend: str, extra: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtra` telling which ``riskserve[extra]`` provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingExtra(backend, extra, module) from error
