"""Adaptive batching of text calls for a model in its own deployment (``batching:`` in the YAML).

Concurrent calls' texts reach the backend as one call of up to ``max_batch_size`` texts, each call
getting back its own slice; Serve's ``@serve.batch`` forms the batches, built per replica because its
settings are fixed when it wraps a function. With ``wait_only_when_busy`` (the default) a batch waits for
more texts only while another batch is in the backend: Serve reads its wait when a batch's first text
arrives, and this module sets it to ``max_wait_ms`` when a batch enters the backend and to 0 when the last
one leaves.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ray import serve

from riskserve.platform.runner import ModelAnswer

TextsCall = Callable[[list[str]], Awaitable[ModelAnswer]]
"""Label a list of texts: the runner's ``predict_texts``."""


def _texts_in(calls: list[list[str]]) -> int:
    return sum(len(texts) for texts in calls)


def batched_texts(predict_texts: TextsCall, batching: dict[str, Any]) -> TextsCall:
    """``predict_texts`` behind Serve's batcher: ``batching`` is a ``BatchingSpec`` dumped
    (``max_batch_size`` counted in texts, ``max_wait_ms``, ``max_concurrent_batches``,
    ``wait_only_when_busy``)."""
    max_wait_s = float(batching["max_wait_ms"]) / 1e3
    adaptive = bool(batching.get("wait_only_when_busy", True))
    in_backend = 0

    async def together(calls: list[list[str]]) -> list[ModelAnswer]:
        """Concurrent calls' texts as one backend call, split back per call."""
        nonlocal in_backend
        flat = [text for texts in calls for text in texts]
        in_backend += 1
        if adaptive and in_backend == 1:
            batcher.set_batch_wait_timeout_s(max_wait_s)  # type: ignore[attr-defined]
        try:
            whole = await predict_texts(flat)
        finally:
            in_backend -= 1
            if adaptive and in_backend == 0:
                batcher.set_batch_wait_timeout_s(0.0)  # type: ignore[attr-defined]
        answers, start = [], 0
        for texts in calls:
            end = start + len(texts)
            answers.append(
                ModelAnswer(
                    model=whole.model,
                    version=whole.version,
                    scores=whole.scores[start:end],
                    labels=None if whole.labels is None else whole.labels[start:end],
                    latency_ms=whole.latency_ms,
                    extra={**whole.extra, "batched_with": len(flat)},
                )
            )
            start = end
        return answers

    batcher: TextsCall = serve.batch(
        max_batch_size=int(batching["max_batch_size"]),
        batch_wait_timeout_s=0.0 if adaptive else max_wait_s,
        max_concurrent_batches=int(batching.get("max_concurrent_batches", 1)),
        batch_size_fn=_texts_in,
    )(together)
    return batcher
