"""The gateway a team puts in front of a model server: riskserve's API outside, V2 model calls inside.

It speaks ``riskserve.v1.RiskPipeline`` (so the load generator is the same for every system), validates and
encodes each request like the floor (``bench/floor_server.py``'s :class:`Front`), calls the model server's
``credit`` and ``fraud`` models concurrently over one V2 gRPC channel (``ModelInfer``, the feature matrix as
raw FP32 bytes, output ``predict_proba``), and applies the floor's rules. This is the "separate models
called by a small gateway" way of serving the pipeline on MLServer, KServe or Triton.

Run: ``.venv/bin/python bench/peers/gateway.py --backend 127.0.0.1:PORT --port 0``; it prints
``serving on HOST:PORT`` once it listens and the backend answered one decision, and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench._common import serve_until_signalled
from bench.floor_server import Front
from bench.peers.v2 import matrix_request, outputs, positive_class, services
from riskserve.platform.errors import RiskServeError
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("credit", "fraud")
BACKEND_TIMEOUT_S = 5.0
BACKEND_START_S = 170.0


class GatewayServicer(pb_grpc.RiskPipelineServicer):
    """``Decide`` and ``DecideBatch``: encode, two concurrent V2 calls, rules."""

    def __init__(self, front: Front, backend: Any, outputs: dict[str, str]) -> None:
        self.front = front
        self.backend = backend
        self.outputs = outputs

    async def _score(self, model: str, matrix: np.ndarray[Any, Any]) -> tuple[str, Any, float]:
        started = time.perf_counter()
        output = self.outputs[model]
        response = await self.backend.ModelInfer(
            matrix_request(model, matrix, output), timeout=BACKEND_TIMEOUT_S
        )
        scores = positive_class(outputs(response)[output])
        return response.model_version or "v2", scores, (time.perf_counter() - started) * 1e3

    async def decide(self, requests: Sequence[pb.DecideRequest]) -> list[pb.DecideResponse]:
        """Decisions for ``requests`` (raises ``InvalidInput`` or the backend's ``AioRpcError``)."""
        matrix = self.front.encode(requests)
        scored = await asyncio.gather(*(self._score(m, matrix) for m in MODELS))
        return self.front.respond(requests, dict(zip(MODELS, scored, strict=True)))

    async def _answer(self, requests: Sequence[pb.DecideRequest], context: Any) -> list[pb.DecideResponse]:
        try:
            return await self.decide(requests)
        except RiskServeError as error:
            await context.abort(error.grpc_status, str(error))
        except grpc.aio.AioRpcError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"model server: {error.details()}")
        raise AssertionError("not reached: abort raises")

    async def Decide(self, request: pb.DecideRequest, context: grpc.aio.ServicerContext) -> pb.DecideResponse:  # noqa: N802
        """One decision."""
        return (await self._answer([request], context))[0]

    async def DecideBatch(  # noqa: N802
        self, request: pb.DecideBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.DecideBatchResponse:
        """Many decisions, two model calls for all of them."""
        if not request.requests:
            return pb.DecideBatchResponse()
        return pb.DecideBatchResponse(responses=await self._answer(request.requests, context))


async def serve(pipeline: Path, backend: str, output: dict[str, str], host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT; one decision through the backend first."""
    channel = grpc.aio.insecure_channel(backend)
    servicer = GatewayServicer(Front.read(pipeline), services.GRPCInferenceServiceStub(channel), output)
    from riskserve.demo.dataset import generate_transactions

    check = [pb.DecideRequest(**generate_transactions(1, seed=1).request_fields(0, text=False))]
    deadline = time.monotonic() + BACKEND_START_S
    while True:  # the model server starts beside us: wait until it answers
        try:
            await servicer.decide(check)
            break
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_RiskPipelineServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await serve_until_signalled(server, f"{host}:{bound}")
    await channel.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", required=True, help="HOST:PORT of the model server's V2 gRPC")
    parser.add_argument(
        "--outputs",
        default="credit=predict_proba,fraud=predict_proba",
        help="the output to request of each model (MLServer's XGBoost runtime loads a Booster's JSON as a "
        "regressor, whose 'predict' is already the probability)",
    )
    parser.add_argument("--pipeline", type=Path, default=ROOT / "deploy" / "pipelines" / "tabular_only.yaml")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        wanted = dict(pair.split("=", 1) for pair in args.outputs.split(","))
        asyncio.run(serve(args.pipeline, args.backend, wanted, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
