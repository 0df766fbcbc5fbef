"""The graph builder: a pipeline spec becomes one Ray Serve application.

``features`` (the shared feature stage) -> one deployment per model (in parallel) -> the decision rules in
the ``ingress``, which is what the gRPC proxy calls. Each deployment is placed on its pool through a Ray
custom resource, so the same application runs on one machine or a KubeRay cluster.
"""

# No `from __future__ import annotations` here: Serve inspects build_app's annotation at run time.

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel as _Schema
from pydantic import ConfigDict
from ray import serve
from ray.serve import Application

from riskserve.features.stage import FeatureStage
from riskserve.learning.service import FeedbackService
from riskserve.pipelines.ingress import PipelineIngress
from riskserve.pipelines.pools import actor_options, check_pools
from riskserve.pipelines.spec import PipelineSpec, StageSpec, load_pipeline
from riskserve.platform.replica import ModelReplica

__all__ = ["GRPC_SERVICER_FUNCTIONS", "AppArgs", "build_app", "build_application", "deployment_names"]

GRPC_SERVICER_FUNCTIONS = [
    "riskserve.pipelines.proto.riskserve.v1.risk_pipeline_pb2_grpc.add_RiskPipelineServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]
"""What Ray Serve's gRPC proxy must register: ``riskserve.v1.RiskPipeline`` and ``grpc.health.v1.Health``."""


class AppArgs(_Schema):
    """Arguments of :func:`build_app` in a Serve config file."""

    model_config = ConfigDict(extra="forbid")

    pipeline: Path
    """The pipeline YAML file."""


def deployment_names(spec: PipelineSpec) -> dict[str, str]:
    """Serve deployment name of each stage: ``features``, ``ingress``, ``model-<name>`` and, with
    feedback, ``feedback``."""
    names = {"features": "features", "ingress": "ingress", **{m: f"model-{m}" for m in spec.models}}
    if spec.serving.feature_stage == "ingress":
        del names["features"]  # encoded inside the ingress replicas
    if spec.feedback is not None:
        names["feedback"] = "feedback"
    return names


@functools.cache
def _code_hash() -> str:
    """Hash of riskserve's own source: a redeploy after a code change must restart the replicas."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _version(*parts: Any) -> str:
    """A deployment version from its code and arguments.

    Without one, Serve gives every ``serve.run`` a random version and restarts every replica, so an
    unchanged model would be reloaded whenever any part of the pipeline is redeployed. With content
    versions, only deployments whose code or arguments changed restart; a ``user_config`` change is
    applied in place.
    """
    canonical = json.dumps([_code_hash(), *parts], sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _logging(spec: PipelineSpec) -> dict[str, Any]:
    return {"enable_access_log": spec.serving.access_log}


def _versioned(deployment: Any, version: str) -> Any:
    """Pin a deployment's version. Ray 2.60 refuses ``options(version=...)`` from users and makes up a
    random one per ``serve.run`` instead; its own config-deploy path passes versions with ``_internal``.
    This is the one place riskserve leans on that (covered by tests that redeploy and compare pids)."""
    return deployment.options(version=version, _internal=True)


def _stage(cls: type, name: str, spec: PipelineSpec, stage: StageSpec, *args: Any) -> Any:
    return _versioned(serve.deployment()(cls), _version(name, args)).options(
        name=name,
        logging_config=_logging(spec),
        num_replicas=stage.replicas,
        max_ongoing_requests=stage.max_ongoing_requests,
        max_queued_requests=stage.max_queued_requests,
        ray_actor_options=actor_options(spec, spec.stage_pool(stage), stage.num_cpus),
    )


def build_application(
    spec: PipelineSpec, *, draining: bool = False, artifacts: dict[str, str] | None = None
) -> Application:
    """The Serve application of a validated pipeline.

    ``draining=True`` deploys the same application with the ingress draining (health NOT_SERVING);
    ``artifacts`` overrides model artifacts (hot swap). Both travel as Serve ``user_config``, which Serve
    applies to every running replica in place (``reconfigure``) without restarting anything.
    """
    check_pools(spec)  # also refused by `riskserve up`, across all the pipelines it starts together
    data = spec.resolved()
    names = deployment_names(spec)
    features = None
    if spec.serving.feature_stage == "deployment":
        features_args = (data["features"], data["tracing"], spec.serving.matrix_retain_s)
        stage_spec = spec.serving.features
        features = _stage(FeatureStage, names["features"], spec, stage_spec, features_args).bind(
            *features_args
        )
    matrix_columns = spec.features.column_names()
    models = {}
    for name, model in spec.models.items():
        deployment = serve.deployment()(ModelReplica).options(
            name=names[name],
            logging_config=_logging(spec),
            num_replicas=model.replicas,
            max_ongoing_requests=model.max_ongoing_requests,
            max_queued_requests=model.max_queued_requests,
            ray_actor_options=actor_options(spec, model.pool, model.num_cpus, model.num_gpus),
            # vLLM loads its engine in the constructor; give slow starts room before Serve gives up.
            health_check_timeout_s=60,
        )
        artifact = (artifacts or {}).get(name) or data["models"][name]["artifact"]
        columns = None if model.reads_text else matrix_columns
        declared = None if model.reads_text else spec.model_columns(name)
        args = (name, model.kind, dict(model.settings), columns, declared, data["tracing"])
        versioned = _versioned(deployment, _version(names[name], args))
        models[name] = versioned.options(user_config={"artifact": str(artifact)}).bind(*args)
    feedback = None
    if spec.feedback is not None:
        learners = {name: models[name] for name in spec.online_models()}
        feedback = _stage(FeedbackService, names["feedback"], spec, spec.feedback.stage, data).bind(
            data, learners
        )
    ingress_deployment = _stage(PipelineIngress, names["ingress"], spec, spec.serving.ingress, data)
    ingress: Application = ingress_deployment.options(user_config={"draining": draining}).bind(
        data, features, models, feedback
    )
    return ingress


def build_app(args: dict[str, Any]) -> Application:
    """Serve config entry point (``riskserve.pipelines.app:build_app`` with ``args: {pipeline: PATH}``)."""
    return build_application(load_pipeline(AppArgs.model_validate(args).pipeline))
