"""Plain Ray Serve on the full decision with the LLM (``card_fraud``): what a team builds on Ray without
riskserve.

Model composition from the Ray Serve guide, as for the tabular decision (:mod:`bench.peers.ray_serve_app`):
an ingress deployment behind Serve's gRPC proxy (the user's protobuf servicer, the application named
``card_fraud``) holding ``DeploymentHandle``s to one deployment per model, ``credit`` and ``fraud`` (the
tabular app's deployments) and ``intent``, calling all three at once. ``intent`` runs vLLM as Serve's vLLM
tutorial does: a deployment that owns vLLM's ``AsyncLLMEngine`` (``AsyncLLMEngine.from_engine_args``) and
awaits ``engine.generate`` per text, so concurrent calls share vLLM's continuous batching. The engine gets
riskserve's CPU settings (:func:`bench.peers.card_fraud.intent_engine`), and each text is scored as
riskserve scores it: one greedy token, ``logprob_token_ids`` = the label tokens, a softmax over them. The
ingress validates and encodes with card_fraud's features and applies its rules by hand
(:mod:`bench.peers.card_fraud`); a model that errs or passes the YAML's ``timeout_ms`` gets its fallback.

Settings: the tabular app's for ``credit``, ``fraud`` and the ingress (one replica, ``num_cpus: 0``,
``max_ongoing_requests`` 64, access log off); ``intent`` has ``num_cpus: 1`` as riskserve's intent replica
(Ray then gives it one OpenMP thread) and ``max_ongoing_requests`` 64, above the engine's ``max_num_seqs``
so Serve does not queue what the engine would batch. vLLM's ``AsyncLLMEngine`` always runs its engine core in
a process of its own; riskserve runs it in the replica's process (``riskserve/wrappers/vllm_driver.py``).

Run: ``.venv/bin/python bench/peers/ray_serve_card_fraud.py --models models --port 0``; prints ``serving
on HOST:PORT`` once Serve runs the application, and shuts Serve and Ray down on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ray import serve
from ray.serve.handle import DeploymentHandle

from bench.floor_server import Front
from bench.peers.card_fraud import (
    FALLBACK_INTENT,
    PIPELINE,
    IntentPrompt,
    intent_engine,
    intent_from_logprobs,
    respond,
)
from bench.peers.ray_serve_app import MODEL_OPTIONS, QUIET, SERVICER, Credit, Fraud, _free_port
from riskserve.platform.errors import RiskServeError
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
TABULAR_TIMEOUT_S = 0.2
INTENT_TIMEOUT_S = 2.0
"""The YAML's ``timeout_ms`` of the tabular models and of the intent model."""
INTENT_OPTIONS: dict[str, Any] = MODEL_OPTIONS | {"ray_actor_options": {"num_cpus": 1}}


@serve.deployment(**INTENT_OPTIONS)
class Intent:
    """The intent LLM: vLLM's ``AsyncLLMEngine`` in the replica, one engine request per text."""

    def __init__(self, artifact: str, engine: dict[str, Any], env: dict[str, str]) -> None:
        os.environ.update(env)  # vLLM reads its CPU settings from the environment when the engine starts
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.engine.async_llm_engine import AsyncLLMEngine

        self.prompt = IntentPrompt.read(Path(artifact))
        self.engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**engine))
        labels = list(self.prompt.label_token_ids)
        self.params = SamplingParams(
            max_tokens=1, temperature=0.0, logprob_token_ids=labels, detokenize=False
        )

    async def _one(self, text: str) -> tuple[str, float]:
        final = None
        async for output in self.engine.generate(self.prompt.prompt(text), self.params, uuid.uuid4().hex):
            final = output
        if final is None or not final.outputs or not final.outputs[0].logprobs:
            raise RuntimeError("the engine returned no log-probabilities")
        step = final.outputs[0].logprobs[0]
        return intent_from_logprobs(self.prompt, {t: step[t].logprob for t in self.prompt.label_token_ids})

    async def __call__(self, texts: list[str]) -> list[tuple[str, float]]:
        """(label, probability) of every text, all in the engine at once."""
        return list(await asyncio.gather(*(self._one(t) for t in texts)))


@serve.deployment(**MODEL_OPTIONS)
class Ingress:
    """``Decide`` and ``DecideBatch`` of ``riskserve.v1.RiskPipeline``: encode, the three models, rules."""

    def __init__(
        self,
        credit: DeploymentHandle[Any],
        fraud: DeploymentHandle[Any],
        intent: DeploymentHandle[Any],
        pipeline: str,
    ) -> None:
        self.credit, self.fraud, self.intent = credit, fraud, intent
        self.front = Front.read(Path(pipeline))

    async def _decide(self, requests: Sequence[pb.DecideRequest], context: Any) -> list[pb.DecideResponse]:
        try:
            matrix = self.front.encode(requests)
        except RiskServeError as error:
            context.set_code(error.grpc_status)
            context.set_details(str(error))
            return []
        credit, fraud, intent = await asyncio.gather(
            asyncio.wait_for(_awaited(self.credit.remote(matrix)), TABULAR_TIMEOUT_S),
            asyncio.wait_for(_awaited(self.fraud.remote(matrix)), TABULAR_TIMEOUT_S),
            asyncio.wait_for(_awaited(self.intent.remote([r.text for r in requests])), INTENT_TIMEOUT_S),
            return_exceptions=True,
        )
        fallbacks = [
            name
            for name, answer in (("credit", credit), ("fraud", fraud), ("intent", intent))
            if isinstance(answer, BaseException)
        ]
        n = len(requests)
        credit = [0.5] * n if "credit" in fallbacks else credit
        fraud = [0.5] * n if "fraud" in fallbacks else fraud
        intent = [FALLBACK_INTENT] * n if "intent" in fallbacks else intent
        return [
            respond(r, float(credit[i]), float(fraud[i]), intent[i], fallbacks)  # type: ignore[index]
            for i, r in enumerate(requests)
        ]

    async def Decide(self, request: pb.DecideRequest, grpc_context: Any) -> pb.DecideResponse:  # noqa: N802
        answers = await self._decide([request], grpc_context)
        return answers[0] if answers else pb.DecideResponse()

    async def DecideBatch(self, request: pb.DecideBatchRequest, grpc_context: Any) -> pb.DecideBatchResponse:  # noqa: N802
        if not request.requests:
            return pb.DecideBatchResponse()
        return pb.DecideBatchResponse(responses=await self._decide(request.requests, grpc_context))


async def _awaited(response: Any) -> Any:
    """A ``DeploymentResponse`` as a coroutine, so ``asyncio.wait_for`` can time it out (and cancel it)."""
    return await response


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, default=ROOT / "models")
    parser.add_argument("--port", type=int, default=0, help="the gRPC proxy's port; 0: any free port")
    args = parser.parse_args(argv)
    import ray
    from ray.serve.config import gRPCOptions

    port = args.port or _free_port()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    models = args.models.resolve()
    engine, env = intent_engine(models)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": _free_port()},
            grpc_options=gRPCOptions(port=port, grpc_servicer_functions=[SERVICER]),
            logging_config=QUIET,
        )
        credit = Credit.bind(str(models / "credit" / "model.json"))  # type: ignore[attr-defined]
        fraud = Fraud.bind(str(models / "fraud" / "params.json"))  # type: ignore[attr-defined]
        intent = Intent.bind(str(models / "intent"), engine, env)  # type: ignore[attr-defined]
        app = Ingress.bind(credit, fraud, intent, str(PIPELINE))  # type: ignore[attr-defined]
        # A route prefix even for gRPC: Serve's proxies do not route to an application without one.
        serve.run(app, name="card_fraud", route_prefix="/card_fraud")
        print(f"serving on 127.0.0.1:{port}", flush=True)
        stop.wait()
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
