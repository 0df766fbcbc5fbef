"""Hot swap of one model's artifact in a running pipeline, and rollback, with nothing else restarted.

``swap_model`` verifies the candidate inside a replica of the model (checksums, the backend's load checks,
same columns and labels, golden rows finite, in [0, 1], not constant and equal to the stored outputs),
then redeploys the pipeline with the new artifact as the model's Serve ``user_config``: Serve calls
``reconfigure`` on the running replicas, which flip to the candidate atomically; calls in flight finish on
the old version. Only one swap of a model runs at a time; a second one gets ``Conflict`` (ABORTED).
Each pipeline's artifact history is kept beside the local state, so ``rollback_model`` returns to the
previous one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from riskserve.pipelines.local import LocalState, connected, read_state, state_dir
from riskserve.pipelines.publish import model_status, publish_artifacts
from riskserve.pipelines.spec import PipelineSpec
from riskserve.platform.errors import Conflict, InvalidInput, ModelLoadError, NotFound, RiskServeError
from riskserve.platform.runner import ModelStatus

__all__ = [
    "SwapResult",
    "artifact_overrides",
    "exclusive",
    "learning_status",
    "rollback",
    "rollback_model",
    "swap",
    "swap_model",
]


@dataclass(frozen=True)
class SwapResult:
    """What a swap did: the versions before and after, and how long until every replica served the new one."""

    pipeline: str
    model: str
    old_version: str
    new_version: str
    artifact: str
    seconds: float


def _history_path() -> Path:
    return state_dir() / "artifacts.json"


def _history() -> dict[str, dict[str, list[str]]]:
    try:
        data: dict[str, dict[str, list[str]]] = json.loads(_history_path().read_text())
    except (OSError, ValueError):
        return {}
    return data


def _save_history(history: dict[str, dict[str, list[str]]]) -> None:
    path = _history_path()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(history, indent=2))
    os.replace(tmp, path)  # readers see the old or the new history, never half of one


def artifact_overrides(pipeline: str) -> dict[str, str]:
    """The artifact each swapped model of ``pipeline`` serves now (models never swapped are absent)."""
    return {model: paths[-1] for model, paths in _history().get(pipeline, {}).items() if paths}


@contextlib.contextmanager
def exclusive(pipeline: str, model: str) -> Iterator[None]:
    """One operation (swap, rollback, shadow) on a model at a time, across processes.

    Raises:
        Conflict: another one is running.
    """
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / f"swap-{pipeline}-{model}.lock").open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Conflict(
                f"a swap of {pipeline}/{model} is already running; try again when it ends"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cause(error: BaseException) -> BaseException:
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def _serving(spec: PipelineSpec, model: str, probes: int) -> list[ModelStatus]:
    return [model_status(spec, model) for _ in range(probes)]


def swap(spec: PipelineSpec, model: str, artifact: Path | str) -> SwapResult:
    """Verify ``artifact`` and make it the serving version of ``model`` (Ray must be connected).

    Raises:
        NotFound: no such model.
        Conflict: another swap of this model is running.
        ModelLoadError: the candidate failed a check; the old version keeps serving.
    """
    from ray import serve

    pipeline = spec.name
    if model not in spec.models:
        raise NotFound(f"pipeline '{pipeline}' has no model '{model}' (models: {', '.join(spec.models)})")
    path = str(Path(artifact).resolve())
    with exclusive(pipeline, model):
        ingress = serve.get_deployment_handle("ingress", app_name=pipeline)
        serving = model_status(spec, model)
        old_version, old_artifact = str(serving.version), serving.artifact
        try:
            candidate = ingress.verify_candidate.remote(model, path).result()
        except Exception as error:
            cause = _cause(error)
            if isinstance(cause, RiskServeError):
                raise ModelLoadError(f"candidate refused, {old_version} keeps serving: {cause}") from error
            raise
        history = _history()
        models = history.setdefault(pipeline, {})
        previous = models.get(model) or []
        if not previous or previous[-1] != old_artifact:  # e.g. a version the online learner published
            previous = [*previous, old_artifact]
        started = time.monotonic()
        _adopt(spec, model, path)
        publish_artifacts(spec, {model: path})
        model_spec = spec.models[model]
        replicas = spec.serving.ingress.replicas if model_spec.in_ingress else model_spec.replicas
        answers = _serving(spec, model, probes=3 * replicas)
        stale = [a for a in answers if a.version != candidate.version]
        if stale:  # a replica refused the flip: put the previous artifact back everywhere
            _adopt(spec, model, old_artifact)
            publish_artifacts(spec, {model: old_artifact})
            raise ModelLoadError(f"a replica refused the swap ({stale[0].last_swap_error}); rolled back")
        models[model] = [*previous, path]
        _save_history(history)
        return SwapResult(
            pipeline, model, old_version, str(candidate.version), path, time.monotonic() - started
        )


def _adopt(spec: PipelineSpec, model: str, artifact: str) -> None:
    """Tell the online learner (if the model learns) to train later labels on ``artifact``."""
    if spec.models[model].online is None:
        return
    from ray import serve

    feedback = serve.get_deployment_handle("feedback", app_name=spec.name)
    feedback.adopt.remote(model, artifact).result()


def rollback(spec: PipelineSpec, model: str) -> SwapResult:
    """Serve the artifact ``model`` served before its last swap (verified again like any candidate).

    Raises:
        NotFound: the model was never swapped.
    """
    history = _history().get(spec.name, {}).get(model, [])
    if len(history) < 2:
        raise NotFound(f"{spec.name}/{model} has no earlier version to roll back to")
    result = swap(spec, model, history[-2])
    full = _history()
    full[spec.name][model] = history[:-1]  # the swap appended history[-2]; drop it and the version left
    _save_history(full)
    return result


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

        # The ingress adds its own replica's decision buffer (buffered, dropped) to the learner's status.
        status: dict[str, Any] = (
            serve.get_deployment_handle("ingress", app_name=pipeline)
            .learning_status.remote()
            .result(timeout_s=30)
        )
        return status
