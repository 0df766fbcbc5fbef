"""The one interface every model backend implements, and what a prediction looks like.

A backend subclasses :class:`BaseModel` and writes ``load`` and ``predict``; the platform
(:class:`riskserve.platform.host.ModelHost`) owns the lifecycle and readiness and wraps every model the
same way, so metrics, tracing and circuit breaking never live in a wrapper.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel as _Schema
from pydantic import ConfigDict, Field

from riskserve.platform.errors import ModelUnavailable

__all__ = ["BaseModel", "Contributions", "ModelMetadata", "ModelOutput", "ModelSettings"]


class ModelSettings(_Schema):
    """What every model needs: a name and the artifact directory to load."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, pattern=r"^[A-Za-z][A-Za-z0-9_-]*$")
    """The model's name in a pipeline, used in metrics, traces and responses."""
    artifact: Path
    """Directory holding the artifact files and their ``manifest.json``."""
    manifest_public_key: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """Hex of the raw Ed25519 key the manifest must be signed with (set by the platform from the
    pipeline's ``signing`` section, not written by hand); ``None``: no signature needed."""
    unsigned_root: Path | None = None
    """Artifacts under this directory are the server's own (an online model's learned versions) and need
    no signature."""

    def manifest_key(self) -> bytes | None:
        """The key ``artifact``'s manifest must be signed with, or ``None``."""
        if self.manifest_public_key is None:
            return None
        if self.unsigned_root is not None:
            root, artifact = self.unsigned_root.resolve(), self.artifact.resolve()
            if root in artifact.parents:
                return None
        return bytes.fromhex(self.manifest_public_key)


@dataclass(slots=True)
class ModelOutput:
    """The answer for one batch: one score per row, optionally a label per row, and the serving version.

    Made once per model call on the request path: slotted and not frozen (a frozen dataclass costs 3x as
    much to make, 0.9 against 0.3 us); treat it as immutable.

    ``scores`` is the probability of the risky class (binary scorers) or of the chosen label (LLM), in [0, 1].
    """

    scores: NDArray[np.float64]
    version: str
    labels: tuple[str, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Backend-specific per-batch detail, for example the LLM's full label distribution."""

    def __len__(self) -> int:
        return int(self.scores.shape[0])


@dataclass(frozen=True)
class Contributions:
    """Exact per-column attributions of a batch, in the model's margin (log-odds) units.

    ``values[i].sum() + bias[i]`` is row ``i``'s margin, whose sigmoid is its score; ``columns`` names the
    columns of ``values`` (the model's inputs, in order) and ``version`` the version that computed them.
    """

    values: NDArray[np.float64]
    bias: NDArray[np.float64]
    columns: tuple[str, ...]
    version: str


class ModelMetadata(_Schema):
    """What a model tells about itself: identity, version, its inputs and outputs, backend details."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: str
    version: str | None
    """Content hash of the loaded artifact; ``None`` before the first load."""
    ready: bool
    inputs: list[str]
    """Feature columns read, in order, or ``["text"]`` for text models."""
    labels: list[str]
    details: dict[str, Any] = Field(default_factory=dict)
    """Backend facts worth knowing when operating it (compiled library path, engine arguments, ...)."""


InputT = TypeVar("InputT", contravariant=True)
SettingsT = TypeVar("SettingsT", bound=ModelSettings)


class BaseModel(abc.ABC, Generic[InputT, SettingsT]):
    """A model backend: settings in ``__init__``, then ``load``, batch-first ``predict``, ``unload``.

    Subclasses must not block the event loop: blocking library calls go through ``asyncio.to_thread``.
    """

    kind: ClassVar[str]
    """Backend name as written in a pipeline YAML (``treelite``, ``sklearn``, ``vllm``)."""

    def __init__(self, settings: SettingsT) -> None:
        self.settings = settings
        self._ready = False

    @classmethod
    def artifact_kind(cls, settings: Mapping[str, Any]) -> str:
        """The kind of artifact this backend serves with ``settings`` (the YAML's ``settings`` section):
        its own, unless it wraps another backend (a test's fault injector serves its ``inner_kind``'s)."""
        return cls.kind

    @property
    def name(self) -> str:
        """The model's name."""
        return self.settings.name

    @property
    def ready(self) -> bool:
        """Whether the platform has loaded this model and lets it serve; only the platform sets it."""
        return self._ready

    @property
    def version(self) -> str:
        """Content hash of the artifact being served.

        Raises:
            ModelUnavailable: nothing is loaded.
        """
        version = self._loaded_version()
        if version is None:
            raise ModelUnavailable(f"model '{self.name}' has no loaded version")
        return version

    @abc.abstractmethod
    def _loaded_version(self) -> str | None:
        """The version currently loaded, or ``None``."""

    @abc.abstractmethod
    async def load(self) -> None:
        """Read, verify and prepare the artifact. Raise ``ModelLoadError`` (or a subclass) on any failure."""

    @abc.abstractmethod
    async def predict(self, batch: InputT) -> ModelOutput:
        """Score a batch. Raise ``InvalidInput`` naming the field for input the caller must fix."""

    inline: ClassVar[bool] = False
    """Whether :meth:`predict_now` is implemented: a synchronous predict cheap enough (microseconds for a
    small batch) to run on the caller's event loop, sparing a thread hop that costs more than the model."""

    def predict_now(self, batch: InputT) -> ModelOutput:
        """:meth:`predict` without leaving the calling thread, for backends that set ``inline``."""
        raise NotImplementedError(f"{type(self).__name__} has no inline predict")

    explains: ClassVar[bool] = False
    """Whether :meth:`contributions` is implemented (exact attributions of a score to its columns)."""

    def contributions(self, batch: InputT) -> Contributions:
        """Exact per-column attributions of each row's margin (backends that set ``explains``); blocking,
        so callers on an event loop run it in a worker thread when it is not cheap."""
        raise NotImplementedError(f"{type(self).__name__} gives no contributions")

    def contributions_us_per_row(self) -> float:
        """What :meth:`contributions` costs a row, in microseconds, as measured in ``bench/reasons.py``:
        callers on an event loop run small batches there and the rest in a worker thread."""
        return float("inf")

    async def unload(self) -> None:
        """Release what ``load`` acquired. The default has nothing to release."""

    @abc.abstractmethod
    def input_names(self) -> list[str]:
        """Feature columns this model reads, in order, or ``["text"]``."""

    @abc.abstractmethod
    def labels(self) -> list[str]:
        """Output labels (``["0", "1"]`` for a binary scorer)."""

    def details(self) -> dict[str, Any]:
        """Backend details for :meth:`metadata`; override to add facts."""
        return {}

    def metadata(self) -> ModelMetadata:
        """Identity, version, inputs, outputs and backend details."""
        return ModelMetadata(
            name=self.name,
            kind=self.kind,
            version=self._loaded_version(),
            ready=self.ready,
            inputs=self.input_names(),
            labels=self.labels(),
            details=self.details(),
        )


def _set_ready(model: BaseModel[Any, Any], ready: bool) -> None:
    """Platform-only: flip a model's readiness (the host calls this after load and before unload)."""
    model._ready = ready
