"""Redeploy a running pipeline with some models' artifacts replaced, keeping every other one as it serves.

Swaps, rollbacks and the online learner all publish this way: the new artifacts travel as the model
deployments' Serve ``user_config``, which Serve applies to every running replica in place (``reconfigure``);
deployments whose configuration is unchanged are not touched. The artifacts of the other models are read
from their replicas just before the deploy. That read-then-deploy is only safe when publishes of a pipeline
never overlap, so there is ONE publisher at a time: in a pipeline with a feedback service, every publish
(learner batches, reconciliation, swaps, the fence before a shutdown) runs under that service's lock;
without one, only ``riskserve swap`` publishes, under a per-pipeline file lock.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from riskserve.operations.served import Source, record_served
from riskserve.platform.errors import RiskServeError
from riskserve.platform.runner import ModelStatus
from riskserve.schema.deployments import INGRESS
from riskserve.schema.pipeline import PipelineSpec

__all__ = [
    "EVERY_REPLICA_TIMEOUT_S",
    "AppBuilder",
    "application_status",
    "every_replica",
    "live_artifacts",
    "model_status",
    "publish_artifacts",
    "publish_checked",
]

EVERY_REPLICA_TIMEOUT_S = 30.0
"""How long :func:`every_replica` asks before it gives up on a replica that never answers."""


class AppBuilder(Protocol):
    """Builds the pipeline's whole Serve application (:func:`riskserve.operations.app.build_application`).

    Handed to every publisher rather than imported: the application contains the feedback service, which
    publishes, so the builder is passed in by whoever deploys (and to the service by the builder itself).
    """

    def __call__(
        self,
        spec: PipelineSpec,
        *,
        draining: bool = False,
        artifacts: dict[str, str] | None = None,
        shadows: dict[str, dict[str, Any]] | None = None,
    ) -> Any: ...


def _ingress(spec: PipelineSpec) -> Any:
    from ray import serve

    return serve.get_deployment_handle(INGRESS, app_name=spec.name)


def model_status(spec: PipelineSpec, model: str) -> ModelStatus:
    """What ``model`` serves now, asked of the ingress (which knows where the model runs)."""
    status: ModelStatus = _ingress(spec).model_status.remote(model).result(timeout_s=30)
    return status


def application_status(name: str) -> str:
    """Serve's status of an application (``RUNNING``, ``DEPLOYING``, ``DELETING``, ...; ``NOT_STARTED``)."""
    from ray import serve

    app = serve.status().applications.get(name)
    if app is None:
        return "NOT_STARTED"
    return str(getattr(app.status, "value", app.status))


def live_artifacts(spec: PipelineSpec) -> dict[str, str]:
    """The artifact each model of the running pipeline serves now (asked of one replica each)."""
    ingress = _ingress(spec)
    calls = {name: ingress.model_status.remote(name) for name in spec.models}
    return {name: str(call.result(timeout_s=30).artifact) for name, call in calls.items()}


def publish_artifacts(
    spec: PipelineSpec,
    overrides: dict[str, str],
    *,
    build: AppBuilder,
    shadows: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Serve ``overrides`` (model -> artifact directory) and keep the other models' current artifacts,
    the ingress's draining state and its shadows (``shadows`` replaces them when given).

    Blocks until Serve reports the application running again (every replica reconfigured).

    Raises:
        ModelUnavailable: the pipeline is not running (being deleted, say); nothing was deployed.
    """
    from ray import serve

    from riskserve.platform.errors import ModelUnavailable

    artifacts = {**live_artifacts(spec), **overrides}
    draining = bool(_ingress(spec).draining.remote().result())
    if shadows is None:
        shadows = dict(_ingress(spec).shadow_config.remote().result(timeout_s=30))
    app = build(spec, artifacts=artifacts, draining=draining, shadows=shadows)
    # Checked last, just before the deploy: a redeploy of a pipeline being deleted would bring it back.
    status = application_status(spec.name)
    if status not in ("RUNNING", "DEPLOYING"):
        raise ModelUnavailable(f"pipeline '{spec.name}' is {status}; nothing published")
    serve.run(app, name=spec.name, route_prefix=None)


def every_replica(
    spec: PipelineSpec, model: str, *, timeout_s: float = EVERY_REPLICA_TIMEOUT_S
) -> list[ModelStatus]:
    """What EVERY replica of ``model`` serves (one status per replica actor), not a sample.

    Serve's handles pick a replica per call, so replicas are asked until as many distinct ones as the
    model runs (the ingress's replicas for a model placed there) have answered.

    Raises:
        ModelUnavailable: not every replica answered within ``timeout_s``.
    """
    from riskserve.platform.errors import ModelUnavailable

    model_spec = spec.models[model]
    replicas = spec.serving.ingress.replicas if model_spec.in_ingress else model_spec.replicas
    seen: dict[str, ModelStatus] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < replicas:
        if time.monotonic() > deadline:
            raise ModelUnavailable(f"only {len(seen)} of {replicas} replicas of '{model}' answered")
        status = model_status(spec, model)
        seen[status.actor_id or f"unnamed-{len(seen)}"] = status
    return list(seen.values())


def publish_checked(
    spec: PipelineSpec,
    model: str,
    artifact: str,
    version: str,
    previous: str,
    *,
    build: AppBuilder,
    source: Source,
    previous_version: str | None = None,
    records: Path | None = None,
) -> None:
    """Publish ``artifact`` (holding ``version``) for ``model``, confirm it on every replica, then record
    it in the pipeline's served record (:mod:`riskserve.operations.served`, ``source`` says why it serves;
    ``records``: the records directory, default this process's).
    If a replica does not serve it, or the record cannot be written, ``previous`` is published back before
    raising, so a failed publish never takes effect and the record always names what serves.

    The caller holds the pipeline's publish lock (see the module docstring).

    Raises:
        ModelLoadError: a replica refused the new version (or never answered), or the record could not be
            written; ``previous`` serves again.
    """
    from riskserve.platform.errors import ModelLoadError, ModelUnavailable

    publish_artifacts(spec, {model: artifact}, build=build)
    try:
        stale = [s for s in every_replica(spec, model) if s.version != version]
    except ModelUnavailable as error:
        publish_artifacts(spec, {model: previous}, build=build)
        raise ModelLoadError(f"{version} not confirmed on every replica ({error}); rolled back") from error
    if stale:
        publish_artifacts(spec, {model: previous}, build=build)
        raise ModelLoadError(
            f"{len(stale)} replica(s) refused {version} ({stale[0].last_swap_error}); rolled back"
        )
    try:
        record_served(
            spec,
            model,
            artifact,
            version,
            source=source,
            previous=previous,
            previous_version=previous_version,
            directory=records,
        )
    except (OSError, RiskServeError) as error:
        publish_artifacts(spec, {model: previous}, build=build)
        raise ModelLoadError(f"{version} served but not recorded ({error}); rolled back") from error
