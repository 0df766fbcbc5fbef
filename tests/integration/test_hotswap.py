"""Hot swap of the scikit-learn model under continuous load, on real Ray Serve over real gRPC."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from riskserve.demo.build import build_demo_models
from riskserve.demo.dataset import FEATURE_NAMES
from riskserve.demo.tabular import make_tabular_data
from riskserve.pipelines.client import RiskClient
from riskserve.pipelines.spec import PipelineSpec
from riskserve.pipelines.swap import rollback, swap
from riskserve.platform.errors import Conflict, ModelLoadError
from riskserve.wrappers.sklearn_model import LinearSnapshot, save_sklearn_artifact

from .conftest import ServeCluster, deploy, pipeline_on

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REQUEST = {
    "numeric": {"amount": 180.0, "account_age_days": 40.0, "txn_velocity_1h": 3.0, "hour": 22.0},
    "categorical": {"merchant_category": "electronics", "channel": "online"},
    "text": "bought headphones for the house",
}
LOAD_PER_S = 10
"""Decisions per second per load thread (two threads: 20 decisions/s in all)."""
LOAD_THREADS = 2


@pytest.fixture(scope="module")
def candidates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Good candidates retrained with other seeds, and bad ones made from them on purpose."""
    root = tmp_path_factory.mktemp("candidates")
    good = {}
    for seed in (1, 2):
        build_demo_models(root / f"seed{seed}", seed=seed, only=["fraud"], progress=False)
        good[f"seed{seed}"] = root / f"seed{seed}" / "fraud"
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
    serve_cluster: ServeCluster, demo_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PipelineSpec]:
    import os

    previous = os.environ.get("RISKSERVE_STATE_DIR")
    os.environ["RISKSERVE_STATE_DIR"] = str(tmp_path_factory.mktemp("swap-state"))  # the swap history
    spec = pipeline_on("card_fraud.yaml", demo_models)
    deploy(spec)
    yield spec
    if previous is None:
        os.environ.pop("RISKSERVE_STATE_DIR")
    else:
        os.environ["RISKSERVE_STATE_DIR"] = previous


def _identities(app: str) -> dict[str, tuple[Any, ...]]:
    from ray import serve

    out = {}
    for name in ("intent", "credit"):
        meta = serve.get_deployment_handle(f"model-{name}", app_name=app).metadata.remote().result()
        out[name] = (
            meta["pid"],
            meta["actor_id"],
            meta["replica_started_at"],
            meta["details"].get("engine_started_at"),
        )
    return out


def test_swaps_under_load_lose_nothing_and_restart_nothing_else(
    serve_cluster: ServeCluster, pipeline: PipelineSpec, candidates: dict[str, Path]
) -> None:
    from riskserve.platform.artifacts import open_artifact

    original = open_artifact(pipeline.artifact_path("fraud"), kind="sklearn").version
    versions = {name: open_artifact(candidates[name], kind="sklearn").version for name in ("seed1", "seed2")}
    before = _identities(pipeline.name)
    responses: list[tuple[float, str]] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def load() -> None:
        with RiskClient(
            f"127.0.0.1:{serve_cluster.grpc_port}", pipeline=pipeline.name, timeout_s=20
        ) as client:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    response = client.decide(**REQUEST)
                    fraud = next(m for m in response.models if m.model == "fraud")
                    assert not fraud.fallback, fraud
                    responses.append((sent, fraud.version))
                except BaseException as error:  # every failure is a test failure, collected
                    failures.append(error)
                time.sleep(max(0.0, 1 / LOAD_PER_S - (time.monotonic() - sent)))

    threads = [threading.Thread(target=load) for _ in range(LOAD_THREADS)]
    load_started = time.monotonic()
    for thread in threads:
        thread.start()
    flips: list[tuple[float, str]] = []
    refusals: dict[str, str] = {}
    try:
        time.sleep(3)
        for step in ("seed1", "truncated", "seed2", "checksum", "width", "constant", "rollback"):
            if step == "rollback":
                result = rollback(pipeline, "fraud")
            elif step.startswith("seed"):
                result = swap(pipeline, "fraud", candidates[step])
            else:
                with pytest.raises(ModelLoadError) as info:
                    swap(pipeline, "fraud", candidates[step])
                serving = flips[-1][1] if flips else original
                assert f"{serving} keeps serving" in str(info.value)
                refusals[step] = str(info.value)
                continue
            flips.append((time.monotonic(), result.new_version))
            time.sleep(4)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    rate = len(responses) / (time.monotonic() - load_started)

    assert failures == []
    assert rate > 0.4 * LOAD_PER_S * LOAD_THREADS, f"{rate:.1f} decisions/s: serving stalled during swaps"
    responses.sort()
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
    assert _identities(pipeline.name) == before, "the LLM and the tree model were not restarted"


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


def test_a_large_batch_in_flight_finishes_on_the_version_it_started_with(
    serve_cluster: ServeCluster, pipeline: PipelineSpec, candidates: dict[str, Path]
) -> None:
    from riskserve.pipelines.proto.riskserve.v1 import risk_pipeline_pb2 as pb

    requests = [pb.DecideRequest(request_id=f"b{i}", **{k: v for k, v in REQUEST.items() if k != "text"})
                for i in range(512)]  # fmt: skip
    target = f"127.0.0.1:{serve_cluster.grpc_port}"
    with RiskClient(target, pipeline=pipeline.name, timeout_s=60) as client, ThreadPoolExecutor(1) as pool:
        batch = pool.submit(client.decide_batch, requests)
        swap(pipeline, "fraud", candidates["seed2"])
        answers = batch.result()
    versions = {next(m.version for m in r.models if m.model == "fraud") for r in answers}
    assert len(versions) == 1, "one batch, one version"
    assert np.isfinite([r.risk_score for r in answers]).all()
