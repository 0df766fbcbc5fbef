"""Train the demo's tabular models on the synthetic transactions: XGBoost (credit/fraud) and the online LR."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import StandardScaler

from riskserve.demo.dataset import FEATURE_NAMES, Transactions, generate_transactions, tabular_features
from riskserve.platform.artifacts import Artifact
from riskserve.wrappers.sklearn_model import (
    LinearParams,
    LinearSnapshot,
    ScalerParams,
    SGDHyperparameters,
    save_sklearn_artifact,
)

__all__ = ["TabularData", "TrainedModel", "make_tabular_data", "train_fraud_lr", "train_xgboost"]

GOLDEN_ROWS = 64


def snapshot_from_logistic_regression(
    classifier: LogisticRegression,
    scaler: StandardScaler,
    *,
    trained_rows: int,
    hyperparameters: SGDHyperparameters | None = None,
) -> LinearSnapshot:
    """Start the online model from an offline ``LogisticRegression`` fit on ``scaler``-ed data.

    ``t`` is set to the rows trained on, so the first online steps are as small as if SGD had seen them.
    """
    params = LinearParams(
        hyperparameters=hyperparameters or SGDHyperparameters(),
        coef=[float(v) for v in np.ravel(classifier.coef_)],
        intercept=float(np.ravel(classifier.intercept_)[0]),
        t=float(max(trained_rows, 1)),
        scaler=ScalerParams(
            mean=[float(v) for v in scaler.mean_],
            var=[float(v) for v in scaler.var_],
            scale=[float(v) for v in scaler.scale_],
            n_samples_seen=int(scaler.n_samples_seen_),
        ),
    )
    return LinearSnapshot.from_params(params)


@dataclass(frozen=True)
class TabularData:
    """Train and held-out splits of the demo data set, as feature matrices and labels."""

    x_train: NDArray[np.float32]
    y_train: NDArray[np.int64]
    x_test: NDArray[np.float32]
    y_test: NDArray[np.int64]
    test: Transactions


@dataclass(frozen=True)
class TrainedModel:
    """A built artifact and its held-out quality."""

    name: str
    artifact: Artifact
    heldout_auc: float
    seconds: float


def make_tabular_data(seed: int, *, train_rows: int = 40_000, test_rows: int = 10_000) -> TabularData:
    """Generate train and held-out transactions from independent seeds derived from ``seed``."""
    train = generate_transactions(train_rows, seed=seed * 1000 + 1)
    test = generate_transactions(test_rows, seed=seed * 1000 + 2)
    return TabularData(
        x_train=tabular_features(train),
        y_train=train.is_fraud,
        x_test=tabular_features(test),
        y_test=test.is_fraud,
        test=test,
    )


def train_fraud_lr(data: TabularData, out_dir: Path, *, seed: int) -> tuple[Artifact, float]:
    """Offline logistic regression on standardised features, stored as the online SGD model's start."""
    scaler = StandardScaler().fit(data.x_train)
    hyper = SGDHyperparameters(random_state=seed)
    classifier = LogisticRegression(C=1.0 / (hyper.alpha * len(data.x_train)), max_iter=1000)
    classifier.fit(scaler.transform(data.x_train), data.y_train)
    snapshot = snapshot_from_logistic_regression(
        classifier, scaler, trained_rows=len(data.x_train), hyperparameters=hyper
    )
    auc = float(roc_auc_score(data.y_test, snapshot.score_floor(data.x_test)))
    artifact = save_sklearn_artifact(
        snapshot,
        out_dir,
        feature_names=FEATURE_NAMES,
        golden_x=data.x_test[:GOLDEN_ROWS],
        info={"seed": seed, "trained_rows": len(data.x_train), "heldout_auc": round(auc, 6)},
    )
    return artifact, auc


def train_xgboost(
    data: TabularData, out_dir: Path, *, seed: int, rounds: int = 200, progress: bool = True
) -> tuple[Artifact, float]:
    """Gradient-boosted trees (binary:logistic), single-threaded so the build is deterministic."""
    import xgboost

    from riskserve.wrappers.treelite_compile import save_xgboost_artifact

    # Column names live in the manifest: XGBoost refuses names such as "merchant_category=<unknown>".
    train = xgboost.DMatrix(data.x_train, label=data.y_train)
    params = {
        "objective": "binary:logistic",
        "eval_metric": "auc",
        "max_depth": 5,
        "eta": 0.1,
        "subsample": 0.9,
        "colsample_bytree": 0.9,
        "min_child_weight": 5,
        "seed": seed,
        "nthread": 1,
        "tree_method": "hist",
    }
    callbacks = [_TqdmCallback(rounds)] if progress else []
    booster = xgboost.train(params, train, num_boost_round=rounds, callbacks=callbacks)
    auc = float(roc_auc_score(data.y_test, booster.inplace_predict(data.x_test)))
    artifact = save_xgboost_artifact(
        booster,
        out_dir,
        feature_names=FEATURE_NAMES,
        golden_x=data.x_test[:GOLDEN_ROWS],
        info={
            "seed": seed,
            "trained_rows": len(data.x_train),
            "rounds": rounds,
            "heldout_auc": round(auc, 6),
        },
    )
    return artifact, auc


def _make_tqdm_callback() -> type:
    import xgboost
    from tqdm import tqdm

    class TqdmCallback(xgboost.callback.TrainingCallback):
        """Boosting rounds as a progress bar."""

        def __init__(self, rounds: int) -> None:
            super().__init__()
            self.bar = tqdm(total=rounds, desc="xgboost rounds", unit="round", leave=False)

        def after_iteration(self, model: object, epoch: int, evals_log: object) -> bool:
            self.bar.update(1)
            return False

        def after_training(self, model: object) -> object:
            self.bar.close()
            return model

    return TqdmCallback


def _TqdmCallback(rounds: int) -> object:  # noqa: N802 - reads like the class it builds
    return _make_tqdm_callback()(rounds)
