"""The table explainer against XGBoost's own TreeSHAP: exact on real boosters (missing values, ties at the
thresholds, features split on again and again down a path), refused where it does not apply, and gated by
the loader, which keeps XGBoost whenever the tables are unavailable or disagree."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xgboost as xgb
from numpy.typing import NDArray

from riskserve.platform import ModelHost
from riskserve.wrappers import treelite_compile
from riskserve.wrappers.treelite_compile import save_xgboost_artifact
from riskserve.wrappers.treelite_model import TreeliteModel, TreeliteSettings
from riskserve.wrappers.treeshap import TreeShap, UnsupportedModel, build_tree_shap, kernel_available

pytestmark = pytest.mark.skipif(not kernel_available(), reason="the _treeshap kernel is not built")

EXACT = 1e-4
"""Log-odds: XGBoost sums its TreeSHAP in float32, the tables in float64."""


def _booster(features: int, depth: int, trees: int, seed: int, **params: Any) -> xgb.Booster:
    """A booster trained on rows with missing values and an interaction, so default sides and repeated
    splits of one feature on a path both occur."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2000, features)).astype(np.float32)
    x[rng.random(x.shape) < 0.15] = np.nan
    filled = np.nan_to_num(x)
    logit = 1.5 * np.sin(2 * filled[:, 0]) - 0.7 * filled[:, -1] + filled[:, 0] * filled[:, features // 2]
    y = (logit + rng.normal(size=x.shape[0]) > 0).astype(np.float32)
    settings = {"objective": "binary:logistic", "max_depth": depth, "eta": 0.3, "nthread": 1, "seed": seed}
    return xgb.train({**settings, **params}, xgb.DMatrix(x, y), num_boost_round=trees)


def _document(booster: xgb.Booster) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(bytes(booster.save_raw("json")))
    return document


def _rows(booster: xgb.Booster, n: int, seed: int) -> NDArray[np.float32]:
    """Random rows, a fifth of the values missing, and a third of the rest exactly on a split threshold."""
    features = booster.num_features()
    rng = np.random.default_rng(seed)
    x = rng.normal(scale=1.5, size=(n, features)).astype(np.float32)
    thresholds = [float(t) for tree in _document(booster)["learner"]["gradient_booster"]["model"]["trees"]
                  for t, left in zip(tree["split_conditions"], tree["left_children"], strict=True)
                  if left != -1]  # fmt: skip
    ties = rng.random(x.shape) < 0.33
    x[ties] = rng.choice(np.asarray(thresholds, dtype=np.float32), size=int(ties.sum()))
    x[rng.random(x.shape) < 0.2] = np.nan
    return x


def _xgboost_shap(booster: xgb.Booster, x: NDArray[np.float32]) -> NDArray[np.float32]:
    return np.asarray(booster.predict(xgb.DMatrix(x), pred_contribs=True))


@pytest.mark.parametrize(
    ("features", "depth", "trees"),
    [(3, 2, 5), (9, 6, 40), (4, 8, 15), (25, 5, 60)],
    ids=["shallow", "depth6", "depth8-few-features-repeated", "wide"],
)
def test_tables_equal_xgboost_treeshap_and_sum_to_the_margin(features: int, depth: int, trees: int) -> None:
    booster = _booster(features, depth, trees, seed=depth * 10 + features)
    shap = build_tree_shap(_document(booster))
    x = _rows(booster, 300, seed=features)
    reference = _xgboost_shap(booster, x)

    values = shap.contributions(x)

    assert values.shape == (300, features)
    np.testing.assert_allclose(values, reference[:, :-1], rtol=0, atol=EXACT)
    np.testing.assert_allclose(np.full(300, shap.bias), reference[:, -1], rtol=0, atol=EXACT)
    margin = booster.predict(xgb.DMatrix(x), output_margin=True)
    np.testing.assert_allclose(values.sum(axis=1) + shap.bias, margin, rtol=0, atol=EXACT)


@pytest.mark.parametrize("rows", [1, 3, 4, 31, 32, 33, 63, 64, 65, 130])
def test_every_batch_size_equals_xgboost_one_row_blocks_and_two_threads(rows: int) -> None:
    """The kernel takes fewer than four rows one at a time, the rest in blocks of 32 (a partial block last),
    and from 64 rows on shares the blocks with a second thread: every split must give XGBoost's values."""
    booster = _booster(9, 6, 40, seed=69)
    shap = build_tree_shap(_document(booster))
    x = _rows(booster, rows, seed=rows)
    np.testing.assert_allclose(shap.contributions(x), _xgboost_shap(booster, x)[:, :-1], rtol=0, atol=EXACT)


def test_a_path_that_splits_one_feature_many_times_is_one_player() -> None:
    booster = _booster(2, 8, 10, seed=7)  # two features, eight levels: every path repeats a feature
    shap = build_tree_shap(_document(booster))
    assert int(np.diff(shap.slot_start).max()) <= 2  # at most two distinct features per leaf
    x = _rows(booster, 200, seed=8)
    np.testing.assert_allclose(shap.contributions(x), _xgboost_shap(booster, x)[:, :-1], rtol=0, atol=EXACT)


def test_rows_of_the_wrong_width_are_refused() -> None:
    shap = build_tree_shap(_document(_booster(4, 3, 3, seed=1)))
    with pytest.raises(ValueError, match=r"expected \(n, 4\)"):
        shap.contributions(np.zeros((2, 5), dtype=np.float32))


def test_models_it_cannot_reproduce_are_refused_with_the_reason() -> None:
    booster = _booster(4, 3, 3, seed=2)
    multiclass = xgb.train(
        {"objective": "multi:softprob", "num_class": 3, "max_depth": 2, "nthread": 1},
        xgb.DMatrix(np.random.default_rng(0).normal(size=(90, 4)), label=np.arange(90) % 3),
        num_boost_round=2,
    )
    with pytest.raises(UnsupportedModel, match="objective 'multi:softprob'"):
        build_tree_shap(_document(multiclass))

    categorical = _document(booster)
    categorical["learner"]["gradient_booster"]["model"]["trees"][1]["split_type"][0] = 1
    with pytest.raises(UnsupportedModel, match="tree 1: categorical splits"):
        build_tree_shap(categorical)

    outside = _document(booster)
    outside["learner"]["gradient_booster"]["model"]["trees"][0]["split_indices"][0] = 4
    with pytest.raises(UnsupportedModel, match="tree 0: node 0 points outside"):
        build_tree_shap(outside)

    no_cover = _document(booster)
    no_cover["learner"]["gradient_booster"]["model"]["trees"][2]["sum_hessian"][0] = 0.0
    with pytest.raises(UnsupportedModel, match="tree 2: node 0 has no cover"):
        build_tree_shap(no_cover)


# The loader: the tables serve only after they reproduced XGBoost on the gate rows.


def _served_model(tmp_path: Path, booster: xgb.Booster) -> TreeliteModel:
    features = booster.num_features()
    artifact = tmp_path / "artifact"
    golden = np.random.default_rng(3).normal(size=(16, features)).astype(np.float32)
    names = [f"f{i}" for i in range(features)]
    save_xgboost_artifact(booster, artifact, feature_names=names, golden_x=golden)
    model = TreeliteModel(TreeliteSettings(name="credit", artifact=artifact, cache_dir=tmp_path / "cache"))
    asyncio.run(ModelHost(model).start())
    return model


@pytest.fixture(scope="module")
def gate_booster() -> xgb.Booster:
    return _booster(6, 5, 25, seed=11)


def test_a_served_model_explains_from_the_tables_with_xgboosts_values(
    tmp_path: Path, gate_booster: xgb.Booster
) -> None:
    model = _served_model(tmp_path, gate_booster)
    assert model.details()["explainer"] == "tables"
    assert model.details()["explainer_max_abs_diff"] <= EXACT
    assert model.contributions_us_per_row() < 1000.0
    x = np.nan_to_num(_rows(gate_booster, 100, seed=12))  # served rows are finite
    reference = _xgboost_shap(gate_booster, x)

    contributions = model.contributions(x)

    np.testing.assert_allclose(contributions.values, reference[:, :-1], rtol=0, atol=EXACT)
    np.testing.assert_allclose(contributions.bias, reference[:, -1], rtol=0, atol=EXACT)
    assert contributions.version == model.version


def test_fault_injected_missing_kernel_leaves_xgboost_explaining(
    tmp_path: Path, gate_booster: xgb.Booster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(treelite_compile, "kernel_available", lambda: False)
    model = _served_model(tmp_path, gate_booster)
    assert model.details()["explainer"] == "xgboost"
    assert model.details()["explainer_reason"] == "the _treeshap kernel is not built"
    assert model.contributions_us_per_row() == 1000.0
    x = np.nan_to_num(_rows(gate_booster, 20, seed=13))
    np.testing.assert_allclose(
        model.contributions(x).values, _xgboost_shap(gate_booster, x)[:, :-1], rtol=0, atol=EXACT
    )


def test_fault_injected_wrong_tables_are_caught_by_the_gate(
    tmp_path: Path, gate_booster: xgb.Booster, monkeypatch: pytest.MonkeyPatch
) -> None:
    def skewed(model: dict[str, Any]) -> TreeShap:
        shap = build_tree_shap(copy.deepcopy(model))
        return dataclasses.replace(shap, table=shap.table * 1.01)

    monkeypatch.setattr(treelite_compile, "build_tree_shap", skewed)
    model = _served_model(tmp_path, gate_booster)
    assert model.details()["explainer"] == "xgboost"
    assert "tables differ from xgboost by" in model.details()["explainer_reason"]
    x = np.nan_to_num(_rows(gate_booster, 20, seed=14))
    np.testing.assert_allclose(
        model.contributions(x).values, _xgboost_shap(gate_booster, x)[:, :-1], rtol=0, atol=EXACT
    )
