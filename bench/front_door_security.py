"""What TLS and bearer tokens cost per call on the front door, isolated from any model.

The real :class:`~riskserve.serving.frontdoor.FrontDoor` (grpc.aio, loopback) serves a pipeline that
answers at once, three ways in one run: plain text, TLS, TLS + a bearer token checked against a table of
``--tokens`` entries. A sync client sends ``--calls`` sequential ``Decide`` calls on one connection each
way; the median and p99 per call are printed side by side (ratios matter, absolute numbers drift).

Run: ``/work/heavy .venv/bin/python bench/front_door_security.py`` (writes nothing; prints a table).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from riskserve.client import RiskClient
from riskserve.platform.metrics import PipelineMetrics
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.schema.pipeline import FrontDoorSpec
from riskserve.serving.frontdoor import Admission, FrontDoor
from riskserve.serving.messages import response_maker
from riskserve.serving.tokens import Caller


class _Instant:
    """A pipeline that answers every decision at once (what is left is the front door's own cost)."""

    name = "bench"
    decision_timeout_ms = 10_000.0
    metrics = PipelineMetrics("bench")

    async def decide(
        self, requests: Sequence[pb.DecideRequest], *_: Any, into: pb.DecideBatchResponse | None = None
    ) -> list[pb.DecideResponse]:
        make = response_maker(into)
        return [make(request_id=r.request_id) for r in requests]

    async def describe(self) -> pb.DescribeResponse:
        return pb.DescribeResponse()

    async def feedback(
        self, request: pb.FeedbackRequest, caller: Caller | None, deadline: float
    ) -> pb.FeedbackResponse:
        return pb.FeedbackResponse()


def _serve(settings: FrontDoorSpec) -> tuple[asyncio.AbstractEventLoop, FrontDoor, int]:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    door = FrontDoor(_Instant(), settings, Admission(64, 64))  # type: ignore[arg-type]
    port = asyncio.run_coroutine_threadsafe(door.start(), loop).result(30)
    asyncio.run_coroutine_threadsafe(door.set_serving(True), loop).result(30)
    return loop, door, port


def _time(client: RiskClient, calls: int) -> tuple[float, float]:
    for _ in range(200):  # warm the connection and the handshake
        client.decide(request_id="w")
    took = []
    for i in range(calls):
        start = time.perf_counter()
        client.decide(request_id=str(i))
        took.append(time.perf_counter() - start)
    took.sort()
    return took[len(took) // 2] * 1e6, took[int(len(took) * 0.99)] * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--tokens", type=int, default=100, help="entries in the token table")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tls_helpers import make_pki, write_tokens  # test-time certificates: nothing is checked in

    with tempfile.TemporaryDirectory() as tmp:
        pki = make_pki(Path(tmp) / "pki")
        token = secrets.token_hex(32)
        table = {f"caller{i}": (secrets.token_hex(32), ["decide"]) for i in range(args.tokens - 1)}
        write_tokens(Path(tmp) / "tokens.yaml", {**table, "bench": (token, ["decide"])})
        tls = {"cert_file": pki.server_cert, "key_file": pki.server_key}
        ways: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
            ("plain text", {}, {}),
            ("TLS", {"tls": tls}, {"ca_file": pki.ca}),
            (f"TLS + token ({args.tokens} in the table)",
             {"tls": tls, "auth": {"tokens_file": Path(tmp) / "tokens.yaml"}},
             {"ca_file": pki.ca, "token": token}),
        ]  # fmt: skip
        print(f"{'front door':<36} {'p50 µs':>8} {'p99 µs':>8}   ({args.calls} sequential Decide calls)")
        for label, extra, client_options in ways:
            settings = FrontDoorSpec.model_validate({"port": 1, **extra}).model_copy(update={"port": 0})
            loop, door, port = _serve(settings)
            with RiskClient(f"127.0.0.1:{port}", pipeline="bench", **client_options) as client:
                p50, p99 = _time(client, args.calls)
            asyncio.run_coroutine_threadsafe(door.stop(0), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            print(f"{label:<36} {p50:8.0f} {p99:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
