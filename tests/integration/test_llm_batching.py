"""Adaptive batching of the LLM (``batching:`` on a model in its own deployment): concurrent decisions'
texts reach vLLM as one engine call, and each decision still gets its own text's label."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from riskserve.client import RiskClient
from riskserve.demo.dataset import generate_transactions
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.schema.deployments import model_deployment

from .conftest import ServeCluster, deploy, endpoint, pipeline_on

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

APP = "batched"
CONCURRENT = 8


def _requests(count: int) -> list[pb.DecideRequest]:
    transactions = generate_transactions(count, seed=11)
    out = []
    for i in range(count):
        out.append(pb.DecideRequest(request_id=f"b{i}", **transactions.request_fields(i, text=True)))
    return out


def client_label(response: pb.DecideResponse) -> str:
    return next(m.label for m in response.models if m.model == "intent")


def test_concurrent_texts_reach_the_engine_as_one_batch(
    serve_cluster: ServeCluster, demo_models: Path
) -> None:
    from ray import serve

    spec = pipeline_on("card_fraud.yaml", demo_models, name=APP)
    data = spec.model_dump(mode="json", exclude={"base_dir"})
    data["models"]["intent"]["batching"] = {"max_batch_size": CONCURRENT, "max_wait_ms": 200}
    spec = type(spec).model_validate({**data, "base_dir": spec.base_dir})
    deploy(spec)
    intent = serve.get_deployment_handle(model_deployment("intent"), app_name=APP)
    requests = _requests(3 * CONCURRENT)
    with RiskClient(endpoint(spec), pipeline=APP, timeout_s=60) as client:
        sequential = [client.decide_request(r) for r in requests[:CONCURRENT]]  # one engine call each
        calls_before = intent.metadata.remote().result().calls
        with ThreadPoolExecutor(CONCURRENT) as pool:
            concurrent = list(pool.map(client.decide_request, requests[:CONCURRENT]))
        engine_calls = intent.metadata.remote().result().calls - calls_before
        # A DecideBatch larger than a batch is one engine call of its own, not a refusal (a fallback).
        whole = client.decide_batch(requests)
    singles = [client_label(r) for r in sequential]
    assert [client_label(r) for r in whole[:CONCURRENT]] == singles
    assert not any(m.fallback for r in whole for m in r.models if m.model == "intent")
    assert engine_calls < CONCURRENT / 2, (
        f"{CONCURRENT} concurrent decisions took {engine_calls} engine calls"
    )
    for one, together in zip(sequential, concurrent, strict=True):
        by_name = {m.model: m for m in together.models}
        assert not by_name["intent"].fallback
        assert by_name["intent"].label == next(m.label for m in one.models if m.model == "intent")
        assert together.request_id == one.request_id
