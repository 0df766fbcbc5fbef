"""One thread that drives a vLLM ``LLMEngine`` inside this process, for any number of asyncio callers.

vLLM's ``AsyncLLM`` always runs its engine core in a second process, and each request then crosses a
ZeroMQ socket both ways: about 4 ms a request on this project's 2-core machine (BENCHMARKS.md). Here the
engine core lives in the caller's process (``LLMEngine`` with multiprocessing off) and one thread owns
it: callers hand it batches through a queue, and before every engine step the thread adds all that is
queued, so concurrent callers still share vLLM's continuous batching as they did with ``AsyncLLM``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from riskserve.platform.errors import ModelUnavailable

__all__ = ["ENGINE_LOCK", "EngineDriver"]

_STOP_WAIT_S = 30.0

ENGINE_LOCK = threading.RLock()
"""Held for every forward pass and every engine start in this process: vLLM keeps the pass's context (and,
while an engine starts, its config and the environment it reads) in process-wide variables, so a second
engine of the same process (a swap's candidate starting while the serving one steps) must never run at
the same time: when they did, the candidate's start failed ("Forward context is not set")."""


@dataclass(eq=False)
class _Batch:
    """Prompts one caller waits for together; ``outputs`` fills in as requests finish, in any order."""

    build: Callable[[], Sequence[Any]]
    """Makes the engine prompts; runs on the engine thread, so its errors (a prompt too long) fail only
    this batch and the caller's event loop never tokenizes."""
    params: Any
    future: concurrent.futures.Future[list[Any]]
    request_ids: list[str] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    remaining: int = 0


@dataclass(frozen=True, eq=False)
class _Abort:
    """The caller gave up (a timeout or a cancelled decision): take its requests out of the engine."""

    batch: _Batch


class EngineDriver:
    """Owns a vLLM ``LLMEngine`` from one thread: :meth:`run` from any event loop, :meth:`stop` once."""

    def __init__(self, engine: Any, name: str) -> None:
        """``engine``: a ``vllm.v1.engine.llm_engine.LLMEngine``; ``name`` prefixes request ids and the
        thread's name."""
        self.engine = engine
        self._name = name
        self._inbox: queue.SimpleQueue[_Batch | _Abort | None] = queue.SimpleQueue()
        self._live: dict[str, tuple[_Batch, int]] = {}
        self._ids = itertools.count()
        self._failure: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"vllm-engine-{name}", daemon=True)
        self._thread.start()

    async def run(self, build: Callable[[], Sequence[Any]], params: Any) -> list[Any]:
        """The engine's final ``RequestOutput`` for every prompt ``build()`` makes, in order.

        Raises:
            ModelUnavailable: the engine stopped or failed.
            Exception: whatever ``build`` raised.
        """
        if self._failure is not None or not self._thread.is_alive():
            raise ModelUnavailable(f"model '{self._name}': the engine is not running ({self._failure})")
        batch = _Batch(build=build, params=params, future=concurrent.futures.Future())
        batch.future.add_done_callback(lambda done: self._abort_if_cancelled(batch))
        self._inbox.put(batch)
        return await asyncio.wrap_future(batch.future)

    @property
    def in_flight(self) -> int:
        """Requests the engine holds for callers now (0 once every call ended, cancelled ones too)."""
        return len(self._live)

    def _abort_if_cancelled(self, batch: _Batch) -> None:
        if batch.future.cancelled():
            self._inbox.put(_Abort(batch))

    def stop(self) -> None:
        """Fail what is in flight with ``ModelUnavailable`` and end the thread (blocking; idempotent)."""
        self._inbox.put(None)
        self._thread.join(timeout=_STOP_WAIT_S)

    # -- the engine thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopping:
                if not self._live:  # idle: sleep until work comes
                    self._take(self._inbox.get())
                self._take_queued()  # busy: everything queued joins the next step
                if self._live and not self._stopping:
                    with ENGINE_LOCK:
                        outputs = self.engine.step()
                    self._finish(outputs)
        except BaseException as error:  # the engine died: every caller must hear of it
            self._failure = error
        finally:
            self._fail_all(self._failure)

    def _take_queued(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._take(item)

    def _take(self, item: _Batch | _Abort | None) -> None:
        if item is None:
            self._stopping = True
            return
        if isinstance(item, _Abort):
            live = [rid for rid in item.batch.request_ids if rid in self._live]
            for rid in live:
                del self._live[rid]
            if live:
                self.engine.abort_request(live)
            return
        batch = item
        if batch.future.done():  # cancelled while queued
            return
        try:
            prompts = list(batch.build())
            batch.outputs = [None] * len(prompts)
            for index, prompt in enumerate(prompts):
                rid = f"{self._name}-{next(self._ids)}"
                self.engine.add_request(rid, prompt, batch.params)
                batch.request_ids.append(rid)
                self._live[rid] = (batch, index)
        except Exception as error:
            self._take(_Abort(batch))
            _settle(batch.future, error=error)
            return
        batch.remaining = len(prompts)
        if not prompts:
            _settle(batch.future, result=[])

    def _finish(self, outputs: Sequence[Any]) -> None:
        for output in outputs:
            if not output.finished:
                continue
            entry = self._live.pop(output.request_id, None)
            if entry is None:  # aborted meanwhile
                continue
            batch, index = entry
            batch.outputs[index] = output
            batch.remaining -= 1
            if batch.remaining == 0:
                _settle(batch.future, result=batch.outputs)

    def _fail_all(self, failure: BaseException | None) -> None:
        reason = "the engine stopped" if failure is None else f"the engine failed: {failure!r}"
        error = ModelUnavailable(f"model '{self._name}': {reason}")
        batches = {batch for batch, _ in self._live.values()}
        self._live.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Batch):
                batches.add(item)
        for batch in batches:
            _settle(batch.future, error=error)


def _settle(
    future: concurrent.futures.Future[list[Any]],
    result: list[Any] | None = None,
    error: BaseException | None = None,
) -> None:
    """Complete ``future`` unless its caller cancelled it meanwhile (a race the caller has already lost)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result or [])
    except concurrent.futures.InvalidStateError:
        pass
