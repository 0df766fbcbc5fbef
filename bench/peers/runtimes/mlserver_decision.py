"""MLServer custom runtime making the whole tabular decision in one model (runs in MLServer's venv).

MLServer's docs for custom runtimes: subclass ``mlserver.MLModel``, load in ``load()``, decode inputs with
the codecs in ``predict()``. Here: the request fields as tensors in, :class:`DecisionSpec` encodes them,
the XGBoost booster (from ``model.json``) and the scikit-learn estimator (built from ``params.json``) score
them, the rules decide; ``risk_score``, ``credit``, ``fraud`` and ``decision`` out.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec, StringCodec
from mlserver.errors import MLServerError
from mlserver.types import InferenceRequest, InferenceResponse

from bench.peers.decision import BadRequest, DecisionSpec, sklearn_fraud, xgboost_credit


class DecisionRuntime(MLModel):  # type: ignore[misc]
    """Encode, score both models, decide: one V2 model."""

    async def load(self) -> bool:
        extra: dict[str, Any] = self.settings.parameters.extra
        self.spec = DecisionSpec.read(extra["spec"])
        self.credit = xgboost_credit(extra["credit"])
        self.fraud = sklearn_fraud(extra["fraud"])
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        inputs: dict[str, Any] = {}
        for tensor in payload.inputs:
            codec = StringCodec if tensor.datatype == "BYTES" else NumpyCodec
            inputs[tensor.name] = np.asarray(codec.decode_input(tensor)).reshape(-1)
        rows = len(next(iter(inputs.values()))) if inputs else 0
        try:
            matrix = self.spec.encode(inputs, rows)
        except BadRequest as error:
            raise MLServerError(str(error), status_code=400) from error
        credit = np.asarray(self.credit.inplace_predict(matrix), np.float64).reshape(-1)
        fraud = self.fraud.predict_proba(matrix)[:, 1]
        risk, outcomes = self.spec.decide(credit, fraud)
        return InferenceResponse(
            id=payload.id,
            model_name=self.name,
            outputs=[
                NumpyCodec.encode_output("risk_score", risk),
                NumpyCodec.encode_output("credit", credit),
                NumpyCodec.encode_output("fraud", fraud),
                StringCodec.encode_output("decision", outcomes),
            ],
        )
