"""Serving XGBoost trees compiled to a native library: one call per batch, or per row for small batches.

What is served was compiled, cached and gated on equality with XGBoost by
:mod:`riskserve.wrappers.treelite_compile` (:func:`~riskserve.wrappers.treelite_compile.load_engine`).
A tl2cgen predictor may be called by one thread at a time, so every predictor call holds a lock; the
library's own per-row function needs none and serves batches of up to :data:`DIRECT_MAX_ROWS` rows.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import numpy as np
import tl2cgen
import treelite
import xgboost
from numpy.typing import NDArray

from riskserve.platform.base_model import BaseModel, Contributions, ModelOutput
from riskserve.platform.errors import InlineBusy, ModelUnavailable
from riskserve.platform.validation import FeatureMatrix, check_feature_matrix
from riskserve.wrappers.treelite_compile import LABELS, Engine, TreeliteSettings, load_engine

__all__ = ["DIRECT_MAX_ROWS", "TreeliteModel", "TreeliteSettings"]


DIRECT_MAX_ROWS = 64
"""Batches up to this many rows call the compiled per-row function directly; larger ones the predictor
(tl2cgen's DMatrix and thread pool cost ~80 µs a call, which pays off only on large batches)."""


class TreeliteModel(BaseModel[FeatureMatrix, TreeliteSettings]):
    """A binary XGBoost scorer served from a tl2cgen-compiled library (or GTIL), gated on XGBoost equality."""

    kind: ClassVar[str] = "treelite"

    def __init__(self, settings: TreeliteSettings) -> None:
        super().__init__(settings)
        self._engine: Engine | None = None

    def _loaded_version(self) -> str | None:
        engine = self._engine
        return engine.version if engine is not None else None

    async def load(self) -> None:
        """Verify, compile (or reuse the cached library), gate on XGBoost equality, then swap in."""
        self._engine = await asyncio.to_thread(load_engine, self.settings)

    async def predict(self, batch: FeatureMatrix) -> ModelOutput:
        """Probability of class "1" per row; the batch is validated and read in place, never copied."""
        engine = self._require_engine()
        rows = check_feature_matrix(batch, engine.feature_names)
        scores = await asyncio.to_thread(_run_locked, engine, rows)
        return ModelOutput(scores=scores, version=engine.version)

    inline = True

    def predict_now(self, batch: FeatureMatrix) -> ModelOutput:
        """Score on the calling thread (a compiled call: microseconds for a few rows).

        Raises:
            InlineBusy: a large batch holds the engine in a worker thread; the caller must not wait on
                its event loop, so it takes the threaded path instead.
        """
        engine = self._require_engine()
        rows = check_feature_matrix(batch, engine.feature_names)
        if engine.direct is not None and rows.shape[0] <= DIRECT_MAX_ROWS:
            return ModelOutput(scores=engine.direct.predict(rows), version=engine.version)
        if not engine.lock.acquire(blocking=False):
            raise InlineBusy(f"model '{self.name}' is scoring another batch")
        try:
            scores = _run_unlocked(engine, rows)
        finally:
            engine.lock.release()
        return ModelOutput(scores=scores, version=engine.version)

    explains: ClassVar[bool] = True

    def contributions(self, batch: FeatureMatrix) -> Contributions:
        """Exact TreeSHAP contributions (XGBoost's ``pred_contribs``) of the serving version, in log-odds.

        From the per-leaf tables (:mod:`riskserve.wrappers.treeshap`) when the loader's gate found them
        equal to XGBoost's (under 0.1 ms a row for the demo's 200 trees), else from XGBoost itself on the
        booster read from the same verified model file (about a millisecond a row; ``bench/reasons.py``).
        Per row they sum, with the bias, to XGBoost's ``predict(output_margin=True)``.
        """
        engine = self._require_engine()
        rows = check_feature_matrix(batch, engine.feature_names)
        if engine.shap is not None:
            values = engine.shap.contributions(rows)
            bias = np.full(rows.shape[0], engine.shap.bias, dtype=np.float64)
            return Contributions(values, bias, tuple(engine.feature_names), engine.version)
        if engine.booster is None:
            raise ModelUnavailable(f"model '{self.name}' keeps no booster to explain with")
        try:
            matrix = xgboost.DMatrix(rows, nthread=self.settings.nthread)
            raw = engine.booster.predict(matrix, pred_contribs=True, validate_features=False)
        except xgboost.core.XGBoostError as error:
            raise ModelUnavailable(f"contributions failed: {error}") from error
        out = np.asarray(raw, dtype=np.float64)
        if out.shape != (rows.shape[0], len(engine.feature_names) + 1):
            raise ModelUnavailable(f"xgboost returned contributions of shape {out.shape}")
        return Contributions(
            np.ascontiguousarray(out[:, :-1]), out[:, -1].copy(), tuple(engine.feature_names), engine.version
        )

    def contributions_us_per_row(self) -> float:
        """About 80 µs a row from the tables, 1,000 from XGBoost (``bench/reasons.py``, 200 trees)."""
        engine = self._engine
        return 80.0 if engine is not None and engine.shap is not None else 1000.0

    def predict_sync(self, batch: FeatureMatrix) -> NDArray[np.float64]:
        """Blocking :meth:`predict` for benchmarks and worker threads: validated, locked, float64 ``(n,)``."""
        engine = self._require_engine()
        return _run_locked(engine, check_feature_matrix(batch, engine.feature_names))

    async def unload(self) -> None:
        """Drop the predictor; a call in flight keeps its engine alive until it returns."""
        self._engine = None

    def input_names(self) -> list[str]:
        """Feature columns of the loaded artifact, in order (empty before the first load)."""
        engine = self._engine
        return list(engine.feature_names) if engine is not None else []

    def labels(self) -> list[str]:
        """``["0", "1"]``: the score is the probability of "1"."""
        return list(LABELS)

    def details(self) -> dict[str, Any]:
        """Engine (``tl2cgen``/``gtil``), library path, cache hit or compile time, gate result, fallback."""
        engine = self._engine
        return dict(engine.details) if engine is not None else {}

    def _require_engine(self) -> Engine:
        engine = self._engine
        if engine is None:
            raise ModelUnavailable(f"model '{self.name}' is not loaded")
        return engine


def _run_locked(engine: Engine, batch: FeatureMatrix) -> NDArray[np.float64]:
    """One engine call at a time (tl2cgen's contract), flattened to float64 ``(n,)``."""
    with engine.lock:
        return _run_unlocked(engine, batch)


def _run_unlocked(engine: Engine, batch: FeatureMatrix) -> NDArray[np.float64]:
    """An engine call by a caller that holds ``engine.lock``."""
    rows = batch.shape[0]
    try:
        raw = engine.run(batch)
    except (tl2cgen.TL2cgenError, treelite.TreeliteError, ValueError) as error:
        raise ModelUnavailable(f"prediction failed: {error}") from error
    scores = np.asarray(raw, dtype=np.float64)
    if scores.size != rows:
        raise ModelUnavailable(f"the predictor returned shape {scores.shape} for {rows} rows")
    return scores.reshape(rows)
