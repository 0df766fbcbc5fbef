"""The floor: a hand-written grpc.aio server with the same models in one process, no framework.

This is what any team could write by hand in an afternoon, and so the latency and cost riskserve is
measured against. Per request it does the work riskserve must do too, and nothing else:

  * validate and encode the request with riskserve's own :class:`FeatureEncoder`, built from the
    pipeline YAML's ``features`` (bad input -> INVALID_ARGUMENT naming the field);
  * score ``credit`` (XGBoost compiled by tl2cgen, through :class:`TreeliteModel`, gated on load exactly
    as riskserve loads it) and ``fraud`` (the logistic regression straight from its coefficients:
    ``expit(((x - mean) / scale) @ w + b)`` in numpy);
  * a hand-written risk score ``0.5 * fraud + 0.5 * credit`` and thresholds (>= 0.6 DECLINE, >= 0.3
    REVIEW, else APPROVE) into a ``DecideResponse`` with each model's name, version and score.

It implements ``Decide`` and ``DecideBatch`` of ``riskserve.v1.RiskPipeline``; the ``application`` and
``riskserve-timeout-ms`` metadata are accepted and ignored. Everything runs on the event loop (a model call
is microseconds; a thread hop would cost more). No fallbacks, breakers, metrics, tracing or feedback log:
that is the point of a floor. With ``card_fraud.yaml`` the text field is validated but no LLM is scored:
the floor stands for ``tabular_only``.

Run: ``.venv/bin/python bench/floor_server.py --models models --port 0``; it prints
``serving on HOST:PORT`` once it answers, and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import serve_until_signalled
from riskserve.features.encoder import FeatureEncoder, RawRequest
from riskserve.platform.errors import ModelLoadError, RiskServeError
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc
from riskserve.schema.pipeline import load_pipeline
from riskserve.wrappers.sklearn_model import LinearSnapshot, load_sklearn_artifact
from riskserve.wrappers.treelite_model import TreeliteModel, TreeliteSettings

ROOT = Path(__file__).resolve().parents[1]
DECLINE_AT = 0.6
REVIEW_AT = 0.3
_OUTCOMES = (
    (DECLINE_AT, pb.DECLINE, "combined risk score is 0.6 or more"),
    (REVIEW_AT, pb.REVIEW, "combined risk score is 0.3 or more"),
)


@dataclass
class Front:
    """What any server of the pipeline does around its models: validate and encode requests, then turn the
    two scores into ``DecideResponse`` messages with the hand-written rules (shared with the peers' gateway
    in ``bench/peers/gateway.py``)."""

    name: str
    version: str
    encoder: FeatureEncoder

    @classmethod
    def read(cls, pipeline: Path) -> Front:
        """The pipeline's name, version and feature encoder."""
        spec = load_pipeline(pipeline)
        return cls(spec.name, spec.version, FeatureEncoder(spec.features))

    def encode(self, requests: Sequence[pb.DecideRequest]) -> np.ndarray[Any, np.dtype[np.float32]]:
        """Validate every request (the first bad one raises ``InvalidInput``); encode them as one matrix."""
        rows = [
            self.encoder.validate(
                RawRequest(numeric=dict(r.numeric), categorical=dict(r.categorical), text=r.text)
            )
            for r in requests
        ]
        return self.encoder.encode(rows).matrix

    def respond(
        self,
        requests: Sequence[pb.DecideRequest],
        scores: dict[str, tuple[str, np.ndarray[Any, Any], float]],
    ) -> list[pb.DecideResponse]:
        """Responses from ``scores``: model name -> (version, one score per request, milliseconds)."""
        risk = 0.5 * scores["fraud"][1] + 0.5 * scores["credit"][1]
        return [self._response(request, float(risk[i]), scores, i) for i, request in enumerate(requests)]

    def _response(
        self,
        request: pb.DecideRequest,
        risk: float,
        scores: dict[str, tuple[str, np.ndarray[Any, Any], float]],
        row: int,
    ) -> pb.DecideResponse:
        """The hand-written rules: the first threshold the risk reaches decides, else APPROVE."""
        decision, reason = pb.APPROVE, "low risk"
        for threshold, outcome, why in _OUTCOMES:
            if risk >= threshold:
                decision, reason = outcome, why
                break
        return pb.DecideResponse(
            request_id=request.request_id or uuid.uuid4().hex,
            decision=decision,
            risk_score=risk,
            models=[
                pb.ModelScore(model=name, version=version, score=float(values[row]), latency_ms=ms)
                for name, (version, values, ms) in scores.items()
            ],
            reasons=[reason],
            pipeline=self.name,
            pipeline_version=self.version,
        )


@dataclass
class Floor:
    """The loaded pipeline: its front (encoder and rules) and the two tabular models."""

    front: Front
    credit: TreeliteModel
    fraud: LinearSnapshot

    @classmethod
    async def load(cls, pipeline: Path, models: Path) -> Floor:
        """Read the pipeline's features and load ``models/credit`` and ``models/fraud`` (refused if their
        columns are not the encoder's)."""
        front = Front.read(pipeline)
        credit = TreeliteModel(TreeliteSettings(name="credit", artifact=models / "credit"))
        await credit.load()
        fraud_artifact, fraud = load_sklearn_artifact(models / "fraud")
        for name, columns in (
            ("credit", credit.input_names()),
            ("fraud", fraud_artifact.manifest.feature_names),
        ):
            if list(columns) != front.encoder.columns:
                raise ModelLoadError(
                    f"model '{name}' reads {columns}, the features give {front.encoder.columns}"
                )
        return cls(front, credit, fraud)

    def decide(self, requests: Sequence[pb.DecideRequest]) -> list[pb.DecideResponse]:
        """Validate every request (the first bad one raises ``InvalidInput``), score all at once, decide."""
        matrix = self.front.encode(requests)
        started = time.perf_counter()
        credit = self.credit.predict_sync(matrix)
        credit_ms = (time.perf_counter() - started) * 1e3
        started = time.perf_counter()
        fraud = self.fraud.score_floor(matrix)
        fraud_ms = (time.perf_counter() - started) * 1e3
        scores = {
            "credit": (self.credit.version, credit, credit_ms),
            "fraud": (self.fraud.version, fraud, fraud_ms),
        }
        return self.front.respond(requests, scores)


class FloorServicer(pb_grpc.RiskPipelineServicer):
    """``Decide`` and ``DecideBatch`` on the event loop; a riskserve error becomes its gRPC status."""

    def __init__(self, floor: Floor) -> None:
        self.floor = floor

    async def Decide(self, request: pb.DecideRequest, context: grpc.aio.ServicerContext) -> pb.DecideResponse:  # noqa: N802
        """One decision."""
        return (await self._decide([request], context))[0]

    async def DecideBatch(  # noqa: N802
        self, request: pb.DecideBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.DecideBatchResponse:
        """Many decisions, scored as one matrix, answered in order."""
        if not request.requests:
            return pb.DecideBatchResponse()
        return pb.DecideBatchResponse(responses=await self._decide(request.requests, context))

    async def _decide(self, requests: Sequence[pb.DecideRequest], context: Any) -> list[pb.DecideResponse]:
        try:
            return self.floor.decide(requests)
        except RiskServeError as error:
            await context.abort(error.grpc_status, str(error))
            raise  # not reached: abort raises


async def serve(pipeline: Path, models: Path, host: str, port: int) -> None:
    """Load, serve until SIGTERM or SIGINT, then stop (calls in flight get a second to finish)."""
    floor = await Floor.load(pipeline, models)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_RiskPipelineServicer_to_server(FloorServicer(floor), server)  # type: ignore[no-untyped-call]
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    _check(floor)
    await serve_until_signalled(server, f"{host}:{bound}")


def _check(floor: Floor) -> None:
    """Score one realistic row before saying we serve, so the first client call pays no lazy start-up."""
    from riskserve.demo.dataset import generate_transactions

    row = generate_transactions(1, seed=1).row(0)
    request = pb.DecideRequest(
        numeric={k: float(v) for k, v in row.items() if isinstance(v, float)},
        categorical={k: str(row[k]) for k in ("merchant_category", "channel")},
    )
    scores = [m.score for m in floor.decide([request])[0].models]
    if not np.isfinite(np.asarray(scores, dtype=np.float64)).all():
        raise ModelLoadError(f"the floor scored a check row as {scores}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, default=ROOT / "models", help="demo models (credit, fraud)")
    parser.add_argument("--pipeline", type=Path, default=ROOT / "deploy" / "pipelines" / "tabular_only.yaml")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.pipeline, args.models.resolve(), args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
