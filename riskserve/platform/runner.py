"""One hot-swappable model wherever it runs: inside the ingress or in a Serve replica of its own.

:class:`ModelRunner` is the one code path around every backend: it loads and verifies an artifact beside
the serving version and flips to it with one reference assignment (a call in flight finishes on the
version it started with), picks the model's columns out of the shared matrix, records the model's
metrics, and says what it serves as a typed :class:`ModelStatus`. A small batch of a backend that can
predict inline runs on the caller's thread; anything else in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel as _Schema
from pydantic import ConfigDict

from riskserve.platform.artifacts import open_artifact
from riskserve.platform.base_model import BaseModel, Contributions, ModelOutput, ModelSettings
from riskserve.platform.errors import (
    ConfigError,
    InlineBusy,
    ModelLoadError,
    ModelUnavailable,
    RiskServeError,
)
from riskserve.platform.host import ModelHost
from riskserve.platform.metrics import ModelMetrics
from riskserve.platform.validation import FeatureMatrix

__all__ = ["Backends", "CandidateReport", "ModelAnswer", "ModelRunner", "ModelStatus"]

Backends = Callable[[str], tuple[type[BaseModel[Any, Any]], type[ModelSettings]]]
"""A backend kind (``treelite``, ``sklearn``, ...) -> its model and settings classes. Given to every
:class:`ModelRunner` by its caller (``riskserve.wrappers.backend``), so the ground floor never imports the
backends above it."""

logger = logging.getLogger(__name__)
_GOLDEN_TOLERANCE = 1e-5


class ModelStatus(_Schema):
    """What a model reports about itself, one shape wherever it runs (replaces a dict read by key)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: str
    placement: Literal["ingress", "deployment"]
    version: str | None
    ready: bool
    inputs: list[str]
    labels: list[str]
    details: dict[str, Any]
    artifact: str
    last_swap_error: str
    pid: int
    actor_id: str
    started_at: float
    calls: int
    cancelled: int


class CandidateReport(_Schema):
    """A candidate artifact that passed every check (it is not served by this)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str
    golden_rows: int
    artifact: str


@dataclass(slots=True)
class ModelAnswer:
    """A model's answer for one batch, one shape from the model to the decision step (slotted, not frozen:
    made once per model call, see ``ModelOutput``; treat it as immutable)."""

    model: str
    version: str
    scores: list[float]
    labels: list[str] | None
    latency_ms: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class _Loaded:
    """One loaded version: its host, the columns it picks from the shared matrix, and calls in flight."""

    host: ModelHost[Any]
    select: NDArray[np.intp] | None
    artifact: str
    in_flight: int = 0


def _actor_id() -> str:
    try:
        import ray

        if not ray.is_initialized():  # get_runtime_context() would start a local Ray just to say "none"
            return ""
        return str(ray.get_runtime_context().get_actor_id() or "")
    except Exception:  # outside Ray (unit tests, the bench floor)
        return ""


class ModelRunner:
    """Loads, swaps, verifies and calls one model of any backend (see the module docstring)."""

    def __init__(
        self,
        name: str,
        kind: str,
        settings: dict[str, Any],
        columns: list[str] | None,
        declared: list[str] | None = None,
        *,
        backends: Backends,
        placement: Literal["ingress", "deployment"] = "deployment",
    ) -> None:
        """``columns``: the shared matrix's; ``declared``: what the pipeline says the model reads;
        ``backends``: resolves ``kind`` to the backend's classes when an artifact is loaded."""
        self.name = name
        self._backends = backends
        self.kind = kind
        self.placement: Literal["ingress", "deployment"] = placement
        self._settings = {k: v for k, v in settings.items() if k != "artifact"}
        self._columns = columns
        self._declared = declared
        self.metrics = ModelMetrics(name, kind)
        self._loaded: _Loaded | None = None
        self._swap_lock = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()
        self._last_swap_error = ""
        self._started_at = time.time()
        self._actor_id = _actor_id()
        self.calls = 0
        self.cancelled = 0

    # -- serving an artifact -------------------------------------------------------------------------

    @property
    def artifact(self) -> str | None:
        """The artifact served now (``None`` before the first load)."""
        return self._loaded.artifact if self._loaded is not None else None

    @property
    def ready(self) -> bool:
        """Whether a version is loaded and ready."""
        loaded = self._loaded
        return loaded is not None and loaded.host.model.ready

    async def serve(self, artifact: str, expected_version: str | None = None) -> None:
        """Serve ``artifact`` (what the pipeline's versions record names: the YAML's, a swap, a learned
        version), which must hold ``expected_version`` when given.

        The first load raises (there is nothing to serve). A later one that fails keeps the serving
        version and records why (:attr:`ModelStatus.last_swap_error`): a version is never half-applied.
        """
        if self._loaded is not None and self._loaded.artifact == artifact:
            return
        if self._loaded is None:
            await self._activate(artifact, expected_version)
            return
        try:
            await self._activate(artifact, expected_version)
        except RiskServeError as error:
            self._last_swap_error = str(error)
            logger.error("model '%s': swap to %s refused, still serving %s: %s", self.name, artifact,
                         self._loaded.host.model.version, error)  # fmt: skip

    async def _load(self, artifact: str) -> _Loaded:
        model_class, settings_class = self._backends(self.kind)
        settings = settings_class.model_validate({"name": self.name, **self._settings, "artifact": artifact})
        host: ModelHost[Any] = ModelHost(model_class(settings))
        await host.start()
        golden = (
            None
            if self._declared is None
            else await asyncio.to_thread(_golden_rows, artifact, self.artifact_kind)
        )
        if golden is not None:  # warm up (thread pools, first-call costs) before any real request waits on it
            await host.predict(golden[0][:1], 1)
        inputs = host.model.input_names()
        if self._declared is not None and self._declared != inputs:
            await host.stop()
            raise ConfigError(
                f"model '{self.name}': the pipeline says it reads {self._declared}, "
                f"the artifact {artifact} was trained on {inputs}"
            )
        return _Loaded(host=host, select=self._column_selection(inputs), artifact=artifact)

    def _same_schema(self, candidate: _Loaded) -> None:
        current = self._loaded
        if current is None:
            return
        for what, old, new in (
            ("feature columns", current.host.model.input_names(), candidate.host.model.input_names()),
            ("labels", current.host.model.labels(), candidate.host.model.labels()),
        ):
            if old != new:
                raise ModelLoadError(f"model '{self.name}': the candidate's {what} {new} differ from {old}")

    async def _activate(self, artifact: str, expected_version: str | None = None) -> None:
        async with self._swap_lock:
            loaded = await self._load(artifact)
            try:
                version = loaded.host.model.version
                if expected_version is not None and version != expected_version:
                    raise ModelLoadError(
                        f"model '{self.name}': {artifact} holds {version}, the record says {expected_version}"
                    )
                self._same_schema(loaded)
            except ModelLoadError:
                await loaded.host.stop()
                raise
            old, self._loaded = self._loaded, loaded  # the flip: every call from now on takes the new one
            self._last_swap_error = ""
            self.metrics.set_version(loaded.host.model.version)
            if old is not None:
                task = asyncio.get_running_loop().create_task(self._retire(old))
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)

    async def _retire(self, old: _Loaded, *, patience_s: float = 120.0) -> None:
        """Unload a replaced version once the calls that started on it are done."""
        deadline = time.monotonic() + patience_s
        while old.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await old.host.stop()

    async def verify_candidate(self, artifact: str) -> CandidateReport:
        """Load ``artifact`` beside the serving version and check it, without serving it.

        Checks: manifest checksums and the backend's own load checks (both in ``load``); the same feature
        columns and labels as the serving version; on the artifact's golden rows, outputs that are finite,
        in [0, 1], not constant, and equal to the outputs stored with the artifact.

        Raises:
            ModelLoadError: the candidate fails a check (the message says which); nothing changes.
        """
        loaded = await self._load(artifact)
        try:
            self._same_schema(loaded)
            rows = await _golden_check(loaded.host, artifact, self.artifact_kind)
            return CandidateReport(version=loaded.host.model.version, golden_rows=rows, artifact=artifact)
        finally:
            await loaded.host.stop()

    @property
    def public_key(self) -> bytes | None:
        """The raw Ed25519 key this model's artifacts must be signed with (``None``: not signed)."""
        key = self._settings.get("manifest_public_key")
        return bytes.fromhex(str(key)) if key else None

    @property
    def artifact_kind(self) -> str:
        """The kind written in the artifact's manifest (a wrapping backend serves another kind's)."""
        model_class, _ = self._backends(self.kind)
        return model_class.artifact_kind(self._settings)

    def _current(self) -> _Loaded:
        loaded = self._loaded
        if loaded is None:
            raise ModelUnavailable(f"model '{self.name}' has no loaded version")
        return loaded

    def _column_selection(self, model_inputs: list[str]) -> NDArray[np.intp] | None:
        columns = self._columns
        if columns is None or model_inputs == ["text"]:
            return None
        missing = [c for c in model_inputs if c not in columns]
        if missing:
            raise ConfigError(f"model '{self.name}' reads columns the features do not produce: {missing}")
        if model_inputs == columns:
            return None  # the model reads the shared matrix as it is: no copy at all
        return np.array([columns.index(c) for c in model_inputs], dtype=np.intp)

    # -- calls ---------------------------------------------------------------------------------------

    def selects_columns(self) -> bool:
        """Whether the model reads a subset of the matrix (a copy of its columns is made per call)."""
        loaded = self._loaded
        return loaded is not None and loaded.select is not None

    def predict_matrix_now(self, matrix: FeatureMatrix) -> ModelAnswer:
        """Score on the calling thread (backends that can: see ``BaseModel.inline``).

        Raises:
            InlineBusy: the backend cannot take it on this thread now (use :meth:`predict_matrix`).
        """
        started = time.perf_counter()
        loaded = self._current()  # read once: a swap during this call does not change what it runs on
        if not loaded.host.inline:
            raise InlineBusy(f"model '{self.name}' has no inline predict")
        batch = matrix if loaded.select is None else np.ascontiguousarray(matrix[:, loaded.select])
        self.calls += 1
        try:
            output = loaded.host.predict_now(batch, batch.shape[0])
        except InlineBusy:
            self.calls -= 1
            raise
        except Exception as error:
            self.metrics.error(type(error).__name__, latency_s=time.perf_counter() - started)
            raise
        return self._answer(output, started)

    async def predict_matrix(self, matrix: FeatureMatrix) -> ModelAnswer:
        """Score the rows of a feature matrix off the event loop (the backend's own worker thread)."""
        started = time.perf_counter()
        loaded = self._current()
        loaded.in_flight += 1  # before any await, so the version is not retired under this call
        try:
            batch = matrix if loaded.select is None else np.ascontiguousarray(matrix[:, loaded.select])
            output = await self._counting_cancellation(loaded, batch, batch.shape[0])
        finally:
            loaded.in_flight -= 1
        return self._answer(output, started)

    @property
    def explains(self) -> bool:
        """Whether the serving version can attribute its scores to its columns (:meth:`contributions`)."""
        loaded = self._loaded
        return loaded is not None and loaded.host.model.explains

    def contributions_us_per_row(self) -> float:
        """What the serving version's :meth:`contributions` costs a row (infinite when it gives none)."""
        loaded = self._loaded
        return loaded.host.model.contributions_us_per_row() if loaded is not None else float("inf")

    def contributions(self, matrix: FeatureMatrix) -> Contributions:
        """Exact attributions of the serving version's margins to the columns it reads (blocking: a
        caller on an event loop decides whether it is cheap enough to run there).

        Raises:
            ModelUnavailable: nothing is loaded, or the backend gives no contributions.
        """
        loaded = self._current()
        model = loaded.host.model
        if not (model.ready and model.explains):
            raise ModelUnavailable(f"model '{self.name}' gives no contributions")
        batch = matrix if loaded.select is None else np.ascontiguousarray(matrix[:, loaded.select])
        contributions: Contributions = model.contributions(batch)
        return contributions

    async def predict_texts(self, texts: list[str]) -> ModelAnswer:
        """Label a batch of texts."""
        started = time.perf_counter()
        loaded = self._current()
        loaded.in_flight += 1
        try:
            output = await self._counting_cancellation(loaded, texts, len(texts))
        finally:
            loaded.in_flight -= 1
        return self._answer(output, started, extra=output.extra)

    def _answer(self, output: ModelOutput, started: float, **fields: Any) -> ModelAnswer:
        latency_s = time.perf_counter() - started
        self.metrics.observe_call(latency_s, len(output), output.version)
        return ModelAnswer(
            model=self.name,
            version=output.version,
            scores=output.scores.tolist(),
            labels=list(output.labels) if output.labels is not None else None,
            latency_ms=latency_s * 1e3,
            **fields,
        )

    async def _counting_cancellation(self, loaded: _Loaded, batch: Any, rows: int) -> ModelOutput:
        """Predict on one loaded version, counted in flight; a caller that gave up (deadline, timeout)
        cancels it here, and we count it."""
        started = time.perf_counter()
        self.calls += 1
        with self.metrics.in_flight():
            try:
                return await loaded.host.predict(batch, rows)
            except asyncio.CancelledError:
                self.cancelled += 1
                self.metrics.error("CANCELLED", latency_s=time.perf_counter() - started)
                raise
            except Exception as error:
                self.metrics.error(type(error).__name__, latency_s=time.perf_counter() - started)
                raise

    # -- status and lifecycle ------------------------------------------------------------------------

    def status(self) -> ModelStatus:
        """What this model serves and how it is doing, in this process."""
        loaded = self._current()
        metadata = loaded.host.model.metadata()
        return ModelStatus(
            name=self.name,
            kind=self.kind,
            placement=self.placement,
            version=metadata.version,
            ready=metadata.ready,
            inputs=metadata.inputs,
            labels=metadata.labels,
            details=metadata.details,
            artifact=loaded.artifact,
            last_swap_error=self._last_swap_error,
            pid=os.getpid(),
            actor_id=self._actor_id,
            started_at=self._started_at,
            calls=self.calls,
            cancelled=self.cancelled,
        )

    async def stop(self) -> None:
        """Unload the serving version (vLLM frees its engine)."""
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            await loaded.host.stop()


def _golden_rows(artifact: str, kind: str) -> tuple[NDArray[np.float32], NDArray[np.float64]] | None:
    """The artifact's golden rows and their stored outputs, or ``None`` (the LLM's artifact has none)."""
    opened = open_artifact(artifact, kind=kind)
    golden_files = opened.files_with_role("golden")
    if not golden_files:
        return None
    golden = opened.read_json(golden_files[0])
    x = np.ascontiguousarray(golden["x"], dtype=np.float32)
    return x, np.asarray(golden["expected"], dtype=np.float64)


async def _golden_check(host: ModelHost[Any], artifact: str, kind: str) -> int:
    """Score the artifact's golden rows with the candidate: finite, in [0, 1], not constant, as stored.

    Returns the number of golden rows (0 for artifacts without a golden set, such as the LLM's).
    """
    golden = _golden_rows(artifact, kind)
    if golden is None:
        return 0
    x, expected = golden
    output = await host.predict(x, len(x))  # the host refuses non-finite or out-of-range scores
    if len(x) > 1 and float(np.std(output.scores)) < 1e-9:
        raise ModelLoadError(f"{artifact}: the candidate gives one constant score on {len(x)} golden rows")
    diff = float(np.max(np.abs(output.scores - expected)))
    if not diff <= _GOLDEN_TOLERANCE:
        raise ModelLoadError(f"{artifact}: golden outputs differ from the stored ones by {diff:.3g}")
    return len(x)
