"""The graph builder: a pipeline spec becomes one Ray Serve application.

The ``ingress`` serves riskserve's own gRPC front door and holds the feature stage and every model placed
``ingress``; each model placed ``deployment`` (the LLM) is a deployment of its own that the ingress calls
through a handle, and ``features`` a deployment only with ``serving.feature_stage: deployment``. Each
deployment is placed on its pool through a Ray custom resource, so the same application runs on one
machine or a KubeRay cluster. What each model serves is not in the application at all: every replica pulls
it from the pipeline's versions record (:mod:`riskserve.serving.version_watch`), so the application, and
the Serve config it comes from, stay the same through every swap and learned version.
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
from riskserve.operations.learning_service import FeedbackService
from riskserve.schema.deployments import FEATURES, FEEDBACK, INGRESS, deployment_names
from riskserve.schema.endpoints import with_endpoint
from riskserve.schema.pipeline import PipelineSpec, StageSpec, load_pipeline
from riskserve.schema.pools import actor_options, check_pools, ingress_cpus
from riskserve.serving.ingress import PipelineIngress
from riskserve.serving.model_lane import LanedModelReplica
from riskserve.serving.model_replica import ModelReplica
from riskserve.wrappers import registered_backends

__all__ = ["SHARED_LOOP_ENV", "SHUTDOWN_POLL_S", "AppArgs", "build_app", "build_application"]

SHUTDOWN_POLL_S = 0.2
"""How often a stopping replica asks Serve whether its last handle call has finished (Serve's
``graceful_shutdown_wait_loop_s``). Serve's default, 2 s, is also how long an idle replica waited before
its destructor ran: every ``down``, delete or restart paid it for nothing. The wait for calls in flight is
unchanged (up to ``graceful_shutdown_timeout_s``), and the ingress's own drain is its front door's
``drain_s``."""


class AppArgs(_Schema):
    """Arguments of :func:`build_app` in a Serve config file."""

    model_config = ConfigDict(extra="forbid")

    pipeline: Path
    """The pipeline YAML file."""
    grpc_port: int | None = None
    """The gRPC port of the pipeline's front door (default: the YAML's ``serving.grpc.port``)."""


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


SHARED_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
"""Runtime env vars that put a replica's user code on Serve's own event loop (``IngressSpec.event_loop``)."""


def _stage(
    cls: type,
    name: str,
    spec: PipelineSpec,
    stage: StageSpec,
    *args: Any,
    num_cpus: float | None = None,
    env_vars: dict[str, str] | None = None,
    health_check_timeout_s: float | None = None,
    max_replicas_per_node: int | None = None,
) -> Any:
    cpus = stage.num_cpus if num_cpus is None else num_cpus
    options = actor_options(spec, spec.stage_pool(stage), cpus)
    if env_vars:  # Ray merges these into the job's and the app's env_vars
        options["runtime_env"] = {"env_vars": dict(env_vars)}
    return _versioned(serve.deployment()(cls), _version(name, args, options.get("runtime_env"))).options(
        name=name,
        logging_config=_logging(spec),
        num_replicas=stage.replicas,
        max_ongoing_requests=stage.max_ongoing_requests,
        max_queued_requests=stage.max_queued_requests,
        ray_actor_options=options,
        health_check_period_s=stage.health_check_period_s,
        health_check_timeout_s=health_check_timeout_s or stage.health_check_timeout_s,
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        **({"max_replicas_per_node": max_replicas_per_node} if max_replicas_per_node else {}),
    )


def build_application(spec: PipelineSpec, *, draining: bool = False) -> Application:
    """The Serve application of a validated pipeline (the same for every version its models serve).

    ``draining=True`` deploys it with the ingress draining (health NOT_SERVING, before a shutdown): the
    ingress's only ``user_config``, applied in place.
    """
    check_pools(spec)  # also refused by `riskserve up`, across all the pipelines it starts together
    data = spec.resolved()
    names = deployment_names(spec)
    # test-only backend kinds registered in this process travel to the replicas that serve them
    registered = registered_backends({model.kind for model in spec.models.values()})
    extra: dict[str, Any] = {"registered": registered} if registered else {}
    features = None
    if spec.serving.feature_stage == "deployment":
        features_args = (data["features"], data["tracing"], spec.serving.matrix_retain_s)
        stage_spec = spec.serving.features
        features = _stage(FeatureStage, names[FEATURES], spec, stage_spec, features_args).bind(*features_args)
    models = {}
    for name, model in spec.models.items():
        if model.in_ingress:
            continue  # built by each ingress replica from the spec; its artifact is the ingress's user_config
        batching = model.batching.model_dump() if model.batching is not None else None
        max_ongoing = model.max_ongoing_requests
        if model.batching is not None:  # Serve wants room for every batch it may run at once
            max_ongoing = max(
                max_ongoing, model.batching.max_batch_size * model.batching.max_concurrent_batches
            )
        replica_class = LanedModelReplica if spec.serving.model_lanes else ModelReplica
        deployment = serve.deployment()(replica_class).options(
            name=names[name],
            logging_config=_logging(spec),
            num_replicas=model.replicas,
            max_ongoing_requests=max_ongoing,
            max_queued_requests=model.max_queued_requests,
            ray_actor_options=actor_options(spec, model.pool, model.num_cpus, model.num_gpus),
            health_check_period_s=model.health_check_period_s,
            health_check_timeout_s=model.health_check_timeout,
            graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        )
        columns, declared = spec.runner_columns(name)
        settings = {**spec.runner_settings(name), "artifact": data["models"][name]["artifact"]}
        args = (name, model.kind, settings, columns, declared, data["tracing"], batching)
        lane = {"lane": {"ongoing": max_ongoing, "queued": model.max_queued_requests}}
        lane = lane if spec.serving.model_lanes else {}
        record = {"pipeline": spec.name, "state": data["state"]}
        versioned = _versioned(deployment, _version(names[name], args, lane, record))
        models[name] = versioned.bind(*args, **lane, **record, **extra)
    feedback = None
    if spec.feedback is not None:
        feedback_stage = _stage(FeedbackService, names[FEEDBACK], spec, spec.feedback.stage, data)
        feedback = feedback_stage.bind(data, **extra)
    shared_loop = spec.serving.ingress.event_loop == "shared"
    ingress_deployment = _stage(
        PipelineIngress,
        names[INGRESS],
        spec,
        spec.serving.ingress,
        data,
        num_cpus=ingress_cpus(spec),
        env_vars=SHARED_LOOP_ENV if shared_loop else None,
        health_check_timeout_s=spec.ingress_health_check_timeout(),
        max_replicas_per_node=spec.serving.ingress.max_replicas_per_node,
    )
    ingress: Application = ingress_deployment.options(user_config={"draining": draining}).bind(
        data, features, models, feedback, **extra
    )
    return ingress


def build_app(args: dict[str, Any]) -> Application:
    """Serve config entry point (``riskserve.operations.app:build_app`` with ``args: {pipeline: PATH}``)."""
    parsed = AppArgs.model_validate(args)
    spec = with_endpoint(load_pipeline(parsed.pipeline), port=parsed.grpc_port)
    return build_application(spec)
