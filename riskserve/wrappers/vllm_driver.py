"""Drives a vLLM ``LLMEngine`` inside this process from the callers' event loop, for any number of callers.

vLLM's ``AsyncLLM`` always runs its engine core in a second process, and each request then crosses a
ZeroMQ socket both ways: about 4 ms a request on this project's 2-core machine (BENCHMARKS.md). Here the
engine core lives in the caller's process (``LLMEngine`` with multiprocessing off), and its steps run on
the event loop that serves the callers (in a model replica, the loop of its lane), one step per loop
callback. Before every step all that was submitted meanwhile is added, so concurrent callers share vLLM's
continuous batching, and between two steps the loop serves its sockets and timers.

Why not a thread of its own (as before): the engine's step is mostly Python, so it holds the GIL the
event loop needs to take and answer calls. Each call then paid two thread hand-offs (loop to engine
thread, engine thread back to the loop) and the GIL passed back and forth during every step; under open
load on two cores those hand-offs, not the model, made the tail (BENCHMARKS.md, *The LLM's tail*).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from riskserve.platform.errors import ModelUnavailable

__all__ = ["EngineDriver"]

_STOP_WAIT_S = 30.0


@dataclass(eq=False)
class _Batch:
    """Prompts one caller waits for together; ``outputs`` fills in as requests finish, in any order."""

    build: Callable[[], Sequence[Any]]
    """Makes the engine prompts; runs when the batch joins the engine, so its errors (a prompt too long)
    fail only this batch."""
    params: Any
    future: concurrent.futures.Future[list[Any]]
    request_ids: list[str] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    remaining: int = 0


class EngineDriver:
    """Owns a vLLM ``LLMEngine`` and steps it on one event loop: :meth:`run` from any loop, :meth:`stop`
    from any thread (once the engine is not needed)."""

    def __init__(self, engine: Any, name: str) -> None:
        """``engine``: a ``vllm.v1.engine.llm_engine.LLMEngine``; ``name`` prefixes request ids."""
        self.engine = engine
        self._name = name
        self._live: dict[str, tuple[_Batch, int]] = {}
        self._submitted: list[_Batch] = []
        self._aborted: list[_Batch] = []
        self._ids = itertools.count()
        self._failure: BaseException | None = None
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop the steps run on: the first caller's, until it closes or idles (see :meth:`_owner`)."""
        self._loop_thread: int | None = None
        self._step_scheduled = False

    async def run(self, build: Callable[[], Sequence[Any]], params: Any) -> list[Any]:
        """The engine's final ``RequestOutput`` for every prompt ``build()`` makes, in order.

        Raises:
            ModelUnavailable: the engine stopped or failed.
            Exception: whatever ``build`` raised.
        """
        if self._failure is not None or self._stopped:
            raise ModelUnavailable(f"model '{self._name}': the engine is not running ({self._failure})")
        batch = _Batch(build=build, params=params, future=concurrent.futures.Future())
        batch.future.add_done_callback(lambda done: self._abort_if_cancelled(batch))
        owner = self._owner(asyncio.get_running_loop())
        if owner is asyncio.get_running_loop():
            self._submit(batch)
        else:  # another loop (another thread) owns the engine: hand the batch to it
            owner.call_soon_threadsafe(self._submit, batch)
        return await asyncio.wrap_future(batch.future)

    @property
    def in_flight(self) -> int:
        """Requests the engine holds for callers now (0 once every call ended, cancelled ones too)."""
        return len(self._live)

    def stop(self) -> None:
        """Fail what is in flight with ``ModelUnavailable`` and take no more; returns once no step runs,
        so the engine may then be shut down (blocking; idempotent; from any thread)."""
        loop = self._loop
        if (
            loop is None
            or loop.is_closed()
            or not loop.is_running()
            or threading.get_ident() == self._loop_thread  # called between two steps on the loop itself
        ):
            self._halt()
            return
        halted = threading.Event()

        def halt() -> None:
            self._halt()
            halted.set()

        try:
            loop.call_soon_threadsafe(halt)
        except RuntimeError:  # the loop closed meanwhile: no step can run
            self._halt()
            return
        halted.wait(timeout=_STOP_WAIT_S)

    # -- on the owning loop ---------------------------------------------------------------------------

    def _owner(self, current: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
        """The loop that steps the engine: ``current`` unless another open loop has work in the engine."""
        loop = self._loop
        busy = bool(self._live or self._submitted or self._step_scheduled)
        if loop is None or loop is current or loop.is_closed() or not (busy and loop.is_running()):
            if loop is not current:
                self._loop, self._loop_thread = current, threading.get_ident()
                self._step_scheduled = False  # a closed loop's pending step never runs
            return current
        return loop

    def _submit(self, batch: _Batch) -> None:
        if self._stopped:
            _settle(batch.future, error=self._unavailable())
            return
        self._submitted.append(batch)
        self._schedule()

    def _abort_if_cancelled(self, batch: _Batch) -> None:
        """The caller gave up (a timeout or a cancelled decision): take its requests out of the engine."""
        if not batch.future.cancelled():
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            self._aborted.append(batch)
            self._schedule()
        else:
            with contextlib.suppress(RuntimeError):  # closed meanwhile: nothing steps it any more
                loop.call_soon_threadsafe(self._abort_later, batch)

    def _abort_later(self, batch: _Batch) -> None:
        self._aborted.append(batch)
        self._schedule()

    def _schedule(self) -> None:
        """One step at the end of the loop's ready queue (calls and timers due meanwhile go first)."""
        if not self._step_scheduled and self._loop is not None:
            self._step_scheduled = True
            self._loop.call_soon(self._step)

    def _step(self) -> None:
        if asyncio.get_running_loop() is not self._loop:  # scheduled by a loop that no longer owns it
            return
        self._step_scheduled = False
        if self._stopped:
            return
        try:
            self._take_aborted()
            self._take_submitted()
            if self._live:
                self._finish(self.engine.step())
        except Exception as error:  # the engine died: every caller must hear of it
            self._failure = error
            self._halt()
            return
        if self._live or self._submitted or self._aborted:
            self._schedule()

    def _take_aborted(self) -> None:
        aborted, self._aborted = self._aborted, []
        for batch in aborted:
            live = [rid for rid in batch.request_ids if rid in self._live]
            for rid in live:
                del self._live[rid]
            if live:
                self.engine.abort_request(live)

    def _take_submitted(self) -> None:
        submitted, self._submitted = self._submitted, []
        for batch in submitted:
            if batch.future.done():  # cancelled before it joined
                continue
            try:
                prompts = list(batch.build())
                batch.outputs = [None] * len(prompts)
                for index, prompt in enumerate(prompts):
                    rid = f"{self._name}-{next(self._ids)}"
                    self.engine.add_request(rid, prompt, batch.params)
                    batch.request_ids.append(rid)
                    self._live[rid] = (batch, index)
            except Exception as error:
                live = [rid for rid in batch.request_ids if self._live.pop(rid, None) is not None]
                if live:
                    self.engine.abort_request(live)
                _settle(batch.future, error=error)
                continue
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

    def _unavailable(self) -> ModelUnavailable:
        failure = self._failure
        reason = "the engine stopped" if failure is None else f"the engine failed: {failure!r}"
        return ModelUnavailable(f"model '{self._name}': {reason}")

    def _halt(self) -> None:
        """Take no more work and fail every caller still waiting (on the owning loop, or with none)."""
        self._stopped = True
        error = self._unavailable()
        batches = {batch for batch, _ in self._live.values()} | set(self._submitted)
        self._live.clear()
        self._submitted.clear()
        self._aborted.clear()
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
