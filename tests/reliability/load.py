"""A reconciling load client: steady ``Decide`` (and ``Feedback``) over real gRPC, one outcome per request.

Every request sent ends in exactly one recorded :class:`Outcome`: a decision (with or without model
fallbacks), a label acknowledgement, or a gRPC status; a call still unanswered ``HANG_GRACE_S`` past its
own deadline is recorded as ``HANG`` (it must never happen). A call answered ``UNAVAILABLE`` (nothing ran,
or its ingress replica died under it) is retried up to ``retries`` times, as a client should; every attempt
is kept, so the drills can count what the fault cost before the retry. A retry waits for the channel to be
ready (``wait_for_ready``): a reconnect that raced a dying replica's socket leaves the channel failing calls
at once for its reconnect backoff otherwise.

Labels are sent for a fraction of decisions, by their server-issued ``decision_id``; :meth:`LoadClient.
relabel` later sends every acknowledged label again with the same ``feedback_id``: a label the server
kept answers ``duplicate=true``, so a label acknowledged and then lost shows up as a fresh acceptance.

It runs its own event loop in a thread, so a test injects faults while the load goes on::

    with LoadClient(target, pipeline="p", rate=40) as load:
        ...  # kill something
    report = load.report()
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import grpc

from riskserve.demo.dataset import generate_transactions
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc

__all__ = ["DECISION", "HANG", "LABEL", "Attempt", "LoadClient", "Outcome", "Report", "requests"]

DECISION = "DECISION"
LABEL = "LABEL"
HANG = "HANG"
"""No answer by the call's deadline plus :data:`HANG_GRACE_S`: the one outcome no drill allows."""
HANG_GRACE_S = 2.0
RETRY_PAUSE_S = 0.05
FLOOD_BACKOFF_S = 0.2
"""A flood worker's pause after a refusal (RESOURCE_EXHAUSTED), as a client honouring the refusal would:
600 workers still offer up to 3,000 calls a second, several times what the overload drill's replicas take;
without it the refusals, answered at once, made the flood a busy loop that starved the client's own
process, which then delivered answers grpc had long ended past the drill's hang limit."""


@dataclass(frozen=True)
class Attempt:
    """One try of a request: when it was sent and answered (monotonic s) and what came back."""

    sent: float
    ended: float
    code: str
    """``OK`` or the gRPC status name (``UNAVAILABLE``, ...) or ``HANG``."""
    details: str = ""


@dataclass
class Outcome:
    """The one outcome of a request: its kind (``DECISION``/``LABEL`` or the final status) and attempts."""

    method: str
    request_id: str
    attempts: list[Attempt] = field(default_factory=list)
    kind: str = ""
    fallbacks: tuple[str, ...] = ()
    """Per model that fell back, ``model:REASON`` (a decision only)."""
    decision_id: str = ""
    duplicate: bool = False

    @property
    def sent(self) -> float:
        return self.attempts[0].sent

    @property
    def ended(self) -> float:
        return self.attempts[-1].ended

    @property
    def retried(self) -> bool:
        return len(self.attempts) > 1


@dataclass
class Report:
    """Everything a run recorded, with the counts the drills assert on."""

    outcomes: list[Outcome]
    started: float
    ended: float

    def of(self, method: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.method == method]

    def kinds(self, method: str = "Decide") -> collections.Counter[str]:
        """Final outcomes by kind (``DECISION``, ``LABEL``, or a status name)."""
        return collections.Counter(o.kind for o in self.of(method))

    def attempt_codes(self, method: str = "Decide") -> collections.Counter[str]:
        """Every attempt's answer (``OK`` or a status), retries included."""
        return collections.Counter(a.code for o in self.of(method) for a in o.attempts)

    def fallbacks(self) -> collections.Counter[str]:
        """Fallbacks by ``model:REASON`` across the decisions."""
        return collections.Counter(f for o in self.of("Decide") for f in o.fallbacks)

    def failures(
        self,
        allowed: Iterable[str],
        method: str = "Decide",
        within: Callable[[Outcome], bool] = lambda o: True,
    ) -> list[Outcome]:
        """Requests whose final outcome is not in ``allowed`` (and matches ``within``)."""
        permitted = set(allowed)
        return [o for o in self.of(method) if o.kind not in permitted and within(o)]

    def acknowledged_labels(self) -> list[Outcome]:
        return [o for o in self.of("Feedback") if o.kind == LABEL and not o.duplicate]

    def summary(self) -> dict[str, object]:
        """Counts for a log line or RELIABILITY.md."""
        return {
            "seconds": round(self.ended - self.started, 1),
            "decide": dict(self.kinds("Decide")),
            "decide_attempts": dict(self.attempt_codes("Decide")),
            "fallbacks": dict(self.fallbacks()),
            "feedback": dict(self.kinds("Feedback")),
            "feedback_attempts": dict(self.attempt_codes("Feedback")),
            "retried": sum(o.retried for o in self.outcomes),
            "statuses": dict(
                collections.Counter(
                    f"{a.code}: {a.details}" for o in self.outcomes for a in o.attempts if a.code != "OK"
                ).most_common(4)
            ),
        }


def requests(seed: int = 0, count: int = 4096) -> Iterator[pb.DecideRequest]:
    """Valid tabular requests (the demo's transactions), cycled forever with fresh request ids."""
    tx = generate_transactions(count, seed=seed)
    rows = [tx.row(i) for i in range(count)]
    for n in itertools.count():
        row = rows[n % count]
        yield pb.DecideRequest(
            request_id=f"load-{seed}-{n}",
            numeric={k: float(v) for k, v in row.items() if isinstance(v, float)},
            categorical={k: str(row[k]) for k in ("merchant_category", "channel")},
        )


class LoadClient:
    """Steady open-loop load: ``rate`` Decide calls a second (fixed interval), whatever the answers do.

    ``label_every``: one decision in this many gets a label (``Feedback`` by ``decision_id``) right after
    its answer; 0 sends none. ``channels``: connections the calls are spread over (each is one HTTP/2
    connection, which the kernel gives one ingress replica); ``retries``: tries after an ``UNAVAILABLE``.
    """

    def __init__(
        self,
        target: str,
        *,
        pipeline: str,
        rate: float,
        deadline_s: float = 5.0,
        label_every: int = 0,
        channels: int = 2,
        retries: int = 3,
        seed: int = 0,
        label_source: str = "reliability",
        concurrency: int = 0,
    ) -> None:
        """``concurrency`` > 0: closed loop instead (a flood): that many workers, each sending its next call
        as soon as the one before it ends (:data:`FLOOD_BACKOFF_S` after a refusal), ``rate`` ignored."""
        self.target, self.pipeline, self.rate = target, pipeline, rate
        self.deadline_s, self.label_every, self.retries = deadline_s, label_every, retries
        self._channels_count = channels
        self._concurrency = concurrency
        self._requests = requests(seed)
        self._source = label_source
        self._outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = self._ended = 0.0
        self._error: BaseException | None = None
        self._run_id = f"{seed}-{int(time.time() * 1000) % 10**9}"

    # -- lifecycle --------------------------------------------------------------------------------------

    def __enter__(self) -> LoadClient:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="load-client", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sending and wait for every call in flight to end (each has its deadline)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.deadline_s * (self.retries + 2) + 30)
            assert not self._thread.is_alive(), "the load client did not finish its calls"
        if self._error is not None:
            raise self._error

    def report(self) -> Report:
        return Report(list(self._outcomes), self._started, self._ended)

    def relabel(self, report: Report) -> list[Outcome]:
        """Send every acknowledged label of ``report`` again (same ids); returns the outcomes. A label the
        server kept answers ``duplicate=true``."""
        acked = report.acknowledged_labels()

        async def run() -> list[Outcome]:
            channel = grpc.aio.insecure_channel(self.target)
            stub = pb_grpc.RiskPipelineStub(channel)  # type: ignore[no-untyped-call]
            try:
                again = []
                for label in acked:
                    request = pb.FeedbackRequest(
                        decision_id=label.decision_id, label=self._label_of(label.request_id),
                        feedback_id=label.request_id, source=self._source,
                    )  # fmt: skip
                    again.append(await self._call(stub, "Feedback", request, label.request_id))
                return again
            finally:
                await channel.close()

        return asyncio.run(run())

    # -- the load -------------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            asyncio.run(self._drive())
        except BaseException as error:  # surfaced by stop()
            self._error = error

    async def _drive(self) -> None:
        # Each channel its own connection (grpc would share one between channels to the same target), so
        # the kernel spreads them over the ingress replicas sharing the port.
        options = [("grpc.use_local_subchannel_pool", 1)]
        channels = [
            grpc.aio.insecure_channel(self.target, options=options) for _ in range(self._channels_count)
        ]
        stubs = [pb_grpc.RiskPipelineStub(c) for c in channels]  # type: ignore[no-untyped-call]
        tasks: set[asyncio.Task[None]] = set()
        interval = 1.0 / self.rate
        self._started = time.monotonic()
        try:
            if self._concurrency:
                counter = itertools.count()

                async def worker() -> None:
                    while not self._stop.is_set():
                        n = next(counter)
                        if await self._one(stubs[n % len(stubs)], n) == "RESOURCE_EXHAUSTED":
                            await asyncio.sleep(FLOOD_BACKOFF_S)

                await asyncio.gather(*(worker() for _ in range(self._concurrency)))
                return
            for n in itertools.count():
                due = self._started + n * interval
                pause = due - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)
                if self._stop.is_set():
                    break
                task = asyncio.get_running_loop().create_task(self._one(stubs[n % len(stubs)], n))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            self._ended = time.monotonic()
            for channel in channels:
                await channel.close()

    def _label_of(self, feedback_id: str) -> int:
        return zlib.crc32(feedback_id.encode()) % 2  # relabel sends the same verdict again

    async def _one(self, stub: pb_grpc.RiskPipelineStub, n: int) -> str:
        """One decision (and its label, if due); returns the decision's outcome kind."""
        request = next(self._requests)
        decided = await self._call(stub, "Decide", request, request.request_id)
        if self.label_every and n % self.label_every == 0 and decided.kind == DECISION:
            feedback_id = f"fb-{self._run_id}-{n}"
            label = pb.FeedbackRequest(
                decision_id=decided.decision_id, label=self._label_of(feedback_id), feedback_id=feedback_id,
                source=self._source,
            )  # fmt: skip
            labelled = await self._call(stub, "Feedback", label, feedback_id)
            labelled.decision_id = decided.decision_id
        return decided.kind

    async def _call(self, stub: pb_grpc.RiskPipelineStub, method: str, request: object, key: str) -> Outcome:
        outcome = Outcome(method=method, request_id=key)
        self._outcomes.append(outcome)
        metadata = (("application", self.pipeline), ("riskserve-timeout-ms", f"{self.deadline_s * 1e3:.0f}"))
        for attempt in range(self.retries + 1):
            sent = time.monotonic()
            try:
                # A retry waits for the channel to connect again (within its deadline): right after a
                # replica died, a reconnect can hit its closing socket, and the channel then fails calls
                # at once for its reconnect backoff (1 s) unless they wait for it.
                call = getattr(stub, method)(
                    request, metadata=metadata, timeout=self.deadline_s, wait_for_ready=attempt > 0
                )
                answer = await asyncio.wait_for(call, timeout=self.deadline_s + HANG_GRACE_S)
            except grpc.aio.AioRpcError as error:
                code, details = error.code().name, str(error.details() or "")[:80]
            except TimeoutError:
                code, details = HANG, ""
            else:
                outcome.attempts.append(Attempt(sent, time.monotonic(), "OK"))
                if method == "Decide":
                    outcome.kind, outcome.decision_id = DECISION, answer.decision_id
                    outcome.fallbacks = tuple(
                        f"{m.model}:{m.fallback_reason}" for m in answer.models if m.fallback
                    )
                else:
                    outcome.kind, outcome.duplicate = LABEL, bool(answer.duplicate)
                return outcome
            outcome.attempts.append(Attempt(sent, time.monotonic(), code, details))
            outcome.kind = code
            if code != "UNAVAILABLE" or attempt == self.retries:
                return outcome
            await asyncio.sleep(RETRY_PAUSE_S)
        return outcome
