"""``riskserve status``: the local deployment's pipelines, models, versions, replicas and health."""

from __future__ import annotations

from typing import Any

from riskserve.pipelines.local import LocalState, connected, read_state

__all__ = ["collect_status", "print_status"]


def collect_status(state: LocalState) -> dict[str, Any]:
    """Serve's view of each pipeline (application and deployment states) plus each model's metadata."""
    with connected(state):
        from ray import serve

        status = serve.status()
        out: dict[str, Any] = {}
        for name in state.pipelines:
            app = status.applications.get(name)
            if app is None:
                out[name] = {"status": "NOT_DEPLOYED", "deployments": {}}
                continue
            deployments = {}
            for dep_name, dep in app.deployments.items():
                entry: dict[str, Any] = {
                    "status": str(dep.status.value),
                    "replicas": dict(dep.replica_states),
                }
                if dep_name.startswith("model-"):
                    meta = serve.get_deployment_handle(dep_name, app_name=name).metadata.remote().result()
                    entry.update(kind=meta["kind"], version=meta["version"], ready=meta["ready"])
                deployments[dep_name] = entry
            out[name] = {"status": str(app.status.value), "deployments": deployments}
        return out


def print_status() -> int:
    """Print the status table; exit code 1 when nothing runs or something is unhealthy."""
    state = read_state()
    if state is None:
        print("riskserve is not running (`riskserve up PIPELINE.yaml`)")
        return 1
    print(f"riskserve on {state.target} (pid {state.pid}, Ray {state.gcs_address})")
    healthy = True
    for pipeline, info in collect_status(state).items():
        print(f"\n{pipeline}: {info['status']}")
        healthy &= info["status"] == "RUNNING"
        for name, dep in info["deployments"].items():
            replicas = ", ".join(f"{n} {s}" for s, n in dep["replicas"].items())
            model = f"  {dep['kind']:<9} {dep['version']}" if "kind" in dep else ""
            print(f"  {name:<16} {dep['status']:<10} replicas: {replicas}{model}")
            healthy &= dep["status"] == "HEALTHY"
    return 0 if healthy else 1
