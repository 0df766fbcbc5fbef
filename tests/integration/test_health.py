"""``grpc.health.v1`` on each pipeline's own front door, answered from the state its ingress keeps.

No ``application`` metadata is needed: a pipeline's port serves its health, and the service name picks
what is asked about ("", ``riskserve.v1.RiskPipeline`` or the pipeline's name; anything else NOT_FOUND).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from riskserve.schema.pipeline import PipelineSpec, parse_pipeline
from tests import fault_injection

from .conftest import ServeCluster, channel, deploy, pipeline_on


@pytest.fixture(autouse=True, scope="module")
def _fault_injection_registered() -> Iterator[None]:
    """``kind: fault_injection`` is a test-only backend: known only while this module runs."""
    with fault_injection.registered():
        yield


pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REMOTE_REFRESH_BOUND_S = 5.0
"""The ingress asks its remote models every second; SERVING must follow their readiness within this."""


def _check(spec: PipelineSpec, service: str = "") -> int:
    with channel(spec) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return int(answer.status)


def _model_status(app: str, model: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle("ingress", app_name=app).model_status.remote(model).result()


def test_check_and_watch_report_serving_then_not_serving_while_draining(
    serve_cluster: ServeCluster, demo_models: Path
) -> None:
    from ray import serve

    from riskserve.operations.app import build_application

    spec = pipeline_on("tabular_only.yaml", demo_models, name="health")
    deploy(spec)
    assert _check(spec) == SERVING
    assert _check(spec, "riskserve.v1.RiskPipeline") == SERVING
    assert _check(spec, "health") == SERVING
    for unknown in ("some.other.Service", "tabular_only"):  # another pipeline's name is not served here
        with pytest.raises(grpc.RpcError) as info:
            _check(spec, unknown)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

    before = {name: _model_status("health", name) for name in ("credit", "fraud")}
    assert {status.placement for status in before.values()} == {"ingress"}
    with channel(spec) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        stream = stub.Watch(health_pb2.HealthCheckRequest(), timeout=60)
        assert next(stream).status == SERVING
        serve.run(build_application(spec, draining=True), name="health", route_prefix=None)
        assert next(stream).status == NOT_SERVING
        stream.cancel()
    assert _check(spec) == NOT_SERVING
    assert _check(spec, "health") == NOT_SERVING
    for name, old in before.items():
        new = _model_status("health", name)
        assert (new.pid, new.actor_id, new.started_at) == (old.pid, old.actor_id, old.started_at), (
            "draining reconfigures the ingress in place; neither it nor its models restart"
        )
        assert (new.version, new.artifact, new.ready) == (old.version, old.artifact, True)


def test_not_serving_until_every_model_is_ready(
    serve_cluster: ServeCluster, demo_models: Path, tmp_path: Path
) -> None:
    """A model in its own deployment whose load takes 8 s on purpose (fault injection): health stays
    NOT_SERVING until the ingress sees it ready."""
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
    assert not spec.models["fraud"].in_ingress  # fault injection defaults to a deployment of its own
    deployer = threading.Thread(target=deploy, args=(spec,))
    deployer.start()
    seen: list[int] = []
    refused: set[grpc.StatusCode] = set()
    while deployer.is_alive():
        try:
            seen.append(_check(spec))
        except grpc.RpcError as error:  # before the ingress binds the port
            refused.add(error.code())
        time.sleep(0.3)
    deployer.join()
    assert refused <= {grpc.StatusCode.UNAVAILABLE}, refused
    assert NOT_SERVING in seen, seen
    assert SERVING not in seen[: seen.index(NOT_SERVING) + 1]
    deadline = time.monotonic() + REMOTE_REFRESH_BOUND_S
    while (status := _check(spec)) != SERVING and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status == SERVING
    assert _model_status("health_slow", "fraud").ready


def test_the_front_door_is_riskserves_own_server_not_rays_proxy(tabular_only: PipelineSpec) -> None:
    """Ray Serve's proxy is gone: its Healthz is not on the pipeline's port; health and reflection are.
    (The session's tabular_only: a pipeline as deployed by default.)"""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    spec = tabular_only
    with channel(spec) as chan:
        healthz = chan.unary_unary(
            "/ray.serve.RayServeAPIService/Healthz",
            request_serializer=lambda _: b"",
            response_deserializer=lambda raw: raw,
        )
        with pytest.raises(grpc.RpcError) as info:
            healthz(None, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        stub = reflection_pb2_grpc.ServerReflectionStub(chan)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = list(stub.ServerReflectionInfo(iter([request]), timeout=30))
    names = {s.name for s in answer.list_services_response.service}
    assert {"riskserve.v1.RiskPipeline", "grpc.health.v1.Health"} <= names
    assert not any(name.startswith("ray.") for name in names)
    assert _check(spec, spec.name) == SERVING
