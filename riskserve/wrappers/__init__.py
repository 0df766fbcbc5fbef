"""One module per model backend; imported lazily so a missing optional backend fails only when used."""

from __future__ import annotations

import importlib
from typing import Any

from riskserve.platform.base_model import BaseModel, ModelSettings
from riskserve.platform.errors import ConfigError

__all__ = ["BACKENDS", "backend"]

BACKENDS: dict[str, tuple[str, str, str]] = {
    "treelite": ("riskserve.wrappers.treelite_model", "TreeliteModel", "TreeliteSettings"),
    "sklearn": ("riskserve.wrappers.sklearn_model", "SklearnModel", "SklearnSettings"),
    "vllm": ("riskserve.wrappers.vllm_model", "VLLMModel", "VLLMSettings"),
    "fault_injection": (
        "riskserve.wrappers.fault_injection",
        "FaultInjectingModel",
        "FaultInjectionSettings",
    ),
}
"""Backend kind (as written in a pipeline YAML) -> (module, model class, settings class)."""


def backend(kind: str) -> tuple[type[BaseModel[Any, Any]], type[ModelSettings]]:
    """The model and settings classes of a backend kind.

    Raises:
        ConfigError: the kind is not a known backend.
        MissingExtra: the backend's optional dependency is not installed.
    """
    try:
        module_name, model_name, settings_name = BACKENDS[kind]
    except KeyError:
        raise ConfigError(f"unknown model kind '{kind}'; choose from {sorted(BACKENDS)}") from None
    module = importlib.import_module(module_name)
    model_class: type[BaseModel[Any, Any]] = getattr(module, model_name)
    settings_class: type[ModelSettings] = getattr(module, settings_name)
    return model_class, settings_class
