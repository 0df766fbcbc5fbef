"""Breakers, fallbacks, deadlines and backpressure on real Ray Serve over real gRPC.

Faults are injected on purpose by the ``fault_injection`` backend, which wraps the real scikit-learn model
and reads a control file before each prediction (tests named ``..._injected_...`` use it). Its default
placement is a deployment of its own (``model-fraud``), so the ingress reaches it through a Serve handle:
these drills cover the remote path (timeouts, cancellation, the model's queue), and every call reaches the
pipeline's own gRPC port (:func:`endpoint`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from riskserve.client import RiskClient
from riskserve.platform.errors import DeadlineExceeded, Overloaded
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.schema.pipeline import PipelineSpec
from tests import fault_injection

from .conftest import ServeCluster, deploy, endpoint, pipeline_on


@pytest.fixture(autouse=True, scope="module")
def _fault_injection_registered() -> Iterator[None]:
    """``kind: fault_injection`` is a test-only backend: known only while this module runs."""
    with fault_injection.registered():
        yield


pytestmark = pytest.mark.slow

REQUEST = {
    "numeric": {"amount": 23.5, "account_age_days": 2400.0, "txn_velocity_1h": 0.0, "hour": 12.0},
    "categorical": {"merchant_category": "grocery", "channel": "pos"},
}


def _drill(
    name: str, models: Path, control: Path, *, fraud: dict[str, Any], serving: dict[str, Any] | None = None
) -> PipelineSpec:
    spec = pipeline_on("tabular_only.yaml", models, name=name)
    data = spec.resolved()
    data["models"]["fraud"] = {
        **data["models"]["fraud"],
        "kind": "fault_injection",
        "settings": {"inner_kind": "sklearn", "control_file": str(control)},
        **fraud,
    }
    if serving:
        data["serving"] = {**data["serving"], **serving}
    from riskserve.schema.pipeline import parse_pipeline

    drill = parse_pipeline(data, source=name)
    assert not drill.models["fraud"].in_ingress, "the drills inject faults into a model deployment"
    return drill


def _faults(control: Path, **faults: object) -> None:
    control.write_text(json.dumps(faults))


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults") / "fraud.json"


@pytest.fixture(scope="module")
def drill(serve_cluster: ServeCluster, demo_models: Path, control: Path) -> Iterator[RiskClient]:
    _faults(control)
    breaker = {"window_size": 4, "minimum_calls": 4, "failure_rate_threshold": 0.5, "open_ms": 1500,
               "half_open_probes": 2}  # fmt: skip
    spec = _drill("drill", demo_models, control, fraud={"timeout_ms": 800, "breaker": breaker})
    deploy(spec)
    with RiskClient(endpoint(spec), pipeline="drill", timeout_s=10) as client:
        yield client


def _fraud(response: pb.DecideResponse) -> pb.ModelScore:
    return next(m for m in response.models if m.model == "fraud")


def _model_calls(app: str) -> int:
    from ray import serve

    calls: int = serve.get_deployment_handle("model-fraud", app_name=app).metadata.remote().result().calls
    return calls


def _breakers(app: str) -> dict[str, str]:
    from ray import serve

    states: dict[str, str] = (
        serve.get_deployment_handle("ingress", app_name=app).breaker_states.remote().result()
    )
    return states


def test_an_injected_slow_model_falls_back_on_timeout_and_the_pipeline_still_decides(
    drill: RiskClient, control: Path
) -> None:
    _faults(control)
    healthy = drill.decide(**REQUEST)
    assert not _fraud(healthy).fallback
    _faults(control, delay_ms=3000)
    started = time.perf_counter()
    slow = drill.decide(**REQUEST)
    elapsed = time.perf_counter() - started
    fraud = _fraud(slow)
    assert (fraud.fallback, fraud.fallback_reason, fraud.score, fraud.version) == (True, "TIMEOUT", 0.5, "")
    assert slow.decision == pb.REVIEW
    assert "fraud: model unavailable (TIMEOUT), decided without it" in slow.reasons
    assert elapsed < 2.0, "the fallback answers at the model's 800 ms budget, not after the 3 s call"
    credit = next(m for m in slow.models if m.model == "credit")
    assert not credit.fallback
    _faults(control)
    time.sleep(2.5)  # let the slow call finish before the next test


def test_an_injected_failing_model_opens_its_breaker_then_probes_and_closes(
    drill: RiskClient, control: Path
) -> None:
    _faults(control)
    for _ in range(4):  # fill the window with successes so only this test's failures judge it
        assert not _fraud(drill.decide(**REQUEST)).fallback
    assert _breakers("drill")["fraud"] == "closed"
    _faults(control, fail=True)
    reasons = [_fraud(drill.decide(**REQUEST)).fallback_reason for _ in range(2)]
    assert reasons == ["ERROR", "ERROR"]
    assert _breakers("drill")["fraud"] == "open"  # 2 failures in a window of 4: rate 0.5
    calls = _model_calls("drill")
    started = time.perf_counter()
    rejected = [_fraud(drill.decide(**REQUEST)) for _ in range(5)]
    assert [m.fallback_reason for m in rejected] == ["CIRCUIT_OPEN"] * 5
    assert time.perf_counter() - started < 1.0
    assert _model_calls("drill") == calls, "an open breaker sends nothing to the model"

    _faults(control)
    time.sleep(1.6)  # open_ms 1500: the next calls are the half-open probes
    probes = [_fraud(drill.decide(**REQUEST)) for _ in range(2)]
    assert [p.fallback for p in probes] == [False, False]
    assert _breakers("drill")["fraud"] == "closed"
    assert _model_calls("drill") == calls + 2


def test_a_failed_probe_reopens_the_breaker(drill: RiskClient, control: Path) -> None:
    _faults(control, fail=True)
    while _breakers("drill")["fraud"] != "open":
        drill.decide(**REQUEST)
    time.sleep(1.6)
    assert _fraud(drill.decide(**REQUEST)).fallback_reason == "ERROR"  # the probe reached the model
    assert _breakers("drill")["fraud"] == "open"
    assert _fraud(drill.decide(**REQUEST)).fallback_reason == "CIRCUIT_OPEN"
    _faults(control)
    time.sleep(1.6)
    for _ in range(2):
        drill.decide(**REQUEST)
    assert _breakers("drill")["fraud"] == "closed"


def test_injected_invalid_input_from_the_model_never_counts_against_it(
    drill: RiskClient, control: Path
) -> None:
    """The MODEL refuses the rows as invalid input (fault injected): six calls reach fraud's guarded
    call, each answers INVALID_ARGUMENT naming the field, and the breaker (4 calls, 50%) stays closed.
    Counted as failures, they would open it."""
    from riskserve.platform.errors import InvalidInput

    _faults(control, invalid="merchant_category")
    try:
        for _ in range(6):
            with pytest.raises(InvalidInput, match="merchant_category: injected, refused by model 'fraud'"):
                drill.decide(**REQUEST)
        assert _breakers("drill") == {"credit": "closed", "fraud": "closed"}
    finally:
        _faults(control)
    assert not _fraud(drill.decide(**REQUEST)).fallback  # the model scores again, its breaker closed


@pytest.fixture(scope="module")
def slow_drill(
    serve_cluster: ServeCluster, demo_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> PipelineSpec:
    """fraud takes 3 s on purpose; the ingress takes 2 decisions at once and queues 1 more."""
    control = tmp_path_factory.mktemp("slow") / "fraud.json"
    _faults(control, delay_ms=3000)
    spec = _drill(
        "drill_slow", demo_models, control, fraud={"timeout_ms": 10_000},
        serving={"ingress": {"replicas": 1, "max_ongoing_requests": 2, "max_queued_requests": 1,
                             "num_cpus": 0.25},
                 "decision_timeout_ms": 10_000},
    )  # fmt: skip
    deploy(spec)
    return spec


def test_the_callers_deadline_bounds_the_decision_and_cancels_the_model_call(
    slow_drill: PipelineSpec,
) -> None:
    from ray import serve

    handle = serve.get_deployment_handle("model-fraud", app_name="drill_slow")
    cancelled_before = handle.metadata.remote().result().cancelled
    with RiskClient(endpoint(slow_drill), pipeline="drill_slow") as client:
        started = time.perf_counter()
        with pytest.raises(DeadlineExceeded):
            client.decide(**REQUEST, timeout_s=0.5)
        elapsed = time.perf_counter() - started
    assert elapsed < 1.0, f"DEADLINE_EXCEEDED after {elapsed:.2f} s"
    deadline = time.monotonic() + 10
    while handle.metadata.remote().result().cancelled == cancelled_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert handle.metadata.remote().result().cancelled > cancelled_before, "the model's work was cancelled"


def _concurrently(spec: PipelineSpec, calls: int, timeout_s: float) -> list[tuple[str, float, Any]]:
    def call(_: int) -> tuple[str, float, Any]:
        with RiskClient(endpoint(spec), pipeline=spec.name) as client:
            started = time.perf_counter()
            try:
                response: Any = client.decide(**REQUEST, timeout_s=timeout_s)
                outcome = "ok"
            except Overloaded:
                outcome, response = "RESOURCE_EXHAUSTED", None
            except DeadlineExceeded:
                outcome, response = "DEADLINE_EXCEEDED", None
            return outcome, time.perf_counter() - started, response

    with ThreadPoolExecutor(calls) as pool:
        return list(pool.map(call, range(calls)))


def test_an_overloaded_ingress_is_a_prompt_resource_exhausted_never_a_hang(slow_drill: PipelineSpec) -> None:
    started = time.perf_counter()
    results = _concurrently(slow_drill, 8, timeout_s=9)
    refused = [elapsed for outcome, elapsed, _ in results if outcome == "RESOURCE_EXHAUSTED"]
    assert len(refused) >= 4, results  # 2 running + 1 queued in the ingress, the rest refused
    assert max(refused) < 1.0, results
    assert time.perf_counter() - started < 9.5, "every call ended within its deadline: nothing hung"
    assert grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] == 8


def test_a_model_whose_queue_is_full_falls_back_as_overloaded(
    serve_cluster: ServeCluster, demo_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    control = tmp_path_factory.mktemp("queue") / "fraud.json"
    _faults(control, delay_ms=2000)
    fraud = {"timeout_ms": 10_000, "max_ongoing_requests": 1, "max_queued_requests": 1}
    spec = _drill("drill_queue", demo_models, control, fraud=fraud)
    deploy(spec)
    results = _concurrently(spec, 5, timeout_s=15)
    overloaded = [
        elapsed for outcome, elapsed, response in results
        if outcome == "ok" and _fraud(response).fallback_reason == "OVERLOADED"
    ]  # fmt: skip
    assert len(overloaded) >= 2, results  # 1 running + 1 queued at the model, the rest fall back at once
    assert max(overloaded) < 1.0, results
    assert all(outcome == "ok" for outcome, _, _ in results), "the pipeline still decides for every call"
