"""KServe's Python model server with the demo models (runs in KServe's venv).

The way KServe's docs write a custom predictor: subclass ``kserve.Model``, load in ``load()`` and set
``ready``, implement ``predict`` on ``InferRequest`` (V2), start ``kserve.ModelServer`` with the models.
``--which gateway`` serves ``credit`` (an ``xgboost.Booster`` from ``model.json``) and ``fraud`` (a
scikit-learn estimator built from ``params.json``), each answering ``predict_proba``; ``--which runtime``
serves one ``decision`` model that encodes, scores both and applies the rules (:mod:`bench.peers.decision`).

Speed settings from KServe's docs and flags: one worker (2 cores, and the client shares them),
``--enable_latency_logging false`` (it logs a line per request otherwise); KServe's own flags
(``--grpc_port``, ``--http_port``, ...) are parsed by KServe at import, so they are passed through.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer
from kserve.errors import InvalidInput

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.peers.decision import BadRequest, DecisionSpec, sklearn_fraud, xgboost_credit


def _numbers(name: str, values: Any) -> InferOutput:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    return InferOutput(name=name, shape=[int(array.shape[0])], datatype="FP64", data=array.tolist())


class Credit(Model):  # type: ignore[misc]
    """XGBoost: ``predict_proba`` is the positive-class probability per row."""

    def __init__(self, model_json: Path) -> None:
        super().__init__("credit")
        self.path = model_json
        self.load()

    def load(self) -> bool:
        self.booster = xgboost_credit(self.path)
        self.ready = True
        return True

    async def predict(
        self, payload: InferRequest, headers: Any = None, response_headers: Any = None
    ) -> InferResponse:
        scores = self.booster.inplace_predict(payload.inputs[0].as_numpy())
        return InferResponse(payload.id, self.name, [_numbers("predict_proba", scores)])


class Fraud(Model):  # type: ignore[misc]
    """scikit-learn: ``predict_proba`` of the positive class per row."""

    def __init__(self, params_json: Path) -> None:
        super().__init__("fraud")
        self.path = params_json
        self.load()

    def load(self) -> bool:
        self.model = sklearn_fraud(self.path)
        self.ready = True
        return True

    async def predict(
        self, payload: InferRequest, headers: Any = None, response_headers: Any = None
    ) -> InferResponse:
        scores = self.model.predict_proba(payload.inputs[0].as_numpy())[:, 1]
        return InferResponse(payload.id, self.name, [_numbers("predict_proba", scores)])


class Decision(Model):  # type: ignore[misc]
    """The whole decision: request fields in; risk_score, credit, fraud and decision out."""

    def __init__(self, models: Path, spec: Path) -> None:
        super().__init__("decision")
        self.models, self.spec_path = models, spec
        self.load()

    def load(self) -> bool:
        self.spec = DecisionSpec.read(self.spec_path)
        self.credit = xgboost_credit(self.models / "credit" / "model.json")
        self.fraud = sklearn_fraud(self.models / "fraud" / "params.json")
        self.ready = True
        return True

    async def predict(
        self, payload: InferRequest, headers: Any = None, response_headers: Any = None
    ) -> InferResponse:
        inputs = {i.name: list(np.asarray(i.as_numpy()).reshape(-1)) for i in payload.inputs}
        rows = len(next(iter(inputs.values()))) if inputs else 0
        try:
            matrix = self.spec.encode(inputs, rows)
        except BadRequest as error:
            raise InvalidInput(str(error)) from error
        credit = np.asarray(self.credit.inplace_predict(matrix), np.float64).reshape(-1)
        fraud = self.fraud.predict_proba(matrix)[:, 1]
        risk, outcomes = self.spec.decide(credit, fraud)
        decision = InferOutput(name="decision", shape=[rows], datatype="BYTES", data=outcomes)
        outputs = [
            _numbers("risk_score", risk),
            _numbers("credit", credit),
            _numbers("fraud", fraud),
            decision,
        ]
        return InferResponse(payload.id, self.name, outputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--which", choices=("gateway", "runtime"), required=True)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--spec", type=Path, required=True)
    args, _ = parser.parse_known_args()  # the rest are KServe's own flags, read by kserve at import
    if args.which == "gateway":
        models: list[Model] = [
            Credit(args.models / "credit" / "model.json"),
            Fraud(args.models / "fraud" / "params.json"),
        ]
    else:
        models = [Decision(args.models, args.spec)]
    ModelServer().start(models)
    return 0


if __name__ == "__main__":
    sys.exit(main())
