"""Models in deployments of their own are called through their replicas' loopback lanes, not Serve hops:
same answers as through the handle, loopback only, token-checked. That a killed replica's lane is dropped
while the decisions go on is the short fault drill's (``test_faults_short.py``, under steady load)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from riskserve.demo.dataset import generate_transactions
from riskserve.proto.riskserve.internal.v1 import model_lane_pb2 as lane_pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline
from riskserve.serving.lane_wire import LaneConnection
from riskserve.serving.model_lane import LaneAddress, LaneUse

from ..sockets import is_loopback, listening_sockets
from .conftest import ServeCluster, announced_lanes, channel, deploy, pipeline_on

pytestmark = pytest.mark.slow

FRAUD_REPLICAS = 2


def _spec(models: Path, name: str, lanes: bool) -> PipelineSpec:
    """tabular_only with the fraud model in a deployment of its own (two replicas)."""
    data = pipeline_on("tabular_only.yaml", models, name=name).resolved()
    data["serving"]["model_lanes"] = lanes
    data["models"]["fraud"] |= {"placement": "deployment", "replicas": FRAUD_REPLICAS}
    return parse_pipeline(data, source=name)


@pytest.fixture(scope="module")
def specs(serve_cluster: ServeCluster, demo_models: Path) -> dict[str, PipelineSpec]:
    laned, handled = _spec(demo_models, "lanes_on", True), _spec(demo_models, "lanes_off", False)
    for spec in (laned, handled):
        deploy(spec)
    _wait_for_lanes(laned, FRAUD_REPLICAS)
    return {"on": laned, "off": handled}


def _ingress(app: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle("ingress", app_name=app)


def _use(spec: PipelineSpec) -> LaneUse:
    use: LaneUse = _ingress(spec.name).lane_use.remote().result()["fraud"]
    return use


def _wait_for_lanes(spec: PipelineSpec, count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while _use(spec).lanes != count:
        assert time.monotonic() < deadline, f"{spec.name}: {_use(spec)} after {timeout_s} s"
        time.sleep(0.25)


def _announced(spec: PipelineSpec) -> list[LaneAddress]:
    return announced_lanes(spec.name, "model-fraud")


def _requests(count: int, seed: int) -> Iterator[pb.DecideRequest]:
    tx = generate_transactions(count, seed=seed)
    for i in range(count):
        row = tx.row(i)
        yield pb.DecideRequest(
            request_id=f"lane-{seed}-{i}",
            numeric={k: float(v) for k, v in row.items() if isinstance(v, float)},
            categorical={k: str(row[k]) for k in ("merchant_category", "channel")},
        )


def test_the_lane_answers_what_the_handle_answers_and_takes_every_call(
    specs: dict[str, PipelineSpec],
) -> None:
    laned, handled = specs["on"], specs["off"]
    before_on, before_off = _use(laned), _use(handled)
    assert before_off.lanes == 0
    with channel(laned) as on_channel, channel(handled) as off_channel:
        on_stub = pb_grpc.RiskPipelineStub(on_channel)  # type: ignore[no-untyped-call]
        off_stub = pb_grpc.RiskPipelineStub(off_channel)  # type: ignore[no-untyped-call]
        for request in _requests(20, seed=5):
            by_lane = on_stub.Decide(request, metadata=(("application", laned.name),), timeout=30)
            by_handle = off_stub.Decide(request, metadata=(("application", handled.name),), timeout=30)
            fraud_lane = {s.model: s for s in by_lane.models}["fraud"]
            fraud_handle = {s.model: s for s in by_handle.models}["fraud"]
            assert not fraud_lane.fallback
            assert not fraud_handle.fallback
            assert (fraud_lane.score, fraud_lane.version) == (fraud_handle.score, fraud_handle.version)
            assert (by_lane.decision, by_lane.risk_score) == (by_handle.decision, by_handle.risk_score)
    after_on, after_off = _use(laned), _use(handled)
    assert (after_on.lane_calls - before_on.lane_calls, after_on.handle_calls - before_on.handle_calls) == (
        20,
        0,
    )
    assert (after_off.lane_calls, after_off.handle_calls - before_off.handle_calls) == (0, 20)


def test_a_lane_listens_on_loopback_and_refuses_a_call_without_its_token(
    specs: dict[str, PipelineSpec],
) -> None:
    lanes = _announced(specs["on"])
    assert len(lanes) == FRAUD_REPLICAS
    listening = list(listening_sockets().values())
    matrix = lane_pb.FeaturesCall(rows=1, columns=1, values=b"\x00\x00\x00\x00")

    async def call(lane: LaneAddress, token: str) -> lane_pb.LaneResponse:
        connection = LaneConnection(lane.host, lane.port)
        try:
            return await connection.call(lane_pb.LaneRequest(token=token, features=matrix))
        finally:
            await connection.close()

    for lane in lanes:
        assert lane.host == "127.0.0.1"
        bound = [address for address, port in listening if port == lane.port]
        assert set(bound) & {"127.0.0.1", "::ffff:127.0.0.1"}
        assert all(is_loopback(address) for address in bound)  # never 0.0.0.0 or [::], every interface
        for token in ("", "not-" + lane.token):
            refused = asyncio.run(call(lane, token))
            assert (refused.code, refused.verdict) == (grpc.StatusCode.UNAUTHENTICATED.value[0], False)
        # With the token, the model's own verdict: one column is not what the fraud model reads.
        wrong_shape = asyncio.run(call(lane, lane.token))
        assert (wrong_shape.code, wrong_shape.verdict) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], True)
        assert wrong_shape.field
