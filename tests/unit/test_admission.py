"""The front door's admission: ``ongoing`` decisions at once, ``queued`` more wait within their deadline,
the rest are refused at once (RESOURCE_EXHAUSTED); a slot is given back however the decision ends."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from riskserve.platform.errors import DeadlineExceeded, Overloaded
from riskserve.serving.frontdoor import Admission


async def _hold(admission: Admission, release: asyncio.Event, deadline: float) -> str:
    async with admission.slot(deadline):
        await release.wait()
    return "done"


def test_ongoing_run_queued_wait_the_rest_are_refused_at_once() -> None:
    asyncio.run(_test_ongoing_run_queued_wait_the_rest_are_refused_at_once())


async def _test_ongoing_run_queued_wait_the_rest_are_refused_at_once() -> None:
    admission = Admission(ongoing=2, queued=1)
    release = asyncio.Event()
    deadline = time.monotonic() + 5
    running = [asyncio.create_task(_hold(admission, release, deadline)) for _ in range(3)]
    await asyncio.sleep(0.01)  # two hold slots, the third waits in the queue
    with pytest.raises(Overloaded) as refused:
        async with admission.slot(deadline):
            pytest.fail("a fourth decision was admitted past ongoing + queued")
    assert refused.value.grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED
    release.set()
    assert await asyncio.gather(*running) == ["done"] * 3
    async with admission.slot(deadline):  # everything was given back
        assert admission._admitted == 1
    assert admission._admitted == 0


def test_a_queued_decision_gives_up_at_its_deadline_and_its_place() -> None:
    asyncio.run(_test_a_queued_decision_gives_up_at_its_deadline_and_its_place())


async def _test_a_queued_decision_gives_up_at_its_deadline_and_its_place() -> None:
    admission = Admission(ongoing=1, queued=5)
    release = asyncio.Event()
    holder = asyncio.create_task(_hold(admission, release, time.monotonic() + 5))
    await asyncio.sleep(0.01)
    with pytest.raises(DeadlineExceeded):
        async with admission.slot(time.monotonic() + 0.05):
            pytest.fail("admitted while the only slot was held")
    assert admission._admitted == 1  # only the holder
    release.set()
    await holder
    assert admission._admitted == 0


def test_a_slot_is_given_back_when_the_decision_fails() -> None:
    asyncio.run(_test_a_slot_is_given_back_when_the_decision_fails())


async def _test_a_slot_is_given_back_when_the_decision_fails() -> None:
    admission = Admission(ongoing=1, queued=0)
    with pytest.raises(ValueError, match="model broke"):
        async with admission.slot(time.monotonic() + 5):
            raise ValueError("model broke")
    async with admission.slot(time.monotonic() + 5):  # the one slot is free again
        pass
    assert admission._admitted == 0
