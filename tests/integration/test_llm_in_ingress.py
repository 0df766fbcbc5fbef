"""The intent LLM placed in the ingress (``placement: ingress``), on real Ray Serve, real vLLM, real gRPC.

The engine then runs in the process that serves the gRPC port: no deployment of its own, no lane, no
second process. It keeps what a model in the ingress has: its version in every answer, the same rules and
reasons, and a hot swap (and rollback) that reloads it in place, under load, losing no decision.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from riskserve.demo.build import build_demo_models
from riskserve.operations.swap import rollback, swap
from riskserve.platform.artifacts import open_artifact
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline

from ..load_helpers import versions_under_load
from .conftest import ServeCluster, deploy, endpoint, pipeline_on, serving_pid
from .test_pipeline_grpc import LEGIT, RISKY, _status

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

NAME = "card_fraud_llm_in_ingress"
NO_TEXT = {k: v for k, v in LEGIT.items() if k != "text"}


@pytest.fixture(scope="module")
def candidate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The intent LLM trained with another seed: another version to swap to."""
    root = tmp_path_factory.mktemp("llm-candidates")
    build_demo_models(root / "seed1", seed=1, only=["intent"], progress=False)
    return root / "seed1" / "intent"


@pytest.fixture(scope="module")
def pipeline(
    serve_cluster: ServeCluster,
    demo_models: Path,
    candidate: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PipelineSpec]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RISKSERVE_STATE_DIR", str(tmp_path_factory.mktemp("llm-swap-state")))  # swap history
        root = str(candidate.parent.parent)  # swap takes candidates from there only
        spec = pipeline_on("card_fraud.yaml", demo_models, name=NAME, models_root=root)
        data = spec.resolved()
        data["models"]["intent"].update(placement="ingress", pool="cpu", num_cpus=0.5)
        spec = parse_pipeline(data, source=NAME)
        assert spec.models["intent"].in_ingress
        deploy(spec)
        yield spec


def _decide(stub: Any, body: dict[str, Any], request_id: str = "") -> pb.DecideResponse:
    response: pb.DecideResponse = stub.Decide(
        pb.DecideRequest(request_id=request_id, **body), metadata=[("application", NAME)], timeout=30
    )
    return response


def test_the_llm_runs_in_the_process_serving_the_port_and_answers_with_its_version(
    pipeline: PipelineSpec, demo_models: Path
) -> None:
    from ray import serve

    assert set(serve.status().applications[NAME].deployments) == {"ingress", "feedback"}
    status = _status(NAME, "intent")
    assert (status.kind, status.placement, status.ready) == ("vllm", "ingress", True)
    assert status.pid == serving_pid(pipeline), "the engine runs where the gRPC port is served"
    version = open_artifact(demo_models / "intent", kind="vllm").version
    assert status.version == version
    with grpc.insecure_channel(endpoint(pipeline)) as chan:
        stub = pb_grpc.RiskPipelineStub(chan)  # type: ignore[no-untyped-call]
        risky = _decide(stub, RISKY)
        intent = {m.model: m for m in risky.models}["intent"]
        assert (intent.version, intent.label, intent.fallback) == (version, "urgent", False)
        assert 0.5 < intent.score <= 1.0
        assert risky.decision == pb.DECLINE
        assert any(r.startswith("pressure_language:") for r in risky.reasons)
        top = list(risky.top_reasons)
        assert (top[0].field, top[0].model, top[0].value) == ("text", "intent", "urgent")
        calls = _status(NAME, "intent").calls
        plain = _decide(stub, NO_TEXT)  # no text: the LLM is not called, and says so with no version
        intent = {m.model: m for m in plain.models}["intent"]
        assert (intent.version, intent.score, intent.fallback) == ("", 0.0, False)
        assert _status(NAME, "intent").calls == calls


def test_a_swap_and_a_rollback_of_the_llm_in_the_ingress_under_load_lose_nothing_and_restart_nothing(
    pipeline: PipelineSpec, demo_models: Path, candidate: Path
) -> None:
    old = open_artifact(demo_models / "intent", kind="vllm").version
    new = open_artifact(candidate, kind="vllm").version
    assert old != new
    pid = serving_pid(pipeline)
    started_at = _status(NAME, "intent").started_at
    request = pb.DecideRequest(**RISKY)
    with versions_under_load(endpoint(pipeline), NAME, request, "intent", per_s=20, retry_shed=True) as load:
        time.sleep(1.0)
        swapped = swap(pipeline, "intent", candidate)
        assert (swapped.old_version, swapped.new_version) == (old, new)
        after_swap = time.monotonic()
        time.sleep(1.0)
        rolled = rollback(pipeline, "intent")
        assert (rolled.old_version, rolled.new_version) == (new, old)
        after_rollback = time.monotonic()
        time.sleep(1.0)
    answers = sorted(load.answers)
    assert load.failures == []
    # Retiring an engine frees its KV cache (1 GiB) with the interpreter held, ~0.5 s: the front door
    # sheds what arrives meanwhile (max_loop_lag_ms), and the caller's retry is answered
    assert load.shed <= 0.25 * len(answers), f"{load.shed} calls shed against {len(answers)} answered"
    versions = [version for _, version in answers]
    assert set(versions) == {old, new}, "answers came from both versions, each named"
    # one connection, one ingress replica: the versions follow the swaps, never back and forth
    changes = [v for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]]
    assert changes == [old, new, old]
    assert all(v == new for t, v in answers if after_swap + 0.5 < t < after_swap + 1.0)
    assert all(v == old for t, v in answers if t > after_rollback + 0.5)
    assert serving_pid(pipeline) == pid, "nothing restarted"
    status = _status(NAME, "intent")
    assert (status.version, status.started_at) == (old, started_at)
