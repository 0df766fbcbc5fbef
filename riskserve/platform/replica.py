"""The Ray Serve replica that hosts any model: the same code around every backend.

A replica reads the shared feature matrix from Ray's object store without copying it (same node), picks
the model's columns, and answers with scores, labels, the serving version and what it measured.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray

from riskserve.platform.errors import ConfigError, ModelUnavailable
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
        mapping, inode, offset = _locate(int(array.__array_interface__["data"][0]))
        return cls(
            read_only=not array.flags.writeable,
            owns_data=bool(array.flags.owndata),
            copied_for_columns=copied_for_columns,
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
    input: InputInfo | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class ModelReplica:
    """Hosts one model of any backend in a Serve replica (the class Serve deploys, once per model)."""

    # Serve awaits an async constructor; the model loads before the replica reports ready.
    async def __init__(  # type: ignore[misc]
        self,
        name: str,
        kind: str,
        settings: dict[str, Any],
        columns: list[str] | None,
        declared: list[str] | None = None,
        tracing: dict[str, Any] | None = None,
    ) -> None:
        """Load the model. ``columns``: the shared matrix's; ``declared``: what the pipeline says it reads."""
        from riskserve.wrappers import backend

        configure_tracing(TracingSettings.model_validate(tracing or {}))
        model_class, settings_class = backend(kind)
        self._kind = kind
        self._metrics = ModelMetrics(name, kind)
        self._name = name
        self._host: ModelHost[Any] = ModelHost(
            model_class(settings_class.model_validate({"name": name, **settings}))
        )
        await self._host.start()
        inputs = self._host.model.input_names()
        if declared is not None and declared != inputs:
            raise ConfigError(
                f"model '{name}': the pipeline says it reads {declared}, its artifact was trained on {inputs}"
            )
        self._select = self._column_selection(columns)
        self._started_at = time.time()
        self._metrics.set_version(self._host.model.version)
        self._inputs: OrderedDict[str, InputInfo] = OrderedDict()
        self._calls = 0
        self._cancelled = 0

    def _column_selection(self, columns: list[str] | None) -> np.ndarray | None:
        model_inputs = self._host.model.input_names()
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
        matrix: FeatureMatrix = await shared.ref
        info = InputInfo.of(matrix, copied_for_columns=self._select is not None)
        self._inputs[shared.batch_id] = info
        while len(self._inputs) > 256:
            self._inputs.popitem(last=False)
        if self._select is not None:
            matrix = np.ascontiguousarray(matrix[:, self._select])
        output = await self._counting_cancellation(self._host.predict(matrix, shared.rows))
        return ReplicaAnswer(
            model=self._name,
            version=output.version,
            scores=output.scores.tolist(),
            labels=list(output.labels) if output.labels is not None else None,
            latency_ms=(time.perf_counter() - started) * 1e3,
            input=info,
        )

    async def predict_texts(self, texts: list[str], trace: dict[str, str] | None = None) -> ReplicaAnswer:
        """Label a batch of texts."""
        with self._span(trace, len(texts)) as span:
            answer = await self._predict_texts(texts)
            span.set_attribute("model.version", answer.version)
            return answer

    async def _predict_texts(self, texts: list[str]) -> ReplicaAnswer:
        started = time.perf_counter()
        self._calls += 1
        output = await self._counting_cancellation(self._host.predict(texts, len(texts)))
        return ReplicaAnswer(
            model=self._name,
            version=output.version,
            scores=output.scores.tolist(),
            labels=list(output.labels) if output.labels is not None else None,
            latency_ms=(time.perf_counter() - started) * 1e3,
            extra=output.extra,
        )

    async def _counting_cancellation(self, prediction: Any) -> Any:
        """Await a prediction with the model's metrics; a caller that gave up (deadline, timeout) cancels it
        here, and we count it."""
        started = time.perf_counter()
        with self._metrics.in_flight():
            try:
                output = await prediction
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
            **self._host.model.metadata().model_dump(mode="json"),
            "pid": os.getpid(),
            "actor_id": ray.get_runtime_context().get_actor_id(),
            "replica_started_at": self._started_at,
            "calls": self._calls,
            "cancelled": self._cancelled,
        }

    def input_info(self, batch_id: str) -> InputInfo | None:
        """How this replica received a recent shared batch (kept for the last 256 batches)."""
        return self._inputs.get(batch_id)

    def check_health(self) -> None:
        """Serve's health probe: an unready model makes the replica unhealthy so Serve replaces it."""
        if not self._host.model.ready:
            raise ModelUnavailable(f"model '{self._name}' is not ready")

    async def __del__(self) -> None:
        """Serve awaits this at replica shutdown: unload the model (vLLM frees its engine)."""
        await asyncio.shield(self._host.stop())
        await asyncio.to_thread(shutdown_tracing)
