"""Hot swap of the scikit-learn model under continuous load, on real Ray Serve over real gRPC.

The fraud model runs where it runs by default: inside every ingress replica (two here), next to the tree
model. A swap reconfigures the ingress replicas in place: each one flips to the candidate, no process
restarts, a decision already in flight finishes on the version it started with, and every answer names the
version that scored it. The LLM, in a deployment of its own, is not touched.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from riskserve.client import RiskClient
from riskserve.demo.build import build_demo_models
from riskserve.demo.dataset import FEATURE_NAMES
from riskserve.demo.tabular import make_tabular_data
from riskserve.operations.publish import model_status
from riskserve.operations.swap import rollback, swap
from riskserve.platform.artifacts import open_artifact
from riskserve.platform.errors import Conflict, ModelLoadError
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc
from riskserve.schema.pipeline import PipelineSpec, parse_pipeline
from riskserve.wrappers.sklearn_model import LinearSnapshot, save_sklearn_artifact
from tests import fault_injection

from ..learning_helpers import own_connection, replica_statuses
from ..load_helpers import versions_under_load
from ..pg_server import PostgresServer
from .conftest import ServeCluster, deploy, endpoint, pipeline_on


@pytest.fixture(autouse=True, scope="module")
def _fault_injection_registered() -> Iterator[None]:
    """``kind: fault_injection`` is a test-only backend: known only while this module runs."""
    with fault_injection.registered():
        yield


pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REQUEST = {
    "numeric": {"amount": 180.0, "account_age_days": 40.0, "txn_velocity_1h": 3.0, "hour": 22.0},
    "categorical": {"merchant_category": "electronics", "channel": "online"},
    "text": "bought headphones for the house",
}
TABULAR = {k: v for k, v in REQUEST.items() if k != "text"}
LOAD_PER_S = 5
"""Decisions per second per load thread (four threads: 20 decisions/s in all)."""
LOAD_THREADS = 4
"""Each on a connection of its own, so the kernel spreads them over the ingress replicas."""
INGRESS_REPLICAS = 2
HOLD_MS = 12_000
"""How long the in-flight test holds a decision in the model, well past a swap (a few seconds)."""
LEAVE_DEPLOYED = ("card_fraud",)
"""test_pipeline_grpc runs next and deploys card_fraud over this one: its LLM replica is kept (same
arguments), the ingress and feedback replicas restart (see ``RUN_NEXT`` in conftest)."""


@pytest.fixture(scope="module")
def candidates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Good candidates retrained with other seeds, and bad ones made from them on purpose."""
    root = tmp_path_factory.mktemp("candidates")
    good = {}
    for seed in (1, 2):
        build_demo_models(root / f"seed{seed}", seed=seed, only=["fraud"], progress=False)
        good[f"seed{seed}"] = root / f"seed{seed}" / "fraud"
    build_demo_models(root / "seed1", seed=1, only=["intent"], progress=False)
    good["intent_seed1"] = root / "seed1" / "intent"
    bad = {name: root / name for name in ("truncated", "checksum", "width", "constant")}
    for path in bad.values():
        shutil.copytree(good["seed1"], path)
    params = bad["truncated"] / "params.json"
    params.write_bytes(params.read_bytes()[:200])
    params = bad["checksum"] / "params.json"
    params.write_text(params.read_text().replace('"alpha": 0.0001', '"alpha": 0.0002'))
    data = make_tabular_data(5, train_rows=2000, test_rows=200)
    snapshot = LinearSnapshot.from_params(_narrow(good["seed1"], 19))
    shutil.rmtree(bad["width"])
    save_sklearn_artifact(
        snapshot, bad["width"], feature_names=FEATURE_NAMES[:19], golden_x=data.x_test[:32, :19]
    )
    constant = _constant(good["seed1"])
    shutil.rmtree(bad["constant"])
    save_sklearn_artifact(constant, bad["constant"], feature_names=FEATURE_NAMES, golden_x=data.x_test[:32])
    return {**good, **bad}


def _narrow(path: Path, width: int) -> Any:
    from riskserve.wrappers.sklearn_model import LinearParams

    params = LinearParams.model_validate_json((path / "params.json").read_bytes())
    scaler = params.scaler.model_copy(
        update={k: getattr(params.scaler, k)[:width] for k in ("mean", "var", "scale")}
    )
    return params.model_copy(update={"coef": params.coef[:width], "scaler": scaler})


def _constant(path: Path) -> LinearSnapshot:
    from riskserve.wrappers.sklearn_model import LinearParams

    params = LinearParams.model_validate_json((path / "params.json").read_bytes())
    return LinearSnapshot.from_params(params.model_copy(update={"coef": [0.0] * len(params.coef)}))


@pytest.fixture(scope="module")
def pipeline(
    serve_cluster: ServeCluster,
    demo_models: Path,
    tmp_path_factory: pytest.TempPathFactory,
    candidates: dict[str, Path],
    postgres: PostgresServer,
) -> Iterator[PipelineSpec]:
    import os

    previous = os.environ.get("RISKSERVE_STATE_DIR")
    os.environ["RISKSERVE_STATE_DIR"] = str(tmp_path_factory.mktemp("swap-state"))  # the swap history
    spec = pipeline_on(
        "card_fraud.yaml",
        demo_models,
        serving={"ingress": {"replicas": INGRESS_REPLICAS}},
        models_root=str(candidates["seed1"].parent.parent),  # swap takes candidates from there only
        state={"dsn": postgres.new_database()},  # swaps under load on PostgreSQL (SQLite: most others)
    )
    assert spec.models["fraud"].in_ingress, "the default placement of a scikit-learn model"
    assert spec.models["credit"].in_ingress
    assert not spec.models["intent"].in_ingress
    deploy(spec)
    yield spec
    if previous is None:
        os.environ.pop("RISKSERVE_STATE_DIR")
    else:
        os.environ["RISKSERVE_STATE_DIR"] = previous


def _identities(spec: PipelineSpec) -> dict[str, Any]:
    """The processes that serve and what they load: per ingress replica (actor id), its pid and when each
    in-ingress model's runner started (credit's version too: it must not move); the LLM's replica and
    engine."""
    from ray import serve

    intent = serve.get_deployment_handle("model-intent", app_name=spec.name).metadata.remote().result()
    credit = replica_statuses(spec.name, "credit", INGRESS_REPLICAS)
    fraud = replica_statuses(spec.name, "fraud", INGRESS_REPLICAS)
    assert set(credit) == set(fraud), "the same ingress replicas hold both models"
    return {
        "ingress": {a: (s.pid, s.started_at, fraud[a].pid, fraud[a].started_at) for a, s in credit.items()},
        "credit": {a: s.version for a, s in credit.items()},
        "intent": (intent.pid, intent.actor_id, intent.started_at, intent.details.get("engine_started_at")),
    }


def _fraud_on_every_replica(spec: PipelineSpec) -> dict[str, str | None]:
    """The fraud version each ingress replica serves (replica actor id -> version)."""
    statuses = replica_statuses(spec.name, "fraud", INGRESS_REPLICAS)
    assert {s.placement for s in statuses.values()} == {"ingress"}
    return {actor: status.version for actor, status in statuses.items()}


def test_swaps_under_load_lose_nothing_and_restart_nothing_else(
    pipeline: PipelineSpec, candidates: dict[str, Path]
) -> None:
    original = open_artifact(pipeline.artifact_path("fraud"), kind="sklearn").version
    versions = {name: open_artifact(candidates[name], kind="sklearn").version for name in ("seed1", "seed2")}
    before = _identities(pipeline)
    assert set(_fraud_on_every_replica(pipeline).values()) == {original}
    flips: list[tuple[float, str]] = []
    refusals: dict[str, str] = {}
    request = pb.DecideRequest(**REQUEST)
    with versions_under_load(
        endpoint(pipeline), pipeline.name, request, "fraud", threads=LOAD_THREADS, per_s=LOAD_PER_S
    ) as load:
        time.sleep(3)
        for step in ("seed1", "truncated", "seed2", "checksum", "width", "constant", "rollback"):
            serving = flips[-1][1] if flips else original
            if step == "rollback":
                result = rollback(pipeline, "fraud")
            elif step.startswith("seed"):
                result = swap(pipeline, "fraud", candidates[step])
            else:
                with pytest.raises(ModelLoadError) as info:
                    swap(pipeline, "fraud", candidates[step])
                assert f"{serving} keeps serving" in str(info.value)
                refusals[step] = str(info.value)
                assert set(_fraud_on_every_replica(pipeline).values()) == {serving}, (
                    "a refusal changes nothing"
                )
                continue
            flips.append((time.monotonic(), result.new_version))
            assert result.old_version == serving
            on_replicas = _fraud_on_every_replica(pipeline)
            assert set(on_replicas.values()) == {result.new_version}, (
                f"every ingress replica flips: {on_replicas}"
            )
            time.sleep(4)
    rate = load.rate()
    responses, failures = sorted(load.answers), load.failures

    assert failures == []
    assert rate > 0.4 * LOAD_PER_S * LOAD_THREADS, f"{rate:.1f} decisions/s: serving stalled during swaps"
    assert [v for _, v in flips] == [versions["seed1"], versions["seed2"], versions["seed1"]]
    assert {v for _, v in responses} <= {original, *versions.values()}
    for (returned, version), (next_start, _) in zip(flips, [*flips[1:], (float("inf"), "")], strict=True):
        after = [v for sent, v in responses if returned < sent < next_start - 2.0]
        assert after, "requests were sent after the swap returned"
        assert set(after) == {version}, "after a swap returns, every new request uses the new version"
    assert "truncated" in refusals["truncated"]
    assert "sha256" in refusals["checksum"]
    assert "was trained on" in refusals["width"]
    assert "constant" in refusals["constant"]
    assert _identities(pipeline) == before, "no ingress replica, tree model or LLM was restarted"


def test_two_swaps_at_once_one_runs_the_other_is_refused(
    pipeline: PipelineSpec, candidates: dict[str, Path]
) -> None:
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(swap, pipeline, "fraud", candidates[name]) for name in ("seed2", "seed1")]
        outcomes = []
        for future in futures:
            try:
                outcomes.append(future.result().new_version)
            except Conflict as error:
                outcomes.append(f"conflict: {error}")
    conflicts = [o for o in outcomes if o.startswith("conflict")]
    assert len(conflicts) == 1, outcomes
    assert "already running" in conflicts[0]


@pytest.fixture(scope="module")
def held(
    pipeline: PipelineSpec, demo_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PipelineSpec, Path]:
    """A pipeline whose fraud model runs in the ingress behind a fault-injecting wrapper, so a test can
    hold a decision inside the model (``delay_ms``) for as long as it needs. It shares ``pipeline``'s
    swap history directory."""
    control = tmp_path_factory.mktemp("hold") / "fraud.json"
    control.write_text("{}")
    data = pipeline_on(
        "tabular_only.yaml", demo_models, name="swap_inflight", models_root=str(pipeline.models_root)
    ).resolved()
    data["models"]["fraud"] = {
        **data["models"]["fraud"],
        "kind": "fault_injection",
        "placement": "ingress",
        "settings": {"inner_kind": "sklearn", "control_file": str(control)},
    }
    spec = parse_pipeline(data, source="swap_inflight")
    deploy(spec)
    return spec, control


def test_a_large_batch_in_flight_in_the_ingress_finishes_on_the_version_it_started_with(
    held: tuple[PipelineSpec, Path], candidates: dict[str, Path]
) -> None:
    spec, control = held
    original = open_artifact(spec.artifact_path("fraud"), kind="sklearn").version
    candidate = open_artifact(candidates["seed2"], kind="sklearn").version
    before = model_status(spec, "fraud")
    assert (before.placement, before.version) == ("ingress", original)
    requests = [pb.DecideRequest(request_id=f"b{i}", **TABULAR) for i in range(512)]
    with (
        RiskClient(endpoint(spec), pipeline=spec.name, timeout_s=60) as client,
        ThreadPoolExecutor(1) as pool,
    ):
        control.write_text(json.dumps({"delay_ms": HOLD_MS}))
        batch = pool.submit(client.decide_batch, requests)
        deadline = time.monotonic() + 30
        while model_status(spec, "fraud").calls == before.calls:  # the batch reached the model
            assert not batch.done(), f"the batch ended before it reached the model: {batch.result()}"
            assert time.monotonic() < deadline, "the batch never reached the model"
            time.sleep(0.05)
        time.sleep(0.5)  # it read the control file: it is held inside the version it started on
        control.write_text("{}")
        result = swap(spec, "fraud", candidates["seed2"])
        assert not batch.done(), "the batch ended before the swap did: nothing was in flight at the flip"
        fresh = client.decide(**TABULAR)
        answers = batch.result()
    assert (result.old_version, result.new_version) == (original, candidate)
    assert next(m for m in fresh.models if m.model == "fraud").version == candidate
    fraud = [next(m for m in r.models if m.model == "fraud") for r in answers]
    assert len(fraud) == 512
    assert not any(m.fallback for m in fraud)
    assert {m.version for m in fraud} == {original}, "a batch in flight finishes on the version it started on"
    assert np.isfinite([r.risk_score for r in answers]).all()
    after = model_status(spec, "fraud")
    assert after.version == candidate
    assert (after.pid, after.actor_id, after.started_at) == (before.pid, before.actor_id, before.started_at)


def test_a_shadow_on_live_traffic_changes_no_answer_and_promotes_as_a_verified_swap(
    pipeline: PipelineSpec, candidates: dict[str, Path]
) -> None:
    """The candidate scores every decision beside the serving fraud model in both ingress replicas; every
    answer stays the serving model's; the figures count each decision once; promote is a verified swap."""
    from riskserve.operations.shadowing import _config, _figures, promote, shadow

    start = model_status(pipeline, "fraud")
    serving = start.version
    candidate = open_artifact(candidates["seed1"], kind="sklearn").version
    if serving == candidate:  # an earlier test left seed1 serving: shadow seed2 instead
        candidate_path = candidates["seed2"]
        candidate = open_artifact(candidate_path, kind="sklearn").version
    else:
        candidate_path = candidates["seed1"]
    requests = [pb.DecideRequest(request_id=f"s{i}", **REQUEST) for i in range(24)]

    def decide_all() -> list[pb.DecideResponse]:
        answers = []
        for half in (requests[:12], requests[12:]):  # two connections: the kernel spreads them over replicas
            with own_connection(endpoint(pipeline)) as channel:
                stub = pb_grpc.RiskPipelineStub(channel)  # type: ignore[no-untyped-call]
                metadata = (("application", pipeline.name),)
                answers += [stub.Decide(r, metadata=metadata, timeout=20) for r in half]
        return answers

    def tabular(response: pb.DecideResponse) -> list[tuple[str, str, float]]:
        return [(m.model, m.version, m.score) for m in response.models if m.model != "intent"]

    before = decide_all()
    report = shadow(pipeline, "fraud", candidate_path, sample=1.0)
    try:
        assert report.version == candidate
        during = decide_all()
        assert [tabular(r) for r in during] == [tabular(r) for r in before]
        assert {m.version for r in during for m in r.models if m.model == "fraud"} == {serving}
        deadline = time.monotonic() + 30
        while True:  # the samples are scored in the background: wait until each one is counted
            figures = _figures(pipeline)
            if sum(f.compared + f.dropped for f in figures) >= len(requests) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len({f.replica for f in figures}) == INGRESS_REPLICAS
        assert {(f.model, f.serving_version, f.candidate_version, f.error) for f in figures} == {
            ("fraud", serving, candidate, "")
        }
        assert sum(f.compared + f.dropped for f in figures) == len(requests)
        assert sum(f.compared for f in figures) > 0
        result = promote(pipeline, "fraud")
    except BaseException:
        from riskserve.operations.shadowing import stop

        with contextlib.suppress(Exception):  # leave no shadow behind for the next test
            stop(pipeline, "fraud")
        raise
    assert (result.old_version, result.new_version) == (serving, candidate)
    assert set(_fraud_on_every_replica(pipeline).values()) == {candidate}
    assert _config(pipeline) == {}
    swap(pipeline, "fraud", start.artifact)  # leave the module's pipeline as it was


def test_a_swap_and_a_rollback_of_the_llm_in_its_deployment_reload_its_engine_in_place(
    pipeline: PipelineSpec, candidates: dict[str, Path]
) -> None:
    """The intent LLM's replica loads the candidate's engine beside the serving one, flips, and stops the
    old one: the same process, every answer from a working engine naming its version (a retired engine's
    stop once broke the new one's every step)."""
    from ray import serve

    handle = serve.get_deployment_handle("model-intent", app_name=pipeline.name)
    before = handle.metadata.remote().result()
    new = open_artifact(candidates["intent_seed1"], kind="vllm").version
    assert before.version != new

    def intents() -> list[tuple[str, bool]]:
        with own_connection(endpoint(pipeline)) as channel:
            stub = pb_grpc.RiskPipelineStub(channel)  # type: ignore[no-untyped-call]
            metadata = (("application", pipeline.name),)
            answers = [
                stub.Decide(pb.DecideRequest(**REQUEST), metadata=metadata, timeout=20) for _ in range(5)
            ]
        return [(m.version, m.fallback) for r in answers for m in r.models if m.model == "intent"]

    swapped = swap(pipeline, "intent", candidates["intent_seed1"])
    assert (swapped.old_version, swapped.new_version) == (before.version, new)
    assert intents() == [(new, False)] * 5
    during = handle.metadata.remote().result()
    assert (during.pid, during.actor_id) == (before.pid, before.actor_id), "the replica did not restart"
    assert during.details["engine_started_at"] != before.details["engine_started_at"]
    rolled = rollback(pipeline, "intent")
    assert (rolled.old_version, rolled.new_version) == (new, before.version)
    assert intents() == [(before.version, False)] * 5
    assert handle.metadata.remote().result().pid == before.pid
