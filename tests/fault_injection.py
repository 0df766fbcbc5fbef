"""A test-only backend that makes a real model fail or slow down on purpose (never a production kind).

A test that uses it calls :func:`register` first: then a pipeline may name ``kind: fault_injection``
(without that, loading such a pipeline fails with "unknown model kind"), and the application builder
hands the registration to the replicas it deploys.

It loads and serves a real backend (``inner_kind``) and, before each prediction, reads a small JSON control
file so a drill can change the fault while the pipeline runs, without a restart::

    {"delay_ms": 300, "fail": false}

``delay_ms`` sleeps before predicting (the model looks slow; past the pipeline's ``timeout_ms`` it times
out), ``fail: true`` raises instead of predicting, ``invalid: "FIELD"`` refuses the rows as the model's own
client error (``InvalidInput`` naming FIELD, INVALID_ARGUMENT). A missing file means no fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel as _Schema
from pydantic import ConfigDict, Field

from riskserve.platform.base_model import BaseModel, ModelOutput, ModelSettings
from riskserve.platform.errors import InvalidInput, ModelUnavailable
from riskserve.wrappers import backend, register_backend, unregister_backend

__all__ = ["KIND", "FaultInjectingModel", "FaultInjectionSettings", "Faults", "register"]

KIND = "fault_injection"


class Faults(_Schema):
    """The control file's content."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    delay_ms: float = Field(default=0, ge=0, le=600_000)
    fail: bool = False
    invalid: str = ""
    """A field name: the model refuses every batch as invalid input naming it."""


class FaultInjectionSettings(ModelSettings):
    """The real backend to wrap and where the drill's control file is."""

    inner_kind: str = "sklearn"
    """Backend that really serves (``sklearn``, ``treelite``, ``vllm``)."""
    inner: dict[str, Any] = Field(default_factory=dict)
    """That backend's settings (``artifact`` defaults to this model's)."""
    control_file: Path
    """JSON control file, read before every prediction."""
    load_delay_ms: float = Field(default=0, ge=0, le=600_000)
    """Extra time ``load`` takes, as a slow model start would (for readiness drills)."""


class FaultInjectingModel(BaseModel[Any, FaultInjectionSettings]):
    """Delegates to a real model; injects the faults the control file asks for."""

    kind = KIND

    @classmethod
    def artifact_kind(cls, settings: Mapping[str, Any]) -> str:
        return str(settings.get("inner_kind", FaultInjectionSettings.model_fields["inner_kind"].default))

    def __init__(self, settings: FaultInjectionSettings) -> None:
        super().__init__(settings)
        model_class, settings_class = backend(settings.inner_kind)
        inner = {
            "name": settings.name,
            "artifact": settings.artifact,
            "manifest_public_key": settings.manifest_public_key,
            "unsigned_root": settings.unsigned_root,
            **settings.inner,
        }
        self.inner: BaseModel[Any, Any] = model_class(settings_class.model_validate(inner))

    def faults(self) -> Faults:
        """The faults asked for right now."""
        try:
            return Faults.model_validate(json.loads(self.settings.control_file.read_text()))
        except FileNotFoundError:
            return Faults()

    def _loaded_version(self) -> str | None:
        return self.inner._loaded_version()

    async def load(self) -> None:
        await asyncio.sleep(self.settings.load_delay_ms / 1e3)
        await self.inner.load()

    async def predict(self, batch: Any) -> ModelOutput:
        faults = await asyncio.to_thread(self.faults)
        if faults.delay_ms:
            await asyncio.sleep(faults.delay_ms / 1e3)
        if faults.fail:
            raise ModelUnavailable(f"model '{self.name}': injected failure")
        if faults.invalid:
            raise InvalidInput(
                f"{faults.invalid}: injected, refused by model '{self.name}'", field=faults.invalid
            )
        return await self.inner.predict(batch)

    async def unload(self) -> None:
        await self.inner.unload()

    def input_names(self) -> list[str]:
        return self.inner.input_names()

    def labels(self) -> list[str]:
        return self.inner.labels()

    def details(self) -> dict[str, Any]:
        return {
            "inner_kind": self.settings.inner_kind,
            "faults": self.faults().model_dump(),
            **self.inner.details(),
        }


def register() -> None:
    """Make ``kind: fault_injection`` a known backend in this process (and the replicas it deploys)."""
    register_backend(KIND, __name__, FaultInjectingModel.__name__, FaultInjectionSettings.__name__)


@contextlib.contextmanager
def registered() -> Iterator[None]:
    """The kind registered for the duration (a test module's fixture), then removed again."""
    register()
    try:
        yield
    finally:
        unregister_backend(KIND)
