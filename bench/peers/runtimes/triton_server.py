"""Triton Inference Server through PyTriton with the demo models (runs in PyTriton's venv).

The way PyTriton's docs serve Python models: ``Triton(config=TritonConfig(...))``, ``triton.bind`` of an
inference function decorated with ``@batch`` per model, ``triton.serve()``. ``--which gateway`` binds
``credit`` (an ``xgboost.Booster`` from ``model.json``) and ``fraud`` (a scikit-learn estimator built
from ``params.json``), each with an FP32 ``input-0`` of 20 columns and an FP64 ``predict_proba``;
``--which runtime`` binds one ``decision`` model over the request fields (:mod:`bench.peers.decision`).

Speed settings from PyTriton's docs: batching on with ``max_batch_size`` 1024 (Triton's dynamic batcher
merges concurrent requests), Triton's gRPC endpoint on loopback, one inference function instance (two
cores). PyTriton runs the Python function in this process and Triton in a child process; requests go
from Triton to Python through PyTriton's proxy backend.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.peers.decision import DecisionSpec, sklearn_fraud, xgboost_credit

CONFIG = ModelConfig(max_batch_size=1024)


def bind_gateway(triton: Triton, models: Path) -> None:
    """``credit`` and ``fraud`` as two Triton models."""
    booster = xgboost_credit(models / "credit" / "model.json")
    fraud = sklearn_fraud(models / "fraud" / "params.json")

    @batch  # type: ignore[untyped-decorator]
    def credit_fn(**inputs: Any) -> dict[str, Any]:
        scores = booster.inplace_predict(inputs["input-0"])
        return {"predict_proba": np.asarray(scores, np.float64).reshape(-1, 1)}

    @batch  # type: ignore[untyped-decorator]
    def fraud_fn(**inputs: Any) -> dict[str, Any]:
        return {"predict_proba": fraud.predict_proba(inputs["input-0"])[:, 1:].astype(np.float64)}

    for name, function in (("credit", credit_fn), ("fraud", fraud_fn)):
        triton.bind(
            model_name=name,
            infer_func=function,
            inputs=[Tensor(name="input-0", dtype=np.float32, shape=(20,))],
            outputs=[Tensor(name="predict_proba", dtype=np.float64, shape=(1,))],
            config=CONFIG,
        )


def bind_runtime(triton: Triton, models: Path, spec_path: Path) -> None:
    """One ``decision`` model: request fields in; risk_score, credit, fraud and decision out."""
    spec = DecisionSpec.read(spec_path)
    booster = xgboost_credit(models / "credit" / "model.json")
    fraud = sklearn_fraud(models / "fraud" / "params.json")

    @batch  # type: ignore[untyped-decorator]
    def decide(**inputs: Any) -> dict[str, Any]:
        columns = {k: list(np.asarray(v).reshape(-1)) for k, v in inputs.items()}
        rows = len(next(iter(columns.values())))
        matrix = spec.encode(columns, rows)
        credit = np.asarray(booster.inplace_predict(matrix), np.float64).reshape(-1)
        fraud_scores = fraud.predict_proba(matrix)[:, 1]
        risk, outcomes = spec.decide(credit, fraud_scores)
        return {
            "risk_score": risk.reshape(-1, 1),
            "credit": credit.reshape(-1, 1),
            "fraud": fraud_scores.reshape(-1, 1),
            "decision": np.asarray([o.encode() for o in outcomes], dtype=np.bytes_).reshape(-1, 1),
        }

    inputs = [Tensor(name=n, dtype=np.float64, shape=(1,)) for n in spec.numeric]
    inputs += [Tensor(name=n, dtype=np.bytes_, shape=(1,)) for n in spec.categorical]
    outputs = [Tensor(name=n, dtype=np.float64, shape=(1,)) for n in ("risk_score", "credit", "fraud")]
    outputs.append(Tensor(name="decision", dtype=np.bytes_, shape=(1,)))
    triton.bind(model_name="decision", infer_func=decide, inputs=inputs, outputs=outputs, config=CONFIG)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--which", choices=("gateway", "runtime"), required=True)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    args = parser.parse_args()
    config = TritonConfig(
        grpc_address="127.0.0.1",
        grpc_port=args.grpc_port,
        http_address="127.0.0.1",
        http_port=args.http_port,
        metrics_port=args.metrics_port,
    )
    with Triton(config=config) as triton:
        if args.which == "gateway":
            bind_gateway(triton, args.models)
        else:
            bind_runtime(triton, args.models, args.spec)
        triton.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
