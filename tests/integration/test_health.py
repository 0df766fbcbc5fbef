"""``grpc.health.v1`` for each pipeline through Ray's proxy, beside Ray Serve's own Healthz."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from riskserve.pipelines.spec import PipelineSpec, parse_pipeline

from .conftest import ServeCluster, deploy, pipeline_on

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _check(cluster: ServeCluster, app: str, service: str = "") -> int:
    with cluster.channel() as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = stub.Check(
            health_pb2.HealthCheckRequest(service=service), metadata=[("application", app)], timeout=10
        )
    return int(answer.status)


def test_check_and_watch_report_serving_then_not_serving_while_draining(
    serve_cluster: ServeCluster, demo_models: Path
) -> None:
    from ray import serve

    from riskserve.pipelines.app import build_application

    spec = pipeline_on("tabular_only.yaml", demo_models, name="health")
    deploy(spec)
    assert _check(serve_cluster, "health") == SERVING
    assert _check(serve_cluster, "health", "riskserve.v1.RiskPipeline") == SERVING
    with pytest.raises(grpc.RpcError) as info:
        _check(serve_cluster, "health", "some.other.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND

    with serve_cluster.channel() as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stream = stub.Watch(health_pb2.HealthCheckRequest(), metadata=[("application", "health")], timeout=60)
        assert next(stream).status == SERVING
        replicas = (
            serve.get_deployment_handle("model-fraud", app_name="health").metadata.remote().result()["pid"]
        )
        serve.run(build_application(spec, draining=True), name="health", route_prefix="/health")
        assert next(stream).status == NOT_SERVING
        stream.cancel()
    assert _check(serve_cluster, "health") == NOT_SERVING
    after = serve.get_deployment_handle("model-fraud", app_name="health").metadata.remote().result()["pid"]
    assert after == replicas, "draining reconfigures the ingress in place; models are not restarted"


def test_not_serving_until_every_model_is_ready(
    serve_cluster: ServeCluster, demo_models: Path, tmp_path: Path
) -> None:
    """A model whose load takes 8 s on purpose (fault injection): health stays NOT_SERVING until it is up."""
    data = pipeline_on("tabular_only.yaml", demo_models, name="health_slow").resolved()
    data["models"]["fraud"].update(
        kind="fault_injection",
        settings={
            "inner_kind": "sklearn",
            "control_file": str(tmp_path / "none.json"),
            "load_delay_ms": 8000,
        },
    )
    spec: PipelineSpec = parse_pipeline(data, source="health_slow")
    deployer = threading.Thread(target=deploy, args=(spec,))
    deployer.start()
    seen: list[int] = []
    refused: set[grpc.StatusCode] = set()
    while deployer.is_alive():
        try:
            seen.append(_check(serve_cluster, "health_slow"))
        except grpc.RpcError as error:  # before the proxy knows the application at all
            refused.add(error.code())
        time.sleep(0.3)
    deployer.join()
    assert refused <= {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE}, refused
    assert NOT_SERVING in seen, seen
    assert SERVING not in seen[: seen.index(NOT_SERVING) + 1]
    assert _check(serve_cluster, "health_slow") == SERVING


def test_ray_serve_healthz_answers_beside_it(serve_cluster: ServeCluster) -> None:
    with serve_cluster.channel() as channel:
        healthz = channel.unary_unary(
            "/ray.serve.RayServeAPIService/Healthz",
            request_serializer=lambda _: b"",
            response_deserializer=lambda raw: raw,
        )
        assert b"success" in healthz(None, timeout=10)
