"""The pipeline's ingress: one Serve deployment per pipeline that serves the gRPC front door itself.

Each ingress replica holds the feature stage, every model placed ``ingress`` (a :class:`ModelRunner` per
model, hot-swapped through Serve's ``user_config`` like a model deployment), handles to the models in
their own deployments, the decision flow and riskserve's own gRPC server. The tabular path of a decision
never leaves this process, reason codes and shadow candidates (``user_config`` too) included. Operators
reach the same replicas through Serve handles (status, swaps, shadows, learning), never through the data
plane.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import grpc

from riskserve.audit.writer import AuditCounts
from riskserve.features.stage import FeatureStage
from riskserve.platform.errors import InvalidInput, ModelUnavailable, NotFound, RiskServeError
from riskserve.platform.metrics import PipelineMetrics
from riskserve.platform.runner import CandidateReport, ModelRunner, ModelStatus
from riskserve.platform.tracing import configure_tracing
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.schema.pipeline import PipelineSpec
from riskserve.serving.auditing import audit_writer
from riskserve.serving.auth import label_source
from riskserve.serving.flow import DecisionFlow
from riskserve.serving.frontdoor import Admission, FrontDoor
from riskserve.serving.guarded_call import GuardedModel, LocalEndpoint, MatrixSharer, RemoteEndpoint
from riskserve.serving.labels import record_label
from riskserve.serving.messages import describe_response
from riskserve.serving.model_lane import Lanes, LaneUse
from riskserve.serving.reasons import ReasonExplainer
from riskserve.serving.shadow import ShadowFigures, Shadows
from riskserve.serving.tokens import Caller
from riskserve.serving.version_watch import VersionWatcher
from riskserve.state.db import open_database
from riskserve.state.versions import VersionsStore
from riskserve.wrappers import BackendEntry, backend, register_backend

__all__ = ["PipelineIngress"]

logger = logging.getLogger(__name__)

HEALTH_REFRESH_S = 1.0
"""How often the ingress asks its remote models whether they are ready (health answers from this)."""
HEALTH_PROBE_TIMEOUT_S = 1.0


class PipelineIngress:
    """Serve deployment: the front door, the decision flow and the models placed in the ingress."""

    async def __init__(  # type: ignore[misc]
        self,
        spec: dict[str, Any],
        features: Any,
        models: dict[str, Any],
        feedback: Any = None,
        registered: dict[str, BackendEntry] | None = None,
    ) -> None:
        """``registered``: test-only backend kinds the builder's process registered (see ``wrappers``)."""
        for kind, entry in (registered or {}).items():
            register_backend(kind, *entry)
        self._spec = PipelineSpec.model_validate(spec)
        self._tracing = configure_tracing(self._spec.tracing)
        self.name = self._spec.name
        self.decision_timeout_ms = self._spec.serving.decision_timeout_ms
        serving = self._spec.serving
        self._runners: dict[str, ModelRunner] = {}
        self._remote: dict[str, Any] = dict(models)
        self._lanes: dict[str, Lanes] = {}
        sharer = MatrixSharer(serving.by_value_rows, serving.matrix_retain_s)
        self._sharer = sharer
        guarded: dict[str, GuardedModel] = {}
        for name, model in self._spec.models.items():
            if model.in_ingress:
                settings = self._spec.runner_settings(name)
                columns, declared = self._spec.runner_columns(name)
                runner = ModelRunner(
                    name, model.kind, settings, columns, declared, backends=backend, placement="ingress"
                )
                self._runners[name] = runner
                endpoint: Any = LocalEndpoint(runner, serving.inline_rows, model.reads_text)
            else:
                handle = models[name]
                lanes = Lanes(handle.app_name, handle.deployment_name) if serving.model_lanes else None
                if lanes is not None:
                    self._lanes[name] = lanes
                endpoint = RemoteEndpoint(handle, model.reads_text, sharer, lanes)
            guarded[name] = GuardedModel.build(name, model, endpoint)
        self._feedback = feedback
        local_stage = None
        if serving.feature_stage == "ingress":
            local_stage = FeatureStage(spec["features"], spec.get("tracing"), serving.matrix_retain_s)
        explainer = ReasonExplainer(self._spec, self._runners) if self._spec.reasons is not None else None
        self._shadows = Shadows(self._spec, self._runners)
        # One pool per replica for everything it keeps: the audit trail it ships and the record it watches.
        self._db = await asyncio.to_thread(open_database, self._spec.state_dsn())
        self._audit = await asyncio.to_thread(audit_writer, self._spec, self._db)
        self._flow = DecisionFlow(
            self._spec,
            models=guarded,
            local_stage=local_stage,
            stage_handle=features,
            explainer=explainer,
            shadows=self._shadows,
            audit=self._audit,
        )
        self._local_stage = local_stage
        self._features = features
        self.metrics: PipelineMetrics = self._flow.metrics
        self._draining = False
        self._remote_ready = not self._remote
        self._remote_versions: dict[str, str] = {}
        """Each remote model's serving version as of the last health probe (``Describe`` answers from it)."""
        admission = Admission(
            serving.ingress.max_ongoing_requests,
            serving.ingress.max_queued_requests,
            max_lag_s=serving.grpc.max_loop_lag_ms / 1e3 if serving.grpc.max_loop_lag_ms else None,
            max_wait_s=serving.grpc.max_queue_wait_ms / 1e3 if serving.grpc.max_queue_wait_ms else None,
        )
        self._front_door = FrontDoor(self, serving.grpc, admission)
        self._refresher: asyncio.Task[None] | None = None
        self._watcher = VersionWatcher(
            VersionsStore(self._db),
            self.name,
            self._runners,
            {name: str(self._spec.artifact_path(name).resolve()) for name in self._runners},
            shadows=self._shadows.configure,
        )
        await self._watcher.apply_now()  # serve what the versions record says before anything else
        self._watcher.start()
        await self._open()

    # -- Serve's hooks ---------------------------------------------------------------------------------

    async def reconfigure(self, config: dict[str, Any]) -> None:
        """Serve's ``user_config`` hook: ``draining`` (before a shutdown) makes health report NOT_SERVING,
        so load balancers move away. What the models serve is not here: the versions record says it."""
        self._draining = bool(config.get("draining", False))
        await self._report_health()

    async def _open(self) -> None:
        """Start the front door once every model placed here is loaded, and the health refresher."""
        if self._refresher is None:
            await self._front_door.start()
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_health())

    def check_health(self) -> None:
        """Serve's liveness probe: every model placed here is loaded and the front door is up."""
        for name, runner in self._runners.items():
            if not runner.ready:
                raise ModelUnavailable(f"model '{name}' is not ready")
        if self._refresher is not None and self._refresher.done():
            raise ModelUnavailable("the health refresher stopped")

    async def __del__(self) -> None:
        """Serve awaits this at replica shutdown: drain the front door, then unload the models."""
        if self._refresher is not None:
            self._refresher.cancel()
        await asyncio.shield(self._watcher.stop())
        await asyncio.shield(self._front_door.stop())
        await asyncio.shield(self._shadows.stop())
        for runner in self._runners.values():
            await asyncio.shield(runner.stop())
        if self._audit is not None:  # after the drain: every answered decision shipped (or journaled)
            await asyncio.to_thread(self._audit.close)
        await asyncio.to_thread(self._db.close)
        await asyncio.to_thread(self._tracing.release)

    # -- health -------------------------------------------------------------------------------------------

    async def _refresh_health(self) -> None:
        while True:
            try:
                await self._probe_remote()
                await self._report_health()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("health refresh failed")
            await asyncio.sleep(HEALTH_REFRESH_S)

    async def _probe_remote(self) -> None:
        """Each remote model is ready when a replica says so through its handle, or when one of its lanes
        on this node answers its health check (a lane is announced only once its model is ready): a hung
        replica the handle happens to pick must not make the whole pipeline NOT_SERVING."""
        if not self._remote:
            return
        alive: dict[str, int] = {}
        for name, lanes in self._lanes.items():
            try:
                await lanes.refresh()
                alive[name] = await lanes.probe()
            except Exception:
                logger.warning("could not refresh the lanes of model '%s'", name, exc_info=True)

        async def ready(name: str, handle: Any) -> bool:
            try:
                status = await asyncio.wait_for(handle.metadata.remote(), timeout=HEALTH_PROBE_TIMEOUT_S)
            except Exception:
                return alive.get(name, 0) > 0
            self._remote_versions[name] = str(status.version or "")
            return bool(status.ready) or alive.get(name, 0) > 0

        answers = await asyncio.gather(*(ready(name, handle) for name, handle in self._remote.items()))
        self._remote_ready = all(answers)

    def serving(self) -> bool:
        """Whether this replica answers SERVING: not draining, every model loaded and ready."""
        local = all(runner.ready for runner in self._runners.values())
        return local and self._remote_ready and not self._draining

    async def _report_health(self) -> None:
        await self._front_door.set_serving(self.serving())

    # -- the front door's calls ------------------------------------------------------------------------

    async def decide(
        self, requests: Any, trace_id: str, deadline: float, traced: bool, into: Any = None
    ) -> Any:
        """Decide a batch (the front door's Decide and DecideBatch; ``into``: see
        :meth:`~riskserve.serving.flow.DecisionFlow.decide`)."""
        return await self._flow.decide(requests, trace_id, deadline, traced, into)

    async def describe(self) -> pb.DescribeResponse:
        """The pipeline's features and models with their serving versions, from the state this replica
        keeps (models in the ingress: their runner; the others: the last health probe, at most
        ``HEALTH_REFRESH_S`` old), so a flood of ``Describe`` never fans out to the model replicas."""
        versions = {name: str(runner.status().version or "") for name, runner in self._runners.items()}
        for name in self._remote:
            versions[name] = self._remote_versions.get(name, "")
        return describe_response(self._spec, versions)

    async def feedback(
        self, request: pb.FeedbackRequest, caller: Caller | None = None, deadline: float | None = None
    ) -> pb.FeedbackResponse:
        """Record the true outcome of a past decision; answered only once the label is durable.

        The decision is ``decision_id`` (the id its Decide answer gave) or, for older clients, the one
        decision made for ``request_id``.

        ``caller``: the authenticated caller when the front door checks tokens; the label's source is then
        its identity (:func:`~riskserve.serving.auth.label_source`), else the request's ``source``.
        ``deadline`` (monotonic; default: the pipeline's ``decision_timeout_ms`` from now): the call's own,
        which bounds every wait (:func:`~riskserve.serving.labels.record_label`).

        A retried ``feedback_id`` answers ``duplicate=true`` and is applied once. Errors: no such decision
        (NOT_FOUND), label not 0/1 or empty ids (INVALID_ARGUMENT, field named), the id reused for another
        label (ABORTED), a decision already labelled with the other value (ALREADY_EXISTS), the source
        or all sources over their rate (RESOURCE_EXHAUSTED), the log unreachable (UNAVAILABLE), no answer
        from it before the deadline (DEADLINE_EXCEEDED: resend with the same ``feedback_id``), no feedback
        in this pipeline (UNIMPLEMENTED).
        """
        audit = self._audit
        if self._feedback is None or audit is None:
            raise _Unimplemented(
                f"pipeline '{self.name}' keeps no feedback (its YAML has no 'feedback' section)"
            )
        if request.label not in (0, 1):
            raise InvalidInput(f"must be 0 or 1, got {request.label}", field="label")
        source = label_source(request.source, caller)
        if deadline is None:
            deadline = time.monotonic() + self.decision_timeout_ms / 1e3
        # A label sent right after its decision must find it in the audit trail the feedback log joins
        # labels to: this replica's records submitted so far leave memory first. With write-ahead they are
        # on its journal already, where the log looks too, so a slow store only costs the lookup a search.
        ack = await record_label(self._feedback, audit, request, source, deadline)
        if ack["accepted"] and not ack["duplicate"]:
            self._shadows.label(request.decision_id or request.request_id, int(request.label))
        return pb.FeedbackResponse(
            accepted=ack["accepted"],
            duplicate=ack["duplicate"],
            model_version=ack["model_version"],
            seq=ack["seq"],
        )

    # -- operators' calls (Serve handles) ----------------------------------------------------------------

    def endpoint(self) -> str:
        """``HOST:PORT`` this replica's front door serves."""
        return f"{self._front_door.host}:{self._front_door.port}"

    def draining(self) -> bool:
        """Whether this pipeline is draining (before a shutdown)."""
        return self._draining

    async def model_status(self, name: str) -> ModelStatus:
        """What a model serves now, wherever it runs (a model in a deployment: one of its replicas)."""
        runner = self._runners.get(name)
        if runner is not None:
            return runner.status()
        handle = self._remote.get(name)
        if handle is None:
            raise NotFound(f"pipeline '{self.name}' has no model '{name}'")
        status: ModelStatus = await handle.metadata.remote()
        return status

    async def verify_candidate(self, name: str, artifact: str) -> CandidateReport:
        """Load ``artifact`` beside model ``name``'s serving version and check it, without serving it."""
        runner = self._runners.get(name)
        if runner is not None:
            return await runner.verify_candidate(artifact)
        handle = self._remote.get(name)
        if handle is None:
            raise NotFound(f"pipeline '{self.name}' has no model '{name}'")
        report: CandidateReport = await handle.verify_candidate.remote(artifact)
        return report

    async def model_versions(self) -> dict[str, str]:
        """Each model's serving version."""
        names = list(self._spec.models)
        statuses = await asyncio.gather(*(self.model_status(n) for n in names))
        return {name: str(status.version or "") for name, status in zip(names, statuses, strict=True)}

    async def learning_status(self) -> dict[str, Any]:
        """The feedback service's status (cursor, pending labels, batch outcomes per online model) and
        what this replica's audit writer, which keeps the decisions labels join, did (``audit``)."""
        if self._feedback is None:
            raise InvalidInput(f"pipeline '{self.name}' has no feedback section", field="feedback")
        status: dict[str, Any] = await self._feedback.status.remote()
        if self._audit is not None:  # the decisions labels are joined to: this replica's audit writer
            status["audit"] = dataclasses.asdict(self._audit.counts())
        # Which replica answered: an operator view asks until every ingress replica has.
        status["replica"] = next((r.status().actor_id for r in self._runners.values()), "")
        return status

    def audit_status(self) -> AuditCounts | None:
        """What this replica's audit writer did (``None``: the pipeline keeps no trail)."""
        return None if self._audit is None else self._audit.counts()

    async def audit_flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every decision this replica made is in its audit store (drills, tests)."""
        return self._audit is None or await asyncio.to_thread(self._audit.flush, timeout_s)

    def lane_use(self) -> dict[str, LaneUse]:
        """Per model in its own deployment: the lanes this replica holds and the calls each path took."""
        uses = {}
        for name, model in self._flow.models.items():
            endpoint = model.endpoint
            if isinstance(endpoint, RemoteEndpoint):
                lanes = len(endpoint.lanes) if endpoint.lanes is not None else 0
                uses[name] = LaneUse(lanes, endpoint.lane_calls, endpoint.handle_calls)
        return uses

    async def shadow_status(self) -> list[ShadowFigures]:
        """Every shadow's comparison figures in this replica."""
        statuses = {name: runner.status() for name, runner in self._runners.items()}
        versions = {name: str(status.version or "") for name, status in statuses.items()}
        replica = next((status.actor_id for status in statuses.values()), "")
        return [f.model_copy(update={"replica": replica}) for f in self._shadows.figures(versions)]

    def breaker_states(self) -> dict[str, str]:
        """Each model's breaker state in this ingress replica."""
        return {name: str(model.breaker.state) for name, model in self._flow.models.items()}

    async def feature_stats(self) -> dict[str, Any]:
        """The feature stage's counters (tests prove it ran once per decision)."""
        if self._local_stage is not None:  # the batch id is that of the last matrix this ingress shared
            return {**self._local_stage.stats(), "last_batch_id": self._sharer.last_batch_id}
        stats: dict[str, Any] = await self._features.stats.remote()
        return stats


class _Unimplemented(RiskServeError):
    """An RPC this pipeline does not offer (``Feedback`` without a ``feedback`` section)."""

    grpc_status = grpc.StatusCode.UNIMPLEMENTED
