"""``riskserve status``: the local deployment's pipelines, endpoints, deployments and models."""

from __future__ import annotations

from typing import Any

from riskserve.operations.local import LocalState, connected, read_state
from riskserve.operations.publish import every_replica, model_status
from riskserve.operations.served import open_versions, served_entries
from riskserve.platform.runner import ModelStatus
from riskserve.schema.pipeline import PipelineSpec, load_pipeline

__all__ = ["collect_status", "print_status"]

STATUS_TIMEOUT_S = 5.0
"""How long ``status`` asks a model's replicas before it shows the ones that answered."""


def collect_status(state: LocalState) -> dict[str, Any]:
    """Serve's view of each pipeline (application and deployment states) plus, per model, the typed
    :class:`ModelStatus` of every replica that serves it (asked of the ingress, which knows whether a model
    runs in it or in a deployment of its own), so replicas that disagree on a version show."""
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
            models: dict[str, list[ModelStatus]] = {}
            spec = load_pipeline(state.pipeline_files[name])
            for model in spec.models:
                models[model] = _every_replica(spec, model)
            out[name] = {
                "provenance": _provenance(spec),
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
        for name, replicas in info["models"].items():
            first = replicas[0]
            versions = sorted({str(r.version) for r in replicas})
            shown = versions[0] if len(versions) == 1 else " / ".join(versions) + " (replicas differ)"
            print(f"  model {name:<10} {first.kind:<9} in {first.placement:<10} {shown}")
            why = info.get("provenance", {}).get(name)
            if why:
                print(f"    {why}")
            healthy &= all(r.ready for r in replicas)
    return 0 if healthy else 1


def _provenance(spec: PipelineSpec) -> dict[str, str]:
    """Per model that does not serve its YAML artifact: why (the versions record's entry)."""
    import time

    with open_versions(spec) as store:
        entries = served_entries(spec, store)
    out = {}
    for model, entry in entries.items():
        ago = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.at))
        note = f": {entry.note}" if entry.note else ""
        out[model] = f"serves its {entry.source} version {entry.version} (since {ago}{note}), not the YAML's"
    return out


def _every_replica(spec: PipelineSpec, model: str) -> list[ModelStatus]:
    """Every replica's status of ``model``; the replicas that answered within a few seconds if not all
    did (a replica being replaced), and at least one."""
    from riskserve.platform.errors import ModelUnavailable

    try:
        return every_replica(spec, model, timeout_s=STATUS_TIMEOUT_S)
    except ModelUnavailable:
        return [model_status(spec, model)]
