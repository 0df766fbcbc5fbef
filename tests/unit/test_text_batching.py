"""Adaptive batching of text calls (``batching:``): Serve's real batcher groups concurrent calls' texts
into one backend call, hands each call its own slice, and runs as many batches at once as
``max_concurrent_batches`` allows. The backend here records what reaches it and labels each text by a
fixed rule, so a slice handed to the wrong call shows."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from riskserve.platform.runner import ModelAnswer
from riskserve.schema.pipeline import BatchingSpec
from riskserve.serving.text_batching import batched_texts


@pytest.fixture(autouse=True)
def replica_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve's batch queue reads its replica's ``max_ongoing_requests`` when it starts; outside a replica
    that context is given here, as ``operations/app.py`` sizes it (batch size x concurrent batches)."""
    from ray import serve

    config = SimpleNamespace(max_ongoing_requests=64)
    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(_deployment_config=config))


class RecordingBackend:
    """Labels a text with its upper case and scores it by its length; counts calls and overlap."""

    def __init__(self, hold_s: float = 0.0) -> None:
        self.calls: list[list[str]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.hold_s = hold_s

    async def predict_texts(self, texts: list[str]) -> ModelAnswer:
        self.calls.append(list(texts))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(self.hold_s)
        self.in_flight -= 1
        return ModelAnswer(
            model="intent",
            version="v1",
            scores=[float(len(t)) for t in texts],
            labels=[t.upper() for t in texts],
            latency_ms=1.0,
        )


def test_concurrent_calls_share_one_backend_call_and_each_gets_its_own_texts() -> None:
    backend = RecordingBackend()
    batching = BatchingSpec(max_batch_size=8, max_wait_ms=200).model_dump()
    calls = [["a"], ["bb", "ccc"], ["dddd"], ["eeeee", "f", "gg"]]  # 7 texts, under one batch of 8

    async def main() -> list[ModelAnswer]:
        predict = batched_texts(backend.predict_texts, batching)
        return await asyncio.gather(*(predict(texts) for texts in calls))

    answers = asyncio.run(main())
    assert len(backend.calls) == 1
    assert sorted(backend.calls[0]) == sorted(t for texts in calls for t in texts)
    for texts, answer in zip(calls, answers, strict=True):
        assert answer.labels == [t.upper() for t in texts]
        assert answer.scores == [float(len(t)) for t in texts]
        assert answer.extra["batched_with"] == 7


@pytest.mark.parametrize("concurrent_batches", [1, 3])
def test_batches_in_the_backend_at_once_follow_max_concurrent_batches(concurrent_batches: int) -> None:
    backend = RecordingBackend(hold_s=0.05)
    spec = BatchingSpec(max_batch_size=2, max_wait_ms=1, max_concurrent_batches=concurrent_batches)

    async def main() -> list[ModelAnswer]:
        predict = batched_texts(backend.predict_texts, spec.model_dump())
        return await asyncio.gather(*(predict([f"t{i}"]) for i in range(6)))

    answers = asyncio.run(main())
    assert [a.labels for a in answers] == [[f"T{i}"] for i in range(6)]
    assert all(len(call) <= 2 for call in backend.calls)
    assert backend.most_in_flight == concurrent_batches


def test_max_concurrent_batches_is_bounded_and_defaults_to_two() -> None:
    """Two: the next batch forms while one is in the engine (one at a time cost throughput)."""
    assert BatchingSpec().max_concurrent_batches == 2
    with pytest.raises(ValueError, match="max_concurrent_batches"):
        BatchingSpec(max_concurrent_batches=0)


class StampingBackend(RecordingBackend):
    """A :class:`RecordingBackend` that also notes when each call reached it (the loop's clock)."""

    def __init__(self, hold_s: float = 0.0) -> None:
        super().__init__(hold_s)
        self.reached: list[float] = []

    async def predict_texts(self, texts: list[str]) -> ModelAnswer:
        self.reached.append(asyncio.get_running_loop().time())
        return await super().predict_texts(texts)


@pytest.mark.parametrize("wait_only_when_busy", [True, False])
def test_a_text_for_an_idle_backend_waits_only_under_serves_own_rule(wait_only_when_busy: bool) -> None:
    """One call, the backend idle: by default it reaches the backend at once; with Serve's own rule it
    waits out ``max_wait_ms`` (0.4 s here, so the two cannot be confused on a slow machine)."""
    backend = StampingBackend()
    spec = BatchingSpec(max_batch_size=8, max_wait_ms=400, wait_only_when_busy=wait_only_when_busy)

    async def main() -> float:
        predict = batched_texts(backend.predict_texts, spec.model_dump())
        sent = asyncio.get_running_loop().time()
        answer = await predict(["alone"])
        assert answer.labels == ["ALONE"]
        return backend.reached[0] - sent

    waited = asyncio.run(main())
    if wait_only_when_busy:
        assert waited < 0.2
    else:
        assert waited >= 0.4


def test_texts_arriving_while_a_batch_is_in_the_backend_wait_for_each_other() -> None:
    """The first text finds the backend idle and goes alone; three more, 30 ms apart, arrive while it is
    in the backend (0.3 s) and wait up to ``max_wait_ms`` (0.2 s) for each other: one batch of three."""
    backend = StampingBackend(hold_s=0.3)
    spec = BatchingSpec(max_batch_size=8, max_wait_ms=200)

    async def main() -> list[ModelAnswer]:
        predict = batched_texts(backend.predict_texts, spec.model_dump())
        first = asyncio.ensure_future(predict(["first"]))
        later = []
        for i in range(3):
            await asyncio.sleep(0.03)
            later.append(asyncio.ensure_future(predict([f"later{i}"])))
        return await asyncio.gather(first, *later)

    answers = asyncio.run(main())
    assert backend.calls == [["first"], ["later0", "later1", "later2"]]
    assert [a.labels for a in answers] == [["FIRST"], ["LATER0"], ["LATER1"], ["LATER2"]]
    assert [a.extra["batched_with"] for a in answers] == [1, 3, 3, 3]
