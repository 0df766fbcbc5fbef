"""The Ray Serve replica that hosts any model: the same code around every backend.

A replica reads the shared feature matrix from Ray's object store without copying it (same node), picks
the model's columns, and answers with scores, labels, the serving version and what it measured.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
from numpy.typing import NDArray

from riskserve.platform.artifacts import open_artifact
from riskserve.platform.base_model import ModelOutput
from riskserve.platform.errors import ConfigError, ModelLoadError, ModelUnavailable, RiskServeError
from riskserve.platform.host import ModelHost
from riskserve.platform.metrics import ModelMetrics
from riskserve.platform.tracing import (
    SPAN_MODEL_PREDICT,
    SpanKind,
    TracingSettings,
    configure_tracing,
    extract,
    shutdown_tracing,
    start_span,
)
from riskserve.platform.validation import FeatureMatrix

__all__ = ["InputInfo", "ModelReplica", "ReplicaAnswer", "SharedMatrix"]

logger = logging.getLogger(__name__)
_GOLDEN_TOLERANCE = 1e-5


@dataclass(frozen=True)
class SharedMatrix:
    """A feature matrix in the object store; the ref is boxed so Ray Serve passes it unresolved."""

    ref: ray.ObjectRef  # type: ignore[type-arg]
    rows: int
    columns: tuple[str, ...]
    batch_id: str
    """Unique per encoded batch, so each model's :class:`InputInfo` can be matched to it."""


@dataclass(frozen=True)
class InputInfo:
    """How the model received its input: evidence that it read the shared buffer, not a copy.

    ``mapping``/``inode``/``file_offset`` locate the buffer in this process's memory map: two processes
    reading one shared-memory object show the same object-store file, inode and offset.
    """

    read_only: bool
    owns_data: bool
    copied_for_columns: bool
    mapping: str
    inode: int
    file_offset: int

    @classmethod
    def of(cls, array: FeatureMatrix, *, copied_for_columns: bool) -> InputInfo:
        """Describe where ``array``'s bytes live."""
        return InputSeen.of(array, copied_for_columns=copied_for_columns).resolve()


@dataclass(frozen=True)
class InputSeen:
    """What a call records about its input: the buffer's address and flags. Finding the mapping
    (parsing ``/proc/self/maps``, 1-5 ms in a replica, more than the model) waits until someone asks;
    the object store's mapping stays in place for the life of the process."""

    address: int
    read_only: bool
    owns_data: bool
    copied_for_columns: bool

    @classmethod
    def of(cls, array: FeatureMatrix, *, copied_for_columns: bool) -> InputSeen:
        """Record ``array``'s address and flags (cheap: no system call)."""
        return cls(
            address=int(array.__array_interface__["data"][0]),
            read_only=not array.flags.writeable,
            owns_data=bool(array.flags.owndata),
            copied_for_columns=copied_for_columns,
        )

    def resolve(self) -> InputInfo:
        """The full description, with the mapping that holds the address now."""
        mapping, inode, offset = _locate(self.address)
        return InputInfo(
            read_only=self.read_only,
            owns_data=self.owns_data,
            copied_for_columns=self.copied_for_columns,
            mapping=mapping,
            inode=inode,
            file_offset=offset,
        )


def _locate(address: int) -> tuple[str, int, int]:
    """The memory-mapped file, inode and file offset holding ``address`` (Linux ``/proc/self/maps``)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return "", 0, -1
    for line in maps.read_text().splitlines():
        parts = line.split(maxsplit=5)
        low, high = (int(v, 16) for v in parts[0].split("-"))
        if low <= address < high:
            return (parts[5] if len(parts) > 5 else ""), int(parts[4]), int(parts[2], 16) + address - low
    return "", 0, -1


@dataclass(frozen=True)
class ReplicaAnswer:
    """A model's answer for one batch, as the decision step gets it."""

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
    select: np.ndarray | None
    artifact: str
    in_flight: int = 0


class ModelReplica:
    """Hosts one model of any backend in a Serve replica (the class Serve deploys, once per model).

    The artifact comes through Serve's ``user_config`` (``{"artifact": PATH}``), so swapping it is a
    ``reconfigure`` of the running replicas, never a restart: the candidate is loaded and verified beside
    the serving version, then one reference assignment flips new calls to it; calls in flight finish on
    the version they started with, which is unloaded once they are done.
    """

    # Serve awaits an async constructor, then calls reconfigure(user_config) before the replica is ready.
    async def __init__(  # type: ignore[misc]
        self,
        name: str,
        kind: str,
        settings: dict[str, Any],
        columns: list[str] | None,
        declared: list[str] | None = None,
        tracing: dict[str, Any] | None = None,
    ) -> None:
        """``columns``: the shared matrix's; ``declared``: what the pipeline says the model reads."""
        configure_tracing(TracingSettings.model_validate(tracing or {}))
        self._name = name
        self._kind = kind
        self._settings = {k: v for k, v in settings.items() if k != "artifact"}
        self._columns = columns
        self._declared = declared
        self._metrics = ModelMetrics(name, kind)
        self._loaded: _Loaded | None = None
        self._swap_lock = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()
        self._last_swap_error = ""
        self._started_at = time.time()
        self._inputs: OrderedDict[str, InputSeen] = OrderedDict()
        self._calls = 0
        self._cancelled = 0
        if "artifact" in settings:  # deployed without a user_config: load now
            await self._activate(str(settings["artifact"]))

    async def reconfigure(self, config: dict[str, Any]) -> None:
        """Serve's ``user_config`` hook: serve ``config["artifact"]``.

        The first load fails the replica (nothing to serve). A later swap that fails keeps the serving
        version and records why (``metadata()["last_swap_error"]``): a version is never half-applied.
        """
        artifact = config.get("artifact")
        if artifact is None or (self._loaded is not None and self._loaded.artifact == str(artifact)):
            return
        if self._loaded is None:
            await self._activate(str(artifact))
            return
        try:
            await self._activate(str(artifact))
        except RiskServeError as error:
            self._last_swap_error = str(error)
            logger.error("model '%s': swap to %s refused, still serving %s: %s", self._name, artifact,
                         self._loaded.host.model.version, error)  # fmt: skip

    async def _load(self, artifact: str) -> _Loaded:
        from riskserve.wrappers import backend

        model_class, settings_class = backend(self._kind)
        settings = settings_class.model_validate({"name": self._name, **self._settings, "artifact": artifact})
        host: ModelHost[Any] = ModelHost(model_class(settings))
        await host.start()
        golden = (
            None
            if self._declared is None
            else await asyncio.to_thread(_golden_rows, artifact, self._artifact_kind)
        )
        if golden is not None:  # warm up (thread pools, first-call costs) before any real request waits on it
            await host.predict(golden[0][:1], 1)
        inputs = host.model.input_names()
        if self._declared is not None and self._declared != inputs:
            await host.stop()
            raise ConfigError(
                f"model '{self._name}': the pipeline says it reads {self._declared}, "
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
                raise ModelLoadError(f"model '{self._name}': the candidate's {what} {new} differ from {old}")

    async def _activate(self, artifact: str) -> None:
        async with self._swap_lock:
            loaded = await self._load(artifact)
            try:
                self._same_schema(loaded)
            except ModelLoadError:
                await loaded.host.stop()
                raise
            old, self._loaded = self._loaded, loaded  # the flip: every call from now on takes the new one
            self._last_swap_error = ""
            self._metrics.set_version(loaded.host.model.version)
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

    async def verify_candidate(self, artifact: str) -> dict[str, Any]:
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
            kind = (
                str(self._settings.get("inner_kind", "sklearn"))
                if self._kind == "fault_injection"
                else self._kind
            )
            rows = await _golden_check(loaded.host, artifact, kind)
            return {"version": loaded.host.model.version, "golden_rows": rows, "artifact": artifact}
        finally:
            await loaded.host.stop()

    @property
    def _artifact_kind(self) -> str:
        """The kind written in the artifact's manifest (a fault-injecting wrapper serves another kind's)."""
        if self._kind == "fault_injection":
            return str(self._settings.get("inner_kind", "sklearn"))
        return self._kind

    @property
    def _current(self) -> _Loaded:
        loaded = self._loaded
        if loaded is None:
            raise ModelUnavailable(f"model '{self._name}' has no loaded version")
        return loaded

    def _column_selection(self, model_inputs: list[str]) -> np.ndarray | None:
        columns = self._columns
        if columns is None or model_inputs == ["text"]:
            return None
        missing = [c for c in model_inputs if c not in columns]
        if missing:
            raise ConfigError(f"model '{self._name}' reads columns the features do not produce: {missing}")
        if model_inputs == columns:
            return None  # the model reads the shared matrix as it is: no copy at all
        return np.array([columns.index(c) for c in model_inputs])

    async def predict_features(
        self, shared: SharedMatrix, trace: dict[str, str] | None = None
    ) -> ReplicaAnswer:
        """Score the rows of a shared feature matrix."""
        with self._span(trace, shared.rows) as span:
            answer = await self._predict_features(shared)
            span.set_attribute("model.version", answer.version)
            return answer

    def _span(self, trace: dict[str, str] | None, rows: int) -> Any:
        attributes: dict[str, str | int] = {"model.name": self._name, "model.kind": self._kind, "rows": rows}
        return start_span(
            SPAN_MODEL_PREDICT, context=extract(trace), kind=SpanKind.SERVER, attributes=attributes
        )

    async def _predict_features(self, shared: SharedMatrix) -> ReplicaAnswer:
        started = time.perf_counter()
        self._calls += 1
        loaded = self._current  # read once: a swap during this call does not change what it runs on
        loaded.in_flight += 1  # before any await, so the version is not retired under this call
        try:
            matrix: FeatureMatrix = await shared.ref
            self._inputs[shared.batch_id] = InputSeen.of(matrix, copied_for_columns=loaded.select is not None)
            while len(self._inputs) > 256:
                self._inputs.popitem(last=False)
            if loaded.select is not None:
                matrix = np.ascontiguousarray(matrix[:, loaded.select])
            output = await self._counting_cancellation(loaded, matrix, shared.rows)
        finally:
            loaded.in_flight -= 1
        return self._answer(output, started)

    async def predict_texts(self, texts: list[str], trace: dict[str, str] | None = None) -> ReplicaAnswer:
        """Label a batch of texts."""
        with self._span(trace, len(texts)) as span:
            answer = await self._predict_texts(texts)
            span.set_attribute("model.version", answer.version)
            return answer

    async def _predict_texts(self, texts: list[str]) -> ReplicaAnswer:
        started = time.perf_counter()
        self._calls += 1
        loaded = self._current
        loaded.in_flight += 1
        try:
            output = await self._counting_cancellation(loaded, texts, len(texts))
        finally:
            loaded.in_flight -= 1
        return self._answer(output, started, extra=output.extra)

    def _answer(self, output: ModelOutput, started: float, **fields: Any) -> ReplicaAnswer:
        return ReplicaAnswer(
            model=self._name,
            version=output.version,
            scores=output.scores.tolist(),
            labels=list(output.labels) if output.labels is not None else None,
            latency_ms=(time.perf_counter() - started) * 1e3,
            **fields,
        )

    async def _counting_cancellation(self, loaded: _Loaded, batch: Any, rows: int) -> Any:
        """Predict on one loaded version with the model's metrics; a caller that gave up (deadline, timeout)
        cancels it here, and we count it."""
        started = time.perf_counter()
        with self._metrics.in_flight():
            try:
                output = await loaded.host.predict(batch, rows)
            except asyncio.CancelledError:
                self._cancelled += 1
                self._metrics.error("CANCELLED", latency_s=time.perf_counter() - started)
                raise
            except Exception as error:
                self._metrics.error(type(error).__name__, latency_s=time.perf_counter() - started)
                raise
        self._metrics.observe_call(time.perf_counter() - started, len(output), output.version)
        return output

    def metadata(self) -> dict[str, Any]:
        """The model's metadata plus which process serves it (used to prove nothing restarted)."""
        return {
            **self._current.host.model.metadata().model_dump(mode="json"),
            "artifact": self._current.artifact,
            "last_swap_error": self._last_swap_error,
            "pid": os.getpid(),
            "actor_id": ray.get_runtime_context().get_actor_id(),
            "replica_started_at": self._started_at,
            "calls": self._calls,
            "cancelled": self._cancelled,
        }

    def input_info(self, batch_id: str) -> InputInfo | None:
        """How this replica received a recent shared batch (kept for the last 256 batches)."""
        seen = self._inputs.get(batch_id)
        return None if seen is None else seen.resolve()

    def check_health(self) -> None:
        """Serve's health probe: an unready model makes the replica unhealthy so Serve replaces it."""
        if not self._current.host.model.ready:
            raise ModelUnavailable(f"model '{self._name}' is not ready")

    async def __del__(self) -> None:
        """Serve awaits this at replica shutdown: unload the model (vLLM frees its engine)."""
        if self._loaded is not None:
            await asyncio.shield(self._loaded.host.stop())
        await asyncio.to_thread(shutdown_tracing)


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
