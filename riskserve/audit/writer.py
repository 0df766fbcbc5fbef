"""The audit trail's writer in an ingress replica: a bounded buffer, a background thread, a journal.

The request path calls :meth:`AuditWriter.submit` with a batch's records. With ``write_ahead`` (the
default) it appends them to the slot's journal in one ``write`` first, so a decision is on disk (in the
kernel) before it is answered and survives ``kill -9``; then it queues them in memory. A background thread
commits the queue to the slot's SQLite file every ``flush_s`` (sooner when ``batch_rows`` are waiting), at
most ``batch_rows`` per transaction, and deletes journal segments whose records are all committed.

Nothing is lost silently. When the store is slow or failing the queue fills; past ``buffer_rows`` a record
stays only in the journal (counted ``spilled``; without ``write_ahead`` it is appended to the journal
then), and the journal's segment is replayed into the store once it is closed. Past ``spill_bytes`` of
journal a record that is not in memory either is dropped: counted (``dropped``, in
``riskserve_audit_records_total``) and logged. On start the writer replays what its slot's journal still
holds (a predecessor that was killed), and the journals of slots no live process holds.

Slots: several replicas (on one node, or sharing a directory) each take ``slot-N`` by an exclusive
``flock`` on ``slot-N.lock``, released by the kernel when the process dies, and write only ``slot-N.sqlite``
and ``slot-N.journal/``. A restarted replica takes the lowest free slot, usually its predecessor's.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from riskserve.audit.journal import Journal, read_segment
from riskserve.audit.store import AuditRecord, AuditStore, dumps

__all__ = ["AuditCounts", "AuditWriter", "take_slot"]

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 4 << 20
"""A journal segment is closed past this size (then deleted once its records are committed)."""
ERROR_BACKOFF_S = 0.5
PURGE_EVERY_S = 3600.0


@dataclass(frozen=True)
class AuditCounts:
    """What one writer did with the records it was given (since it started)."""

    submitted: int
    written: int
    """Committed to the store from memory."""
    replayed: int
    """Committed to the store from the journal (spilled records, or a dead predecessor's)."""
    spilled: int
    """Kept only in the journal when they arrived (memory full)."""
    dropped: int
    """Lost: neither memory nor the journal could take them, or a journal line was unreadable."""
    buffered: int
    """In memory, not committed yet."""
    journal_bytes: int
    errors: int
    """Failed store transactions (the records were kept and retried)."""
    slot: str


@dataclass
class _Segment:
    pending: int = 0
    """Records of this segment still in memory (not committed)."""
    orphaned: bool = False
    """Some of its records are not in memory: the segment must be replayed before it is deleted."""


def take_slot(directory: Path) -> tuple[str, int]:
    """The lowest ``slot-N`` of ``directory`` no live process holds, and the open, locked lock file."""
    for n in itertools.count():
        name = f"slot-{n}"
        fd = os.open(directory / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return name, fd
    raise AssertionError("unreachable")


class AuditWriter:
    """Keeps every record it is given in ``directory``, off the caller's thread (see the module doc)."""

    def __init__(
        self,
        directory: Path,
        *,
        buffer_rows: int = 10_000,
        flush_s: float = 0.1,
        batch_rows: int = 512,
        spill_bytes: int = 256 << 20,
        write_ahead: bool = True,
        retention_s: float = 1825 * 86400.0,
        purge_rows: int = 500,
        on_count: Callable[[str, int], None] = lambda outcome, n: None,
        clock: Callable[[], float] = time.time,
        store_factory: Callable[[Path], AuditStore] = AuditStore,
    ) -> None:
        """``on_count(outcome, n)``: called from the writer thread with new ``written``, ``replayed``,
        ``spilled`` and ``dropped`` counts (the metrics); ``store_factory``: how the slot's store is opened
        (tests inject a failing one)."""
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._buffer_rows = buffer_rows
        self._flush_s = flush_s
        self._batch_rows = batch_rows
        self._write_ahead = write_ahead
        self.retention_s = retention_s
        self._purge_rows = purge_rows
        self._on_count = on_count
        self._clock = clock
        self.slot, self._lock_fd = take_slot(self.directory)
        try:
            self.store = store_factory(self.directory / f"{self.slot}.sqlite")
            self._journal = Journal(
                self.directory / f"{self.slot}.journal", max_bytes=spill_bytes, segment_bytes=SEGMENT_BYTES
            )
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._store_factory = store_factory
        self._lock = threading.Lock()
        self._committed = threading.Condition(self._lock)
        """Notified whenever records leave memory for the store (:meth:`flush_submitted` waits on it)."""
        self._buffer: collections.deque[tuple[AuditRecord, int, str]] = collections.deque()
        """(record, its journal segment or -1, its JSON when the request path made it, else '')."""
        self._enqueued = self._dequeued = 0
        """Records ever appended to / committed out of the buffer (FIFO: the first ``_dequeued`` are in)."""
        self._layouts: dict[tuple[str, ...], str] = {}
        self._segments: dict[int, _Segment] = {s: _Segment(orphaned=True) for s in self._journal.leftovers}
        self._submitted = self._written = self._replayed = self._spilled = self._dropped = self._errors = 0
        self._journal_errors = 0
        self._journal_errors_logged = 0
        self._reported: dict[str, int] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- the request path ---------------------------------------------------------------------------------

    def submit(self, records: Sequence[AuditRecord]) -> None:
        """Keep ``records`` (called on the request path: one ``write`` with ``write_ahead``, else none
        unless memory is full; never blocks on the store, never raises)."""
        try:
            self._submit(records)
        except Exception:  # the trail must never cost a decision
            logger.exception("audit: %d records could not be kept", len(records))
            with self._lock:
                self._dropped += len(records)

    def _submit(self, records: Sequence[AuditRecord]) -> None:
        journal = self._journal
        lines = [dumps(r) for r in records] if self._write_ahead else [""] * len(records)
        data = "".join(line + "\n" for line in lines).encode() if self._write_ahead else b""
        with self._lock:  # serialized outside it: the writer thread never waits on a dumps
            self._submitted += len(records)
            segment = -1
            if self._write_ahead:
                try:
                    segment = journal.append(data) or -1
                except OSError:  # the disk is full or gone: memory still takes them (logged by the writer)
                    self._journal_errors += 1
            room = self._buffer_rows - len(self._buffer)
            kept = records if room >= len(records) else records[: max(room, 0)]
            for record, line in zip(kept, lines, strict=False):
                self._buffer.append((record, segment, line))
            self._enqueued += len(kept)
            if segment > 0:
                state = self._segments.setdefault(segment, _Segment())
                state.pending += len(kept)
            rest = records[len(kept) :]
            if rest:
                if segment > 0:  # already on the journal: replayed from there
                    self._segments[segment].orphaned = True
                    self._spilled += len(rest)
                else:
                    spilled = None
                    if not self._write_ahead:
                        try:
                            spilled = journal.append("".join(dumps(r) + "\n" for r in rest).encode())
                        except OSError:
                            self._journal_errors += 1
                    if spilled is not None:
                        self._segments.setdefault(spilled, _Segment()).orphaned = True
                        self._spilled += len(rest)
                    else:
                        self._dropped += len(rest)
            if len(self._buffer) >= self._batch_rows:
                self._wake.set()

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> AuditWriter:
        """Start the writer thread (it first replays leftover journals); returns self."""
        self._thread = threading.Thread(target=self._run, name=f"riskserve-audit-{self.slot}", daemon=True)
        self._thread.start()
        return self

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every record submitted so far is in the store; ``False`` if it took too long."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                done = not self._buffer and not self._segments_with_work()
            if done:
                return True
            if time.monotonic() >= deadline:
                return False
            if self._thread is None or not self._thread.is_alive():
                self.cycle()  # not started (tests, tools): work in the caller's thread
            else:
                self._wake.set()
                time.sleep(min(self._flush_s, 0.01))

    def flush_submitted(self, timeout_s: float) -> bool:
        """Wait until every record submitted before this call has left memory: committed to the store,
        or (memory was full) spilled to the journal, where readers find it too. Records submitted
        meanwhile are not waited for, so it returns promptly under load. ``False`` if it took too long.

        The feedback RPC calls it, so a label sent right after its decision finds the decision."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            target = self._enqueued
        if self._thread is None or not self._thread.is_alive():
            return self.flush(timeout_s)  # not started (tests, tools): work in the caller's thread
        self._wake.set()
        with self._committed:
            while self._dequeued < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._committed.wait(left)
        return True

    def layout(self, columns: Sequence[str]) -> str:
        """The digest records name ``columns`` by; the names are kept in the slot's store on first use."""
        key = tuple(columns)
        digest = self._layouts.get(key)
        if digest is None:
            digest = self._layouts[key] = self.store.add_layout(key)
        return digest

    def close(self, timeout_s: float = 10.0) -> None:
        """Commit what is buffered, delete the drained journal, stop the thread and release the slot."""
        if self._closed:
            return
        if self._thread is None:
            self.flush(timeout_s)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._closed = True
        with self._lock:
            if not self._buffer and not self._segments_with_work():  # all committed: no journal to keep
                self._journal.rotate()
                for segment in list(self._journal.sizes):
                    self._journal.remove(segment)
                self._segments.clear()
            self._journal.close()
        self.store.close()
        os.close(self._lock_fd)

    def counts(self) -> AuditCounts:
        """What this writer did so far."""
        with self._lock:
            return AuditCounts(
                submitted=self._submitted,
                written=self._written,
                replayed=self._replayed,
                spilled=self._spilled,
                dropped=self._dropped,
                buffered=len(self._buffer),
                journal_bytes=self._journal.bytes,
                errors=self._errors,
                slot=self.slot,
            )

    # -- the writer thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        self._adopt_orphan_slots()
        purged_at = float("-inf")
        while not self._stop.is_set():
            self._wake.wait(self._flush_s)
            self._wake.clear()
            if not self.cycle():
                self._stop.wait(ERROR_BACKOFF_S)
            if time.monotonic() - purged_at > PURGE_EVERY_S:
                purged_at = time.monotonic()
                try:
                    self.purge_expired()
                except Exception:
                    logger.exception("audit: retention purge failed; retried in an hour")
        for _ in range(100):  # closing: drain what is left while the store takes it
            with self._lock:
                busy = bool(self._buffer) or self._segments_with_work()
            if not busy or not self.cycle():
                break
        self._report()

    def cycle(self) -> bool:
        """Commit the buffer in transactions of ``batch_rows``, then replay and delete drained journal
        segments; ``False`` when the store failed (everything is kept for the next cycle)."""
        ok = self._commit_buffer() and self._drain_journal()
        self._report()
        return ok

    def _commit_buffer(self) -> bool:
        while True:
            with self._lock:
                batch = list(itertools.islice(self._buffer, self._batch_rows))
            if not batch:
                return True
            try:
                self.store.insert([r for r, _, _ in batch], [line or dumps(r) for r, _, line in batch])
            except Exception:
                logger.exception("audit: the store refused %d records; kept and retried", len(batch))
                with self._lock:
                    self._errors += 1
                return False
            with self._lock:
                for _, segment, _ in batch:
                    self._buffer.popleft()
                    if segment > 0:
                        self._segments[segment].pending -= 1
                self._written += len(batch)
                self._dequeued += len(batch)
                self._committed.notify_all()

    def _segments_with_work(self) -> bool:
        """Whether a journal segment still holds records the store may not have (lock held)."""
        return any(state.orphaned for state in self._segments.values())

    def _drain_journal(self) -> bool:
        journal = self._journal
        with self._lock:
            current = self._segments.get(journal.current)
            full = journal.sizes.get(journal.current, 0) >= journal.segment_bytes
            if full or (current is not None and current.orphaned):
                journal.rotate()
            done = [s for s, state in self._segments.items() if s != journal.current and state.pending <= 0]
        for segment in sorted(done):
            state = self._segments.get(segment)
            if state is not None and state.orphaned:
                try:
                    self._replay(self.store, journal.path(segment))
                except Exception:
                    logger.exception("audit: replaying %s failed; kept and retried", journal.path(segment))
                    with self._lock:
                        self._errors += 1
                    return False
            with self._lock:
                journal.remove(segment)
                self._segments.pop(segment, None)
        return True

    def _replay(self, store: AuditStore, path: Path) -> None:
        """Write a journal segment's records to ``store`` (``INSERT OR IGNORE``: committed ones stay)."""
        batch: list[tuple[AuditRecord, str]] = []
        bad = 0

        def write() -> None:
            new = store.insert([r for r, _ in batch], [t for _, t in batch])
            with self._lock:
                self._replayed += new
            batch.clear()

        for entry in read_segment(path):
            if entry is None:
                bad += 1
                continue
            batch.append(entry)
            if len(batch) >= self._batch_rows:
                write()
        if batch:
            write()
        if bad:
            with self._lock:
                self._dropped += bad

    def _adopt_orphan_slots(self) -> None:
        """Replay the journals of slots no live process holds (a replica that died and did not return)."""
        for lock in sorted(self.directory.glob("slot-*.lock")):
            name = lock.name.removesuffix(".lock")
            journal_dir = self.directory / f"{name}.journal"
            if name == self.slot or not any(journal_dir.glob("*.jsonl")):
                continue
            fd = os.open(lock, os.O_RDWR)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # alive: it replays its own
                store = self._store_factory(self.directory / f"{name}.sqlite")
                try:
                    for path in sorted(journal_dir.glob("*.jsonl")):
                        self._replay(store, path)
                        path.unlink()
                finally:
                    store.close()
            except Exception:
                logger.exception("audit: could not replay the journal of %s; left for the next start", name)
            finally:
                os.close(fd)

    def purge_expired(self) -> tuple[int, int]:
        """Delete records past retention, ``purge_rows`` per transaction, committing the buffer between
        them; returns (records deleted, transactions)."""
        cutoff = self._clock() - self.retention_s
        deleted = transactions = 0
        while True:
            n = self.store.purge(cutoff, self._purge_rows)
            transactions += 1
            deleted += n
            if n < self._purge_rows:
                break
            self._commit_buffer()  # decisions keep flowing in while a long retention backlog goes
        if deleted:
            logger.info("audit: purged %d records older than %.0f days", deleted, self.retention_s / 86400)
        return deleted, transactions

    def _report(self) -> None:
        """Hand new counts to ``on_count`` and log drops (the writer thread; never the request path)."""
        with self._lock:
            journal_errors = self._journal_errors
        if journal_errors > self._journal_errors_logged:
            logger.error(
                "audit: %d appends to the journal in %s failed (disk full?); those records waited in "
                "memory only (a kill -9 then loses them)",
                journal_errors - self._journal_errors_logged,
                self.directory,
            )
            self._journal_errors_logged = journal_errors
        with self._lock:
            now = {
                "written": self._written,
                "replayed": self._replayed,
                "spilled": self._spilled,
                "dropped": self._dropped,
            }
        for outcome, value in now.items():
            delta = value - self._reported.get(outcome, 0)
            if delta > 0:
                self._reported[outcome] = value
                if outcome == "dropped":
                    logger.error(
                        "audit: %d decision records DROPPED (memory and journal full, %s); %d in all",
                        delta,
                        self.directory,
                        value,
                    )
                with contextlib.suppress(Exception):
                    self._on_count(outcome, delta)
