"""Plain Ray Serve, written the way its docs show: what a team builds on Ray without riskserve.

Model composition from the Ray Serve guide: an ingress deployment holding ``DeploymentHandle``s to one
deployment per model, calling both concurrently (``await handle.remote(...)``), behind Serve's own gRPC
proxy with the user's protobuf servicer (``grpc_servicer_functions``); the proxy routes by the
``application`` metadata, so the application is named ``tabular_only`` and the load generator is the same.
The ingress validates, encodes and decides like the floor (``bench/floor_server.py``'s :class:`Front`);
``credit`` is an ``xgboost.Booster`` from ``model.json`` and ``fraud`` a scikit-learn estimator built from
``params.json`` (:mod:`bench.peers.decision`).

Settings from Serve's performance guide, for small fast requests on 2 cores: one replica each,
``num_cpus: 0`` so three replicas fit, ``max_ongoing_requests`` raised to 64 (the default 5 queues at c=8),
access logs off and log level WARNING.

Run: ``.venv/bin/python bench/peers/ray_serve_app.py --models models --port 0``; prints ``serving on
HOST:PORT`` once Serve runs the application, and shuts Serve and Ray down on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ray import serve
from ray.serve.handle import DeploymentHandle

from bench.floor_server import Front
from bench.peers.decision import sklearn_fraud, xgboost_credit
from riskserve.platform.errors import RiskServeError
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
SERVICER = "riskserve.proto.riskserve.v1.risk_pipeline_pb2_grpc.add_RiskPipelineServicer_to_server"
QUIET = {"log_level": "WARNING", "enable_access_log": False}
MODEL_OPTIONS: dict[str, Any] = {
    "num_replicas": 1,
    "max_ongoing_requests": 64,
    "ray_actor_options": {"num_cpus": 0},
    "logging_config": QUIET,
}


@serve.deployment(**MODEL_OPTIONS)
class Credit:
    """XGBoost from its JSON model file."""

    def __init__(self, model_json: str) -> None:
        self.booster = xgboost_credit(model_json)

    def __call__(self, matrix: Any) -> Any:
        return self.booster.inplace_predict(matrix)


@serve.deployment(**MODEL_OPTIONS)
class Fraud:
    """scikit-learn logistic regression, positive-class probability."""

    def __init__(self, params_json: str) -> None:
        self.model = sklearn_fraud(params_json)

    def __call__(self, matrix: Any) -> Any:
        return self.model.predict_proba(matrix)[:, 1]


@serve.deployment(**MODEL_OPTIONS)
class Ingress:
    """``Decide`` and ``DecideBatch`` of ``riskserve.v1.RiskPipeline``: encode, both models, rules."""

    def __init__(self, credit: DeploymentHandle[Any], fraud: DeploymentHandle[Any], pipeline: str) -> None:
        self.credit, self.fraud = credit, fraud
        self.front = Front.read(Path(pipeline))

    async def _decide(self, requests: Sequence[pb.DecideRequest], context: Any) -> list[pb.DecideResponse]:
        try:
            matrix = self.front.encode(requests)
        except RiskServeError as error:
            context.set_code(error.grpc_status)
            context.set_details(str(error))
            return []
        credit, fraud = await asyncio.gather(self.credit.remote(matrix), self.fraud.remote(matrix))
        return self.front.respond(
            requests, {"credit": ("json", credit, 0.0), "fraud": ("params", fraud, 0.0)}
        )

    async def Decide(self, request: pb.DecideRequest, grpc_context: Any) -> pb.DecideResponse:  # noqa: N802
        answers = await self._decide([request], grpc_context)
        return answers[0] if answers else pb.DecideResponse()

    async def DecideBatch(self, request: pb.DecideBatchRequest, grpc_context: Any) -> pb.DecideBatchResponse:  # noqa: N802
        return pb.DecideBatchResponse(responses=await self._decide(request.requests, grpc_context))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, default=ROOT / "models")
    parser.add_argument("--pipeline", type=Path, default=ROOT / "deploy" / "pipelines" / "tabular_only.yaml")
    parser.add_argument("--port", type=int, default=0, help="the gRPC proxy's port; 0: any free port")
    args = parser.parse_args(argv)
    import ray
    from ray.serve.config import gRPCOptions

    port = args.port or _free_port()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": _free_port()},
            grpc_options=gRPCOptions(port=port, grpc_servicer_functions=[SERVICER]),
            logging_config=QUIET,
        )
        models = args.models.resolve()
        credit = Credit.bind(str(models / "credit" / "model.json"))  # type: ignore[attr-defined]
        fraud = Fraud.bind(str(models / "fraud" / "params.json"))  # type: ignore[attr-defined]
        app = Ingress.bind(credit, fraud, str(args.pipeline.resolve()))  # type: ignore[attr-defined]
        # A route prefix even for gRPC: Serve's proxies do not route to an application without one.
        serve.run(app, name="tabular_only", route_prefix="/tabular_only")
        print(f"serving on 127.0.0.1:{port}", flush=True)
        stop.wait()
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
