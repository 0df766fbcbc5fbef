"""One module per model backend; imported lazily so a missing optional backend fails only when used.

The table holds the production backends. A test-only backend (the fault-injecting wrapper of
``tests/fault_injection.py``) is added by the tests that use it with :func:`register_backend`; a pipeline
naming a kind that is not in the table fails when it loads. The application builder hands the kinds
registered in its process to the replicas it deploys (:func:`registered_backends`), so a registration
made by a test reaches the Ray workers that serve its pipeline, and nothing else. A test that starts
processes of its own (``riskserve up`` and its background process) names its registration hook in the
environment variable :data:`REGISTER_ENV` instead; production never sets it.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Final

from riskserve.platform.base_model import BaseModel, ModelSettings
from riskserve.platform.errors import ConfigError

__all__ = [
    "BUILT_IN",
    "REGISTER_ENV",
    "BackendEntry",
    "backend",
    "known_kind",
    "register_backend",
    "registered_backends",
    "unregister_backend",
]

BackendEntry = tuple[str, str, str]
"""(module, model class, settings class) of a backend, by import path: data that can cross processes."""

BUILT_IN: dict[str, BackendEntry] = {
    "treelite": ("riskserve.wrappers.treelite_model", "TreeliteModel", "TreeliteSettings"),
    "sklearn": ("riskserve.wrappers.sklearn_model", "SklearnModel", "SklearnSettings"),
    "vllm": ("riskserve.wrappers.vllm_model", "VLLMModel", "VLLMSettings"),
}
"""Backend kind (as written in a pipeline YAML) -> its entry: what a production pipeline may name."""

_registered: dict[str, BackendEntry] = {}
"""Kinds added in this process by :func:`register_backend` (tests only)."""

REGISTER_ENV: Final = "RISKSERVE_TEST_BACKENDS"
"""Comma-separated ``module:function`` registration hooks run once per process before the first lookup
(a test sets it for the ``riskserve up`` processes it starts, e.g. ``tests.fault_injection:register``)."""
_hooks_ran = False


def _run_env_hooks() -> None:
    global _hooks_ran
    if _hooks_ran:
        return
    _hooks_ran = True
    for hook in filter(None, (part.strip() for part in os.environ.get(REGISTER_ENV, "").split(","))):
        module, _, function = hook.partition(":")
        getattr(importlib.import_module(module), function or "register")()


def register_backend(kind: str, module: str, model_class: str, settings_class: str) -> None:
    """Add a backend kind to this process's table (tests register their test-only backends with this).

    Raises:
        ConfigError: ``kind`` is a built-in backend (they cannot be replaced).
    """
    if kind in BUILT_IN:
        raise ConfigError(f"model kind '{kind}' is built in and cannot be registered again")
    _registered[kind] = (module, model_class, settings_class)


def unregister_backend(kind: str) -> None:
    """Remove a kind :func:`register_backend` added (a test cleaning up after itself)."""
    _registered.pop(kind, None)


def registered_backends(kinds: set[str] | None = None) -> dict[str, BackendEntry]:
    """The registered (not built-in) kinds among ``kinds`` (all when ``None``), to hand to a replica."""
    _run_env_hooks()
    return {k: entry for k, entry in _registered.items() if kinds is None or k in kinds}


def known_kind(kind: str) -> str:
    """``kind`` if a backend of that kind exists in this process; the YAML check of ``models.<m>.kind``.

    Raises:
        ValueError: naming the kinds there are.
    """
    _run_env_hooks()
    if kind in BUILT_IN or kind in _registered:
        return kind
    raise ValueError(
        f"unknown model kind '{kind}'; choose from {sorted(BUILT_IN)} "
        "(a test-only kind must first be registered with riskserve.wrappers.register_backend)"
    )


def backend(kind: str) -> tuple[type[BaseModel[Any, Any]], type[ModelSettings]]:
    """The model and settings classes of a backend kind.

    Raises:
        ConfigError: the kind is not a known backend.
        MissingExtra: the backend's optional dependency is not installed.
    """
    _run_env_hooks()
    entry = BUILT_IN.get(kind) or _registered.get(kind)
    if entry is None:
        raise ConfigError(f"unknown model kind '{kind}'; choose from {sorted(BUILT_IN)}")
    module_name, model_name, settings_name = entry
    module = importlib.import_module(module_name)
    model_class: type[BaseModel[Any, Any]] = getattr(module, model_name)
    settings_class: type[ModelSettings] = getattr(module, settings_name)
    return model_class, settings_class
