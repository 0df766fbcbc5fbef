"""``riskserve status``: the local deployment's pipelines, endpoints, deployments and models."""

from __future__ import annotations

from typing import Any

from riskserve.operations.local import LocalState, connected, read_state
from riskserve.platform.runner import ModelStatus
from riskserve.schema.deployments import INGRESS
from riskserve.schema.pipeline import load_pipeline

__all__ = ["collect_status", "print_status"]


def collect_status(state: LocalState) -> dict[str, Any]:
    """Serve's view of each pipeline (application and deployment states) plus each model's typed
    :class:`ModelStatus`, asked of the ingress (which knows whether a model runs in it or in a
    deployment of its own)."""
    with connected(state):
        from ray import serve

        status = serve.status()
        out: dict[str, Any] = {}
        for name in state.pipelines:
            app = status.applications.get(name)
            if app is None:
                out[name] = {"status": "NOT_DEPLOYED", "deployments": {}, "models": {}}
                continue
            deployments = {
                dep_name: {
                    "status": str(dep.status.value),
                    "replicas": {str(k): v for k, v in dep.replica_states.items()},
                }
                for dep_name, dep in app.deployments.items()
            }
            models: dict[str, ModelStatus] = {}
            ingress = serve.get_deployment_handle(INGRESS, app_name=name)
            for model in load_pipeline(state.pipeline_files[name]).models:
                models[model] = ingress.model_status.remote(model).result(timeout_s=30)
            out[name] = {
                "status": str(app.status.value),
                "endpoint": state.endpoint(name),
                "deployments": deployments,
                "models": models,
            }
        return out


def print_status() -> int:
    """Print the status table; exit code 1 when nothing runs or something is unhealthy."""
    state = read_state()
    if state is None:
        print("riskserve is not running (`riskserve up PIPELINE.yaml`)")
        return 1
    print(f"riskserve (pid {state.pid}, Ray {state.gcs_address})")
    healthy = True
    for pipeline, info in collect_status(state).items():
        print(f"\n{pipeline}: {info['status']}  gRPC {info.get('endpoint', '-')}")
        healthy &= info["status"] == "RUNNING"
        for name, dep in info["deployments"].items():
            replicas = ", ".join(f"{n} {s}" for s, n in dep["replicas"].items())
            print(f"  {name:<16} {dep['status']:<10} replicas: {replicas}")
            healthy &= dep["status"] == "HEALTHY"
        for name, model in info["models"].items():
            print(f"  model {name:<10} {model.kind:<9} in {model.placement:<10} {model.version}")
            healthy &= model.ready
    return 0 if healthy else 1
