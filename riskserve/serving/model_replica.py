"""The Ray Serve replica that hosts a model in a deployment of its own: the same runner as in the ingress.

A model placed ``deployment`` (the LLM, by default) runs here: a Serve replica around one
:class:`~riskserve.platform.runner.ModelRunner`, so it has exactly the hot swap, checks and metrics of a
model running inside the ingress. It reads a large feature matrix from Ray's object store without copying
it (same node), or takes a small one by value, and with ``batching`` set, concurrent calls' texts reach
the backend as one batch (Serve's ``@serve.batch``).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from pathlib import Path
from typing import Any

from riskserve.platform.errors import ModelUnavailable
from riskserve.platform.runner import CandidateReport, ModelAnswer, ModelRunner, ModelStatus
from riskserve.platform.shared_matrix import InputInfo, InputSeen, SharedMatrix
from riskserve.platform.tracing import (
    SPAN_MODEL_PREDICT,
    SpanKind,
    TracingSettings,
    configure_tracing,
    extract,
    optional_span,
)
from riskserve.platform.validation import FeatureMatrix
from riskserve.schema.pipeline import StateSpec
from riskserve.serving.text_batching import batched_texts
from riskserve.serving.version_watch import VersionWatcher
from riskserve.state.db import open_database
from riskserve.state.versions import VersionsStore
from riskserve.wrappers import BackendEntry, backend, register_backend

__all__ = ["InputInfo", "ModelReplica", "SharedMatrix"]

_INPUTS_KEPT = 256


class ModelReplica:
    """Hosts one model of any backend in a Serve replica (the class Serve deploys, once per model).

    What it serves comes from the pipeline's versions record, which it watches
    (:class:`~riskserve.serving.version_watch.VersionWatcher`): a swap flips the running replicas, never
    restarts them (see :class:`ModelRunner`).
    """

    # Serve awaits an async constructor before the replica is ready: it loads what the record says first.
    async def __init__(  # type: ignore[misc]
        self,
        name: str,
        kind: str,
        settings: dict[str, Any],
        columns: list[str] | None,
        declared: list[str] | None = None,
        tracing: dict[str, Any] | None = None,
        batching: dict[str, Any] | None = None,
        registered: dict[str, BackendEntry] | None = None,
        *,
        pipeline: str = "",
        state: dict[str, Any] | None = None,
    ) -> None:
        """``columns``: the shared matrix's; ``declared``: what the pipeline says the model reads;
        ``batching``: a dumped ``BatchingSpec``, to batch concurrent text calls
        (:mod:`riskserve.serving.text_batching`); ``registered``: test-only backend kinds the builder's
        process registered (see :mod:`riskserve.wrappers`); ``pipeline`` and ``state`` (the resolved
        ``state`` section): the versions record this replica pulls what it serves from
        (``settings["artifact"]``, the YAML's, serves without one)."""
        for kind, entry in (registered or {}).items():
            register_backend(kind, *entry)
        self._tracing = configure_tracing(TracingSettings.model_validate(tracing or {}))
        self._runner = ModelRunner(
            name, kind, settings, columns, declared, backends=backend, placement="deployment"
        )
        self._inputs: OrderedDict[str, InputSeen] = OrderedDict()
        self._batch_size = int(batching["max_batch_size"]) if batching is not None else 0
        self._texts_batched = (
            batched_texts(self._runner.predict_texts, batching) if batching is not None else None
        )
        yaml_artifact = str(Path(settings["artifact"]).resolve())
        self._watcher: VersionWatcher | None = None
        if state is not None:
            self._watcher = VersionWatcher(
                VersionsStore(
                    await asyncio.to_thread(open_database, StateSpec.model_validate(state).resolve_dsn())
                ),
                pipeline,
                {name: self._runner},
                {name: yaml_artifact},
            )
            await self._watcher.apply_now()  # what the record says, before the replica is ready
            self._watcher.start()
        else:  # a replica outside a pipeline (benchmarks, tests): the artifact it was given
            await self._runner.serve(yaml_artifact)

    async def verify_candidate(self, artifact: str) -> CandidateReport:
        """Load ``artifact`` beside the serving version and check it, without serving it."""
        return await self._runner.verify_candidate(artifact)

    async def predict_features(
        self, matrix: SharedMatrix | FeatureMatrix, trace: dict[str, str] | None = None
    ) -> ModelAnswer:
        """Score the rows of a feature matrix: shared through the object store, or sent by value."""
        rows = matrix.rows if isinstance(matrix, SharedMatrix) else int(matrix.shape[0])
        with self._span(trace, rows) as span:
            if isinstance(matrix, SharedMatrix):
                array: FeatureMatrix = await matrix.ref
                self._inputs[matrix.batch_id] = InputSeen.of(
                    array, copied_for_columns=self._runner.selects_columns()
                )
                while len(self._inputs) > _INPUTS_KEPT:
                    self._inputs.popitem(last=False)
            else:
                array = matrix
            answer = await self._runner.predict_matrix(array)
            span.set_attribute("model.version", answer.version)
            return answer

    async def predict_texts(self, texts: list[str], trace: dict[str, str] | None = None) -> ModelAnswer:
        """Label a batch of texts; with ``batching``, together with other calls' texts (a call that fills a
        batch by itself, such as a large ``DecideBatch``, goes straight to the backend)."""
        with self._span(trace, len(texts)) as span:
            if self._texts_batched is None or len(texts) >= self._batch_size:
                answer = await self._runner.predict_texts(texts)  # a whole batch already: no waiting
            else:
                answer = await self._texts_batched(texts)
            span.set_attribute("model.version", answer.version)
            return answer

    def _span(self, trace: dict[str, str] | None, rows: int) -> Any:
        """The model's span, a child of the caller's, only when the caller sends its trace context: the
        ingress sends it for a sampled decision alone. Without one, a span here would start a trace of its
        own holding the model alone, sampled apart from its decision (and cost ~40 µs a call for nothing)."""
        attributes: dict[str, str | int] = {
            "model.name": self._runner.name,
            "model.kind": self._runner.kind,
            "rows": rows,
        }
        return optional_span(
            bool(trace),
            SPAN_MODEL_PREDICT,
            context=extract(trace) if trace else None,
            kind=SpanKind.SERVER,
            attributes=attributes,
        )

    def metadata(self) -> ModelStatus:
        """What this replica serves (version, artifact, readiness, calls) and which process it is."""
        return self._runner.status()

    def input_info(self, batch_id: str) -> InputInfo | None:
        """How this replica received a recent shared batch (kept for the last 256 batches)."""
        seen = self._inputs.get(batch_id)
        return None if seen is None else seen.resolve()

    def check_health(self) -> None:
        """Serve's health probe: an unready model makes the replica unhealthy so Serve replaces it."""
        if not self._runner.ready:
            raise ModelUnavailable(f"model '{self._runner.name}' is not ready")

    async def __del__(self) -> None:
        """Serve awaits this at replica shutdown: unload the model (vLLM frees its engine)."""
        if self._watcher is not None:
            await asyncio.shield(self._watcher.stop())
        await asyncio.shield(self._runner.stop())
        await asyncio.to_thread(self._tracing.release)
