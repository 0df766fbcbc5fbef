"""Operating shadows: start one beside a model, read its figures, promote it (a verified hot swap), stop it.

A shadow is published to every ingress replica through the pipeline's versions record (the same path a
swap takes), so nothing restarts; the candidate is verified first with the swap's checks (checksums, the
backend's load checks, same columns and labels, golden rows). Only models placed in the ingress can be
shadowed. See :mod:`riskserve.serving.shadow` for what a shadow does on the request path (nothing).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from riskserve.operations.local import LocalState, connected, read_state
from riskserve.operations.publish import publish_shadows
from riskserve.operations.served import open_versions
from riskserve.operations.swap import SwapResult, admit_candidate, exclusive, swap
from riskserve.platform.errors import InvalidInput, ModelLoadError, NotFound, RiskServeError
from riskserve.platform.runner import CandidateReport
from riskserve.schema.deployments import INGRESS
from riskserve.schema.pipeline import PipelineSpec

if TYPE_CHECKING:  # the shadow module imports Ray, which must not happen before `connected` set it up
    from riskserve.serving.shadow import ShadowFigures

__all__ = ["promote_shadow", "shadow_status", "start_shadow", "stop_shadow"]


def _ingress(spec: PipelineSpec) -> Any:
    from ray import serve

    return serve.get_deployment_handle(INGRESS, app_name=spec.name)


def _local(pipeline: str, state: LocalState | None) -> tuple[LocalState, PipelineSpec]:
    state = state or read_state()
    if state is None:
        raise NotFound("no local riskserve is running")
    if pipeline not in state.pipeline_files:
        raise NotFound(f"no pipeline '{pipeline}' is running (running: {', '.join(state.pipeline_files)})")
    return state, state.running_spec(pipeline)


def _config(spec: PipelineSpec) -> dict[str, dict[str, Any]]:
    """The shadows the versions record names."""
    with open_versions(spec) as store:
        return dict(store.read(spec.name).shadows)


def _publish(spec: PipelineSpec, shadows: dict[str, dict[str, Any]]) -> None:
    with open_versions(spec) as store:
        publish_shadows(spec, store, shadows)


def _figures(spec: PipelineSpec, *, timeout_s: float = 30.0) -> list[ShadowFigures]:
    """Every ingress replica's figures: Serve's handle picks a replica per call, so it is asked until each
    replica has answered (or ``timeout_s`` passed: then the replicas that did)."""
    handle = _ingress(spec)
    replicas = spec.serving.ingress.replicas
    seen: dict[str, list[ShadowFigures]] = {}
    deadline = time.monotonic() + timeout_s
    for _ in range(20 * replicas):
        figures: list[ShadowFigures] = handle.shadow_status.remote().result(timeout_s=timeout_s)
        seen[figures[0].replica if figures else ""] = figures
        if len(seen) >= replicas or time.monotonic() > deadline or not figures:
            break
    return [figure for figures in seen.values() for figure in figures]


def _model(spec: PipelineSpec, model: str) -> None:
    if model not in spec.models:
        raise NotFound(f"pipeline '{spec.name}' has no model '{model}' (models: {', '.join(spec.models)})")
    if not spec.models[model].in_ingress:
        raise InvalidInput(
            f"'{model}' runs in a deployment of its own; only models placed in the ingress can be shadowed",
            field="model",
        )
    if spec.models[model].reads_text:
        raise InvalidInput(
            f"'{model}' reads the request's text; shadows score the feature matrix (tabular models only)",
            field="model",
        )


def shadow(spec: PipelineSpec, model: str, artifact: Path | str, sample: float) -> CandidateReport:
    """Verify ``artifact`` and run it as a shadow of ``model`` on ``sample`` of live decisions (Ray must be
    connected). A shadow already beside the model is replaced.

    Raises:
        NotFound: no such model. InvalidInput: not placed in the ingress, a text model, or ``sample``
            not in (0, 1].
        ModelLoadError: the candidate failed a check; nothing changed.
    """
    from riskserve.serving.shadow import ShadowSettings

    _model(spec, model)
    path = str(admit_candidate(spec, model, artifact))  # from the models root only, like a swap
    settings = ShadowSettings(artifact=path, sample=sample)  # refuses a sample outside (0, 1]
    with exclusive(spec.name):
        try:
            report: CandidateReport = _ingress(spec).verify_candidate.remote(model, path).result()
        except Exception as error:
            cause = getattr(error, "cause", error)
            if isinstance(cause, RiskServeError):
                raise ModelLoadError(f"candidate refused: {cause}") from error
            raise
        _publish(spec, {**_config(spec), model: settings.model_dump()})
        refused = [f.error for f in _figures(spec) if f.model == model and f.error]
        if refused:
            _publish(spec, {m: s for m, s in _config(spec).items() if m != model})
            raise ModelLoadError(f"the ingress refused the shadow: {refused[0]}")
    return report


def stop(spec: PipelineSpec, model: str) -> None:
    """Unload the shadow of ``model``.

    Raises:
        NotFound: ``model`` has no shadow.
    """
    with exclusive(spec.name):
        config = _config(spec)
        if model not in config:
            raise NotFound(f"{spec.name}/{model} has no shadow")
        _publish(spec, {m: s for m, s in config.items() if m != model})


def promote(spec: PipelineSpec, model: str) -> SwapResult:
    """Hot-swap ``model`` to its shadow's candidate (verified again, like any swap), then stop the shadow.

    Raises:
        NotFound: ``model`` has no shadow. ModelLoadError: the swap refused the candidate (the shadow stays).
    """
    from riskserve.serving.shadow import ShadowSettings

    config = _config(spec).get(model)
    if config is None:
        raise NotFound(f"{spec.name}/{model} has no shadow to promote")
    result = swap(spec, model, ShadowSettings.model_validate(config).artifact)
    stop(spec, model)
    return result


def start_shadow(
    pipeline: str, model: str, artifact: Path | str, *, sample: float = 0.2, state: LocalState | None = None
) -> CandidateReport:
    """:func:`shadow` on the local riskserve (``riskserve shadow PIPELINE MODEL CANDIDATE``)."""
    state, spec = _local(pipeline, state)
    with connected(state):
        return shadow(spec, model, artifact, sample)


def stop_shadow(pipeline: str, model: str, *, state: LocalState | None = None) -> None:
    """:func:`stop` on the local riskserve (``riskserve shadow stop``)."""
    state, spec = _local(pipeline, state)
    with connected(state):
        stop(spec, model)


def promote_shadow(pipeline: str, model: str, *, state: LocalState | None = None) -> SwapResult:
    """:func:`promote` on the local riskserve (``riskserve shadow promote``)."""
    state, spec = _local(pipeline, state)
    with connected(state):
        return promote(spec, model)


def shadow_status(
    pipeline: str | None = None, *, state: LocalState | None = None
) -> dict[str, list[ShadowFigures]]:
    """Every shadow's figures, per running pipeline (or only ``pipeline``)."""
    state = state or read_state()
    if state is None:
        raise NotFound("no local riskserve is running")
    names = [pipeline] if pipeline else list(state.pipeline_files)
    out: dict[str, list[ShadowFigures]] = {}
    with connected(state):
        for name in names:
            _, spec = _local(name, state)
            out[name] = _figures(spec)
    return out
