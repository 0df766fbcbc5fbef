"""A ``serve deploy``-able Ray Serve config file generated from pipeline YAMLs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from riskserve.schema.endpoints import assign_endpoints
from riskserve.schema.pipeline import load_pipeline

__all__ = ["serve_config"]


def serve_config(paths: Sequence[Path], *, grpc_port: int | None = None) -> dict[str, Any]:
    """The Serve config (validated against Ray's ``ServeDeploySchema``) that runs these pipelines.

    Each application is ``riskserve.operations.app:build_app`` with the pipeline file as its argument, so the
    cluster reads the same YAML; deployment names and options come from the YAML, not from this file. What
    each model serves is not in it: the replicas pull that from the pipeline's versions record, so this
    config is the same before and after any number of swaps and learned versions.
    Serve's proxies stay off: each pipeline's ingress serves gRPC on its own port (``grpc_port`` numbers
    them from that port, as ``riskserve up --grpc-port`` does).

    Raises:
        ConfigError: two pipelines would share a port.
    """
    from ray.serve.schema import ServeDeploySchema

    loaded = [load_pipeline(p) for p in paths]
    specs = assign_endpoints(loaded, base_port=grpc_port)
    applications = []
    for path, spec in zip(paths, specs, strict=True):
        args: dict[str, Any] = {"pipeline": str(Path(path).resolve()), "grpc_port": spec.serving.grpc.port}
        applications.append(
            {
                "name": spec.name,
                "route_prefix": None,
                "import_path": "riskserve.operations.app:build_app",
                "args": args,
            }
        )
    config = {"proxy_location": "Disabled", "applications": applications}
    ServeDeploySchema.model_validate(config)
    return config
