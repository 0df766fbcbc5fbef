"""Online learning of one scikit-learn model from the feedback log: mini-batches, exactly once, guarded.

One :meth:`OnlineLearner.step`:

1. reads the labels after the model's cursor: a mini-batch of ``batch_size`` labels, or fewer once the
   oldest has waited ``interval_ms``;
2. splits them: one label in ``holdout_every`` (chosen by an HMAC of its ``feedback_id`` under the
   pipeline's secret key, so a replay, on any node, splits the same way and a caller cannot choose the
   split) is held out for validation, the others train;
3. runs ``partial_fit`` on a copy of the cursor's version and scales the step down to ``max_coef_step``
   (the L2 norm of the change to coefficients and intercept), so a burst of poisoned labels moves the
   model a bounded distance;
4. judges the candidate: golden rows finite, in [0, 1], not constant, none moved by more than
   ``max_golden_shift``; on the held-out window (labels held out of earlier accepted batches), a
   log-loss no worse than the serving version's by more than ``max_logloss_increase``. A candidate that
   fails is reverted: the batch is consumed, the version stays, its held-out labels do not join the
   window, and the report says why;
5. bounds the total drift: a candidate farther from the served baseline (the version last adopted) than
   ``max_drift`` (L2 of coefficients and intercept) or ``max_drift_logloss`` (log-loss on the baseline's
   golden rows against the baseline's own scores) is not served and learning PAUSES: the batch stays
   pending, the cursor records why, and only adopting a version (a swap) resumes. Per-batch caps bound one
   step; this bounds the sum of many small poisoned steps;
6. writes the candidate as a verifiable artifact (content-addressed directory, fsynced, atomic rename);
7. moves cursor, version, artifact, held-out ids, the batch report and the version's checkpoint in ONE
   commit of the log.

A crash anywhere before step 7 leaves the cursor where it was: the restarted learner reads the same labels
onto the same parent and, the steps being deterministic, writes the same version. So every label is in
the served lineage exactly once (see :mod:`riskserve.learning.feedback_log`).

The learner's whole state is in the state database (the cursor and the checkpoint of the version it
names); its ``artifact_dir`` is where versions are written, and a cache any node can rebuild. A learner
restarted on a node whose disk lacks the cursor's artifact (or holds it damaged) rebuilds it from the
checkpoint into its ``artifact_dir`` (:meth:`OnlineLearner.restore`) and carries on: the artifact is
content-addressed, so the rebuilt one must hash to the version the cursor names, or it is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel as _Schema
from pydantic import ConfigDict

from riskserve.learning.feedback_log import Batch, Checkpoint, Cursor, FeedbackLog
from riskserve.platform.durable import fsync_dir
from riskserve.platform.errors import ModelLoadError
from riskserve.schema.pipeline import OnlineLearningSpec
from riskserve.wrappers.sklearn_model import (
    GOLDEN_FILE,
    LinearParams,
    LinearSnapshot,
    ScalerParams,
    load_sklearn_artifact,
    save_sklearn_artifact,
    snapshot_scores,
)

__all__ = [
    "BatchReport",
    "LearnedVersion",
    "OnlineLearner",
    "cap_step",
    "checkpoint_of",
    "drift_from",
    "is_holdout",
    "load_version",
    "log_loss",
    "train_step",
]

logger = logging.getLogger(__name__)

BatchOutcome = Literal["applied", "reverted", "held_out", "paused"]


def is_holdout(feedback_id: str, every: int, key: bytes) -> bool:
    """Whether a label validates instead of training: one in ``every``, by an HMAC-SHA256 of its id under
    the pipeline's secret ``key`` (:meth:`FeedbackLog.holdout_key`: stable for a replay on any node,
    unpredictable to whoever picks the id)."""
    if every <= 0:
        return False
    digest = hmac.new(key, feedback_id.encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") % every == 0


def log_loss(y: NDArray[np.int64], p: NDArray[np.float64]) -> float:
    """Mean binary cross-entropy, with probabilities clipped away from 0 and 1."""
    q = np.clip(p, 1e-12, 1 - 1e-12)
    return float(-np.mean(y * np.log(q) + (1 - y) * np.log(1 - q)))


def cap_step(
    parent: LinearSnapshot, candidate: LinearSnapshot, cap: float
) -> tuple[LinearSnapshot, float, bool]:
    """``candidate`` with its change from ``parent`` scaled to an L2 norm of at most ``cap``.

    Returns the (possibly scaled) snapshot, the norm of the unscaled step, and whether it was scaled.
    """
    old = np.append(parent.coef, parent.params.intercept)
    new = np.append(candidate.coef, candidate.params.intercept)
    norm = float(np.linalg.norm(new - old))
    if norm <= cap:
        return candidate, norm, False
    scaled = old + (new - old) * (cap / norm)
    params = candidate.params.model_copy(
        update={"coef": [float(v) for v in scaled[:-1]], "intercept": float(scaled[-1])}
    )
    return LinearSnapshot.from_params(params), norm, True


def drift_from(baseline: LearnedVersion, candidate: LinearSnapshot) -> tuple[float, float]:
    """How far ``candidate`` is from the served ``baseline``: the L2 norm of the change of (coefficients,
    intercept), and the candidate's log-loss on the baseline's golden rows against the baseline's own
    probabilities minus the baseline's (the mean KL divergence on that fixed reference set; 0 = same).

    Raises:
        ModelLoadError: the candidate has another width than the baseline (it is not of its lineage).
    """
    old = np.append(baseline.snapshot.coef, baseline.snapshot.params.intercept)
    new = np.append(candidate.coef, candidate.params.intercept)
    if old.shape != new.shape:
        raise ModelLoadError(f"candidate has {new.size - 1} coefficients, the baseline {old.size - 1}")
    target = snapshot_scores(baseline.snapshot, baseline.golden_x)
    excess = _cross_entropy(target, snapshot_scores(candidate, baseline.golden_x)) - _cross_entropy(
        target, target
    )
    return float(np.linalg.norm(new - old)), max(excess, 0.0)


def _cross_entropy(target: NDArray[np.float64], p: NDArray[np.float64]) -> float:
    q = np.clip(p, 1e-12, 1 - 1e-12)
    return float(-np.mean(target * np.log(q) + (1 - target) * np.log(1 - q)))


@dataclass(frozen=True, eq=False)
class LearnedVersion:
    """A verified version a learner trains from: its snapshot, artifact and golden rows."""

    snapshot: LinearSnapshot
    artifact: Path
    feature_names: tuple[str, ...]
    golden_x: NDArray[np.float32]
    info: dict[str, Any] = field(default_factory=dict)
    """The manifest's notes (``parent``, who made it), kept in its checkpoint so a rebuild writes them."""

    @property
    def version(self) -> str:
        """The content version."""
        return self.snapshot.version


def load_version(path: Path | str) -> LearnedVersion:
    """Open and verify an sklearn artifact as a learner's parent (it must carry a golden set).

    Raises:
        ModelLoadError: the artifact fails verification or has no golden rows.
    """
    artifact, snapshot = load_sklearn_artifact(path)
    if GOLDEN_FILE not in artifact.manifest.files:
        raise ModelLoadError(f"{artifact.root}: an online model needs a golden set ({GOLDEN_FILE})")
    golden_x = np.ascontiguousarray(artifact.read_json(GOLDEN_FILE)["x"], dtype=np.float32)
    names = tuple(artifact.manifest.feature_names)
    return LearnedVersion(snapshot, artifact.root, names, golden_x, dict(artifact.manifest.info))


def checkpoint_of(version: LearnedVersion) -> Checkpoint:
    """What the log keeps of ``version`` so that any node can rewrite its artifact
    (:meth:`OnlineLearner.restore`)."""
    return Checkpoint(
        version=version.version,
        params=version.snapshot.params.to_json_bytes().decode(),
        feature_names=version.feature_names,
        golden_x=version.golden_x,
        info=dict(version.info),
    )


class BatchReport(_Schema):
    """What one mini-batch did; stored in the log with the cursor move that consumed it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    after_seq: int
    last_seq: int
    rows: int
    trained_rows: int
    holdout_rows: int
    parent: str
    version: str
    """The version serving after this batch: the candidate, or ``parent`` when it was reverted."""
    artifact: str
    outcome: BatchOutcome
    reason: str = ""
    coef_step: float = 0.0
    """L2 norm of the step ``partial_fit`` asked for (before capping)."""
    clipped: bool = False
    golden_shift: float = 0.0
    """Largest change of a golden-row score from parent to candidate."""
    window_rows: int = 0
    logloss_before: float | None = None
    logloss_after: float | None = None
    drift: float = 0.0
    """L2 norm of the candidate's total change of (coefficients, intercept) from the served baseline."""
    drift_logloss: float = 0.0
    """The candidate's excess log-loss on the baseline's golden rows (see :func:`drift_from`)."""
    first_received_at: float
    applied_at: float

    @property
    def changed(self) -> bool:
        """Whether the batch produced a new serving version."""
        return self.version != self.parent


class OnlineLearner:
    """Applies one model's labels from the log as mini-batches; the log's cursor and checkpoints are its
    only state (see the module's docstring: any node can run it)."""

    def __init__(
        self,
        log: FeedbackLog,
        model: str,
        settings: OnlineLearningSpec,
        artifact_dir: Path,
        *,
        clock: Callable[[], float] = time.time,
        holdout_key: bytes | None = None,
    ) -> None:
        """``holdout_key``: the secret of the holdout split; default: the log's (the same on every node).
        ``artifact_dir``: where learned versions are written, and where versions this node lacks are
        rebuilt from their checkpoints."""
        self.log = log
        self.model = model
        self.settings = settings
        self.artifact_dir = Path(artifact_dir)
        self._clock = clock
        self.holdout_key = holdout_key if holdout_key is not None else log.holdout_key()
        self._parent: LearnedVersion | None = None
        self._baseline: LearnedVersion | None = None

    def current(self) -> LearnedVersion | None:
        """The version the cursor names (``None`` before a version is adopted), rebuilt from its checkpoint
        when this node's disk lacks its artifact."""
        return self._current(self.log.cursor(self.model))

    def _current(self, cursor: Cursor) -> LearnedVersion | None:
        if cursor.version is None or cursor.artifact is None:
            return None
        parent = self._parent
        if parent is None or parent.version != cursor.version:
            parent = self._parent = self._open(cursor.version, cursor.artifact)
        return parent

    def _open(self, version: str, artifact: str) -> LearnedVersion:
        """``version`` from ``artifact`` if it is there and verifies, else rebuilt from its checkpoint.

        Raises:
            ModelLoadError: neither: the artifact is missing or unusable and the log has no checkpoint.
        """
        try:
            found = load_version(artifact)
        except ModelLoadError as error:
            why = str(error)
        else:
            if found.version == version:
                return found
            why = f"{artifact}: holds version {found.version}, the log names {version}"
        logger.warning("model '%s': %s; rebuilding %s from its checkpoint", self.model, why, version)
        try:
            return self.restore(version)
        except ModelLoadError as error:
            raise ModelLoadError(f"{why}; {error}") from error

    def restore(self, version: str) -> LearnedVersion:
        """``version`` as ``artifact_dir/<version>``, rewritten from the checkpoint in the log (or found
        there already): how a learner continues on a node whose disk does not hold its cursor's artifact.

        Raises:
            ModelLoadError: the log has no checkpoint of ``version``, or the checkpoint does not hash to it
                (the artifact is content-addressed: a rebuild is the same version or nothing).
        """
        checkpoint = self.log.checkpoint(self.model, version)
        if checkpoint is None:
            raise ModelLoadError(f"model '{self.model}': the log holds no checkpoint of {version}")
        try:
            params = LinearParams.model_validate_json(checkpoint.params)
        except ValueError as error:
            raise ModelLoadError(
                f"model '{self.model}': checkpoint {version} is unreadable: {error}"
            ) from error
        snapshot = LinearSnapshot.from_params(params)
        if snapshot.version != version:
            raise ModelLoadError(
                f"model '{self.model}': the checkpoint of {version} hashes to {snapshot.version}; refused"
            )
        return self._materialize(snapshot, checkpoint.feature_names, checkpoint.golden_x, checkpoint.info)

    def adopt(self, artifact: Path | str) -> LearnedVersion:
        """Verify ``artifact`` and make it the version later labels train (a swap, or the first version);
        it becomes the served baseline drift is measured from, and paused learning resumes. Its checkpoint
        is stored in the same commit."""
        version = load_version(artifact)
        self.log.adopt(self.model, version.version, str(version.artifact), checkpoint=checkpoint_of(version))
        self._parent = version
        self._baseline = version
        return version

    def baseline(self, cursor: Cursor, parent: LearnedVersion) -> LearnedVersion:
        """The served baseline the cursor names (a cursor moved without an adoption: ``parent`` becomes
        it), rebuilt from its checkpoint when this node's disk lacks it."""
        if cursor.baseline is None:
            self.log.set_baseline(self.model, str(parent.artifact))
            self._baseline = parent
            return parent
        cached = self._baseline
        wanted = cursor.baseline_version
        if wanted is None:  # no version recorded: the directory is all there is
            if cached is None or str(cached.artifact) != cursor.baseline:
                cached = self._baseline = load_version(cursor.baseline)
            return cached
        if cached is None or cached.version != wanted:
            cached = self._baseline = (
                parent if parent.version == wanted else self._open(wanted, cursor.baseline)
            )
        return cached

    def due(self, batch: Batch) -> bool:
        """A full mini-batch, or a partial one whose oldest label has waited ``interval_ms``."""
        if len(batch) == 0:
            return False
        waited_ms = (self._clock() - batch.first_received_at) * 1e3
        return len(batch) >= self.settings.batch_size or waited_ms >= self.settings.interval_ms

    def step(self, *, force: bool = False) -> BatchReport | None:
        """Apply the next mini-batch if one is due (or ``force``); ``None`` when there was nothing to do.

        A paused model does nothing (``None``); the step that pauses it returns a ``paused`` report and
        leaves its batch pending.

        Raises:
            ModelLoadError: no version was adopted yet, or the cursor's artifact fails verification.
            Conflict: another learner moved the cursor meanwhile (nothing was applied by this one).
        """
        cursor = self.log.cursor(self.model)
        if cursor.paused:
            return None
        parent = self._current(cursor)
        if parent is None:
            raise ModelLoadError(f"model '{self.model}': no version adopted yet; nothing to train from")
        baseline = self.baseline(cursor, parent)
        batch = self.log.pending(self.model, limit=self.settings.batch_size)
        if len(batch) == 0:
            if batch.last_seq > batch.after_seq and cursor.version is not None:  # only skipped labels
                self.log.mark_applied(
                    self.model,
                    batch.last_seq,
                    cursor.version,
                    expected_last_seq=batch.after_seq,
                    artifact=cursor.artifact,
                )
                self._skipped(batch)
            return None
        if not (force or self.due(batch)):
            return None
        report, holdout_seqs, made = self._judge(parent, batch, baseline)
        if report.outcome == "paused":
            self.log.pause(self.model, report.reason)
            return report
        serving = made if made is not None else parent
        self.log.mark_applied(
            self.model,
            batch.last_seq,
            report.version,
            expected_last_seq=batch.after_seq,
            artifact=report.artifact,
            holdout_seqs=holdout_seqs,
            report=report.model_dump(mode="json"),
            checkpoint=checkpoint_of(serving),
        )
        self._parent = serving
        self._skipped(batch)
        if report.changed:
            self._prune(keep={report.version, parent.version, baseline.version})
            self.log.prune_checkpoints(self.model, keep=self.settings.keep_versions)
        return report

    def _skipped(self, batch: Batch) -> None:
        """Log the labels a batch moved past without a row to train on."""
        if batch.unjoined:
            logger.warning(
                "model '%s': %d labels skipped, their decisions' audit records are gone: %s",
                self.model,
                len(batch.unjoined),
                ", ".join(batch.unjoined[:5]),
            )

    def _judge(
        self, parent: LearnedVersion, batch: Batch, baseline: LearnedVersion
    ) -> tuple[BatchReport, list[int], LearnedVersion | None]:
        """Train, cap and judge a candidate; write it if it passes (returned third). Nothing here touches
        the cursor."""
        base = {
            "model": self.model,
            "after_seq": batch.after_seq,
            "last_seq": batch.last_seq,
            "rows": len(batch),
            "parent": parent.version,
            "first_received_at": batch.first_received_at,
        }
        missing = [c for c in parent.feature_names if c not in batch.columns]
        if missing:
            reason = f"decisions lack the model's columns {missing}"
            return self._report(base, parent, "reverted", reason), [], None
        index = [batch.columns.index(c) for c in parent.feature_names]
        x = np.ascontiguousarray(batch.x[:, index])
        every, key = self.settings.holdout_every, self.holdout_key
        held = np.array([is_holdout(f, every, key) for f in batch.feedback_ids], dtype=bool)
        holdout_seqs = [int(s) for s in batch.seqs[held]]
        base |= {"trained_rows": int((~held).sum()), "holdout_rows": int(held.sum())}
        if not (~held).any():
            reason = "every label of the batch is held out"
            return self._report(base, parent, "held_out", reason), holdout_seqs, None
        trained = train_step(
            parent.snapshot, x[~held], batch.y[~held], update_scaler=self.settings.update_scaler
        )
        candidate, step, clipped = cap_step(parent.snapshot, trained, self.settings.max_coef_step)
        base |= {"coef_step": step, "clipped": clipped}
        reason, checks = self._validate(parent, candidate, batch, index)
        base |= checks
        if reason:
            return self._report(base, parent, "reverted", reason), [], None
        drift, drift_logloss = drift_from(baseline, candidate)
        base |= {"drift": drift, "drift_logloss": drift_logloss}
        limits = self.settings
        if drift > limits.max_drift or drift_logloss > limits.max_drift_logloss:
            reason = (
                f"learning paused: the candidate is {drift:.4f} (L2) / {drift_logloss:.4f} (golden log-loss)"
                f" from the served baseline {baseline.version}, past max_drift {limits.max_drift} /"
                f" max_drift_logloss {limits.max_drift_logloss}; review the labels, then swap in a"
                " version to resume"
            )
            return self._report(base, parent, "paused", reason), [], None
        info = {"learned_by": "riskserve online learner", "model": self.model}
        made = self._materialize(candidate, parent.feature_names, parent.golden_x, info)
        report = BatchReport(
            **base,
            version=candidate.version,
            artifact=str(made.artifact),
            outcome="applied",
            reason="clipped to max_coef_step" if clipped else "",
            applied_at=self._clock(),
        )
        return report, holdout_seqs, made

    def _report(
        self, base: dict[str, object], parent: LearnedVersion, outcome: BatchOutcome, reason: str
    ) -> BatchReport:
        fields = {"trained_rows": 0, "holdout_rows": 0, **base}
        return BatchReport.model_validate(
            {
                **fields,
                "version": parent.version,
                "artifact": str(parent.artifact),
                "outcome": outcome,
                "reason": reason,
                "applied_at": self._clock(),
            }
        )

    def _validate(
        self,
        parent: LearnedVersion,
        candidate: LinearSnapshot,
        batch: Batch,
        index: list[int],
    ) -> tuple[str, dict[str, object]]:
        """Why the candidate must be reverted ('' if it passes), and the figures it was judged on."""
        checks: dict[str, object] = {}
        golden_new = snapshot_scores(candidate, parent.golden_x)
        golden_old = snapshot_scores(parent.snapshot, parent.golden_x)
        if not np.isfinite(golden_new).all() or golden_new.min() < 0 or golden_new.max() > 1:
            return "golden scores are not finite numbers in [0, 1]", checks
        shift = float(np.max(np.abs(golden_new - golden_old)))
        checks["golden_shift"] = shift
        if len(golden_new) > 1 and float(np.std(golden_new)) < 1e-9:
            return "the candidate gives one constant score on the golden rows", checks
        if shift > self.settings.max_golden_shift:
            return (
                f"a golden score moved by {shift:.3f} > max_golden_shift {self.settings.max_golden_shift}",
                checks,
            )
        # Judged on labels held out of earlier *accepted* batches only: a poisoned batch's own held-out
        # labels are as poisoned as its training labels, and a reverted batch's never join the window.
        window = self.log.holdout_window(self.model, batch.columns, self.settings.holdout_window)
        x, y = window.x[:, index], window.y
        checks["window_rows"] = len(y)
        if len(y) < self.settings.min_holdout_rows:
            return "", checks
        before = log_loss(y, snapshot_scores(parent.snapshot, x))
        after = log_loss(y, snapshot_scores(candidate, x))
        checks |= {"logloss_before": before, "logloss_after": after}
        if not math.isfinite(after) or after > before + self.settings.max_logloss_increase:
            margin = self.settings.max_logloss_increase
            return f"held-out log-loss {after:.4f} > {before:.4f} + max_logloss_increase {margin}", checks
        return "", checks

    def _materialize(
        self,
        snapshot: LinearSnapshot,
        feature_names: Sequence[str],
        golden_x: NDArray[np.float32],
        info: dict[str, Any],
    ) -> LearnedVersion:
        """``snapshot`` as a verifiable artifact at ``artifact_dir/<version>``, written durably (fsync,
        atomic rename), or the one there already if it verifies (an earlier attempt, or a rebuild, wrote
        the same version). A damaged one there is moved aside and written again."""
        final = self.artifact_dir / snapshot.version
        if final.is_dir():
            try:
                found = load_version(final)
            except ModelLoadError as error:
                logger.warning("model '%s': %s; writing it again", self.model, error)
            else:
                if found.version == snapshot.version:
                    return found
            stale = self.artifact_dir / f".stale-{uuid.uuid4().hex}"
            os.rename(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        self.artifact_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.artifact_dir / f".tmp-{uuid.uuid4().hex}"
        try:
            written = save_sklearn_artifact(
                snapshot, tmp, feature_names=feature_names, golden_x=golden_x, info=info
            )
            _fsync_tree(tmp)
            os.rename(tmp, final)
            fsync_dir(self.artifact_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return LearnedVersion(
            snapshot,
            final,
            tuple(written.manifest.feature_names),
            np.ascontiguousarray(golden_x, dtype=np.float32),
            dict(written.manifest.info),
        )

    def _prune(self, keep: set[str]) -> None:
        """Delete learned artifacts beyond the ``keep_versions`` newest (never one in ``keep``)."""
        versions = sorted(
            (p for p in self.artifact_dir.iterdir() if p.is_dir() and not p.name.startswith(".")),
            key=lambda p: p.stat().st_mtime,
        )
        for path in versions[: max(len(versions) - self.settings.keep_versions, 0)]:
            if path.name not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def reports(self) -> list[BatchReport]:
        """Every mini-batch this model applied, in order."""
        return [BatchReport.model_validate(r) for r in self.log.batch_reports(self.model)]


def _fsync_tree(root: Path) -> None:
    for path in root.iterdir():
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
    fsync_dir(root)


def train_step(
    parent: LinearSnapshot, batch: NDArray[np.float32], labels: NDArray[np.int64], *, update_scaler: bool
) -> LinearSnapshot:
    """One mini-batch of online learning from ``parent``; pure: ``parent`` is left as it was."""
    x = batch.astype(np.float64)  # SGD's float64 coefficients need float64 rows
    scaler = parent.make_scaler()
    if update_scaler:
        scaler.partial_fit(x)
    classifier = parent.make_classifier()
    classifier.partial_fit(scaler.transform(x), labels)
    params = parent.params.model_copy(
        update={
            "coef": [float(v) for v in classifier.coef_.ravel()],
            "intercept": float(classifier.intercept_[0]),
            "t": float(classifier.t_),
            "scaler": ScalerParams(
                mean=[float(v) for v in scaler.mean_],
                var=[float(v) for v in scaler.var_],
                scale=[float(v) for v in scaler.scale_],
                n_samples_seen=int(scaler.n_samples_seen_),
            ),
            "parent": parent.version,
        }
    )
    return LinearSnapshot.from_params(params)
