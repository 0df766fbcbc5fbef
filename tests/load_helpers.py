"""Decisions sent at a steady rate while a test changes the pipeline (swaps, rollbacks, publishes)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc

from .learning_helpers import own_connection


@dataclass
class VersionsUnderLoad:
    """What the load saw: each answer's send time and the watched model's version, and every failure."""

    answers: list[tuple[float, str]] = field(default_factory=list)
    failures: list[BaseException] = field(default_factory=list)
    shed: int = 0
    """Calls the front door refused with RESOURCE_EXHAUSTED and the caller sent again (``retry_shed``)."""
    started: float = field(default_factory=time.monotonic)

    def rate(self) -> float:
        """Answers per second since the load started."""
        return len(self.answers) / (time.monotonic() - self.started)


@contextlib.contextmanager
def versions_under_load(
    target: str,
    app: str,
    request: pb.DecideRequest,
    model: str,
    *,
    threads: int = 1,
    per_s: float = 5.0,
    retry_shed: bool = False,
) -> Iterator[VersionsUnderLoad]:
    """While the block runs, ``threads`` callers (each on a connection of its own, so the kernel spreads
    them over the ingress replicas) send ``request`` ``per_s`` times a second each. An RPC error or a
    fallback of ``model`` is a failure; with ``retry_shed`` a RESOURCE_EXHAUSTED (the front door shedding,
    "retry with backoff") is counted and sent again after 50 ms, as a client should. The load stops (and
    every caller is joined) when the block ends."""
    seen = VersionsUnderLoad()
    stop = threading.Event()

    def load() -> None:
        with own_connection(target) as channel:
            stub = pb_grpc.RiskPipelineStub(channel)  # type: ignore[no-untyped-call]
            metadata = (("application", app),)
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    response = stub.Decide(request, metadata=metadata, timeout=20)
                    score = next(m for m in response.models if m.model == model)
                    assert not score.fallback, score
                    seen.answers.append((sent, score.version))
                except grpc.RpcError as error:
                    if retry_shed and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        seen.shed += 1
                        time.sleep(0.05)
                        continue
                    seen.failures.append(error)
                except BaseException as error:  # every failure is a test failure, collected
                    seen.failures.append(error)
                time.sleep(max(0.0, 1 / per_s - (time.monotonic() - sent)))

    callers = [threading.Thread(target=load) for _ in range(threads)]
    for caller in callers:
        caller.start()
    try:
        yield seen
    finally:
        stop.set()
        for caller in callers:
            caller.join(timeout=60)
