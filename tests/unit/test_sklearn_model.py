"""SklearnModel against real scikit-learn: versions, immutability, concurrency and artifact checks."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from riskserve.demo.dataset import FEATURE_NAMES
from riskserve.demo.tabular import TabularData, make_tabular_data, train_fraud_lr
from riskserve.platform import InvalidInput, ModelHost, ModelLoadError, ModelUnavailable, write_manifest
from riskserve.wrappers.sklearn_model import (
    GOLDEN_FILE,
    PARAMS_FILE,
    LinearSnapshot,
    SklearnModel,
    SklearnSettings,
    save_sklearn_artifact,
)


@pytest.fixture(scope="module")
def data() -> TabularData:
    return make_tabular_data(3, train_rows=8000, test_rows=4000)


@pytest.fixture(scope="module")
def artifact_dir(data: TabularData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fraud")
    train_fraud_lr(data, out, seed=3)
    return out


def _reference(snapshot: LinearSnapshot, x: np.ndarray) -> np.ndarray:
    """Single-threaded scikit-learn scores of one version, computed from fresh estimators."""
    return snapshot.make_classifier().predict_proba(snapshot.make_scaler().transform(x))[:, 1]


async def _loaded(artifact: Path, **settings: object) -> tuple[ModelHost[np.ndarray], SklearnModel]:
    model = SklearnModel(SklearnSettings(name="fraud", artifact=artifact, **settings))  # type: ignore[arg-type]
    host = ModelHost(model)
    await host.start()
    return host, model


def test_partial_fit_makes_a_new_version_and_leaves_the_old_one_unchanged(
    data: TabularData, artifact_dir: Path
) -> None:
    async def scenario() -> None:
        host, model = await _loaded(artifact_dir)
        x = data.x_test[:500]
        before = await host.predict(x, 500)
        old = model.snapshot
        new_version = await asyncio.to_thread(model.partial_fit, data.x_train[:512], data.y_train[:512])
        after = await host.predict(x, 500)

        assert new_version != before.version
        assert after.version == new_version == model.version
        assert np.abs(after.scores - before.scores).max() > 1e-6
        np.testing.assert_array_equal(model.score_sync(x, old), before.scores)
        assert old.params.parent is None
        assert model.snapshot.params.parent == before.version
        assert model.versions() == [before.version, new_version]

    asyncio.run(scenario())


def test_an_updated_version_saved_and_loaded_keeps_its_version_and_scores(
    data: TabularData, artifact_dir: Path, tmp_path: Path
) -> None:
    async def scenario() -> None:
        _, model = await _loaded(artifact_dir)
        model.partial_fit(data.x_train[:256], data.y_train[:256])
        saved = save_sklearn_artifact(
            model.snapshot, tmp_path / "v2", feature_names=FEATURE_NAMES, golden_x=data.x_test[:32]
        )
        host2, model2 = await _loaded(tmp_path / "v2")
        assert saved.version == model.version == model2.version
        out = await host2.predict(data.x_test[:100], 100)
        np.testing.assert_array_equal(out.scores, model.score_sync(data.x_test[:100]))

    asyncio.run(scenario())


def test_online_learning_matches_scikit_learn_trained_once_on_the_same_labels(
    data: TabularData, artifact_dir: Path
) -> None:
    """Mini-batches applied one by one equal a reference SGDClassifier fed the same batches in order."""

    async def scenario() -> None:
        _, model = await _loaded(artifact_dir, update_scaler=False)
        start = model.snapshot
        reference = start.make_classifier()
        scaler = start.make_scaler()
        for i in range(0, 2048, 256):
            batch, labels = data.x_train[i : i + 256], data.y_train[i : i + 256]
            model.partial_fit(batch, labels)
            reference.partial_fit(scaler.transform(batch.astype(np.float64)), labels)
        np.testing.assert_allclose(model.snapshot.coef, reference.coef_.ravel(), rtol=0, atol=1e-12)

    asyncio.run(scenario())


def test_scoring_threads_never_see_a_half_applied_update(data: TabularData, artifact_dir: Path) -> None:
    """Large batches scored in parallel (joblib threads) while partial_fit runs: each uses one version."""

    async def scenario() -> None:
        host, model = await _loaded(artifact_dir, n_jobs=2, parallel_min_rows=256, history=1000)
        x = np.ascontiguousarray(np.tile(data.x_test, (2, 1)))
        stop = threading.Event()
        updates: list[str] = []

        def learner() -> None:
            i = 0
            while not stop.is_set() and len(updates) < 200:
                rows = slice((i * 128) % 7000, (i * 128) % 7000 + 128)
                updates.append(model.partial_fit(data.x_train[rows], data.y_train[rows]))
                i += 1

        thread = threading.Thread(target=learner)
        thread.start()
        try:
            outputs = []
            for _ in range(6):
                outputs += await asyncio.gather(*(host.predict(x, len(x)) for _ in range(4)))
        finally:
            stop.set()
            thread.join()

        snapshots = {version: model._history[version] for version in model.versions()}
        seen = {out.version for out in outputs}
        assert len(updates) > 5, "the learner must have published while batches ran"
        assert len(seen) > 1, "batches must have been scored on several versions"
        for out in outputs:
            np.testing.assert_allclose(out.scores, _reference(snapshots[out.version], x), rtol=0, atol=1e-12)

    asyncio.run(scenario())


def _copy(artifact_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(artifact_dir, target)
    return target


@pytest.mark.parametrize("damage", ["flip_a_byte", "truncate", "delete"])
def test_a_damaged_artifact_is_refused(artifact_dir: Path, tmp_path: Path, damage: str) -> None:
    target = _copy(artifact_dir, tmp_path)
    params = target / PARAMS_FILE
    raw = params.read_bytes()
    if damage == "flip_a_byte":
        params.write_bytes(raw.replace(b"1", b"2", 1))
    elif damage == "truncate":
        params.write_bytes(raw[: len(raw) // 2])
    else:
        params.unlink()
    host = ModelHost(SklearnModel(SklearnSettings(name="fraud", artifact=target)))
    with pytest.raises(ModelLoadError, match=PARAMS_FILE):
        asyncio.run(host.start())
    assert not host.model.ready


def test_a_golden_set_that_disagrees_is_refused_even_with_valid_checksums(
    artifact_dir: Path, tmp_path: Path
) -> None:
    target = _copy(artifact_dir, tmp_path)
    golden = json.loads((target / GOLDEN_FILE).read_text())
    golden["expected"][0] = 1.0 - golden["expected"][0]
    (target / GOLDEN_FILE).write_text(json.dumps(golden))
    write_manifest(target, kind="sklearn", files={PARAMS_FILE: "model", GOLDEN_FILE: "golden"},
                   feature_names=list(FEATURE_NAMES), labels=["0", "1"])  # fmt: skip
    with pytest.raises(ModelLoadError, match="golden"):
        asyncio.run(ModelHost(SklearnModel(SklearnSettings(name="fraud", artifact=target))).start())


def test_bad_input_names_the_field(data: TabularData, artifact_dir: Path) -> None:
    async def scenario() -> None:
        host, model = await _loaded(artifact_dir)
        bad = data.x_test[:4].copy()
        bad[2, FEATURE_NAMES.index("txn_velocity_1h")] = np.nan
        with pytest.raises(InvalidInput, match="txn_velocity_1h") as info:
            await host.predict(bad, 4)
        assert info.value.field == "txn_velocity_1h"
        with pytest.raises(InvalidInput, match="expected 20 columns") as info:
            await host.predict(np.ascontiguousarray(data.x_test[:4, :19]), 4)
        assert info.value.field == "features"
        with pytest.raises(InvalidInput, match="label"):
            model.partial_fit(data.x_test[:4], [0, 1, 2, 0])
        version = model.version
        poisoned = data.x_test[:4].copy()
        poisoned[0, 0] = np.inf
        with pytest.raises(InvalidInput, match="amount_log1p"):
            model.partial_fit(poisoned, [0, 1, 0, 0])
        assert model.version == version, "a refused update publishes nothing"

    asyncio.run(scenario())


def test_predict_before_load_is_unavailable(artifact_dir: Path, data: TabularData) -> None:
    host = ModelHost(SklearnModel(SklearnSettings(name="fraud", artifact=artifact_dir)))
    with pytest.raises(ModelUnavailable):
        asyncio.run(host.predict(data.x_test[:2], 2))


def test_read_only_shared_buffers_are_scored_without_a_copy(data: TabularData, artifact_dir: Path) -> None:
    async def scenario() -> None:
        host, _ = await _loaded(artifact_dir)
        x = data.x_test[:64].copy()
        x.setflags(write=False)
        out = await host.predict(x, 64)
        assert out.scores.shape == (64,)
        assert np.all((out.scores > 0) & (out.scores < 1))

    asyncio.run(scenario())
