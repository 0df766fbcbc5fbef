"""A gRPC load generator for ``riskserve.v1.RiskPipeline``, in its own process: its CPU is not the server's.

Modes (one per run):

  * ``closed``: ``--concurrency`` grpc.aio tasks, each sending its next ``Decide`` when the previous answer
    arrives, until ``--calls`` answers or ``--seconds`` have passed. Latency is the call's own time.
  * ``open``: ``Decide`` sent at ``--rate`` per second for ``--seconds`` (Poisson or fixed-interval arrivals),
    whatever the answers do. Latency runs from the *intended* send time, so a client or server that falls
    behind shows as latency instead of silently sending less (no coordinated omission).
  * ``batch``: one ``DecideBatch`` of ``--batch`` rows at a time, ``--calls`` times (or ``--seconds``).

The client's own garbage collector is paused for the measured window (everything built before it is frozen
out of the collector's scans, and it runs again after the window): its full collections took 23-34 ms
in the middle of open-loop windows at 1,000/s, stalls that counted as the server's latency, for every
system alike.

Requests are rows of :func:`riskserve.demo.dataset.generate_transactions` (text only with ``--text``).
Every call carries the metadata ``("application", PIPELINE)`` and ``("riskserve-timeout-ms", "5000")`` and a
5 s gRPC deadline. ``--warmup`` untimed calls come first. The measured window is announced on stdout with
``{"event": "start"}`` and ``{"event": "end"}`` lines (so a parent can sample the server's CPU over exactly
that window), then one JSON line with the result: latency p50/p90/p99/mean/max in ms, answers per second,
errors by gRPC status code, fallbacks (``DecideResponse.models[i].fallback``) by model, decisions by outcome,
and the client's own CPU seconds.

``--expect FILE`` (JSON: request_id -> [credit, fraud, risk_score, decision], plus [intent label, intent
score] for a pipeline with the LLM) checks every answer against reference scores: an answer whose scores
differ by more than ``TOLERANCE`` or whose decision or label differs is counted as ``wrong`` (a system that
answers wrong does not count). An answer with a fallback is counted in ``fallbacks`` and not checked.
``--protocol v2`` sends the same requests as Open Inference Protocol (KServe V2) ``ModelInfer`` calls to
``--model`` (``bench/peers/v2.py``), for a peer whose own runtime makes the whole decision.

Run: ``.venv/bin/python bench/loadgen.py --target 127.0.0.1:PORT --pipeline tabular_only --mode closed -c 8``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc

TIMEOUT_S = 5.0
TOLERANCE = 1e-4
"""Largest difference from a reference score that still counts as right (float32 features, compiled trees)."""
DEFAULT_CHANNELS = 1
"""Channels the tasks share (task i uses channel i % K). One channel served the floor best on 2 cores
(see hotpath's --channels); the same is used for every system."""
CHANNEL_OPTIONS: Final = (("grpc.use_local_subchannel_pool", 1),)
"""Each channel its own TCP connection: gRPC would otherwise share one connection among channels with
the same target and arguments. Several connections are what a fleet of callers opens; a server with
several processes on one port (SO_REUSEPORT) gets them spread over its processes by the kernel."""
_POOL = 2048
"""Distinct requests cycled through (each with its own request_id)."""


@dataclass
class Tally:
    """What the calls of one window came back with."""

    latencies: list[float] = field(default_factory=list)
    """Seconds per answered call (successful or not), in completion order."""
    ok: int = 0
    decisions: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    error_details: dict[str, str] = field(default_factory=dict)
    """The first error message seen per status code."""
    fallbacks: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    send_lags: list[float] = field(default_factory=list)
    """Open loop: seconds each send left after its intended time (timer granularity, a busy client)."""
    late_sends: int = 0
    """Open loop: sends that left more than a millisecond after their intended time."""
    wrong: int = 0
    """Decisions whose scores or outcome differ from the reference (only with ``--expect``)."""
    wrong_example: str = ""

    def answered(
        self, latency: float, responses: Sequence[pb.DecideResponse], expect: Expected | None = None
    ) -> None:
        """Count one successful call and what its decisions say (and how many are wrong, given ``expect``)."""
        self.latencies.append(latency)
        self.ok += 1
        self.decisions += len(responses)
        for response in responses:
            degraded = any(m.fallback for m in response.models)  # counted in fallbacks, not checked
            problem = _wrong(response, expect) if expect is not None and not degraded else ""
            if problem:
                self.wrong += 1
                self.wrong_example = self.wrong_example or problem
            self.outcomes[pb.Decision.Name(response.decision)] += 1
            for model in response.models:
                if model.fallback:
                    self.fallbacks[model.model] += 1

    def failed(self, latency: float, code: str, details: str) -> None:
        """Count one failed call by its status code name."""
        self.latencies.append(latency)
        self.errors[code] += 1
        self.error_details.setdefault(code, details)


Expected = dict[str, tuple[Any, ...]]
"""request_id -> (credit, fraud, risk_score, decision name[, intent label, intent score]): the reference
answer (the intent only for a pipeline with the LLM)."""


def _wrong(response: pb.DecideResponse, expect: Expected) -> str:
    """What is wrong with ``response`` against its reference ('' when it is right)."""
    reference = expect.get(response.request_id)
    if reference is None:
        return f"{response.request_id!r}: no reference answer for this request id"
    credit, fraud, risk, decision = reference[:4]
    scores = {m.model: m.score for m in response.models}
    if len(reference) == 6:
        intent = next((m for m in response.models if m.model == "intent"), None)
        label, score = reference[4], reference[5]
        if intent is None or intent.label != label or not abs(intent.score - score) <= TOLERANCE:
            got = (intent.label, intent.score) if intent is not None else None
            return f"{response.request_id}: intent {got}, reference {(label, score)}"
    got = (scores.get("credit", float("nan")), scores.get("fraud", float("nan")), response.risk_score)
    for name, value, want in zip(("credit", "fraud", "risk_score"), got, (credit, fraud, risk), strict=True):
        if not abs(value - want) <= TOLERANCE:
            return f"{response.request_id}: {name} {value!r}, reference {want!r}"
    near = min(abs(risk - 0.6), abs(risk - 0.3)) <= TOLERANCE
    if pb.Decision.Name(response.decision) != decision and not near:
        return f"{response.request_id}: {pb.Decision.Name(response.decision)}, reference {decision}"
    return ""


def read_expected(path: Path) -> Expected:
    """Reference answers written by the harness (``--expect``)."""
    return {k: tuple(v) for k, v in json.loads(path.read_text()).items()}


def make_requests(count: int, seed: int, text: bool) -> list[pb.DecideRequest]:
    """``DecideRequest`` messages from generated transactions, as ``bench/decide.py`` builds them."""
    from riskserve.demo.dataset import generate_transactions

    tx = generate_transactions(count, seed=seed)
    out = []
    for i in range(count):
        out.append(
            pb.DecideRequest(
                request_id=f"load-{seed}-{i}",
                **tx.request_fields(i, text=text),
            )
        )
    return out


class Caller:
    """Stubs over ``channels`` channels and the one way every call is made and counted."""

    def __init__(self, target: str, pipeline: str, channels: int, expect: Expected | None = None) -> None:
        self.expect = expect
        self.channels = [grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) for _ in range(channels)]
        self.stubs = [pb_grpc.RiskPipelineStub(c) for c in self.channels]  # type: ignore[no-untyped-call]
        self.metadata = (("application", pipeline), ("riskserve-timeout-ms", f"{TIMEOUT_S * 1e3:.0f}"))

    async def decide(self, lane: int, request: pb.DecideRequest, tally: Tally, since: float) -> None:
        """One ``Decide`` on lane ``lane``'s channel; latency counted from ``since`` (perf_counter)."""
        stub = self.stubs[lane % len(self.stubs)]
        try:
            response = await stub.Decide(request, metadata=self.metadata, timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            tally.failed(time.perf_counter() - since, error.code().name, error.details() or "")
            return
        tally.answered(time.perf_counter() - since, [response], self.expect)

    async def decide_batch(self, request: pb.DecideBatchRequest, tally: Tally) -> None:
        """One ``DecideBatch``; a short answer counts as an error (``SHORT_ANSWER``)."""
        since = time.perf_counter()
        try:
            response = await self.stubs[0].DecideBatch(request, metadata=self.metadata, timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            tally.failed(time.perf_counter() - since, error.code().name, error.details() or "")
            return
        if len(response.responses) != len(request.requests):
            tally.failed(time.perf_counter() - since, "SHORT_ANSWER", f"{len(response.responses)} answers")
            return
        tally.answered(time.perf_counter() - since, response.responses, self.expect)

    async def close(self) -> None:
        """Close every channel."""
        for channel in self.channels:
            await channel.close()


async def closed_loop(
    caller: Caller, requests: Sequence[pb.DecideRequest], concurrency: int, calls: int, seconds: float
) -> Tally:
    """``concurrency`` tasks calling back to back until ``calls`` calls were started or time is up."""
    tally = Tally()
    deadline = time.perf_counter() + seconds
    issued = 0

    async def worker(lane: int) -> None:
        nonlocal issued
        while issued < calls and time.perf_counter() < deadline:
            request = requests[issued % len(requests)]
            issued += 1
            await caller.decide(lane, request, tally, time.perf_counter())

    await asyncio.gather(*(worker(lane) for lane in range(concurrency)))
    return tally


def arrivals(rate: float, seconds: float, poisson: bool, seed: int) -> list[float]:
    """``rate * seconds`` send times in ``[0, seconds)``, seconds from the start: evenly spaced, or Poisson.

    Poisson arrivals are drawn as that many sorted uniform times (a Poisson process given its count), so
    the offered rate is exact and the gaps are still exponential-like; seeded, so every system gets the same.
    """
    count = max(1, round(rate * seconds))
    if not poisson:
        return [i / rate for i in range(count)]
    times = np.sort(np.random.default_rng(seed).uniform(0.0, seconds, count))
    return [float(t) for t in times]


async def open_loop(caller: Caller, requests: Sequence[pb.DecideRequest], schedule: Sequence[float]) -> Tally:
    """Send on a schedule fixed in advance (seconds from now), whatever the answers do; wait for all.

    Sends due while the loop was busy go out at once, their latency still counted from the schedule. Each
    call leaves the pending set as it finishes, so the end waits only for the calls still out (gathering
    every call of the window at once stalled the loop for tens of ms while the last answers came in).
    """
    tally = Tally()
    start = time.perf_counter()
    pending: set[asyncio.Task[None]] = set()
    for i, offset in enumerate(schedule):
        due = start + offset
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        lag = time.perf_counter() - due
        tally.send_lags.append(lag)
        if lag > 1e-3:
            tally.late_sends += 1
        task = asyncio.create_task(caller.decide(i, requests[i % len(requests)], tally, due))
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.wait(pending)
    return tally


async def batch_loop(
    caller: Caller, requests: Sequence[pb.DecideRequest], size: int, calls: int, seconds: float
) -> Tally:
    """``DecideBatch`` of ``size`` rows, one at a time, ``calls`` times or until time is up."""
    batches = [
        pb.DecideBatchRequest(requests=[requests[(start + j) % len(requests)] for j in range(size)])
        for start in range(0, max(len(requests), size * 2), size)
    ]
    tally = Tally()
    deadline = time.perf_counter() + seconds
    for i in range(calls):
        if time.perf_counter() >= deadline:
            break
        await caller.decide_batch(batches[i % len(batches)], tally)
    return tally


def latency_ms(samples: Sequence[float]) -> dict[str, float]:
    """p50 / p90 / p99 / p99.9 / mean / max of ``samples`` (seconds) in milliseconds (zeros when empty)."""
    if not samples:
        return dict.fromkeys(("p50", "p90", "p99", "p999", "mean", "max"), 0.0)
    ordered = np.sort(np.asarray(samples) * 1e3)
    p50, p90, p99, p999 = np.percentile(ordered, [50, 90, 99, 99.9])
    return {
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "p999": float(p999),
        "mean": statistics.fmean(ordered),
        "max": float(ordered[-1]),
    }


def report(args: argparse.Namespace, tally: Tally, elapsed: float, client_cpu_s: float) -> dict[str, Any]:
    """The result line: settings, latency, rates, errors, fallbacks and outcomes."""
    calls = tally.ok + sum(tally.errors.values())
    result: dict[str, Any] = {
        "mode": args.mode,
        "pipeline": args.pipeline,
        "concurrency": args.concurrency if args.mode == "closed" else None,
        "channels": args.channels,
        "calls": calls,
        "ok": tally.ok,
        "decisions": tally.decisions,
        "seconds": elapsed,
        "calls_per_s": calls / elapsed if elapsed > 0 else 0.0,
        "decisions_per_s": tally.decisions / elapsed if elapsed > 0 else 0.0,
        "latency_ms": latency_ms(tally.latencies),
        "errors": dict(tally.errors),
        "error_count": sum(tally.errors.values()),
        "error_details": tally.error_details,
        "fallbacks": dict(tally.fallbacks),
        "fallback_count": sum(tally.fallbacks.values()),
        "outcomes": dict(tally.outcomes),
        "wrong": tally.wrong,
        "wrong_example": tally.wrong_example,
        "client_cpu_s": client_cpu_s,
    }
    if args.mode == "open":
        result |= {
            "offered_rate": args.rate,
            "arrivals": args.arrivals,
            "sent_per_s": calls / args.seconds,
            "send_lag_ms": latency_ms(tally.send_lags),
            "late_sends": tally.late_sends,
        }
    if args.mode == "batch":
        result["batch"] = args.batch
    return result


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No garbage collection in the block: what exists now is collected and frozen first, and the
    collector runs again after it (the window's cycles wait until then)."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def _emit(document: dict[str, Any]) -> None:
    print(json.dumps(document), flush=True)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, announce the window, measure it, announce its end; return the result."""
    requests = make_requests(max(_POOL, args.batch * 2), args.seed, args.text)
    expect = read_expected(args.expect) if args.expect else None
    caller: Caller
    if args.protocol == "v2":
        from bench.peers.v2_caller import V2Caller

        caller = V2Caller(args.target, args.model, args.channels, expect)
    else:
        caller = Caller(args.target, args.pipeline, args.channels, expect)
    try:
        if args.mode == "batch":
            await batch_loop(caller, requests, args.batch, args.warmup, 60.0)
        elif args.warmup:
            await closed_loop(caller, requests, args.concurrency, args.warmup, 60.0)
        schedule = (
            arrivals(args.rate, args.seconds, args.arrivals == "poisson", args.seed)
            if args.mode == "open"
            else []
        )
        with collector_paused():
            _emit({"event": "start"})
            cpu, started = time.process_time(), time.perf_counter()
            if args.mode == "closed":
                tally = await closed_loop(caller, requests, args.concurrency, args.calls, args.seconds)
            elif args.mode == "open":
                tally = await open_loop(caller, requests, schedule)
            else:
                tally = await batch_loop(caller, requests, args.batch, args.calls, args.seconds)
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
            _emit({"event": "end"})
    finally:
        await caller.close()
    return report(args, tally, elapsed, cpu)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True, help="HOST:PORT of the gRPC server")
    parser.add_argument("--pipeline", required=True, help="sent as the 'application' metadata")
    parser.add_argument("--mode", choices=("closed", "open", "batch"), default="closed")
    parser.add_argument("-c", "--concurrency", type=int, default=1, help="closed loop: calls in flight")
    parser.add_argument("--calls", type=int, default=1000, help="closed/batch: calls in the window (at most)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the window (at most)")
    parser.add_argument("--rate", type=float, default=100.0, help="open loop: calls per second offered")
    parser.add_argument("--arrivals", choices=("poisson", "fixed"), default="poisson")
    parser.add_argument("--batch", type=int, default=1000, help="batch: rows per DecideBatch")
    parser.add_argument(
        "--channels", type=int, default=DEFAULT_CHANNELS, help="channels shared by tasks, one connection each"
    )
    parser.add_argument("--warmup", type=int, default=50, help="untimed calls first")
    parser.add_argument("--text", action="store_true", help="send each row's message (pipelines with an LLM)")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--expect", type=Path, help="reference answers to check every answer against")
    parser.add_argument("--protocol", choices=("riskserve", "v2"), default="riskserve")
    parser.add_argument("--model", default="decision", help="v2: the model making the whole decision")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _emit(asyncio.run(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
