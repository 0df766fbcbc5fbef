"""The separate-services design of the full decision: a gateway in front of an LLM server and a model server.

What a team builds without riskserve for ``card_fraud``: vLLM's own OpenAI-compatible server for the
intent model, a tabular model server for ``credit`` and ``fraud`` (KServe's, the fastest peer on the
tabular decision, its ``decision`` model reading the raw request fields), and this gateway. It speaks
``riskserve.v1.RiskPipeline`` (the load generator is the same for every system); per call it sends, at the
same time, one V2 ``ModelInfer`` of all rows to the model server and one ``/v1/completions`` of all
prompts to vLLM (one greedy token, ``logprob_token_ids`` = the label tokens, as riskserve asks its engine),
then applies ``card_fraud.yaml``'s rules by hand (:mod:`bench.peers.card_fraud`). A backend that errs or
times out (the YAML's ``timeout_ms``: 200 ms tabular, 2 s intent) gets the YAML's fallback, marked
``fallback`` in the answer; bad input is ``INVALID_ARGUMENT``.

Run: ``.venv/bin/python bench/peers/llm_gateway.py --tabular 127.0.0.1:P --llm http://127.0.0.1:Q
--intent models/intent --port 0``; prints ``serving on HOST:PORT`` once both backends answered one
decision, and stops on SIGTERM.
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

import aiohttp
import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench._common import serve_until_signalled
from bench.peers.card_fraud import FALLBACK_INTENT, IntentPrompt, intent_from_logprobs, respond
from bench.peers.v2 import decision_request, outputs, services
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
TABULAR_TIMEOUT_S = 0.2
INTENT_TIMEOUT_S = 2.0
BACKEND_START_S = 290.0
_TOKEN_KEY = "token_id:"


class BadInput(ValueError):
    """A request the gateway or the model server refuses as invalid (the message names the field)."""


class LLMGatewayServicer(pb_grpc.RiskPipelineServicer):
    """``Decide`` and ``DecideBatch``: the model server and the LLM server at once, then the rules."""

    def __init__(
        self, tabular: Any, http: aiohttp.ClientSession, llm_url: str, prompt: IntentPrompt, model: str
    ) -> None:
        self.tabular = tabular
        self.http = http
        self.completions = f"{llm_url.rstrip('/')}/v1/completions"
        self.prompt = prompt
        self.model = model

    async def _tabular(self, requests: Sequence[pb.DecideRequest]) -> tuple[np.ndarray[Any, Any], ...]:
        """(credit, fraud) of every row: one V2 call to the model server's ``decision`` model."""
        numeric = {k: [r.numeric[k] for r in requests] for k in requests[0].numeric}
        categorical = {k: [r.categorical[k] for r in requests] for k in requests[0].categorical}
        message = decision_request("decision", requests[0].request_id, numeric, categorical)
        try:
            response = await self.tabular.ModelInfer(message, timeout=TABULAR_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise BadInput(error.details() or "invalid input") from error
            raise
        out = outputs(response)
        return tuple(np.asarray(out[name], np.float64).reshape(-1) for name in ("credit", "fraud"))

    async def _intent(self, texts: Sequence[str]) -> list[tuple[str, float]]:
        """(label, probability) of every text: one completions call of all prompts."""
        try:
            prompts = [self.prompt.prompt(t) for t in texts]
        except ValueError as error:
            raise BadInput(str(error)) from error
        body = {
            "model": self.model,
            "prompt": prompts,
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": 1,
            "logprob_token_ids": list(self.prompt.label_token_ids),
            "return_tokens_as_token_ids": True,
        }
        timeout = aiohttp.ClientTimeout(total=INTENT_TIMEOUT_S)
        async with self.http.post(self.completions, json=body, timeout=timeout) as response:
            if response.status != 200:
                raise RuntimeError(f"LLM server: HTTP {response.status}: {(await response.text())[:300]}")
            document = await response.json()
        choices = sorted(document["choices"], key=lambda c: c["index"])
        if len(choices) != len(texts):
            raise RuntimeError(f"LLM server: {len(choices)} choices for {len(texts)} prompts")
        answers = []
        for choice in choices:
            step = choice["logprobs"]["top_logprobs"][0]
            logprobs = {int(k.removeprefix(_TOKEN_KEY)): float(v) for k, v in step.items()}
            answers.append(intent_from_logprobs(self.prompt, logprobs))
        return answers

    async def decide(self, requests: Sequence[pb.DecideRequest]) -> list[pb.DecideResponse]:
        """Decisions for ``requests`` (raises ``BadInput``); a failed backend gets its fallback."""
        tabular, intent = await asyncio.gather(
            self._tabular(requests), self._intent([r.text for r in requests]), return_exceptions=True
        )
        for outcome in (tabular, intent):
            if isinstance(outcome, BadInput):
                raise outcome
        fallbacks: list[str] = []
        if isinstance(tabular, BaseException):
            fallbacks += ["credit", "fraud"]
            credit = fraud = np.full(len(requests), 0.5)
        else:
            credit, fraud = tabular
        if isinstance(intent, BaseException):
            fallbacks.append("intent")
            intent = [FALLBACK_INTENT] * len(requests)
        return [
            respond(r, float(credit[i]), float(fraud[i]), intent[i], fallbacks)
            for i, r in enumerate(requests)
        ]

    async def _answer(self, requests: Sequence[pb.DecideRequest], context: Any) -> list[pb.DecideResponse]:
        try:
            return await self.decide(requests)
        except BadInput as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        raise AssertionError("not reached: abort raises")

    async def Decide(self, request: pb.DecideRequest, context: grpc.aio.ServicerContext) -> pb.DecideResponse:  # noqa: N802
        """One decision."""
        return (await self._answer([request], context))[0]

    async def DecideBatch(  # noqa: N802
        self, request: pb.DecideBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.DecideBatchResponse:
        """Many decisions: one call to each backend for all of them."""
        if not request.requests:
            return pb.DecideBatchResponse()
        return pb.DecideBatchResponse(responses=await self._answer(request.requests, context))


async def _wait_for_backends(servicer: LLMGatewayServicer) -> None:
    """Both backends start beside us: call them until one decision has no fallback."""
    from riskserve.demo.dataset import generate_transactions

    check = [pb.DecideRequest(**generate_transactions(1, seed=1).request_fields(0, text=True))]
    deadline = time.monotonic() + BACKEND_START_S
    while True:
        answer = (await servicer.decide(check))[0]
        if not any(m.fallback for m in answer.models):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"backends did not answer in {BACKEND_START_S:.0f} s: {answer}")
        await asyncio.sleep(0.5)


async def serve(args: argparse.Namespace) -> None:
    """Serve until SIGTERM or SIGINT, once both backends answered."""
    channel = grpc.aio.insecure_channel(args.tabular)
    connector = aiohttp.TCPConnector(limit=64, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector) as http:
        servicer = LLMGatewayServicer(
            services.GRPCInferenceServiceStub(channel),
            http,
            args.llm,
            IntentPrompt.read(args.intent),
            args.model,
        )
        await _wait_for_backends(servicer)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_RiskPipelineServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
        bound = server.add_insecure_port(f"{args.host}:{args.port}")
        await server.start()
        await serve_until_signalled(server, f"{args.host}:{bound}")
    await channel.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tabular", required=True, help="HOST:PORT of the model server's V2 gRPC")
    parser.add_argument("--llm", required=True, help="base URL of vLLM's OpenAI-compatible server")
    parser.add_argument("--model", default="intent", help="the served model name at the LLM server")
    parser.add_argument("--intent", type=Path, default=ROOT / "models" / "intent", help="intent artifact")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
