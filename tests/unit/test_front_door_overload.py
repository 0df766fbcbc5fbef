"""Overload at the front door is a prompt RESOURCE_EXHAUSTED, never a queue that outlives its deadlines:
calls past ``max_concurrent_calls`` are refused by grpc before any handler runs, while calls reach the
handlers having waited in a queue that stands in front of them (``max_queue_wait_ms``) those that waited
are refused, and while the event loop runs behind (``max_loop_lag_ms``) new decisions are refused until it
catches up."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence

import grpc
import pytest

from riskserve.platform.errors import Overloaded
from riskserve.platform.metrics import PipelineMetrics
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb
from riskserve.proto.riskserve.v1 import risk_pipeline_pb2_grpc as pb_grpc
from riskserve.schema.pipeline import FrontDoorSpec
from riskserve.serving.frontdoor import Admission, FrontDoor
from riskserve.serving.messages import response_maker
from riskserve.serving.tokens import Caller

NAME = "overload"


class HeldPipeline:
    """Decides only once :attr:`hold` is set (so calls stay in flight as long as the test wants)."""

    name = NAME
    decision_timeout_ms = 20_000.0

    def __init__(self) -> None:
        self.metrics = PipelineMetrics(NAME)
        self.hold: asyncio.Event | None = None
        self.in_flight = 0

    async def decide(
        self,
        requests: Sequence[pb.DecideRequest],
        trace_id: str,
        deadline: float,
        traced: bool,
        into: pb.DecideBatchResponse | None = None,
    ) -> list[pb.DecideResponse]:
        self.in_flight += 1
        try:
            if self.hold is not None:
                await self.hold.wait()
            make = response_maker(into)
            return [make(request_id=r.request_id, pipeline=NAME) for r in requests]
        finally:
            self.in_flight -= 1

    async def describe(self) -> pb.DescribeResponse:
        return pb.DescribeResponse(pipeline=NAME)

    async def feedback(
        self, request: pb.FeedbackRequest, caller: Caller | None, deadline: float
    ) -> pb.FeedbackResponse:
        return pb.FeedbackResponse(accepted=True)


@pytest.fixture
def door() -> Iterator[tuple[asyncio.AbstractEventLoop, HeldPipeline, str]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    pipeline = HeldPipeline()
    settings = FrontDoorSpec.model_validate({"port": 1, "max_concurrent_calls": 2}).model_copy(
        update={"port": 0}
    )
    front = FrontDoor(pipeline, settings, Admission(16, 16))
    port = asyncio.run_coroutine_threadsafe(front.start(), loop).result(timeout=30)
    try:
        yield loop, pipeline, f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(front.stop(0), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def test_calls_past_max_concurrent_calls_are_refused_at_once_while_the_others_run(
    door: tuple[asyncio.AbstractEventLoop, HeldPipeline, str],
) -> None:
    loop, pipeline, target = door
    hold = asyncio.run_coroutine_threadsafe(_event(), loop).result()
    pipeline.hold = hold
    metadata = (("application", NAME),)
    # A connection each, so HTTP/2's per-connection stream cap plays no part: this is the replica's limit.
    channels = [
        grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(5)
    ]
    try:
        stubs = [pb_grpc.RiskPipelineStub(c) for c in channels]  # type: ignore[no-untyped-call]
        held = [stubs[i].Decide.future(pb.DecideRequest(request_id=f"h{i}"), metadata=metadata, timeout=20)
                for i in range(2)]  # fmt: skip
        deadline = time.monotonic() + 10
        while pipeline.in_flight < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for stub in stubs[2:]:
            with pytest.raises(grpc.RpcError) as refused:
                stub.Decide(pb.DecideRequest(request_id="more"), metadata=metadata, timeout=20)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not any(call.done() for call in held), "refused while the two admitted calls still ran"
        loop.call_soon_threadsafe(hold.set)
        assert [call.result().request_id for call in held] == ["h0", "h1"]
        assert stubs[4].Decide(
            pb.DecideRequest(request_id="after"), metadata=metadata, timeout=20
        ).request_id == ("after")
    finally:
        for channel in channels:
            channel.close()


async def _event() -> asyncio.Event:
    return asyncio.Event()


def test_decisions_are_refused_while_the_event_loop_runs_behind_and_admitted_once_it_caught_up() -> None:
    async def scenario() -> None:
        admission = Admission(16, 16, max_lag_s=0.1)
        watcher = asyncio.get_running_loop().create_task(admission.watch_lag())
        await asyncio.sleep(0.12)
        async with admission.slot(time.monotonic() + 5):
            pass  # an idle loop admits
        time.sleep(0.3)  # fault injected: the loop is blocked (as by a backlog of work) for 300 ms
        await asyncio.sleep(0.01)  # the lag probe (due long ago) wakes first, 300 ms late
        async with admission.slot(time.monotonic() + 5):
            pass  # once is not sustained: the process may just not have had a CPU
        time.sleep(0.3)  # and again: the loop runs behind
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded, match="behind"):
            async with admission.slot(time.monotonic() + 5):
                pass
        await asyncio.sleep(0.12)  # the next probes wake on time
        async with admission.slot(time.monotonic() + 5):
            pass
        watcher.cancel()

    asyncio.run(scenario())


def test_a_standing_queue_in_front_of_the_handlers_is_seen_and_a_burst_is_not() -> None:
    admission = Admission(16, 16, max_wait_s=0.25)
    t = 1000.0
    for at, waited in ((0.0, 0.4), (0.05, 0.3), (0.1, 0.01)):  # a burst after a stall drains in its interval
        admission.arrived(waited, t + at)
    admission.arrived(0.5, t + 0.201)  # the next interval begins: the last one's least wait stands
    assert admission.standing_s == 0.01
    for at, waited in ((0.25, 0.6), (0.3, 0.55), (0.35, 0.7)):  # every call of an interval waited long
        admission.arrived(waited, t + at)
    admission.arrived(0.65, t + 0.402)
    assert admission.standing_s == 0.5
    admission.arrived(0.65, t + 1.5)  # no call for a whole interval: no queue
    assert admission.standing_s == 0.0


def test_while_a_queue_stands_the_decisions_that_waited_in_it_are_refused_and_prompt_ones_admitted() -> None:
    """Through the real front door: the calls' waits are what their ``riskserve-timeout-ms`` budget says
    beyond their gRPC deadline (fault injected: a budget 20 s longer reads as a 20 s wait in front of the
    replica), the intervals by an injected clock."""

    async def scenario() -> list[str]:
        now = [0.0]
        pipeline = HeldPipeline()
        settings = FrontDoorSpec.model_validate({"port": 1}).model_copy(update={"port": 0})
        front = FrontDoor(pipeline, settings, Admission(16, 16, max_wait_s=0.25, clock=lambda: now[0]))
        port = await front.start()
        outcomes = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.RiskPipelineStub(channel)  # type: ignore[no-untyped-call]

                async def decide(budget_ms: int) -> str:
                    metadata = (("application", NAME), ("riskserve-timeout-ms", str(budget_ms)))
                    try:
                        await stub.Decide(pb.DecideRequest(request_id="r"), metadata=metadata, timeout=10)
                    except grpc.aio.AioRpcError as error:
                        return f"{error.code().name}: {error.details()}"
                    return "OK"

                outcomes.append(await decide(30_000))  # the first interval: nothing seen to stand yet
                now[0] = 0.3
                outcomes.append(await decide(30_000))  # the interval that ended had only calls that waited
                outcomes.append(await decide(10_000))  # this one came in at once: decided
                now[0] = 0.55
                outcomes.append(await decide(30_000))  # its interval had a prompt call: the queue drained
        finally:
            await front.stop(0)
        return outcomes

    first, refused, prompt, drained = asyncio.run(scenario())
    assert (first, prompt, drained) == ("OK", "OK", "OK")
    assert refused.startswith("RESOURCE_EXHAUSTED: overloaded: calls wait 20")
    assert "max_queue_wait_ms 250" in refused
