"""A ``serve deploy``-able Ray Serve config file generated from pipeline YAMLs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from riskserve.pipelines.app import GRPC_SERVICER_FUNCTIONS
from riskserve.pipelines.spec import load_pipeline

__all__ = ["serve_config"]


def serve_config(paths: Sequence[Path], *, grpc_port: int = 9000, http_port: int = 8000) -> dict[str, Any]:
    """The Serve config (validated against Ray's ``ServeDeploySchema``) that runs these pipelines.

    Each application is ``riskserve.pipelines.app:build_app`` with the pipeline file as its argument, so the
    cluster reads the same YAML; deployment names and options come from the YAML, not from this file.
    """
    from ray.serve.schema import ServeDeploySchema

    specs = [(Path(p).resolve(), load_pipeline(p)) for p in paths]
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "grpc_options": {"port": grpc_port, "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS)},
        "applications": [
            {
                "name": spec.name,
                "route_prefix": f"/{spec.name}",
                "import_path": "riskserve.pipelines.app:build_app",
                "args": {"pipeline": str(path)},
            }
            for path, spec in specs
        ],
    }
    ServeDeploySchema.model_validate(config)
    return config
