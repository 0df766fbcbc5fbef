"""The feedback service: one Serve deployment per pipeline that owns its feedback log and learners.

Its feedback log lives in the pipeline's state database (``state.dsn``: a SQLite file on one machine,
PostgreSQL on a cluster), with the learners' cursors and checkpoints and the holdout key, so the service
can restart on any node and continue. It reads the decisions the labels name from the pipeline's audit
trail, in the same database (the log keeps no copy of them), wherever the decision was made. It admits
labels (:class:`~riskserve.learning.admission.LabelAdmission`: rate limits per source and for all
sources, one label per decision, then a durable commit before the answer), and a background thread runs
each online model's :class:`~riskserve.learning.learner.OnlineLearner` and publishes every new version by
writing it into the pipeline's versions record (:mod:`riskserve.operations.publish`), which every replica
pulls: nothing is redeployed. With an artifact store (``state.artifacts``) each learned version is copied
there first, so replicas on every node can fetch it. The cursor in the log names the version that should
serve; when the record names another one, the service publishes the cursor's again (a crash fell between
the commit and the publish), unless ``riskserve up --reset`` forgot the record since: then the learner
adopts the YAML's artifact, which serves.

It is also the pipeline's ONE publisher: learner batches, reconciliation and hot swaps
(:meth:`FeedbackService.swap`) all publish under one lock, a swap is a compare-and-set on the version it
was verified against, and :meth:`FeedbackService.fence` (called before a shutdown drains the pipeline)
stops every later publish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import asdict
from typing import Any

from riskserve.audit.lookup import DecisionLookup
from riskserve.learning.admission import LabelAdmission
from riskserve.learning.feedback_log import FeedbackLog
from riskserve.learning.learner import BatchReport, OnlineLearner, load_version
from riskserve.learning.rate_limit import SourceRateLimiter
from riskserve.operations.publish import publish_version
from riskserve.operations.served import base_of
from riskserve.platform.artifact_store import ArtifactStore, fetch_verified
from riskserve.platform.artifacts import open_artifact
from riskserve.platform.errors import ConfigError, Conflict, ModelUnavailable
from riskserve.platform.metrics import LearningMetrics
from riskserve.schema.pipeline import PipelineSpec
from riskserve.state.db import open_database
from riskserve.state.versions import Source, VersionsStore
from riskserve.wrappers import BackendEntry, register_backend

__all__ = ["FeedbackService"]

logger = logging.getLogger(__name__)

WAKE_S = 0.25
"""The learner thread looks for due mini-batches at least this often (a new label wakes it at once)."""
PROBE_S = 5.0
"""How often the serving version is compared with the cursor's when nothing else happens."""
PURGE_S = 600.0
ERROR_BACKOFF_S = 2.0


def _ship_wait_s(spec: PipelineSpec) -> float:
    """How long a label waits for a decision not in the trail yet: two of the ingress replicas' shipping
    intervals and a transaction's time (a decision answered on another node is in the database by then)."""
    return 0.0 if spec.audit is None else 2 * spec.audit.flush_ms / 1e3 + 0.25


class FeedbackService:
    """Serve deployment: ``record_feedback``, ``status``; learns in a thread."""

    def __init__(self, spec: dict[str, Any], registered: dict[str, BackendEntry] | None = None) -> None:
        """``registered``: test-only backend kinds the builder's process registered (see ``wrappers``)."""
        for kind, entry in (registered or {}).items():
            register_backend(kind, *entry)
        self._spec = PipelineSpec.model_validate(spec)
        db = open_database(self._spec.state_dsn())  # one pool for the log, the trail and the record
        self._versions = VersionsStore(db)
        root = self._spec.state.artifacts
        self._artifacts = ArtifactStore(root) if root else None
        self._yaml_versions: dict[str, str] = {}
        feedback = self._spec.feedback
        if feedback is None:
            raise ConfigError(f"pipeline '{self._spec.name}' has no feedback section")
        self._log = FeedbackLog(
            db,
            lookup=DecisionLookup(db, self._spec.audit_dir()) if self._spec.audit is not None else None,
            retention_s=feedback.retention_hours * 3600,
            find_wait_s=_ship_wait_s(self._spec),
        )
        limiter = SourceRateLimiter(
            feedback.source_rate_per_s,
            feedback.source_burst,
            total_rate_per_s=feedback.total_rate_per_s,
            total_burst=feedback.total_burst,
        )
        self._metrics = LearningMetrics(self._spec.name)
        self._admission = LabelAdmission(self._log, limiter, self._metrics)
        key = self._log.holdout_key()  # the database's: every node splits labels alike
        self._learners: dict[str, OnlineLearner] = {}
        for name in self._spec.online_models():
            online = self._spec.models[name].online
            assert online is not None
            self._log.register_model(name)
            self._learners[name] = OnlineLearner(
                self._log, name, online, self._spec.learned_dir(name), holdout_key=key
            )
        self._published: dict[str, str] = {}
        self._probed: dict[str, float] = {}
        self._counts: dict[str, dict[str, int]] = {name: {} for name in self._learners}
        self._last_report: dict[str, BatchReport] = {}
        self._last_error: dict[str, str] = {}
        self._publish_seconds: dict[str, float] = {}
        self._publishes: dict[str, int] = {}
        self._drift_of: dict[str, float] = {}
        self._cycle_lock = threading.Lock()  # one step, adoption or publish at a time
        self._fenced = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="riskserve-learner", daemon=True)
        self._thread.start()

    # -- called by the ingress ------------------------------------------------------------------------

    async def record_feedback(
        self, request_id: str, label: int, feedback_id: str, source: str, decision_id: str = ""
    ) -> dict[str, Any]:
        """Admit one label: rate limit (a retry is never limited), commit durably, then answer.

        Raises:
            Overloaded: the source or all sources are over their rate. AlreadyExists: the decision has
                a label of the other value. InvalidInput, NotFound, Conflict: see the log.
        """
        return await asyncio.to_thread(
            self._record_feedback, request_id, label, feedback_id, source, decision_id
        )

    def _record_feedback(
        self, request_id: str, label: int, feedback_id: str, source: str, decision_id: str
    ) -> dict[str, Any]:
        ack = self._admission.admit(request_id, label, feedback_id, source, decision_id=decision_id)
        if not ack.duplicate:
            self._wake.set()
        first = next(iter(self._learners), None)
        version = self._log.cursor(first).version if first is not None else None
        return {**asdict(ack), "model_version": version or ""}

    # -- called by swaps and tools -------------------------------------------------------------------

    async def adopt(self, model: str, artifact: str) -> str:
        """Train later labels on ``artifact`` (a hot swap of an online model); returns its version."""
        learner = self._learner(model)

        def adopt() -> str:
            with self._cycle_lock:  # not between a step's read of its parent and its commit
                version = learner.adopt(artifact)
                self._published[model] = version.version
                self._drift_of[model] = 0.0
                return version.version

        return await asyncio.to_thread(adopt)

    async def swap(
        self, model: str, artifact: str, version: str, expected: str, source: Source = "swap"
    ) -> None:
        """Serve ``artifact`` (holding ``version``) for ``model``, verified by the caller against the
        serving version ``expected``: one publish under the learner's lock, confirmed on every replica.

        The learner adopts it (trains later labels on it, measures drift from it) only once every replica
        serves it; a refused swap is rolled back and never adopted, so it cannot take effect later.

        Raises:
            Conflict: ``model`` no longer serves ``expected`` (another publish came first): verify again.
            ModelLoadError: a replica refused it, or it is not a learnable artifact; nothing changed.
            ModelUnavailable: the pipeline is shutting down.
        """
        await asyncio.to_thread(self._swap, model, artifact, version, expected, source)

    def _swap(self, model: str, artifact: str, version: str, expected: str, source: Source) -> None:
        with self._cycle_lock:
            self._check_open(version)
            _, serving, _ = self._serving(model)
            if serving != expected:
                raise Conflict(
                    f"'{model}' serves {serving}, not {expected} the candidate was verified against: "
                    "another publish came first; run the swap again"
                )
            learner = self._learners.get(model)
            if learner is not None:
                load_version(self._local(artifact))  # learnable (a golden set) before anything is published
            publish_version(
                self._spec, self._versions, model, artifact, version, source=source, expected=expected
            )
            if learner is not None:
                learner.adopt(self._local(artifact))
                self._drift_of[model] = 0.0
            self._published[model] = version

    async def fence(self) -> None:
        """Publish nothing more (a shutdown is about to drain and delete the pipeline); waits for a
        publish in progress to end."""

        def fence() -> None:
            with self._cycle_lock:
                self._fenced = True

        await asyncio.to_thread(fence)

    async def learn_now(self, model: str) -> dict[str, Any] | None:
        """Apply the pending labels now, even a partial mini-batch (drills, demos); publish the result."""
        report = await asyncio.to_thread(self._cycle, model, True)
        return None if report is None else report.model_dump(mode="json")

    async def status(self) -> dict[str, Any]:
        """Per online model: cursor, pending labels, batch outcomes, last report and error."""
        return await asyncio.to_thread(self._status)

    def _status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"log": self._log.location, "pid": os.getpid(), "models": {}}
        for name in self._learners:
            cursor = self._log.cursor(name)
            last = self._last_report.get(name)
            out["models"][name] = {
                "last_seq": cursor.last_seq,
                "version": cursor.version,
                "artifact": cursor.artifact,
                "baseline": cursor.baseline,
                "paused": cursor.paused,
                "drift": self._drift(name),
                "pending": self._log.pending_count(name),
                "batches": dict(self._counts[name]),
                "last_report": None if last is None else last.model_dump(mode="json"),
                "last_error": self._last_error.get(name, ""),
                "last_publish_s": self._publish_seconds.get(name),
                "publishes": self._publishes.get(name, 0),
            }
        return out

    def check_health(self) -> None:
        """Serve's liveness probe: the learner thread must be running."""
        if not self._thread.is_alive():
            raise ModelUnavailable("the online-learning thread has stopped")

    def __del__(self) -> None:
        self._stop.set()
        self._wake.set()

    # -- the learner thread ----------------------------------------------------------------------------

    def _learner(self, model: str) -> OnlineLearner:
        learner = self._learners.get(model)
        if learner is None:
            raise ConfigError(f"model '{model}' does not learn online (no 'online' section)")
        return learner

    def _run(self) -> None:
        purged_at = time.monotonic()
        while not self._stop.is_set():
            self._wake.wait(WAKE_S)
            self._wake.clear()
            failed = False
            for name in self._learners:
                try:
                    self._cycle(name, False)
                    self._last_error.pop(name, None)
                except Exception as error:
                    failed = True
                    self._last_error[name] = f"{type(error).__name__}: {error}"
                    logger.exception("online learning of '%s' failed; retrying", name)
            if time.monotonic() - purged_at > PURGE_S:
                purged_at = time.monotonic()
                self._log.purge_expired()
            if failed:
                self._stop.wait(ERROR_BACKOFF_S)

    def _cycle(self, name: str, force: bool) -> BatchReport | None:
        """Make the model serve the cursor's version, then apply one due mini-batch and publish it."""
        with self._cycle_lock:
            return self._cycle_locked(name, force)

    def _cycle_locked(self, name: str, force: bool) -> BatchReport | None:
        learner = self._learner(name)
        self._reconcile(name, learner)
        report = learner.step(force=force)
        if report is None:
            paused = bool(self._log.cursor(name).paused)
            self._metrics.learning_state(name, paused=paused, drift=self._drift(name))
            return None
        self._last_report[name] = report
        counts = self._counts[name]
        counts[report.outcome] = counts.get(report.outcome, 0) + 1
        if report.outcome == "paused":
            logger.error("online learning of '%s' paused: %s", name, report.reason)
        if report.changed:
            self._drift_of[name] = report.drift
            self._publish(name, report.version, report.artifact)
        self._metrics.learning_state(name, paused=report.outcome == "paused", drift=self._drift(name))
        return report

    def _drift(self, name: str) -> float:
        """The learned version's L2 drift from the baseline, as the batch that made it measured it."""
        return self._drift_of.get(name, 0.0)

    def _reconcile(self, name: str, learner: OnlineLearner) -> None:
        cursor = self._log.cursor(name)
        due = time.monotonic() - self._probed.get(name, 0.0) > PROBE_S
        known = cursor.version is not None and cursor.artifact is not None
        if known and not due and self._published.get(name) == cursor.version:
            return
        artifact, version, reset = self._serving(name)
        self._probed[name] = time.monotonic()
        if cursor.version is None or cursor.artifact is None or reset:
            if cursor.version != version:  # the first version seen, or the YAML's after a reset
                learner.adopt(self._local(artifact))
                self._drift_of[name] = 0.0
            self._published[name] = version
            return
        if version == cursor.version:
            self._published[name] = cursor.version
            return
        logger.info("'%s' serves %s, the log says %s: publishing it", name, version, cursor.version)
        self._publish(name, cursor.version, cursor.artifact)

    def _serving(self, name: str) -> tuple[str, str, bool]:
        """What the versions record says ``name`` serves: its artifact, its version, and whether that is the
        YAML's because ``riskserve up --reset`` forgot every recorded version."""
        base = base_of(self._spec, name)
        record = self._versions.read(self._spec.name)
        entry = record.serving(name, base)
        if entry is not None:
            return entry.artifact, entry.version, False
        if name not in self._yaml_versions:
            self._yaml_versions[name] = open_artifact(base, kind=self._spec.models[name].kind).version
        return base, self._yaml_versions[name], record.reset_at > 0

    def _local(self, artifact: str) -> str:
        """A local directory for ``artifact`` (an artifact-store URI is fetched into the cache, verified)."""
        if not ArtifactStore.is_remote(artifact):
            return artifact
        return str(fetch_verified(artifact, kind="sklearn"))

    def _check_open(self, version: str) -> None:
        if self._stop.is_set() or self._fenced:
            raise ModelUnavailable(f"the pipeline is shutting down; {version} not published")

    def _publish(self, name: str, version: str, artifact: str) -> None:
        """Write ``artifact`` (copied to the artifact store first, when there is one) into the versions
        record and wait for every replica of the model; a replica that refuses takes it out again (the cursor
        still names ``version``, so reconciliation tries again)."""
        self._check_open(version)
        started = time.monotonic()
        if self._artifacts is not None:
            artifact = self._artifacts.put(artifact, kind="sklearn")
        _, previous, _ = self._serving(name)
        report = self._last_report.get(name)
        note = (
            f"learned from {report.rows} labels" if report is not None and report.version == version else ""
        )
        publish_version(
            self._spec,
            self._versions,
            name,
            artifact,
            version,
            source="learned",
            expected=previous,
            note=note,
        )
        self._publish_seconds[name] = time.monotonic() - started
        self._publishes[name] = self._publishes.get(name, 0) + 1
        self._published[name] = version
