"""Redeploy a running pipeline with some models' artifacts replaced, keeping every other one as it serves.

Swaps, rollbacks and the online learner all publish this way: the new artifacts travel as the model
deployments' Serve ``user_config``, which Serve applies to every running replica in place (``reconfigure``);
deployments whose configuration is unchanged are not touched. The artifacts of the other models are read
from their replicas, so two publishers never undo each other's models.
"""

from __future__ import annotations

from typing import Any

from riskserve.pipelines.spec import PipelineSpec
from riskserve.platform.runner import ModelStatus

__all__ = ["application_status", "live_artifacts", "model_status", "publish_artifacts"]


def _ingress(spec: PipelineSpec) -> Any:
    from ray import serve

    return serve.get_deployment_handle("ingress", app_name=spec.name)


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
    spec: PipelineSpec, overrides: dict[str, str], *, shadows: dict[str, dict[str, Any]] | None = None
) -> None:
    """Serve ``overrides`` (model -> artifact directory) and keep the other models' current artifacts,
    the ingress's draining state and its shadows (``shadows`` replaces them when given).

    Blocks until Serve reports the application running again (every replica reconfigured).

    Raises:
        ModelUnavailable: the pipeline is not running (being deleted, say); nothing was deployed.
    """
    from ray import serve

    from riskserve.pipelines.app import build_application
    from riskserve.platform.errors import ModelUnavailable

    artifacts = {**live_artifacts(spec), **overrides}
    draining = bool(_ingress(spec).draining.remote().result())
    if shadows is None:
        shadows = dict(_ingress(spec).shadow_config.remote().result(timeout_s=30))
    app = build_application(spec, artifacts=artifacts, draining=draining, shadows=shadows)
    # Checked last, just before the deploy: a redeploy of a pipeline being deleted would bring it back.
    status = application_status(spec.name)
    if status not in ("RUNNING", "DEPLOYING"):
        raise ModelUnavailable(f"pipeline '{spec.name}' is {status}; nothing published")
    serve.run(app, name=spec.name, route_prefix=None)
