"""The platform's side of a model's lifecycle: load, readiness, a checked predict, unload.

Every model in every deployment runs inside a :class:`ModelHost`, so the same guarantees hold for every
backend: no predict before a successful load, output shape and range checked, one place to add more.
"""

from __future__ import annotations

from typing import Any, Generic

import numpy as np

from riskserve.platform.base_model import BaseModel, InputT, ModelOutput, _set_ready
from riskserve.platform.errors import ModelLoadError, ModelUnavailable, RiskServeError

__all__ = ["ModelHost"]


class ModelHost(Generic[InputT]):
    """Owns one model instance: loads it, gates ``predict`` on readiness and checks every output."""

    def __init__(self, model: BaseModel[InputT, Any]) -> None:
        self.model = model

    async def start(self) -> None:
        """Load the model and mark it ready; any unexpected failure becomes ``ModelLoadError``."""
        try:
            await self.model.load()
        except RiskServeError:
            raise
        except Exception as error:
            raise ModelLoadError(f"model '{self.model.name}' failed to load: {error}") from error
        _set_ready(self.model, True)

    async def predict(self, batch: InputT, rows: int) -> ModelOutput:
        """Predict ``rows`` rows on a ready model; check it gave one finite score in [0, 1] per row."""
        self._require_ready()
        return self._checked(await self.model.predict(batch), rows)

    @property
    def inline(self) -> bool:
        """Whether the model can predict synchronously on the caller's thread (:meth:`predict_now`)."""
        return self.model.inline

    def predict_now(self, batch: InputT, rows: int) -> ModelOutput:
        """:meth:`predict` on the calling thread (backends with ``inline``), with the same checks."""
        self._require_ready()
        return self._checked(self.model.predict_now(batch), rows)

    def _require_ready(self) -> None:
        if not self.model.ready:
            raise ModelUnavailable(f"model '{self.model.name}' is not ready")

    def _checked(self, output: ModelOutput, rows: int) -> ModelOutput:
        scores = output.scores
        if scores.shape != (rows,):
            raise ModelUnavailable(
                f"model '{self.model.name}' returned {scores.shape} scores for {rows} rows"
            )
        if not _probabilities(scores):
            raise ModelUnavailable(f"model '{self.model.name}' returned scores outside [0, 1] or not finite")
        if output.labels is not None and len(output.labels) != rows:
            raise ModelUnavailable(
                f"model '{self.model.name}' returned {len(output.labels)} labels for {rows} rows"
            )
        return output

    async def stop(self) -> None:
        """Take the model out of service, then let it release its resources."""
        _set_ready(self.model, False)
        await self.model.unload()


def _probabilities(scores: np.ndarray[Any, Any]) -> bool:
    """Every score finite and in [0, 1] (a NaN fails both comparisons); a plain loop for a few rows,
    where numpy's reductions cost more than the check."""
    if scores.shape[0] <= 16:
        return all(0.0 <= value <= 1.0 for value in scores.tolist())
    return bool(((scores >= 0) & (scores <= 1)).all())
