"""The load generator's caller for a peer whose own runtime makes the whole decision over V2 gRPC.

Same requests, same counting and checking as :class:`bench.loadgen.Caller`: each ``DecideRequest`` is
sent as a ``ModelInferRequest`` (one tensor per field, :func:`bench.peers.v2.decision_request`, built
once per request and reused) and the answer is read back into ``DecideResponse`` messages, so latency,
outcomes and wrong answers are tallied exactly as for riskserve.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import grpc

from bench.loadgen import CHANNEL_OPTIONS, TIMEOUT_S, Caller, Expected, Tally
from bench.peers.v2 import decision_request, outputs, services
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb

__all__ = ["V2Caller"]


class V2Caller(Caller):
    """``Decide`` / ``DecideBatch`` as V2 ``ModelInfer`` calls to one decision model."""

    def __init__(self, target: str, model: str, channels: int, expect: Expected | None = None) -> None:
        self.expect = expect
        self.model = model
        self.channels = [grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) for _ in range(channels)]
        self.v2 = [services.GRPCInferenceServiceStub(c) for c in self.channels]
        self.built: dict[tuple[str, int], Any] = {}

    def _request(self, requests: Sequence[pb.DecideRequest]) -> Any:
        """The V2 message of ``requests``, built on first use (keyed by the first request id and the count:
        the load generator's rows and batches are fixed, while its message objects may be rebuilt)."""
        key = (requests[0].request_id, len(requests))
        if key not in self.built:
            numeric = {k: [r.numeric[k] for r in requests] for k in requests[0].numeric}
            categorical = {k: [r.categorical[k] for r in requests] for k in requests[0].categorical}
            self.built[key] = decision_request(self.model, requests[0].request_id, numeric, categorical)
        return self.built[key]

    async def _call(
        self, lane: int, requests: Sequence[pb.DecideRequest], tally: Tally, since: float
    ) -> None:
        stub = self.v2[lane % len(self.v2)]
        try:
            response = await stub.ModelInfer(self._request(requests), timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            tally.failed(time.perf_counter() - since, error.code().name, error.details() or "")
            return
        answers = _answers(requests, outputs(response))
        if len(answers) != len(requests):
            tally.failed(time.perf_counter() - since, "SHORT_ANSWER", f"{len(answers)} answers")
            return
        tally.answered(time.perf_counter() - since, answers, self.expect)

    async def decide(self, lane: int, request: pb.DecideRequest, tally: Tally, since: float) -> None:
        """One decision as one ``ModelInfer`` of one row."""
        await self._call(lane, [request], tally, since)

    async def decide_batch(self, request: pb.DecideBatchRequest, tally: Tally) -> None:
        """A batch as one ``ModelInfer`` of ``len(request.requests)`` rows."""
        await self._call(0, request.requests, tally, time.perf_counter())


def _answers(requests: Sequence[pb.DecideRequest], out: dict[str, Any]) -> list[pb.DecideResponse]:
    """``DecideResponse`` messages from the decision model's outputs, row by row."""
    risk, credit, fraud = (list(map(float, _flat(out[n]))) for n in ("risk_score", "credit", "fraud"))
    decisions = [d.decode() if isinstance(d, bytes) else str(d) for d in _flat(out["decision"])]
    return [
        pb.DecideResponse(
            request_id=request.request_id,
            decision=decisions[i],
            risk_score=risk[i],
            models=[
                pb.ModelScore(model="credit", score=credit[i]),
                pb.ModelScore(model="fraud", score=fraud[i]),
            ],
        )
        for i, request in enumerate(requests[: len(risk)])
    ]


def _flat(values: Any) -> list[Any]:
    return list(values.reshape(-1)) if hasattr(values, "reshape") else list(values)
