"""The graph builder: a pipeline spec becomes one Ray Serve application.

``features`` (the shared feature stage) -> one deployment per model (in parallel) -> the decision rules in
the ``ingress``, which is what the gRPC proxy calls. Each deployment is placed on its pool through a Ray
custom resource, so the same application runs on one machine or a KubeRay cluster.
"""

# No `from __future__ import annotations` here: Serve inspects build_app's annotation at run time.

from pathlib import Path
from typing import Any

from pydantic import BaseModel as _Schema
from pydantic import ConfigDict
from ray import serve
from ray.serve import Application

from riskserve.features.stage import FeatureStage
from riskserve.pipelines.ingress import PipelineIngress
from riskserve.pipelines.spec import PipelineSpec, StageSpec, load_pipeline
from riskserve.platform.replica import ModelReplica

__all__ = ["GRPC_SERVICER_FUNCTIONS", "AppArgs", "build_app", "build_application", "deployment_names"]

GRPC_SERVICER_FUNCTIONS = [
    "riskserve.pipelines.proto.riskserve.v1.risk_pipeline_pb2_grpc.add_RiskPipelineServicer_to_server",
]
"""What Ray Serve's gRPC proxy must register to serve ``riskserve.v1.RiskPipeline``."""


class AppArgs(_Schema):
    """Arguments of :func:`build_app` in a Serve config file."""

    model_config = ConfigDict(extra="forbid")

    pipeline: Path
    """The pipeline YAML file."""


def _actor_options(spec: PipelineSpec, pool: str, num_cpus: float, num_gpus: float = 0) -> dict[str, Any]:
    """Ray placement of one replica: its CPU/GPU share, taken from its pool's custom resource."""
    options: dict[str, Any] = {
        "num_cpus": num_cpus,
        "resources": {spec.pool_resource(pool): max(num_cpus, 0.01)},
    }
    if num_gpus:
        options["num_gpus"] = num_gpus
    return options


def deployment_names(spec: PipelineSpec) -> dict[str, str]:
    """Serve deployment name of each stage: ``features``, ``ingress`` and ``model-<name>``."""
    return {"features": "features", "ingress": "ingress", **{m: f"model-{m}" for m in spec.models}}


def _logging(spec: PipelineSpec) -> dict[str, Any]:
    return {"enable_access_log": spec.serving.access_log}


def _stage(cls: type, name: str, spec: PipelineSpec, stage: StageSpec) -> Any:
    return serve.deployment()(cls).options(
        name=name,
        logging_config=_logging(spec),
        num_replicas=stage.replicas,
        max_ongoing_requests=stage.max_ongoing_requests,
        max_queued_requests=stage.max_queued_requests,
        ray_actor_options=_actor_options(spec, spec.stage_pool(stage), stage.num_cpus),
    )


def build_application(spec: PipelineSpec) -> Application:
    """The Serve application of a validated pipeline."""
    data = spec.resolved()
    names = deployment_names(spec)
    features = _stage(FeatureStage, names["features"], spec, spec.serving.features).bind(
        data["features"], data["tracing"]
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
            ray_actor_options=_actor_options(spec, model.pool, model.num_cpus, model.num_gpus),
            # vLLM loads its engine in the constructor; give slow starts room before Serve gives up.
            health_check_timeout_s=60,
        )
        settings = {"artifact": data["models"][name]["artifact"], **model.settings}
        columns = None if model.reads_text else matrix_columns
        declared = None if model.reads_text else spec.model_columns(name)
        models[name] = deployment.bind(name, model.kind, settings, columns, declared, data["tracing"])
    ingress: Application = _stage(PipelineIngress, names["ingress"], spec, spec.serving.ingress).bind(
        data, features, models
    )
    return ingress


def build_app(args: dict[str, Any]) -> Application:
    """Serve config entry point (``riskserve.pipelines.app:build_app`` with ``args: {pipeline: PATH}``)."""
    return build_application(load_pipeline(AppArgs.model_validate(args).pipeline))
