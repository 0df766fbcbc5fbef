"""The flow of one decision batch: features once, every model (in parallel where it pays), then the rules.

The feature stage validates first, so bad input is INVALID_ARGUMENT naming the field and reaches no
model. Models in their own deployments are started first, so their hops overlap with the work that stays
in process; a small batch's in-ingress models then run as plain function calls on the event loop, a large
batch's in a worker thread. The rules follow, then the reason codes of the decisions whose outcome the
pipeline explains (none for the others), then the responses. After the answer is built, the batch's
records are handed to the audit writer (with write-ahead: on the journal before the answer leaves; in a
pipeline that learns online with the encoded rows, which the feedback log joins labels to) and a sample
is handed to any shadow candidate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from riskserve.audit.writer import AuditWriter
from riskserve.features.stage import FeatureStage, StageResult
from riskserve.platform.errors import DeadlineExceeded, InlineBusy
from riskserve.platform.metrics import PipelineMetrics
from riskserve.platform.tracing import SPAN_DECISION, inject, optional_span
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.schema.pipeline import PipelineSpec
from riskserve.schema.rules import Decision, ModelResult
from riskserve.serving.auditing import audit_records
from riskserve.serving.guarded_call import GuardedModel
from riskserve.serving.ids import new_ids
from riskserve.serving.messages import decide_response, raw_request
from riskserve.serving.reasons import Reason, ReasonExplainer
from riskserve.serving.shadow import Shadows

__all__ = ["FEATURES_INLINE_ROWS", "DecisionFlow"]

FEATURES_INLINE_ROWS = 1024
"""Batches up to this many rows are validated and encoded on the event loop (1,000 rows: ~5 ms, column by
column). That work is pure Python: a worker thread could not run it beside the loop (the GIL), it would
only add two hand-offs, each waiting for the GIL; larger batches still leave the loop."""

logger = logging.getLogger(__name__)


class DecisionFlow:
    """Decides batches of requests for one pipeline, inside an ingress replica."""

    def __init__(
        self,
        spec: PipelineSpec,
        *,
        models: dict[str, GuardedModel],
        local_stage: FeatureStage | None,
        stage_handle: Any = None,
        explainer: ReasonExplainer | None = None,
        shadows: Shadows | None = None,
        audit: AuditWriter | None = None,
    ) -> None:
        """``local_stage``: encode in this process; else ``stage_handle``, the feature-stage deployment;
        ``explainer``: reason codes for the outcomes the pipeline explains; ``shadows``: candidates that
        score a sample of the answered decisions off the request path; ``audit``: the replica's audit
        writer (every decision is kept; with the encoded rows when the pipeline learns online)."""
        self.spec = spec
        self.models = models
        self._names = list(spec.models)
        self._local_stage = local_stage
        self._stage_handle = stage_handle
        self.explainer = explainer
        self.shadows = shadows
        self.audit = audit
        self.metrics = PipelineMetrics(spec.name)
        self._engine = spec.decision_engine()
        self._inline_rows = spec.serving.inline_rows
        self._any_in_process = any(m.spec.in_ingress for m in models.values())
        self._keeps_rows = audit is not None and spec.feedback is not None
        """Audit records carry the encoded rows (the feedback log's learners train on them)."""

    async def decide(
        self,
        requests: Sequence[pb.DecideRequest],
        trace_id: str,
        deadline: float,
        traced: bool,
        into: pb.DecideBatchResponse | None = None,
    ) -> list[pb.DecideResponse]:
        """Decide every request; the responses come in the same order. With ``into`` (an empty batch
        response), they are made as its responses, and the list returned holds them."""
        gate = self.shadows.gate if self.shadows is not None else None
        if gate is None:
            return await self._decide(requests, trace_id, deadline, traced, into)
        gate.enter()  # shadows wait while any decision is in flight
        try:
            return await self._decide(requests, trace_id, deadline, traced, into)
        finally:
            gate.leave()

    async def _decide(
        self,
        requests: Sequence[pb.DecideRequest],
        trace_id: str,
        deadline: float,
        traced: bool,
        into: pb.DecideBatchResponse | None,
    ) -> list[pb.DecideResponse]:
        started = time.perf_counter()
        raw = [raw_request(r) for r in requests]
        stage = await self._features(raw, deadline, traced)
        self.metrics.feature_latency(stage.latency_ms / 1e3)
        per_model = await self._run_models(stage, deadline, traced)
        if time.monotonic() >= deadline:
            raise DeadlineExceeded("the decision's deadline passed while the models ran")
        # The decision's own id is the server's, never the caller's: a request_id is an echo, and two
        # callers may send the same one (see riskserve.learning.feedback_log).
        decision_ids = new_ids(len(requests))
        ids = [r.request_id or decision_ids[i] for i, r in enumerate(requests)]
        decisions = self._engine.decide_batch(stage.rows, per_model)
        names = self._names
        decided = [
            (decision, {name: per_model[name][i] for name in names}) for i, decision in enumerate(decisions)
        ]
        if traced:
            for request_id, decision in zip(ids, decisions, strict=True):
                attributes = {"request.id": request_id, "outcome": decision.outcome}
                with optional_span(True, SPAN_DECISION, attributes=attributes) as span:
                    span.set_attribute("risk_score", decision.risk_score)
        self.metrics.decisions([decision.outcome for decision in decisions])
        reasons = await self._reasons(stage, decided)
        responses = [
            decide_response(
                request_id=request_id,
                decision_id=decision_ids[i],
                decision=decision,
                results=results,
                spec=self.spec,
                trace_id=trace_id,
                top_reasons=reasons.get(i, ()),
                into=into,
            )
            for i, (request_id, (decision, results)) in enumerate(zip(ids, decided, strict=True))
        ]
        if self.audit is not None:
            self.audit.submit(
                audit_records(
                    self.spec,
                    raw=raw,
                    request_ids=ids,
                    decision_ids=decision_ids,
                    decided=decided,
                    reasons=reasons,
                    trace_id=trace_id,
                    **self._rows(stage),
                )
            )
        if self.shadows is not None and self.shadows.active:
            self.shadows.offer(stage, decision_ids, decided)  # labels join them by decision id
        self.metrics.decision_latency(time.perf_counter() - started)
        return responses

    def _rows(self, stage: StageResult) -> dict[str, Any]:
        """The encoded rows and their layout for the audit records, when they keep them."""
        if not self._keeps_rows or self.audit is None:
            return {}
        if stage.matrix is None:
            logger.error("the feature stage returned no matrix; these records keep no rows to learn from")
            return {}
        return {"rows": stage.matrix, "layout": self.audit.layout(stage.columns)}

    async def _reasons(
        self, stage: StageResult, decided: list[tuple[Decision, dict[str, ModelResult]]]
    ) -> dict[int, list[Reason]]:
        """The reasons of the rows whose outcome the pipeline explains (none: nothing is computed).

        A few rows run here (tens of microseconds each), larger batches in a worker thread. A failure
        costs the reasons, never the decision (logged and counted).
        """
        explainer = self.explainer
        if explainer is None or stage.matrix is None:
            return {}
        wanted = [i for i, (decision, _) in enumerate(decided) if explainer.wanted(decision.outcome)]
        if not wanted:
            return {}
        started = time.perf_counter()
        matrix = stage.matrix if len(wanted) == len(decided) else stage.matrix[wanted]
        rows = [stage.rows[i] for i in wanted]
        results = [decided[i][1] for i in wanted]
        try:
            if explainer.inline_for(len(wanted)):
                computed = explainer.explain(matrix, rows, results)
            else:
                computed = await asyncio.to_thread(explainer.explain, matrix, rows, results)
        except Exception:
            logger.exception("reasons failed; the decisions are answered without them")
            self.metrics.reasons_failed(len(wanted))
            return {}
        self.metrics.reasons(len(wanted), time.perf_counter() - started)
        return dict(zip(wanted, computed, strict=True))

    async def _features(self, raw: list[Any], deadline: float, traced: bool) -> StageResult:
        """Validate and encode once: in process (inline when small), or in the feature-stage deployment."""
        trace = inject() if traced else None
        if self._local_stage is not None:
            if len(raw) <= max(self._inline_rows, FEATURES_INLINE_ROWS):
                return self._local_stage.encode(raw, trace, share=False)
            return await asyncio.to_thread(self._local_stage.encode, raw, trace, True, share=False)
        # Reason codes come from models in this process only, so they need the matrix only with such a model.
        keep = self._keeps_rows or self._any_in_process
        call = self._stage_handle.encode.remote(raw, trace=trace or inject(), keep_matrix=keep)
        try:
            result: StageResult = await asyncio.wait_for(call, timeout=max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            call.cancel()
            raise DeadlineExceeded("the decision's deadline passed in the feature stage") from None
        return result

    async def _run_models(
        self, stage: StageResult, deadline: float, traced: bool
    ) -> dict[str, list[ModelResult]]:
        """Every model's results: remote and threaded calls started first, inline calls meanwhile."""
        pending: dict[str, asyncio.Task[list[ModelResult]]] = {}
        now: list[GuardedModel] = []
        for name in self._names:
            model = self.models[name]
            if model.runs_now(stage):
                now.append(model)
            else:
                pending[name] = asyncio.ensure_future(model.call(stage, deadline, traced))
        results: dict[str, list[ModelResult]] = {}
        try:
            if pending and now:  # let the remote calls go out (an LLM's text: ~4 ms) before the inline work
                await asyncio.sleep(0)
            for model in now:
                try:
                    results[model.name] = model.call_now(stage, deadline, traced)
                except InlineBusy:  # its engine is busy with a large batch: wait for it off the loop
                    pending[model.name] = asyncio.ensure_future(model.call(stage, deadline, traced))
            if pending:
                done = await asyncio.gather(*pending.values())
                results.update(zip(pending, done, strict=True))
        except BaseException:
            for task in pending.values():
                task.cancel()
            raise
        return results
