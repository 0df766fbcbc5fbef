"""The ingress side of the feedback log: decisions are buffered and written in one commit per flush.

A Decide must not wait for an fsync, so each ingress replica keeps the decisions it made in a bounded
buffer and sends them to the feedback service every ``flush_ms`` (one SQLite commit per send). A send
takes its records out of the buffer while it runs, so decisions added meanwhile are never mistaken for
sent ones; a send that fails (the service is restarting) puts its records back in front, to be retried.
The records kept (in flight and buffered) are bounded by ``buffer_rows``: once it is full, new decisions
are refused (counted in ``dropped`` and through ``on_drop``, which the ingress wires to the metric
``riskserve_decisions_unrecorded``); a record once accepted is never dropped, not even by an overflow
during a send or after a send fails. ``Feedback`` flushes first, so a label sent right after its decision
finds it. With a :class:`~riskserve.learning.journal.DecisionJournal`, what is buffered is also journaled
to local disk, so a replica killed with decisions unsent loses none: another replica adopts and sends them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from riskserve.learning.feedback_log import DecisionRecord
from riskserve.learning.journal import DecisionJournal

__all__ = ["DecisionRecorder"]

logger = logging.getLogger(__name__)
RETRY_S = 0.5
ADOPT_EVERY_S = 5.0
"""How often the journals of dead replicas are looked for (a ``listdir``)."""


class DecisionRecorder:
    """Bounded buffer of decisions with a background flusher on the running event loop."""

    def __init__(
        self,
        send: Callable[[list[DecisionRecord]], Awaitable[Any]],
        *,
        flush_s: float,
        max_rows: int,
        on_drop: Callable[[int], None] = lambda n: None,
        journal: DecisionJournal | None = None,
    ) -> None:
        self._send = send
        self._journal = journal
        self._flush_s = flush_s
        self._max_rows = max_rows
        self._on_drop = on_drop
        self._buffer: collections.deque[DecisionRecord] = collections.deque()
        self._in_flight = 0
        self._lock: asyncio.Lock | None = None
        self._task: asyncio.Task[None] | None = None
        self.sent = 0
        self.dropped = 0

    def add(self, records: list[DecisionRecord]) -> None:
        """Buffer decisions (called on the event loop); those past ``max_rows`` kept are refused and
        counted. The flusher starts with the first one."""
        room = max(self._max_rows - self.buffered, 0)
        accepted = records[:room]
        if self._journal is not None:
            self._journal.append(accepted)
        self._buffer.extend(accepted)
        self.drop(len(records) - room)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def drop(self, count: int) -> None:
        """Count ``count`` decisions that will never reach the log."""
        if count > 0:
            self.dropped += count
            self._on_drop(count)

    @property
    def buffered(self) -> int:
        """Decisions not sent yet (a send in progress included)."""
        return self._in_flight + len(self._buffer)

    async def flush(self) -> None:
        """Send every decision buffered now; raises if the feedback service cannot take them (they are
        kept, in front of any added meanwhile, for the next flush).

        A caller that stops waiting (a label's deadline) does not cancel the send: it runs in a task of
        its own and completes. Cancelling it would throw away a commit the service may already have made
        and put the whole batch back, so every later flush re-sent a bigger one while labels kept timing
        out under it (a slow moment of the service turned into labels failing for as long as load lasted).
        """
        task = asyncio.ensure_future(self._flush())
        task.add_done_callback(_retrieved)  # a waiter that left does not see its error: it is logged here
        await asyncio.shield(task)

    async def _flush(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            while self._buffer:
                covered = self._journal.rotate() if self._journal is not None else []
                batch = list(self._buffer)
                self._buffer.clear()  # out of reach of add()'s trimming while they are sent
                self._in_flight = len(batch)
                try:
                    await self._send(batch)
                except BaseException:
                    self._buffer.extendleft(reversed(batch))  # oldest first again
                    raise
                finally:
                    self._in_flight = 0
                self.sent += len(batch)
                if self._journal is not None:
                    self._journal.forget(covered)

    def adopt(self) -> int:
        """Buffer the decisions of dead replicas' journals (sent with the next flush); returns how many."""
        if self._journal is None:
            return 0
        records = self._journal.adopt()
        if records:
            self._buffer.extend(records)
            if self._task is None or self._task.done():
                self._task = asyncio.get_running_loop().create_task(self._run())
        return len(records)

    @property
    def recovered(self) -> int:
        """Decisions adopted from the journals of replicas that died."""
        return self._journal.recovered if self._journal is not None else 0

    async def _run(self) -> None:
        adopted_at = time.monotonic()
        while True:
            await asyncio.sleep(self._flush_s)
            try:
                if self._journal is not None and time.monotonic() - adopted_at >= ADOPT_EVERY_S:
                    adopted_at = time.monotonic()
                    self.adopt()
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the service is restarting: keep the records and retry
                logger.warning("feedback log unreachable (%s); %d decisions kept", error, self.buffered)
                await asyncio.sleep(RETRY_S)


def _retrieved(task: asyncio.Future[None]) -> None:
    """Mark a flush's outcome as seen (its records are kept for the next flush if it failed)."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("a flush failed: %s", task.exception())
