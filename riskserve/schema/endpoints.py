"""Where each pipeline's gRPC front door listens: one port per pipeline, on loopback unless opened.

Every ingress replica of a pipeline binds the pipeline's ``serving.grpc`` address (replicas share it with
``SO_REUSEPORT``). Pipelines never share a port: connections are spread over every socket bound to it, so
two pipelines on one port would answer each other's calls (with NOT_FOUND, since a call names its
pipeline, but never with the right decision).
"""

from __future__ import annotations

from collections.abc import Sequence

from riskserve.platform.errors import ConfigError
from riskserve.schema.pipeline import PipelineSpec

__all__ = ["assign_endpoints", "endpoint_of", "with_endpoint"]


def with_endpoint(spec: PipelineSpec, *, port: int | None = None, host: str | None = None) -> PipelineSpec:
    """``spec`` with its front door moved to ``host:port`` (``None`` keeps the YAML's)."""
    grpc = spec.serving.grpc
    update: dict[str, object] = {}
    if port is not None:
        update["port"] = port
    if host is not None:
        update["host"] = host
    if not update:
        return spec
    serving = spec.serving.model_copy(update={"grpc": grpc.model_copy(update=update)})
    return spec.model_copy(update={"serving": serving})


def endpoint_of(spec: PipelineSpec) -> str:
    """``HOST:PORT`` clients dial for ``spec`` (``0.0.0.0`` is dialled on loopback)."""
    host = spec.serving.grpc.host
    return f"{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{spec.serving.grpc.port}"


def assign_endpoints(
    specs: Sequence[PipelineSpec], *, base_port: int | None = None, host: str | None = None
) -> list[PipelineSpec]:
    """Each pipeline with its front door: ``base_port`` (``up --grpc-port``) gives the first pipeline that
    port and each next one the next port; without it the YAMLs' ports are used.

    Raises:
        ConfigError: two pipelines would share a port.
    """
    out = [
        with_endpoint(spec, port=None if base_port is None else base_port + i, host=host)
        for i, spec in enumerate(specs)
    ]
    seen: dict[int, str] = {}
    for spec in out:
        port = spec.serving.grpc.port
        if port in seen:
            raise ConfigError(
                f"{spec.name}: serving.grpc.port {port} is also {seen[port]}'s; give each pipeline its own "
                "port (or start them with `riskserve up --grpc-port PORT`, which numbers them from PORT)"
            )
        seen[port] = spec.name
    return out
