"""SklearnModel against real scikit-learn: versions, immutability and artifact checks."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from riskserve.demo.dataset import FEATURE_NAMES
from riskserve.demo.tabular import TabularData, make_tabular_data, train_fraud_lr
from riskserve.learning.learner import train_step
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


def test_a_learned_step_leaves_the_served_version_unchanged_and_serves_once_saved(
    data: TabularData, artifact_dir: Path, tmp_path: Path
) -> None:
    """The learner's step trains a copy; the serving model changes only by loading the saved artifact."""

    async def scenario() -> None:
        host, model = await _loaded(artifact_dir)
        x = data.x_test[:500]
        before = await host.predict(x, 500)
        old = model.snapshot
        step = train_step(old, data.x_train[:512], data.y_train[:512].astype(np.int64), update_scaler=True)
        assert step.version != before.version
        assert step.params.parent == before.version
        assert old.params.parent is None
        np.testing.assert_array_equal((await host.predict(x, 500)).scores, before.scores)  # still the old one
        saved = save_sklearn_artifact(step, tmp_path / "v2", feature_names=FEATURE_NAMES, golden_x=x[:32])
        host2, model2 = await _loaded(tmp_path / "v2")
        after = await host2.predict(x, 500)
        assert saved.version == step.version == model2.version == after.version
        assert np.abs(after.scores - before.scores).max() > 1e-6
        np.testing.assert_array_equal(after.scores, step.score(x))

    asyncio.run(scenario())


def test_online_learning_matches_scikit_learn_trained_once_on_the_same_labels(
    data: TabularData, artifact_dir: Path
) -> None:
    """Mini-batches applied one by one equal a reference SGDClassifier fed the same batches in order."""

    async def scenario() -> None:
        _, model = await _loaded(artifact_dir)
        snapshot = start = model.snapshot
        reference = start.make_classifier()
        scaler = start.make_scaler()
        for i in range(0, 2048, 256):
            batch, labels = data.x_train[i : i + 256], data.y_train[i : i + 256]
            snapshot = train_step(snapshot, batch, labels.astype(np.int64), update_scaler=False)
            reference.partial_fit(scaler.transform(batch.astype(np.float64)), labels)
        np.testing.assert_allclose(snapshot.coef, reference.coef_.ravel(), rtol=0, atol=1e-12)

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
        host, _model = await _loaded(artifact_dir)
        bad = data.x_test[:4].copy()
        bad[2, FEATURE_NAMES.index("txn_velocity_1h")] = np.nan
        with pytest.raises(InvalidInput, match="txn_velocity_1h") as info:
            await host.predict(bad, 4)
        assert info.value.field == "txn_velocity_1h"
        with pytest.raises(InvalidInput, match="expected 20 columns") as info:
            await host.predict(np.ascontiguousarray(data.x_test[:4, :19]), 4)
        assert info.value.field == "features"

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
