"""Hot swap of one model's artifact in a running pipeline, and rollback, with nothing else restarted.

``swap_model`` verifies the candidate inside a replica of the model (checksums, the backend's load checks,
same columns and labels, golden rows finite, in [0, 1], not constant and equal to the stored outputs),
then writes it into the pipeline's versions record (:mod:`riskserve.operations.publish`): every replica
pulls it and flips to the candidate atomically; calls in flight finish on the old version. Only one swap
of a pipeline runs at a time; a second one gets ``Conflict`` (ABORTED). In a pipeline with a feedback
service the publish runs inside that service, under the same lock as the learner's publishes, as a
compare-and-set on the version the candidate was verified against; the learner adopts the candidate only
after every replica serves it, so a refused swap never takes effect later. The record keeps every
version's entry, so ``rollback_model`` returns to the previous one, and the swapped version survives
``down`` and ``up`` and serves on every replica started later, on any node.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from riskserve.operations.local import LocalState, connected, read_state
from riskserve.operations.publish import model_status, publish_version
from riskserve.operations.served import open_versions, record_rollback
from riskserve.operations.state import state_dir
from riskserve.platform.errors import Conflict, InvalidInput, ModelLoadError, NotFound, RiskServeError
from riskserve.schema.deployments import FEEDBACK, INGRESS
from riskserve.schema.pipeline import PipelineSpec
from riskserve.state.versions import Source, VersionsRecord

__all__ = [
    "SwapResult",
    "admit_candidate",
    "exclusive",
    "learning_status",
    "rollback",
    "rollback_model",
    "swap",
    "swap_model",
]

EVERY_REPLICA_S = 5.0
"""How long ``riskserve learning`` asks the ingress replicas before it shows the ones that answered."""


@dataclass(frozen=True)
class SwapResult:
    """What a swap did: the versions before and after, and how long until every replica served the new one."""

    pipeline: str
    model: str
    old_version: str
    new_version: str
    artifact: str
    seconds: float


@contextlib.contextmanager
def exclusive(pipeline: str) -> Iterator[None]:
    """One operation (swap, rollback, shadow) per pipeline at a time, across processes: a publish reads
    every model's artifact, so two swaps of different models of one pipeline would undo each other too.

    Raises:
        Conflict: another one is running.
    """
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / f"swap-{pipeline}.lock").open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Conflict(f"a swap in {pipeline} is already running; try again when it ends") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cause(error: BaseException) -> BaseException:
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def admit_candidate(spec: PipelineSpec, model: str, artifact: Path | str) -> Path:
    """The candidate's real path, if ``model`` may be swapped to it: inside the pipeline's models root
    (symlinks resolved, so a link out of the root does not count), its YAML artifact, or one of its
    learned versions.

    Raises:
        NotFound: no such model or no such directory.
        InvalidInput: the candidate is elsewhere (field ``artifact``).
    """
    if model not in spec.models:
        raise NotFound(f"pipeline '{spec.name}' has no model '{model}' (models: {', '.join(spec.models)})")
    try:
        path = Path(artifact).resolve(strict=True)
    except OSError as error:
        raise NotFound(f"no candidate artifact at {artifact}: {error}") from error
    roots = [spec.candidate_root(model).resolve()]
    if spec.models[model].online is not None:
        roots.append(spec.learned_dir(model).resolve())
    if path == spec.artifact_path(model).resolve() or any(root in path.parents for root in roots):
        return path
    raise InvalidInput(
        f"{path} is outside the models root {roots[0]} (set 'models_root' in the pipeline YAML to swap "
        "from elsewhere)",
        field="artifact",
    )


def swap(spec: PipelineSpec, model: str, artifact: Path | str, *, source: Source = "swap") -> SwapResult:
    """Verify ``artifact`` and make it the serving version of ``model`` (Ray must be connected); the
    served record keeps it (``source``: a swap, or a rollback).

    Raises:
        NotFound: no such model or candidate. InvalidInput: the candidate is outside the models root.
        Conflict: another swap of this pipeline is running, or another publish changed the model while
            the candidate was verified.
        ModelLoadError: the candidate failed a check, or a replica refused it; the old version serves.
    """
    path = str(admit_candidate(spec, model, artifact))
    return _swap_verified(spec, model, path, source)


def _swap_verified(spec: PipelineSpec, model: str, path: str, source: Source) -> SwapResult:
    from ray import serve

    pipeline = spec.name
    with exclusive(pipeline):
        ingress = serve.get_deployment_handle(INGRESS, app_name=pipeline)
        serving = model_status(spec, model)
        old_version, old_artifact = str(serving.version), serving.artifact
        try:
            candidate = ingress.verify_candidate.remote(model, path).result()
        except Exception as error:
            cause = _cause(error)
            if isinstance(cause, RiskServeError):
                raise ModelLoadError(f"candidate refused, {old_version} keeps serving: {cause}") from error
            raise
        started = time.monotonic()
        _publish(spec, model, path, str(candidate.version), old_version, old_artifact, source)
        return SwapResult(
            pipeline, model, old_version, str(candidate.version), path, time.monotonic() - started
        )


def _publish(
    spec: PipelineSpec, model: str, artifact: str, version: str, expected: str, old: str, source: Source
) -> None:
    """Publish a verified candidate: with a learner, through the feedback service (it adopts the candidate
    for later labels once every replica serves it); else from here, under :func:`exclusive`."""
    if spec.feedback is None:
        with open_versions(spec) as store:
            publish_version(spec, store, model, artifact, version, source=source, expected=expected)
        return
    from ray import serve

    feedback = serve.get_deployment_handle(FEEDBACK, app_name=spec.name)
    try:
        feedback.swap.remote(model, artifact, version, expected, source).result()
    except Exception as error:
        cause = _cause(error)
        if isinstance(cause, RiskServeError):
            raise cause from error
        raise


def rollback(spec: PipelineSpec, model: str) -> SwapResult:
    """Serve the artifact ``model`` served before its last publish in the served record (verified again
    like any candidate).

    Raises:
        NotFound: the model has no earlier entry.
    """
    with open_versions(spec) as store:
        target = record_rollback(spec, store, model)
    result = _swap_verified(spec, model, target.artifact, "rollback")
    _drop_rolled_back(spec, model)
    return result


def _drop_rolled_back(spec: PipelineSpec, model: str) -> None:
    """Once a rollback to the entry before the last is confirmed (recorded as the newest entry), drop the
    version rolled back from and that duplicate, so the next rollback goes one further back."""

    def drop(record: VersionsRecord) -> VersionsRecord | None:
        served = record.models.get(model)
        if served is None or len(served.entries) < 3:
            return None
        *older, _target, _left, newest = served.entries  # [..., A, B, A again]: A serves, B is gone
        new = record.model_copy(deep=True)
        new.models[model].entries = [*older, newest]
        return new

    with open_versions(spec) as store:
        store.update(spec.name, drop)


def _local(pipeline: str, state: LocalState | None) -> tuple[LocalState, PipelineSpec]:
    state = state or read_state()
    if state is None:
        raise NotFound("no local riskserve is running")
    if pipeline not in state.pipeline_files:
        raise NotFound(f"no pipeline '{pipeline}' is running (running: {', '.join(state.pipeline_files)})")
    return state, state.running_spec(pipeline)


def swap_model(
    pipeline: str, model: str, artifact: Path | str, *, state: LocalState | None = None
) -> SwapResult:
    """:func:`swap` on the local riskserve (``riskserve swap``)."""
    state, spec = _local(pipeline, state)
    with connected(state):
        return swap(spec, model, artifact)


def rollback_model(pipeline: str, model: str, *, state: LocalState | None = None) -> SwapResult:
    """:func:`rollback` on the local riskserve (``riskserve rollback``)."""
    state, spec = _local(pipeline, state)
    with connected(state):
        return rollback(spec, model)


def learning_status(pipeline: str, *, state: LocalState | None = None) -> dict[str, Any]:
    """The online learner of a local pipeline: cursor, pending labels, batch outcomes per model.

    Raises:
        NotFound: the pipeline is not running. InvalidInput: it has no ``feedback`` section.
    """
    state, spec = _local(pipeline, state)
    if spec.feedback is None:
        raise InvalidInput(f"pipeline '{pipeline}' has no feedback section", field="feedback")
    with connected(state):
        from ray import serve

        # Each ingress replica adds what its own audit writer did (the decisions labels join): Serve's
        # handle picks a replica per call, so it is asked until every replica has answered (or a few
        # seconds passed: then the ones that did), and their counts are summed.
        handle = serve.get_deployment_handle(INGRESS, app_name=pipeline)
        replicas = spec.serving.ingress.replicas
        seen: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + EVERY_REPLICA_S
        status: dict[str, Any] = {}
        for _ in range(20 * replicas):
            status = handle.learning_status.remote().result(timeout_s=30)
            seen[str(status.get("replica", ""))] = status
            if len(seen) >= replicas or time.monotonic() > deadline:
                break
        audits = {replica: s["audit"] for replica, s in seen.items() if "audit" in s}
        if audits:
            status["audit"] = {
                key: sum(counts[key] for counts in audits.values())
                for key, value in next(iter(audits.values())).items()
                if isinstance(value, int)
            }
            status["audit_by_replica"] = audits
        status.pop("replica", None)
        status["replicas_answered"] = len(seen)
        return status
